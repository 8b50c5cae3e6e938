"""Steady-state overhead: NTPEngine vs a plain DeepSpeedEngine on the same uniform topology, no failure.

Both engines train the same TP-sharded Llama in the same processes; their steps are interleaved in blocks so that
machine noise hits both alike. The last line reads `overhead_ratio=<NTP step time / DeepSpeed step time>`.

    python benchmarks/steady_state.py --tp 1 --replicas 2 --steps 20
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.mp import run_ranks  # noqa: E402


def _config(args) -> dict:
    from ntp_ds.models import LlamaConfig

    return LlamaConfig(vocab_size=1024, hidden_size=args.hidden, intermediate_size=args.hidden * 3,
                       num_hidden_layers=args.layers, num_attention_heads=8, num_key_value_heads=4,
                       max_position_embeddings=args.seq)


def _ds_config(args) -> dict:
    replicas = args.replicas
    return {"train_batch_size": args.micro * args.accum * replicas, "train_micro_batch_size_per_gpu": args.micro,
            "gradient_accumulation_steps": args.accum,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True}},
            "zero_optimization": {"stage": args.zero_stage}, "bf16": {"enabled": torch.cuda.is_available()},
            "steps_per_print": 10**9}


def _worker(rank, world_size, args):
    import deepspeed
    import torch.distributed as dist

    import ntp_ds
    from ntp_ds.batch.loader import GlobalBatchSampler, SyntheticTokens, replica_micro_batches
    from ntp_ds.comm.groups import NTPMpu
    from ntp_ds.models import Llama
    from ntp_ds.models.sharding import shard_tensor

    config = _config(args)
    torch.manual_seed(0)
    full = Llama(config)
    ntp_engine = ntp_ds.initialize(model=full, config=_ds_config(args),
                                   ntp={"tp": args.tp, "replicas": args.replicas,
                                        "zero_redundancy": args.zero_redundancy})
    groups = ntp_engine.ntp_groups
    # The plain engine: same shard, same groups, DeepSpeed's own gradient averaging and accumulation.
    shard = Llama(config, layout=groups.layout, tp_rank=groups.tp_rank, tp_group=groups.tp_group)
    specs = shard.param_specs()
    with torch.no_grad():
        for name, p in shard.named_parameters():
            p.copy_(shard_tensor(dict(full.named_parameters())[name].detach(), specs[name][0], groups.layout,
                                 groups.tp_rank))
    plain, *_ = deepspeed.initialize(model=shard, model_parameters=list(shard.parameters()),
                                     config=_ds_config(args), mpu=NTPMpu(groups))
    data = SyntheticTokens(config.vocab_size, args.seq, size=4096, seed=0)
    sampler = GlobalBatchSampler(len(data), seed=0)
    plan = ntp_engine.batch_plan

    def run(engine, step, plain_engine):
        for batch in replica_micro_batches(data, sampler, plan, groups.replica, step):
            if plain_engine:
                batch.pop("global_tokens")
                loss = engine(input_ids=batch["input_ids"], labels=batch["labels"])
            else:
                loss = engine(batch)
            engine.backward(loss)
            engine.step()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        dist.barrier()

    times = {"ntp": [], "plain": []}
    for step in range(args.warmup + args.steps):
        for name, engine in (("plain", plain), ("ntp", ntp_engine)) if step % 2 else (("ntp", ntp_engine),
                                                                                       ("plain", plain)):
            start = time.perf_counter()
            run(engine, step, name == "plain")
            if step >= args.warmup:
                times[name].append(time.perf_counter() - start)
    return times


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--zero-stage", type=int, default=1)
    parser.add_argument("--zero-redundancy", type=int, default=1,
                        help="in-memory copies of each ZeRO partition kept for live recovery (the NTP default is 1)")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--micro", type=int, default=4)
    parser.add_argument("--accum", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args(argv)
    results = run_ranks(_worker, args.tp * args.replicas, args, timeout=1800)
    # A step ends when its slowest rank ends: take the per-step maximum over ranks.
    ntp = [max(r["ntp"][i] for r in results) for i in range(args.steps)]
    plain = [max(r["plain"][i] for r in results) for i in range(args.steps)]
    ntp_s, plain_s = statistics.median(ntp), statistics.median(plain)
    print(f"topology: {args.replicas} replicas x TP {args.tp}, ZeRO {args.zero_stage}, "
          f"zero_redundancy {args.zero_redundancy}, {args.steps} steps each")
    print(f"deepspeed_step_s={plain_s:.4f} ntp_step_s={ntp_s:.4f}")
    print(f"overhead_ratio={ntp_s / plain_s:.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
