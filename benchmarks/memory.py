"""Steady-state memory: peak resident memory of an NTPEngine rank (zero_redundancy=1) vs a plain DeepSpeedEngine.

Each side runs in its own launch (peak RSS is per process): every rank builds the same TP-sharded Llama on the same
topology and groups (the plain engine gets them through the `mpu`), either as an NTPEngine or as a plain
DeepSpeedEngine, and trains the same batches for the same steps with AdamW and ZeRO. Each rank then reports its
peak RSS (`ru_maxrss`), the RSS before the engine was built (after imports and process-group setup) and, on the NTP
side, the bytes of the optimizer copies it keeps for other ranks. For the rank with the largest excess the last four
lines read `deepspeed_peak_bytes=<x>`, `ntp_peak_bytes=<y>`, `redundant_copy_bytes=<c>` and
`memory_excess_ratio=<(y - x - c) / x>` (target: at most 0.05).

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


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_job_args(parser, hidden=1024, layers=8, heads=16, kv_heads=8, vocab=8192, seq=64, micro=2, accum=2)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3)
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
    return 0


if __name__ == "__main__":
    sys.exit(main())
