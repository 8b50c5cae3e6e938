"""Steady-state overhead: NTPEngine vs a plain DeepSpeedEngine on the same uniform topology, no failure.

Every engine trains the same TP-sharded Llama in the same processes. Their steps are interleaved (the order
alternating from step to step) so that machine noise hits all alike; each step's time is its slowest rank's, and a
ratio is the median over steps of (NTP step time / DeepSpeed step time of the same round). The last line reads
`overhead_ratio=<ratio>` (target <= 1.01 with zero_redundancy=1; `--redundancy-overlap` lets the copies travel
during the next step).

The step is sized like a training step, not like a unit test's: 16,384 tokens per replica (micro-batch 4 x 32
accumulation steps x 128 tokens), still a quarter of what a 70B job with a 4M-token global batch on 64 replicas
gives each replica. What NTP adds per step is fixed (two votes and the redundant copy: 12 bytes per parameter of
the rank's ZeRO partition), while the step's compute grows with its tokens, so a step of a few hundred tokens
measures the copy against almost nothing. Both the copy and the compute grow with the parameters, so the ratio
does not depend on the model's size: the model is small (hidden 128) so that 80 rounds fit in about five minutes,
as the median needs on a machine whose step times vary by a few percent from round to round (the spread of the
paired ratios is printed). To show what the copy costs, the run also times the copy alone after the interleaved
rounds (the same bytes, nothing else running) and prints it against a DeepSpeed step.

With `--contributor`, replica 1 runs a different layout of the same degree (its TP ranks' units swapped), so it
syncs as a contributor of replica 0 (gradients streamed into the anchor's backward, parameters copied back), and
the line before the last reads `contributor_overhead_ratio=<ratio>` against the same plain DeepSpeed run (target
<= 1.10 on CPU, where compute and communication share two cores). It needs `--tp 2` or more.

    python benchmarks/steady_state.py                                  # 2 replicas x TP 1, about 5 minutes here
    python benchmarks/steady_state.py --hidden 256 --accum 2           # 1,024 tokens per replica step
    python benchmarks/steady_state.py --tp 2 --replicas 2 --contributor
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from ntp_ds.testing.bench import add_job_args, deepspeed_config, llama_config
from ntp_ds.testing.spawn import run_ranks


def _swapped(layout):
    """The same units in reverse rank order: a different layout of the same degree."""
    from ntp_ds.layout import ShardLayout

    return ShardLayout(layout.units, layout.heads[::-1], layout.ffn[::-1], layout.vocab[::-1])


def _worker(rank, world_size, args):
    import deepspeed

    import ntp_ds
    from ntp_ds.batch.loader import GlobalBatchSampler, SyntheticTokens, replica_micro_batches
    from ntp_ds.comm import wire
    from ntp_ds.comm.groups import NTPMpu, build_groups
    from ntp_ds.engine.initialize import build_engine, prepare, shard_module
    from ntp_ds.layout import Topology, plan_gradient_sync
    from ntp_ds.layout.sharding import shard_tensor
    from ntp_ds.models import Llama

    config = llama_config(args)
    torch.manual_seed(0)
    full = Llama(config)
    ntp = {"tp": args.tp, "replicas": args.replicas, "zero_redundancy": args.zero_redundancy,
           "redundancy_overlap": args.redundancy_overlap, "bucket_size": args.bucket_size}
    engines = {"ntp": ntp_ds.initialize(model=full, config=deepspeed_config(args), ntp=ntp)}
    uniform = engines["ntp"].ntp_groups
    if args.contributor:
        spec, topology = prepare(full, deepspeed_config(args), ntp)
        layouts = list(topology.layouts)
        layouts[1] = _swapped(layouts[1])
        engines["contributor"] = build_engine(spec, Topology(tuple(layouts)),
                                              lambda groups: shard_module(full, config, groups))
    # The plain engine: same shard, DeepSpeed's own groups over the uniform topology, its own averaging.
    groups = build_groups(uniform.topology, plan_gradient_sync(uniform.topology), rank, 300.0)
    shard = Llama(config, layout=groups.layout, tp_rank=groups.tp_rank, tp_group=groups.tp_group)
    specs = shard.param_specs()
    with torch.no_grad():
        for name, p in shard.named_parameters():
            p.copy_(shard_tensor(dict(full.named_parameters())[name].detach(), specs[name][0], groups.layout,
                                 groups.tp_rank))
    engines["plain"], *_ = deepspeed.initialize(model=shard, model_parameters=list(shard.parameters()),
                                                config=deepspeed_config(args), mpu=NTPMpu(groups))
    data = SyntheticTokens(config.vocab_size, args.seq, size=4096, seed=0)
    sampler = GlobalBatchSampler(len(data), seed=0)

    def run(name, step):
        engine = engines[name]
        plan = uniform if name == "plain" else engine.ntp_groups
        batch_plan = engines["ntp"].batch_plan if name == "plain" else engine.batch_plan
        for batch in replica_micro_batches(data, sampler, batch_plan, plan.replica, step):
            if name == "plain":
                loss = engine(input_ids=batch["input_ids"].to(engine.device), labels=batch["labels"].to(engine.device))
            else:
                loss = engine(batch)
            engine.backward(loss)
            engine.step()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        wire.barrier()

    names = list(engines)
    times = {name: [] for name in names}
    for step in range(args.warmup + args.steps):
        order = names[step % len(names):] + names[:step % len(names)]
        for name in order:
            start = time.perf_counter()
            run(name, step)
            if step >= args.warmup:
                times[name].append(time.perf_counter() - start)
    # The redundant copy alone: the same exchange as after each step (the state of the last one, sent again), with
    # nothing else running.
    ntp = engines["ntp"]
    times["copy_alone"], times["copy_bytes"] = [], [ntp.copies.held_bytes()]
    for _ in range(5 if ntp.copies.targets or ntp.copies.owners else 0):
        wire.barrier()
        start = time.perf_counter()
        ntp.refresh_copies(overlap=False)
        times["copy_alone"].append(time.perf_counter() - start)
    return times


def paired_ratios(results: list[dict], name: str, steps: int) -> list[float]:
    """Per step: engine step time / plain step time of the same round, each the slowest rank's."""
    side = [max(r[name][i] for r in results) for i in range(steps)]
    plain = [max(r["plain"][i] for r in results) for i in range(steps)]
    return [s / p for s, p in zip(side, plain)]


