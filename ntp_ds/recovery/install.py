"""Install: build the new generation's engine on this rank from what the members hold, and measure what it took.

Parameters come from the units this rank already held plus exactly the missing units pulled from their holders
(`plan.plan_unit_moves`); a rank that keeps its place keeps its engine and only serves (`rebind_engine`). Optimizer
fragments are re-sliced for the new anchors' ZeRO partitions from their live holders or, for a dead holder, its
buddy's copy (`reslice`). Replicas that lost nothing and hold the interrupted step's gradients whole keep them and
run only the rest of the step (`resume`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from ntp_ds.comm import wire
from ntp_ds.comm.exchange import Side, UnitExchange
from ntp_ds.comm.groups import count_communicators
from ntp_ds.engine.config import ConfigError
from ntp_ds.engine.fragments import params_from_masters
from ntp_ds.engine.initialize import JobSpec, build_engine, rebind_engine
from ntp_ds.engine.recut import recuttable
from ntp_ds.engine.snapshot import Snapshot
from ntp_ds.layout import plan_gradient_sync
from ntp_ds.layout import units as U
from ntp_ds.layout.generation import Generation
from ntp_ds.layout.sharding import gather_units, packed_numel, scatter_units
from ntp_ds.models import CausalLMShard, empty_shard
from ntp_ds.recovery import report
from ntp_ds.recovery.errors import RecoveryImpossible
from ntp_ds.recovery.handoff import Handoff
from ntp_ds.recovery.plan import keeps_place, old_ranks, plan_unit_moves, rebalanced_moves, rereplicated_moves
from ntp_ds.recovery.reslice import reslice


@dataclass(frozen=True)
class Change:
    """One installation's inputs besides the engine held: the state carried, and the generations on each side."""

    snapshot: Snapshot
    handoff: Handoff
    before: Generation
    after: Generation
    dead_owners: frozenset[int] = frozenset()
    """Old global ranks that died (their optimizer state comes from copies)."""


def install(job: JobSpec, store, rank: int, change: Change, *, held, release: Callable[[], None],
            on_phase: Callable[[int, str], None], kept_here: list[str], traffic_before: dict) -> tuple[object, dict]:
    """Build this rank's engine of `change.after`; return it and the event's fields of what was installed
    (`traffic_before`: the wire's meter as the recovery began).

    `held`: this rank's engine of the old generation, detached (None on a joiner); kept if this rank keeps its place,
    else `release` is called before the new one is built. `on_phase(step, phase)`: the fault-injection seams
    "groups" (the communicators are about to be created) and "transfer" (the lost units move)."""
    snapshot, handoff, new_topology = change.snapshot, change.handoff, change.after.topology
    old_members, new_members = change.before.members, change.after.members
    old_rank_of = old_ranks(old_members, new_members)
    try:
        moves = plan_unit_moves(snapshot.topology, new_topology, old_rank_of, handoff.stale_by_rank)
    except LookupError as e:
        raise RecoveryImpossible(f"{e}: every replica lost it (ranks {sorted(set(old_members) - set(new_members))} "
                                 f"died); restart from the last checkpoint") from None
    moved = {}
    rereplicated = rereplicated_moves(snapshot.topology, new_topology, old_rank_of, moves)
    rebalanced = rebalanced_moves(snapshot.topology, new_topology, old_rank_of, moves)
    me = new_members.index(rank)
    grads = held.take_grads() if held is not None else {}
    step = handoff.global_steps + 1
    on_phase(step, "groups")
    if held is None or not (recuttable(held.optimizer) and keeps_place(snapshot.topology, snapshot.rank,
                                                                       new_topology, me)
                            and not any(m.dst == me for m in moves)):
        release()
        engine = build_engine(job, new_topology,
                              lambda groups: reshard(job, groups, snapshot, moves, moved, rereplicated, rebalanced,
                                                     lambda: on_phase(step, "transfer")),
                              store, resharded=True)
    else:
        engine = rebind_engine(job, new_topology, held, lambda groups: serve(
            job, held, groups, snapshot, moves, moved, lambda: on_phase(step, "transfer")))
    engines_built = int(engine is not held)
    created, kept = count_communicators()
    state = reslice(engine, snapshot, handoff.held, change.dead_owners, own=not handoff.rolled_back,
                    old_rank_of=old_rank_of, buddies=job.buddies(snapshot.topology))
    if handoff.params_from_masters:
        params_from_masters(engine)
        engine.sync_parameters()
    engine.global_steps, engine.global_samples = handoff.global_steps, handoff.global_samples
    restore_learning_rate(engine, handoff.carried_lr)
    kept_samples = resume(job, rank, engine, change, old_rank_of, moves, grads)
    # Before any optimizer step there is no state to copy (the first step sends it, layout included). The new
    # layout's copies travel during the step that follows, off the recovery's critical path, and are awaited
    # before its optimizer step: a failure before they land is recovered as not lossless.
    if wire.sum_counts([len(engine.optimizer_keys())])[0]:
        engine.refresh_copies(overlap=True)
    # Lossless is what was installed: every element of every new fragment written, all of one step (the last
    # committed one after a roll-back), with intact payloads. Before the first step the fallback (the parameter,
    # zero moments) is the exact state: nothing is lost, unless that first step was half applied.
    whole = ((state["covered"] == state["wanted"] and state["checksums_ok"] and state["fresh"])
             or (handoff.global_steps == 0 and not handoff.params_from_masters))
    mine = {"bytes_moved": moved.get("bytes", 0), "kv_rereplicated_bytes": moved.get("kv_rereplicated", 0),
            "optimizer_bytes_moved": state["bytes_received"], "optimizer_bytes_restored": state["restored_bytes"],
            "whole": int(whole), "rebalanced_bytes": moved.get("rebalanced", 0),
            "lost_optimizer_bytes": state["lost_bytes"], "engines_rebuilt": engines_built,
            "communicators_created": created, "communicators_kept": kept,
            "refused_param_buckets": snapshot.refused.get("param_buckets", 0),
            "refused_copies": len(snapshot.refused.get("copies", ())),
            "refused_grads": int(bool(snapshot.refused.get("grads")))}
    event = report.installed(mine, report.received_by_kind(wire.traffic_since(traffic_before)), wire.sum_counts,
                             len(new_members))
    keepable = report.keepable(snapshot, engine, handoff.rolled_back) if not engines_built else None
    return engine, {"generation": change.after.number, "degrees_before": list(snapshot.topology.degrees),
                    "degrees_after": list(new_topology.degrees), **event,
                    "rank_bytes_received": moved.get("bytes", 0), "state_index": state["state_index"],
                    "kept_here": kept_here,
                    "rank_state_elements": {k: state[k] for k in ("wanted", "kept", "from_copies", "received")}
                    | {"keepable": keepable},
                    "rolled_back": handoff.rolled_back, "rank_refused": snapshot.refused,
                    "samples_kept": kept_samples}


