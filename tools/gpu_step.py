"""One-GPU check: bf16 training steps of a ~1B-parameter Llama through NTPEngine in one rank; prints the step time
and the peak GPU memory, and fails loudly on any problem. Then a group built as the product builds them (created
non-blocking under NCCL) carries one collective of each kind the product runs and is aborted. `--cpu`: the same steps of a tiny Llama on the CPU, so
that the script is run where there is no GPU (tools/gpu_check.sh --cpu)."""

import argparse
import os
import sys
import time

import torch

os.environ.setdefault("RANK", "0")
os.environ.setdefault("LOCAL_RANK", "0")
os.environ.setdefault("WORLD_SIZE", "1")
os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
os.environ.setdefault("MASTER_PORT", "29533")

import ntp_ds  # noqa: E402
from ntp_ds.batch.loader import GlobalBatchSampler, SyntheticTokens, replica_micro_batches  # noqa: E402
from ntp_ds.models import Llama, LlamaConfig  # noqa: E402


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--cpu", action="store_true", help="a tiny Llama on the CPU instead of ~1B on a GPU")
    cpu = parser.parse_args(argv).cpu
    assert cpu or torch.cuda.is_available(), "no CUDA device visible"
    if cpu:
        config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    else:
        config = LlamaConfig(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=18,
                             num_attention_heads=16, num_key_value_heads=8, max_position_embeddings=1024)
    torch.manual_seed(0)
    model = Llama(config)
    n_params = sum(p.numel() for p in model.parameters())
    ds = {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 4, "bf16": {"enabled": True},
          "optimizer": {"type": "AdamW", "params": {"lr": 3e-4, "torch_adam": True}}, "zero_optimization": {"stage": 1},
          "steps_per_print": 10**9}
    engine = ntp_ds.initialize(model=model, config=ds, ntp={"tp": 1, "replicas": 1})
    # Without torch_adam DeepSpeed JIT-builds its fused Adam (nvcc on a GPU machine).
    assert type(engine.basic_optimizer) is torch.optim.AdamW, f"optimizer is {type(engine.basic_optimizer)}"
    data = SyntheticTokens(config.vocab_size, 32 if cpu else 512, size=64, seed=0)
    sampler = GlobalBatchSampler(len(data), seed=0)
    before = {n: p.detach().float().clone() for n, p in engine.module.named_parameters()}
    if not cpu:
        torch.cuda.reset_peak_memory_stats()
    times = []
    for step in range(4):
        start = time.perf_counter()
        for batch in replica_micro_batches(data, sampler, engine.batch_plan, 0, step):
            loss = engine(batch)
            engine.backward(loss)
            engine.step()
        if not cpu:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
        print(f"step {step}: loss {loss.item():.4f} time {times[-1]:.3f}s")
        assert torch.isfinite(loss), "loss is not finite"
    dtypes = {p.dtype for p in engine.module.parameters()}
    assert dtypes == {torch.bfloat16}, f"parameters are {dtypes}, expected bf16"
    moved = max((p.detach().float() - before[n]).abs().max().item() for n, p in engine.module.named_parameters())
    assert moved > 0, "the optimizer did not change the weights"
    peak = "" if cpu else f" peak_memory_gib={torch.cuda.max_memory_allocated() / 2**30:.1f},"
    print(f"gpu_step ok{' (cpu)' if cpu else ''}: {n_params / 1e6:,.1f}M parameters, bf16, "
          f"step_s={min(times[1:]):.3f}{peak} max weight change {moved:.3g}")
    print(f"gpu_step ok: a group created as the product creates them ({product_group_ops()})")
    return 0


def product_group_ops() -> str:
    """A group of this rank alone, built by `groups.named_group` (under NCCL: created non-blocking, at its first op),
    carries an all-reduce, an all-gather and a broadcast, then is aborted; return what it was created with. (Its
    point-to-point path needs a second GPU: the product never sends to itself.)"""
    from datetime import timedelta

    import torch.distributed as dist

    from ntp_ds.comm import groups, wire

    me = dist.get_rank()
    group = groups.named_group("check/created", [me], timedelta(seconds=120), role="check")
    device = wire.device_of(group)
    t = torch.full((8,), 2.0, device=device)
    dist.all_reduce(t, group=group)  # the first op: the communicator is created here
    gathered = torch.empty(8, device=device)
    dist.all_gather_single(gathered, t, group=group)
    dist.broadcast(t, src=me, group=group)
    assert t.tolist() == gathered.tolist() == [2.0] * 8, (t, gathered)
    options = groups.creation_options(dist.get_backend(group), timedelta(seconds=120))
    wire.discard([group])
    blocking = getattr(getattr(options, "config", None), "blocking", None)
    return f"backend {dist.get_backend()}, " + ("default options" if options is None else f"config.blocking={blocking}")


if __name__ == "__main__":
    sys.exit(main())
