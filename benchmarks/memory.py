"""Steady-state memory: peak resident memory of an NTPEngine rank (zero_redundancy=1) vs a plain DeepSpeedEngine.

Each side runs in its own launch (peak RSS is per process): every rank builds the same TP-sharded Llama on the same
topology and groups (the plain engine gets them through the `mpu`), either as an NTPEngine or as a plain
DeepSpeedEngine, and trains the same batches for the same steps with AdamW and ZeRO. Each rank then reports its
peak RSS (`ru_maxrss`), the RSS before the engine was built (after imports and process-group setup) and, on the NTP
side, the bytes of the optimizer copies it keeps for other ranks. For the rank with the largest excess the last four
lines read `deepspeed_peak_bytes=<x>`, `ntp_peak_bytes=<y>`, `redundant_copy_bytes=<c>` and
`memory_excess_ratio=<(y - x - c) / x>` (target: at most 0.05).

Then the recovery peak (skip it with `--no-recovery`): 3 replicas x TP 2 train in the caller's own loop with fault
tolerance on; after `--warmup` steps each rank clears its peak (`/proc/self/clear_refs`) and trains `--steps` more,
whose peak resident memory (VmHWM) is its steady-state peak; it clears it again, rank 5 (TP rank 1 of replica 2)
crashes in the next step's backward, and after the recovery and the re-run step each survivor reads its peak
again: the recovery peak. A job is then started at the recovered topology (`ntp.degrees`), and each of its ranks
reads its steady-state peak the same way: what a rank needs at that place, with no recovery behind it. A survivor of
the degraded replica needs more there (its replica's TP degree fell, so it holds more of the model), which is its new
place and not the recovery's cost; the recovery peak is therefore compared with the larger of the two steady states.
For a survivor of the degraded replica, a rank of a healthy replica, and the buddy that keeps the dead rank's ZeRO
partition it prints the three peaks, that ratio, the ratio over the steady state before alone, and the rank's own
peak in the steps after the recovery (which also holds what the recovery left allocated); the last line reads
`recovery_peak_ratio=<the largest of the three ratios>` (target: at most 1.15).

    python benchmarks/memory.py --tp 1 --replicas 2 --steps 3
"""

from __future__ import annotations

import argparse
import resource
import sys


from ntp_ds.testing.bench import add_job_args, deepspeed_config, llama_config
from ntp_ds.testing.spawn import run_ranks


def _ntp(args) -> dict:
    return {"tp": args.tp, "replicas": args.replicas, "zero_redundancy": args.zero_redundancy}