def reshard(job: JobSpec, groups, snapshot: Snapshot, moves, moved: dict, rereplicated, rebalanced,
            transfer: Callable[[], None]) -> CausalLMShard:
    """Build this rank's new shard: keep the units it held, pull the missing ones from their holders. The shard is
    built on the data device in the parameters' dtype, so kept units never leave the device."""
    dtype = parameter_dtype(job.ds_config)
    module = empty_shard(job.model_config, groups.layout, groups.tp_rank, groups.tp_group, device=wire.device_of(),
                         dtype=dtype)
    spec_shapes = module.param_specs()
    specs = {n: s for n, (s, _) in spec_shapes.items()}
    full_shapes = {n: shape for n, (_, shape) in spec_shapes.items()}
    new_params = dict(module.named_parameters())
    if snapshot.rank is None:  # a joiner holds nothing yet: it only receives
        old_layout, old_tp = groups.layout, groups.tp_rank
    else:
        old_replica, old_tp = snapshot.topology.locate(snapshot.rank)
        old_layout = snapshot.topology.layouts[old_replica]
    with torch.no_grad():
        for name, spec in specs.items():
            if snapshot.rank is None:
                continue
            keep = U.intersect(old_layout.owned(spec.kind, old_tp), groups.layout.owned(spec.kind, groups.tp_rank))
            keep = U.subtract(keep, snapshot.stale.get(spec.kind, ()))  # fetched afresh with the moves
            if keep:
                buf = gather_units(snapshot.params[name], spec, old_layout, old_tp, keep)
                scatter_units(new_params[name].data, buf, spec, groups.layout, groups.tp_rank, keep)
        transfer()  # the fault-injection seam: its peers are blocked in this exchange with it
        moved["bytes"] = exchange_units(job, moves, groups, snapshot, Side(old_layout, old_tp), specs, full_shapes,
                                        new_params)
    for key, extra in (("kv_rereplicated", rereplicated), ("rebalanced", rebalanced)):
        moved[key] = sum(packed_numel(specs[n], tuple(new_params[n].shape), m.units) * dtype.itemsize
                         for m in extra if m.dst == groups.rank for n in specs if specs[n].kind == m.kind)
    return module


