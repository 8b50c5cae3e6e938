"""An NTPEngine's DeepSpeed checkpoints, and its weights consolidated (in one process, or as an HF directory).

DeepSpeed's checkpoint is written and read by the anchors (a contributor's state is a copy of its anchor's), with
the topology it was written by beside it: a checkpoint is loaded by the same topology only; moving between
topologies goes through the HF directory (`save_pretrained`, `from_pretrained`). DeepSpeed's barriers and its tag
check run along the control tree, not on the default group (under NCCL a communicator of the world).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
from pathlib import Path

import torch

from ntp_ds.comm import wire
from ntp_ds.comm.exchange import Side, assemble_whole
from ntp_ds.layout import plan_whole_tensors
from ntp_ds.layout.sharding import unshard_into
from ntp_ds.models.checkpoint import write_whole_tensors

TOPOLOGY_FILE = "ntp_topology.json"
log = logging.getLogger("ntp_ds.engine.engine")


def save(engine, deepspeed_save, save_dir, tag=None) -> bool:
    """DeepSpeed's checkpoint (`deepspeed_save(tag)`), written by the anchors; a contributor's state is a copy of
    its anchor's. The first anchor also writes the topology it was written by."""
    engine.settle_parameters()
    if not engine.is_anchor:
        engine.save_non_zero_checkpoint = False
        engine.save_zero_checkpoint = False
    tag = str(tag) if tag is not None else f"global_step{engine.global_steps}"
    with wire.waiting(), _barriers_along_the_control_tree():  # DeepSpeed's barriers around every rank's writes
        ok = deepspeed_save(tag)
    if engine.global_rank == engine.ntp_groups.topology.ranks_of(engine.ntp_groups.plan.anchors[0])[0]:
        meta = {"degrees": list(engine.ntp_groups.topology.degrees), "global_steps": engine.global_steps,
                "global_samples": engine.global_samples}
        (Path(save_dir) / tag / TOPOLOGY_FILE).write_text(json.dumps(meta))
    wire.barrier()
    return ok


def check_tag(engine, tag) -> None:
    """DeepSpeed's check that every rank saves under the same tag, along the control tree: DeepSpeed's own
    all-reduces the tag's digest on the default group, which under NCCL creates a communicator of the world."""
    if not engine.checkpoint_tag_validation_enabled():
        return
    digest = torch.tensor(list(hashlib.sha1(tag.encode()).digest()), dtype=torch.int32)
    highest = wire.control_all_reduce(digest.clone(), "max", "tag_check")
    lowest = wire.control_all_reduce(digest.clone(), "min", "tag_check")
    if torch.equal(highest, digest) and torch.equal(lowest, digest):
        return
    message = (f"rank {engine.global_rank}: the checkpoint tag {tag!r} differs between ranks; every rank must save "
               "under the same tag")
    if engine.checkpoint_tag_validation_fail():
        raise ValueError(message)
    log.warning(message)


def load(engine, deepspeed_load, load_dir, tag=None) -> tuple:
    """Load a checkpoint written by the same topology (the anchors through `deepspeed_load(tag)`); contributors
    then copy their anchors' parameters."""
    if tag is None:
        tag = (Path(load_dir) / "latest").read_text().strip()
    meta = json.loads((Path(load_dir) / str(tag) / TOPOLOGY_FILE).read_text())
    degrees = list(engine.ntp_groups.topology.degrees)
    if meta["degrees"] != degrees:
        raise ValueError(f"checkpoint {load_dir}/{tag} was written by TP degrees {meta['degrees']}, this job "
                         f"runs {degrees}; move between topologies with save_pretrained/from_pretrained")
    if engine.is_anchor:
        with wire.waiting():
            path, client_state = deepspeed_load(tag)
    else:
        path, client_state = str(Path(load_dir) / str(tag)), {}
        engine.global_steps, engine.global_samples = meta["global_steps"], meta["global_samples"]
    engine.sync_parameters()
    return path, client_state


@torch.no_grad()
def consolidated_state_dict(engine) -> dict[str, torch.Tensor] | None:
    """Unsharded weights, assembled on TP rank 0 of the first anchor replica (None elsewhere), through pickled
    objects: for tests and small models (`save_pretrained` never gathers the whole model on one host).

    Collective over that replica's TP group; every rank may call it, the others return at once.
    """
    engine.settle_parameters()
    g = engine.ntp_groups
    if g.replica != g.plan.anchors[0]:
        return None
    layout = g.layout
    local = {n: p.detach().to("cpu", torch.float32) for n, p in engine.named_shards().items()}
    gathered = wire.gather_object(local, g.tp_ranks[0], g.tp_control)
    if g.tp_rank != 0:
        return None
    full = {}
    for name, spec in engine.param_specs.items():
        out = torch.empty(engine.full_shapes[name])
        for r, shards in enumerate(gathered):
            unshard_into(out, shards[name], spec, layout, r)
        full[name] = out
    return full


@torch.no_grad()
def save_pretrained(engine, path) -> None:
    """Write the weights as a sharded HF directory (config.json, an index, a safetensors file per writer; fp32),
    which `from_pretrained` loads. The first anchor replica's ranks write: each assembles about 1/tp of the
    tensors whole, the units it lacks sent by its TP peers over the TP group, so no rank holds the whole model
    and no tensor is pickled. Every rank calls it; the other replicas' return at once."""
    engine.settle_parameters()
    g = engine.ntp_groups
    if g.replica == g.plan.anchors[0]:
        wire.open_for_batches(g.tp_group)  # (NCCL: a group's first op must involve every member)
        holders = list(g.topology.ranks_of(g.replica))
        writer, moves = plan_whole_tensors(g.topology, holders, engine.param_specs, engine.full_shapes)
        full = assemble_whole(moves, writer, g.tp_rank, holders, engine.param_specs, engine.full_shapes,
                              Side(g.layout, g.tp_rank), {n: p.detach() for n, p in engine.named_shards().items()},
                              engine.job.ntp.bucket_size, wire.device_of(), "save_pretrained", group=g.tp_group)
        write_whole_tensors(path, engine.module.config, {n: t.cpu() for n, t in full.items()}, g.tp_rank, writer,
                            engine.full_shapes)
    wire.barrier(g.tp_control)


@contextlib.contextmanager
def _barriers_along_the_control_tree():
    """Run DeepSpeed's `dist.barrier()` (two in `save_checkpoint`, on the default group: under NCCL a communicator of
    the world) as the generation's barrier along the control tree, for the block."""
    import deepspeed.comm

    own = deepspeed.comm.barrier
    deepspeed.comm.barrier = lambda *args, **kwargs: wire.barrier()
    try:
        yield
    finally:
        deepspeed.comm.barrier = own
