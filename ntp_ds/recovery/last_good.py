"""Last good weights: when no replica can go on, the survivors write the last completed step's weights to disk.

Each survivor assembles and writes about 1/n of the tensors (never the whole model) as a sharded HF directory; the
lowest survivor writes the index. Every survivor computes the same plan, so all of them stop alike when some
parameter has no holder left.
"""

from __future__ import annotations

from ntp_ds.comm import wire
from ntp_ds.comm.exchange import Side, assemble_whole
from ntp_ds.engine.initialize import JobSpec, join_world
from ntp_ds.engine.snapshot import Snapshot
from ntp_ds.layout import plan_whole_tensors
from ntp_ds.models import empty_shard
from ntp_ds.models.checkpoint import write_whole_tensors


def save_last_good(job: JobSpec, store, rank: int, members: tuple[int, ...], survivors: tuple[int, ...],
                   generation: int, snapshot: Snapshot, last_good_dir) -> str:
    """Write the survivors' shards of `snapshot` (the old generation's `members`, launch ranks) to `last_good_dir`
    on a world of the `survivors` (generation `generation`); return what happened, for the error that ends the
    job."""
    if last_good_dir is None:
        return "no last_good_dir to write the last good state to"
    me = survivors.index(rank)
    position = {m: i for i, m in enumerate(members)}
    holders = [position[r] for r in survivors]
    model = empty_shard(job.model_config, device="meta")
    specs = {n: s for n, (s, _) in model.param_specs().items()}
    shapes = {n: shape for n, (_, shape) in model.param_specs().items()}
    try:
        writer, moves = plan_whole_tensors(snapshot.topology, holders, specs, shapes)
    except LookupError as missing:  # every survivor computes the same plan, so all stop here alike
        return f"{missing}, so no last good state was written"
    join_world(job.ntp, store, generation, me, len(survivors))
    wire.open_for_batches(None)  # the moves run on the default group (the job ends here)
    replica, tp = snapshot.topology.locate(snapshot.rank)
    full = assemble_whole(moves, writer, me, list(range(len(survivors))), specs, shapes,
                          Side(snapshot.topology.layouts[replica], tp), snapshot.params, job.ntp.bucket_size,
                          wire.device_of(), "last_good")
    write_whole_tensors(last_good_dir, job.model_config, {n: t.cpu() for n, t in full.items()}, me, writer, shapes)
    wire.barrier()
    wire.teardown()
    return f"the last good state is in {last_good_dir}"