def _peak_rss() -> int:
    """This process's peak resident memory so far, in bytes (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _worker(rank, world_size, args, side):
    from datetime import timedelta

    import deepspeed
    import torch.distributed as dist

    import ntp_ds
    from ntp_ds.batch.loader import GlobalBatchSampler, SyntheticTokens, replica_micro_batches
    from ntp_ds.comm import wire
    from ntp_ds.comm.groups import NTPMpu, backend_for_device, build_groups, start_generation
    from ntp_ds.engine.initialize import prepare
    from ntp_ds.models import Llama

    config, ds_config = llama_config(args), deepspeed_config(args)
    spec, topology = prepare(config, ds_config, _ntp(args))
    sync, plan = spec.plan(topology)
    deepspeed.init_distributed(dist_backend=backend_for_device(), timeout=timedelta(seconds=spec.ntp.timeout_s))
    start_generation(spec.ntp.timeout_s)
    baseline = _peak_rss()

    if side == "ntp":
        engine = ntp_ds.initialize(model=config, config=ds_config, ntp=_ntp(args))
        replica = engine.ntp_groups.replica
    else:
        groups = build_groups(topology, sync, dist.get_rank(), spec.ntp.timeout_s)
        shard = Llama(config, layout=groups.layout, tp_rank=groups.tp_rank, tp_group=groups.tp_group, seed=0)
        engine, *_ = deepspeed.initialize(model=shard, model_parameters=list(shard.parameters()), config=ds_config,
                                          mpu=NTPMpu(groups))
        del shard
        replica = groups.replica
    built = _peak_rss()

    data = SyntheticTokens(config.vocab_size, args.seq, size=4096, seed=0)
    sampler = GlobalBatchSampler(len(data), seed=0)
    for step in range(args.warmup + args.steps):
        for batch in replica_micro_batches(data, sampler, plan, replica, step):
            if side == "ntp":
                loss = engine(batch)
            else:
                loss = engine(input_ids=batch["input_ids"], labels=batch["labels"])
            engine.backward(loss)
            engine.step()
        wire.barrier()
    copies = engine.copies.held_bytes() if side == "ntp" else 0
    return {"baseline": baseline, "built": built, "peak": _peak_rss(), "copies": copies}


RECOVERY_TP, RECOVERY_REPLICAS, VICTIM = 2, 3, 5


def _resident_peak() -> int:
    """Peak resident memory since the last `_clear_peak` (VmHWM), in bytes."""
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def _clear_peak() -> None:
    """Reset this process's VmHWM to its current resident memory (Linux: write 5 to clear_refs)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _recovery_worker(rank, world_size, args):
    import ntp_ds
    from ntp_ds.batch.loader import SyntheticTokens

    config, ds_config = llama_config(args), deepspeed_config(args)
    fault = {"rank": VICTIM, "step": args.warmup + args.steps + 1, "phase": "backward", "kind": "crash"}
    events = []
    engine = ntp_ds.initialize(model=config, config=ds_config,
                               ntp={**_ntp(args), "fault_tolerance": {"heartbeat_timeout_s": 3.0, "faults": [fault]}},
                               on_event=lambda kind, step, fields: events.append(kind))
    buddies = engine.job.buddies(engine.ntp_groups.topology)
    # The dead rank's replica-mate; the buddy keeping its partition (in replica 0); replica 1, which neither lost
    # a rank nor keeps the dead rank's copy.
    roles = {"survivor": VICTIM - 1, "buddy": buddies[VICTIM][0], "healthy": RECOVERY_TP}
    data = SyntheticTokens(config.vocab_size, args.seq, size=4096, seed=0)
    failing = args.warmup + args.steps  # the step index the crash interrupts (run again after the recovery)
    peaks = {}
    for step in engine.train_steps(failing + 1 + args.steps):
        if step == args.warmup:
            _clear_peak()
        if step == failing and "steady" not in peaks:
            peaks["steady"] = _resident_peak()
            _clear_peak()
        if step == failing + 1 and "recovery" not in peaks:  # the recovery and the step it re-ran are behind
            peaks["recovery"] = _resident_peak()
            _clear_peak()
        with engine.attempt(step):
            for batch in engine.micro_batches(data, seed=0):
                engine.backward(engine(batch))
                engine.step()
    peaks["after"] = _resident_peak()  # its own steps after the recovery (with what the recovery left allocated)
    degrees = tuple(engine.ntp_groups.topology.degrees)
    engine.close()
    return {"peaks": peaks, "roles": roles, "events": events, "degrees": degrees}


def _fresh_worker(rank, world_size, args, degrees):
    """A job started at the recovered topology: each rank's steady-state peak at that place, with no recovery behind
    it (what the rank needs there; the recovered ranks' own later peaks also hold what the recovery left behind)."""
    import ntp_ds
    from ntp_ds.batch.loader import SyntheticTokens

    config, ds_config = llama_config(args), deepspeed_config(args)
    ntp = {**_ntp(args), "degrees": list(degrees), "fault_tolerance": {"heartbeat_timeout_s": 3.0}}
    engine = ntp_ds.initialize(model=config, config=ds_config, ntp=ntp)
    data = SyntheticTokens(config.vocab_size, args.seq, size=4096, seed=0)
    for step in range(args.warmup + args.steps):
        if step == args.warmup:
            _clear_peak()
        for batch in engine.micro_batches(data, seed=0):
            engine.backward(engine(batch))
            engine.step()
    peak = _resident_peak()
    engine.close()
    return peak