def paired_ratio(results: list[dict], name: str, steps: int) -> float:
    """The median of `paired_ratios`, after a line giving their spread."""
    ratios = paired_ratios(results, name, steps)
    q1, _, q3 = statistics.quantiles(ratios, n=4)
    print(f"{name}: paired ratios over {steps} steps, quartiles {q1:.4f} to {q3:.4f}")
    return statistics.median(ratios)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_job_args(parser, hidden=128, layers=4, heads=8, kv_heads=4, vocab=1024, seq=128, micro=4, accum=32)
    parser.add_argument("--redundancy-overlap", action="store_true",
                        help="let the redundant copies travel during the next step (ntp.redundancy_overlap)")
    parser.add_argument("--bucket-size", type=int, default=500_000_000,
                        help="elements per gradient/parameter message between replicas")
    parser.add_argument("--contributor", action="store_true",
                        help="also run replica 1 with a different layout of the same degree (a contributor)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=80, help="interleaved steps of each engine")
    args = parser.parse_args(argv)
    if args.contributor and (args.tp < 2 or args.replicas < 2):
        parser.error("--contributor needs --tp 2 or more and --replicas 2 or more (a layout of the same degree "
                     "that differs)")
    results = run_ranks(_worker, args.tp * args.replicas, args, timeout=3600)
    plain_s = statistics.median(max(r["plain"][i] for r in results) for i in range(args.steps))
    ntp_s = statistics.median(max(r["ntp"][i] for r in results) for i in range(args.steps))
    print(f"topology: {args.replicas} replicas x TP {args.tp}, ZeRO {args.zero_stage}, "
          f"zero_redundancy {args.zero_redundancy} (overlap {args.redundancy_overlap}), {args.steps} interleaved "
          f"steps each, {args.micro * args.accum * args.seq} tokens per replica step")
    print(f"deepspeed_step_s={plain_s:.4f} ntp_step_s={ntp_s:.4f}")
    copies = [max(r["copy_alone"][i] for r in results) for i in range(len(results[0]["copy_alone"]))]
    if copies:
        copy_s = statistics.median(copies)
        print(f"redundant_copy_bytes_per_rank={max(r['copy_bytes'][0] for r in results)} copy_alone_s={copy_s:.4f} "
              f"({copy_s / plain_s:.2%} of a DeepSpeed step)")
    if args.contributor:
        contributor_s = statistics.median(max(r["contributor"][i] for r in results) for i in range(args.steps))
        print(f"contributor_step_s={contributor_s:.4f}")
    contributor = paired_ratio(results, "contributor", args.steps) if args.contributor else None
    ratio = paired_ratio(results, "ntp", args.steps)
    if contributor is not None:
        print(f"contributor_overhead_ratio={contributor:.4f}")
    print(f"overhead_ratio={ratio:.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
