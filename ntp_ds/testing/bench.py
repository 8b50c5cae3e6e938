"""What the steady-state and memory benchmarks share: the job's shape flags and the configs built from them."""

from __future__ import annotations

import argparse

import torch


def add_job_args(parser: argparse.ArgumentParser, *, hidden: int, layers: int, heads: int, kv_heads: int,
                 vocab: int, seq: int, micro: int, accum: int) -> None:
    """Topology, ZeRO and model-shape flags, with the benchmark's own defaults."""
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--zero-stage", type=int, default=1)
    parser.add_argument("--zero-redundancy", type=int, default=1,
                        help="in-memory copies of each ZeRO partition kept for live recovery (the NTP default is 1)")
    parser.add_argument("--hidden", type=int, default=hidden)
    parser.add_argument("--layers", type=int, default=layers)
    parser.add_argument("--heads", type=int, default=heads)
    parser.add_argument("--kv-heads", type=int, default=kv_heads)
    parser.add_argument("--vocab", type=int, default=vocab)
    parser.add_argument("--seq", type=int, default=seq)
    parser.add_argument("--micro", type=int, default=micro)
    parser.add_argument("--accum", type=int, default=accum)


def llama_config(args):
    from ntp_ds.models import LlamaConfig

    return LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.hidden * 3,
                       num_hidden_layers=args.layers, num_attention_heads=args.heads,
                       num_key_value_heads=args.kv_heads, max_position_embeddings=args.seq)


def deepspeed_config(args) -> dict:
    """AdamW (torch's, no CUDA op built), the flags' ZeRO stage, bf16 on GPUs, the failure-free global batch."""
    return {"train_batch_size": args.micro * args.accum * args.replicas, "train_micro_batch_size_per_gpu": args.micro,
            "gradient_accumulation_steps": args.accum,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True}},
            "zero_optimization": {"stage": args.zero_stage}, "bf16": {"enabled": torch.cuda.is_available()},
            "steps_per_print": 10**9}