def recovery_peaks(args) -> int:
    import copy

    args = copy.copy(args)
    args.tp, args.replicas = RECOVERY_TP, RECOVERY_REPLICAS
    results = run_ranks(_recovery_worker, RECOVERY_TP * RECOVERY_REPLICAS, args, timeout=1800, store=True)
    if VICTIM in results or not results:
        raise RuntimeError(f"rank {VICTIM} was to crash; finished: {sorted(results)}")
    any_result = next(iter(results.values()))
    print(f"\nrecovery: {RECOVERY_REPLICAS} replicas x TP {RECOVERY_TP}, ZeRO {args.zero_stage}, rank {VICTIM} crashes "
          f"in step {args.warmup + args.steps + 1}; degrees after {any_result['degrees']}, events "
          f"{any_result['events']}")
    degrees = any_result["degrees"]
    fresh = run_ranks(_fresh_worker, sum(degrees), args, degrees, timeout=1800, store=True)
    fresh = [fresh[r] for r in range(sum(degrees))]
    survivors = sorted(results)
    print(f"a job started at degrees {degrees}: steady-state peaks {fresh}")
    ratios = {}
    for role, rank in any_result["roles"].items():
        peaks = results[rank]["peaks"]
        if "recovery" not in peaks:
            raise RuntimeError(f"rank {rank} ({role}) saw no recovery: {results[rank]['events']}")
        there = fresh[survivors.index(rank)]  # the same place (new global rank) in the job started there
        ratios[role] = peaks["recovery"] / max(peaks["steady"], there)
        print(f"{role:<9} rank {rank}: steady_peak_bytes={peaks['steady']} new_place_peak_bytes={there} "
              f"recovery_peak_bytes={peaks['recovery']} ratio={ratios[role]:.4f} (over the steady state before "
              f"alone: {peaks['recovery'] / peaks['steady']:.4f}; its own peak in the steps after: {peaks['after']})")
    print(f"recovery_peak_ratio={max(ratios.values()):.4f}")
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_job_args(parser, hidden=1024, layers=8, heads=16, kv_heads=8, vocab=8192, seq=64, micro=2, accum=2)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--no-recovery", action="store_true", help="skip the recovery peak")
    args = parser.parse_args(argv)
    world = args.tp * args.replicas
    plain = run_ranks(_worker, world, args, "plain", timeout=1800)
    ntp = run_ranks(_worker, world, args, "ntp", timeout=1800)
    print(f"topology: {args.replicas} replicas x TP {args.tp}, ZeRO {args.zero_stage}, "
          f"zero_redundancy {args.zero_redundancy}, {args.warmup} + {args.steps} steps each")
    for rank, (p, n) in enumerate(zip(plain, ntp)):
        print(f"rank {rank}: deepspeed baseline={p['baseline']} built={p['built']} peak={p['peak']} | "
              f"ntp baseline={n['baseline']} built={n['built']} peak={n['peak']} copies={n['copies']}")
    worst = max(range(world), key=lambda r: ntp[r]["peak"] - plain[r]["peak"] - ntp[r]["copies"])
    p, n = plain[worst]["peak"], ntp[worst]["peak"]
    c = ntp[worst]["copies"]
    print(f"worst rank: {worst}")
    print(f"deepspeed_peak_bytes={p}")
    print(f"ntp_peak_bytes={n}")
    print(f"redundant_copy_bytes={c}")
    print(f"memory_excess_ratio={(n - p - c) / p:.4f}")
    return 0 if args.no_recovery else recovery_peaks(args)


if __name__ == "__main__":
    sys.exit(main())
