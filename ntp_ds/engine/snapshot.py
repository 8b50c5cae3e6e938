"""What a survivor carries into a recovery: its engine's state at the failure, as a frozen value."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from ntp_ds.batch import BatchPlan
from ntp_ds.comm import wire
from ntp_ds.comm.streams import stale_units
from ntp_ds.engine import fragments as state
from ntp_ds.layout import units as U

log = logging.getLogger("ntp_ds.engine.engine")


@dataclass(frozen=True)
class Snapshot:
    """A survivor's state at the moment of a failure, in its old topology's terms (what the engine returns; what the
    members tell each other in a recovery is the recovery's `Handoff`)."""

    topology: object
    rank: int
    params: dict[str, torch.Tensor]
    fragments: dict
    keys: tuple[str, ...]
    optimizer_step: int
    held: dict
    global_steps: int
    global_samples: int
    mid_step: bool
    stale: dict
    """Units (by kind) of this rank's shard still at the previous step: their streamed copy never arrived."""
    lr_state: tuple | None = None
    """(scheduler state, learning rate of each parameter group) of an anchor; None elsewhere."""
    before_step: tuple | None = None
    """(global_steps, global_samples, lr_state, optimizer step) as the last step began (at its ready vote): where
    a roll-back returns to."""
    previous: dict = field(default_factory=dict)
    """With `redundancy_keep_previous`: the whole copies of the step before the newest, by owner."""
    order: object = None
    """An anchor's `layout.zero.FlatOrder`: how its optimizer laid out the state its fragments are part of."""
    batch_plan: BatchPlan | None = None
    """The plan of the step the failure interrupted."""
    whole_grads: bool = False
    """This rank holds the interrupted step's gradients of its whole share, none reduced yet
    (`NTPEngine.allreduce_gradients`): a recovery that keeps its replica's engines may keep them."""
    refused: dict = field(default_factory=dict)
    """What arrived by a wait that returned but was not proven to have arrived (cut by an abort) and was refused:
    `param_buckets` (their units are stale), `copies` (the owners whose copy was dropped), `grads` (the kept
    gradients, dropped)."""


def take_snapshot(engine) -> Snapshot:
    """Everything a survivor carries into recovery (views of live tensors: keep `engine` until done). What arrived
    but was not proven to have arrived is refused, and said so."""
    try:
        engine.copies.finish(salvage=True)
    except Exception as err:  # a copy in flight did not arrive whole: it is dropped, and recovery says so
        log.warning("a redundant copy in flight was lost (%s)", err)
    stale = engine._params_in.settle(salvage=True)
    if not all(e.proven() for e in engine._synced):  # the last copy of the anchors' parameters was cut
        synced = stale_units(engine._params, [b for bs in engine._params.incoming.values() for b in bs])
        stale = {k: U.union(stale.get(k, ()), synced.get(k, ())) for k in stale.keys() | synced.keys()}
    whole = engine._whole_grads_step == engine.global_steps + 1
    grads_proven = not whole or wire.proven(engine._grads_proof)
    refused = {"param_buckets": engine._params_in.refused, "copies": sorted(engine.copies.refused),
               "grads": not grads_proven}
    if any(refused.values()):
        log.warning("rank %d: refused what was not proven to have arrived: %s", engine.ntp_groups.rank, refused)
    keys = engine.optimizer_keys()
    return Snapshot(
        topology=engine.ntp_groups.topology, rank=engine.ntp_groups.rank,
        params={n: p.detach() for n, p in engine.named_shards().items()},
        fragments=state.local_fragments(engine, keys) if engine.is_anchor else {},
        keys=keys, optimizer_step=state.optimizer_step(engine) if engine.is_anchor else 0,
        held=dict(engine.copies.held), global_steps=engine.global_steps, global_samples=engine.global_samples,
        mid_step=engine.in_optimizer_step, stale=stale, lr_state=lr_state(engine),
        before_step=engine._before_step, previous=dict(engine.copies.previous),
        order=state.flat_order(engine) if engine.is_anchor else None, batch_plan=engine.batch_plan,
        whole_grads=whole and grads_proven, refused=refused)


def lr_state(engine) -> tuple | None:
    """(scheduler state, learning rate of each parameter group) of an anchor; None elsewhere."""
    if not engine.is_anchor or engine.optimizer is None:
        return None
    scheduler = engine.lr_scheduler.state_dict() if engine.lr_scheduler is not None else None
    return scheduler, [group["lr"] for group in engine.optimizer.param_groups]
