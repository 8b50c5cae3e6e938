"""Degraded pace: how long each rank's shard of a degraded replica takes, work-balanced layout against count-balanced.

One process builds every rank's shard of three layouts of the same Llama (the project's own shard modules): the
healthy TP t layout, and TP t' = t - lost as the engine degrades it (`without_ranks`, work-balanced) and as the old
count rule did (`balance="count"`). It then times each shard's forward and backward on the same tokens, one shard
after another, repetitions interleaved (every repetition visits every shard, in a seeded random order), and takes
the median per shard, in CPU seconds of the process by default (on shared cores a neighbour's load would inflate
wall-clock times at random). A shard runs its own compute only: without a process group the TP layers skip their
collectives (a row-parallel output is then this rank's partial sum, which costs the same to compute).

A degraded replica's step waits for its slowest rank, and it takes t'/t of a healthy replica's samples, so it keeps
the healthy pace when its slowest rank needs at most t/t' of a healthy rank's time on the same tokens. The last line
reads `degraded_pace_ratio=<slowest rank / (t/t' x a healthy rank)> count_balanced_ratio=<same, old layout>`
(target: at most 1.05; the defaults give the old rule at least 1.2). About a minute on one CPU core; the
per-rank lines compare each shard's time with the cost model's prediction (`ntp_ds.layout.cost`).

    python benchmarks/degraded_pace.py
    python benchmarks/degraded_pace.py --tp 8 --lost 2 --reps 15
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from ntp_ds.layout import ShardLayout, max_rank_work, rank_work
from ntp_ds.models import Llama, LlamaConfig


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--ffn", type=int, default=2048)
    parser.add_argument("--vocab", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--tp", type=int, default=8)
    parser.add_argument("--lost", type=int, default=1, help="ranks the degraded replica lost (its last ones)")
    parser.add_argument("--reps", type=int, default=11)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (1: least noise)")
    parser.add_argument("--clock", choices=sorted(CLOCKS), default="cpu",
                        help="cpu: this process's CPU seconds, which a neighbour's load on shared cores does not "
                             "inflate (with one thread, the shard's compute time); wall: elapsed seconds")
    return parser.parse_args(argv)


def layouts(config: LlamaConfig, seq: int, tp: int, lost: int) -> dict[str, ShardLayout]:
    """The healthy layout and the two degraded ones, costed as the engine costs them."""
    healthy = ShardLayout.balanced(config.units(seq), tp)
    gone = set(range(tp - lost, tp))
    return {"healthy": healthy, "work": healthy.without_ranks(gone),
            "count": healthy.without_ranks(gone, balance="count")}


CLOCKS = {"cpu": time.process_time, "wall": time.perf_counter}


def local_step(shard: Llama, ids: torch.Tensor, clock=time.process_time) -> float:
    """Seconds of one forward and backward of the shard's own compute (decoder, its vocabulary rows, a loss)."""
    shard.zero_grad(set_to_none=True)
    start = clock()
    logits = shard.lm_head(shard.model(ids))
    logits.logsumexp(-1).mean().backward()
    return clock() - start


def time_shards(shards: list[tuple[str, int, Llama]], ids: torch.Tensor, reps: int,
                clock=time.process_time) -> dict[tuple[str, int], list[float]]:
    """Seconds of every repetition per shard; each repetition visits every shard once, in its own seeded order, so a
    slow spell of the machine falls on no layout in particular."""
    for _, _, shard in shards:  # warm up every shape once
        local_step(shard, ids, clock)
    times: dict[tuple[str, int], list[float]] = {(name, r): [] for name, r, _ in shards}
    rng = random.Random(0)
    for _ in range(reps):
        order = rng.sample(shards, len(shards))
        for name, r, shard in order:
            times[(name, r)].append(local_step(shard, ids, clock))
    return times


def pace_ratios(times: dict[tuple[str, int], list[float]], tp: int, degree: int, summary=statistics.median
                ) -> dict[str, float]:
    """Per degraded layout: its slowest rank over t/t' x a healthy rank (the median over healthy ranks), each rank's
    time summarised over its repetitions by `summary`."""
    per = {key: summary(ts) for key, ts in times.items()}
    healthy = statistics.median(per[("healthy", r)] for r in range(tp))
    return {name: max(per[(name, r)] for r in range(degree)) / (tp / degree * healthy) for name in ("work", "count")}


def main(argv=None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    config = LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.ffn,
                         num_hidden_layers=args.layers, num_attention_heads=args.heads,
                         num_key_value_heads=args.kv_heads, max_position_embeddings=args.seq)
    lays = layouts(config, args.seq, args.tp, args.lost)
    shards = [(name, r, Llama(config, lay, r, seed=0)) for name, lay in lays.items() for r in range(lay.tp)]
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=torch.Generator().manual_seed(0))
    times = time_shards(shards, ids, args.reps, CLOCKS[args.clock])
    medians = {key: statistics.median(ts) for key, ts in times.items()}

    degree = args.tp - args.lost
    ideal = args.tp / degree
    healthy_s = statistics.median(medians[("healthy", r)] for r in range(args.tp))
    healthy_work = max_rank_work(lays["healthy"])
    print(f"model: hidden {args.hidden}, {args.heads} heads on {args.kv_heads} KV heads, FFN {args.ffn}, vocab "
          f"{args.vocab}, {args.layers} layers; {args.batch} x {args.seq} tokens; TP {args.tp} -> {degree}; "
          f"{args.reps} repetitions, {args.threads} thread(s), {args.clock} clock")
    print(f"healthy rank: {healthy_s * 1e3:.1f} ms (median over ranks)")
    for name in ("work", "count"):
        lay = lays[name]
        print(f"{name}-balanced TP {degree}:")
        for r in range(lay.tp):
            units = ", ".join(f"{k} {sum(b - a for a, b in lay.owned(k, r))}" for k in ("heads", "kv", "ffn", "vocab"))
            print(f"  rank {r}: {medians[(name, r)] * 1e3:7.1f} ms = {medians[(name, r)] / healthy_s:.3f}x healthy "
                  f"(predicted {rank_work(lay, r) / healthy_work:.3f}x); {units}")
        slowest = max(medians[(name, r)] for r in range(lay.tp))
        print(f"  slowest {slowest / healthy_s:.3f}x healthy against ideal {ideal:.3f}x; predicted "
              f"{max_rank_work(lay) / healthy_work / ideal:.3f} of ideal")
    fastest = pace_ratios(times, args.tp, degree, min)
    print(f"from each shard's fastest repetition instead (least disturbed by other load): work-balanced "
          f"{fastest['work']:.3f}, count-balanced {fastest['count']:.3f}")
    ratios = pace_ratios(times, args.tp, degree)
    print(f"degraded_pace_ratio={ratios['work']:.3f} count_balanced_ratio={ratios['count']:.3f}")


if __name__ == "__main__":
    main()