def serve(job: JobSpec, engine, groups, snapshot: Snapshot, moves, moved: dict, transfer: Callable[[], None]) -> None:
    """The unit exchange of a rank that keeps its shard (`keeps_place`): it lacks nothing, so it only sends."""
    old_replica, old_tp = snapshot.topology.locate(snapshot.rank)
    with torch.no_grad():
        transfer()
        moved["bytes"] = exchange_units(job, moves, groups, snapshot, Side(snapshot.topology.layouts[old_replica],
                                                                           old_tp),
                                        engine.param_specs, engine.full_shapes, engine.named_shards())
    moved["kv_rereplicated"] = moved["rebalanced"] = 0


def exchange_units(job: JobSpec, moves, groups, snapshot: Snapshot, old: Side, specs, full_shapes,
                   new_params) -> int:
    """Pull the missing units: senders pack them out of their old layout, receivers unpack into the new one."""
    exchange = UnitExchange(moves, groups.rank, specs, full_shapes, old, Side(groups.layout, groups.tp_rank),
                            job.ntp.bucket_size)
    return exchange.run(snapshot.params, {n: p.data for n, p in new_params.items()},
                        dtype=parameter_dtype(job.ds_config), device=wire.device_of(), op="reshard")


def resume(job: JobSpec, rank: int, engine, change: Change, old_rank_of, moves, grads) -> int:
    """Where replicas that lost nothing hold the interrupted step's gradients whole on every rank, and every rank
    of theirs keeps its engine, keep those gradients and run only the rest of the step: the other replicas'
    samples spread over all of them (`JobSpec.resume_plan`). Decided alike on every rank from what each one
    told (`handoff`). Return the samples kept (0: the whole step is run again)."""
    snapshot, handoff, new_topology = change.snapshot, change.handoff, change.after.topology
    old = snapshot.topology
    if (handoff.rolled_back or handoff.any_mid_step or snapshot.batch_plan is None
            or len(new_topology.layouts) != len(old.layouts)):
        return 0
    destinations = {m.dst for m in moves}
    old_sync, new_sync = plan_gradient_sync(old), plan_gradient_sync(new_topology)

    def keeps(replica: int) -> bool:
        """An anchor before and after with the same layout (so each rank keeps its place, as `keeps_place`
        says), every rank of it the same worker at the same TP index, none receiving a unit, all whole."""
        if (new_topology.layouts[replica] != old.layouts[replica] or not old_sync.is_anchor(replica)
                or not new_sync.is_anchor(replica)):
            return False
        return all(handoff.whole_by_rank.get(i) and i not in destinations and i in old_rank_of
                   and old.locate(old_rank_of[i]) == new_topology.locate(i)
                   for i in new_topology.rank_range(replica))

    kept = tuple(r for r in range(len(new_topology.layouts)) if keeps(r))
    plan = job.resume_plan(new_topology, snapshot.batch_plan, kept) if kept else None
    if plan is None:
        return 0
    mine = engine.ntp_groups.replica in kept
    if mine and not grads:
        raise RecoveryImpossible(f"rank {rank}: told its gradients were whole but holds none")
    scale = len(new_sync.anchors) / len(old_sync.anchors)
    engine.resume(plan, grads if mine else {}, scale)
    return plan.kept


def require_masters(job: JobSpec) -> JobSpec:
    """Check that live recovery can read `job`'s optimizer's fp32 masters (bf16 keeps them only under ZeRO)."""
    if job.ds_config.get("bf16", {}).get("enabled") and not job.zero_stage:
        raise ConfigError("zero_optimization.stage=0 with bf16.enabled=true: live recovery cannot read that "
                          "optimizer's fp32 masters; use stage 1 or 2")
    return job


def parameter_dtype(ds_config: dict) -> torch.dtype:
    """The dtype DeepSpeed trains the module's parameters in (what the members' shards hold)."""
    if ds_config.get("bf16", {}).get("enabled"):
        return torch.bfloat16
    if ds_config.get("fp16", {}).get("enabled"):
        return torch.float16
    return torch.float32


def restore_learning_rate(engine, lr_state) -> None:
    """Put the learning-rate schedule where it was: a rebuilt engine starts its scheduler (and the optimizer's
    learning rates) from step 0, so a warm-up would start over after every recovery."""
    if lr_state is None or getattr(engine, "optimizer", None) is None:
        return
    scheduler_state, lrs = lr_state
    if engine.lr_scheduler is not None and scheduler_state is not None:
        engine.lr_scheduler.load_state_dict(scheduler_state)
    for group, lr in zip(engine.optimizer.param_groups, lrs):
        group["lr"] = lr
