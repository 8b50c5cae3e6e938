"""`engine.recut.recut_zero`: a live ZeRO 1/2 engine re-cut onto a data-parallel group of another size must be the
engine DeepSpeed would have built there: the same partition bookkeeping, a DeepSpeed checkpoint that loads into a
fresh engine, and the same next steps, bit for bit.

Three ranks train a small model at dp 3 (the fp32 masters and Adam moments gathered whole before the change); then
either rank 2 leaves (dp 3 -> 2, a recovery: ranks 0 and 1 meet in a new default group of two) or a dp 2 job gains
rank 2 (dp 2 -> 3, a grow: rank 2 builds a fresh engine). The ranks that keep their engine re-cut it, every rank
writes the elements its new partition holds, and each compares its re-cut engine with a fresh engine built on the
same group: every partition field, the state installed, a DeepSpeed checkpoint of the re-cut engines loaded into
the fresh ones, and two more steps on both.
"""

from __future__ import annotations

import os

import pytest

from ntp_ds.testing.spawn import free_port, run_ranks

LAYERS = (12, 20, 7, 16, 6)
"""Widths of a chain of linear layers: sizes that no partition boundary respects."""


class _Mpu:
    """A model-parallel unit of one rank per model-parallel group whose data-parallel group can change."""

    def __init__(self, dp_group, mp_group):
        self.dp_group, self.mp_group = dp_group, mp_group

    def get_model_parallel_group(self):
        return self.mp_group

    def get_model_parallel_rank(self):
        return 0

    def get_model_parallel_world_size(self):
        return 1

    def get_data_parallel_group(self):
        return self.dp_group

    def get_data_parallel_rank(self):
        import torch.distributed as dist

        return dist.get_rank(self.dp_group)

    def get_data_parallel_world_size(self):
        import torch.distributed as dist

        return dist.get_world_size(self.dp_group)

    get_tensor_model_parallel_group = get_model_parallel_group
    get_tensor_model_parallel_rank = get_model_parallel_rank
    get_tensor_model_parallel_world_size = get_model_parallel_world_size

    def get_pipeline_model_parallel_world_size(self):
        return 1


def _model():
    import torch

    torch.manual_seed(0)
    layers = []
    for a, b in zip(LAYERS, LAYERS[1:]):
        layers += [torch.nn.Linear(a, b), torch.nn.Tanh()]
    return torch.nn.Sequential(*layers[:-1])


def _config(stage: int, round_robin: bool, bf16: bool, dp: int) -> dict:
    return {"train_batch_size": 2 * dp, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}},
            "zero_optimization": {"stage": stage, "round_robin_gradients": round_robin, "reduce_bucket_size": 64},
            "bf16": {"enabled": bf16}, "steps_per_print": 10**9}


def _engine(config, mpu):
    import deepspeed

    model = _model()
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config, mpu=mpu,
                                      dist_init_required=False)
    return engine


def _train(engine, steps: int, seed: int) -> None:
    import torch
    import torch.distributed as dist

    for step in range(steps):
        g = torch.Generator().manual_seed(seed * 1000 + step * 10 + dist.get_rank(engine.data_parallel_group))
        x = torch.randn(2, LAYERS[0], generator=g).to(engine.module[0].weight.dtype)
        loss = engine(x).float().pow(2).mean()
        engine.backward(loss)
        engine.step()


def _whole_state(engine) -> dict:
    """Every parameter's fp32 master and Adam moments, whole (DeepSpeed's own gathers over the dp group)."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    return {name: {"fp32": safe_get_full_fp32_param(p).clone(),
                   **{k: safe_get_full_optimizer_state(p, k).clone() for k in ("exp_avg", "exp_avg_sq")}}
            for name, p in engine.module.named_parameters()}


def _install(engine, whole: dict, step: int) -> None:
    """Write the elements of `whole` this rank's new partition holds, through DeepSpeed's fragment links; the
    parameters from their masters (DeepSpeed's own copy and all-gather)."""
    import torch

    from ntp_ds.engine.fragments import inner_optimizer

    inner = inner_optimizer(engine)
    for flat in engine.optimizer.single_partition_of_fp32_groups:
        state = inner.state.setdefault(flat, {})
        for k in ("exp_avg", "exp_avg_sq"):
            state.setdefault(k, torch.zeros_like(flat))
        state["step"] = torch.tensor(float(step))
    engine.optimizer._hp_optimizer_states_linked = False
    engine.optimizer._lazy_init_hp_params_optimizer_state()
    with torch.no_grad():
        for name, p in engine.module.named_parameters():
            mapping = p._hp_mapping
            if mapping is None:
                continue
            lo, n = mapping.lp_fragment_address.start, mapping.lp_fragment_address.numel
            mapping.get_hp_fragment().copy_(whole[name]["fp32"].view(-1)[lo:lo + n])
            for k in ("exp_avg", "exp_avg_sq"):
                mapping.get_hp_fragment(k).copy_(whole[name][k].view(-1)[lo:lo + n])
    engine.optimizer.update_lp_params()


def _fields(engine) -> dict:
    """Everything of the optimizer and the engine that follows from the partitioning, comparable across engines."""
    zero = engine.optimizer
    ids = {id(p): n for n, p in engine.module.named_parameters()}
    names = lambda params: [ids[id(p)] for p in params]  # noqa: E731
    return {"dp": engine.dp_world_size, "seq_dp": engine.seq_dp_world_size,
            "partition_count": list(zero.partition_count), "partition_size": list(zero.partition_size),
            "groups_padding": list(zero.groups_padding), "first_offset": list(zero.first_offset),
            "flat": [f.numel() for f in zero.bit16_groups_flat],
            "partitions": [[t.numel() for t in g] for g in zero.parallel_partitioned_bit16_groups],
            "fp32": [t.numel() for t in zero.single_partition_of_fp32_groups],
            "rr": [names(g) for g in zero.round_robin_bit16_groups], "rr_offsets": zero.round_robin_bit16_offsets,
            "rr_padding": zero.round_robin_bit16_padding, "rr_indices": zero.round_robin_bit16_indices,
            "in": [names(g) for g in zero.params_in_partition], "out": [names(g) for g in zero.params_not_in_partition],
            "in_current": {ids[id(zero.param_dict[i])]: v for i, v in zero.is_param_in_current_partition.items()},
            "total_grads": dict(zero.total_grads_in_partition),
            "insertion": {k: dict(v) for k, v in zero.grad_partition_insertion_offset.items()},
            "grad_start": {k: dict(v) for k, v in zero.grad_start_offset.items()},
            "slices": [{k: (v.start, v.numel) for k, v in m.items()} for m in zero._param_slice_mappings],
            "writers": (engine.save_non_zero_checkpoint, engine.save_zero_checkpoint),
            "views": all(p.data.data_ptr() >= zero.bit16_groups_flat[0].data_ptr() for p in zero.bit16_groups[0])}


def _state(engine) -> dict:
    from ntp_ds.engine.fragments import inner_optimizer

    inner = inner_optimizer(engine)
    out = {"params": {n: p.detach().float().clone() for n, p in engine.module.named_parameters()}}
    for i, flat in enumerate(engine.optimizer.single_partition_of_fp32_groups):
        out[f"fp32/{i}"] = flat.detach().clone()
        for k, v in inner.state[flat].items():
            out[f"{k}/{i}"] = v.detach().clone()
    return out


def _same(a: dict, b: dict, what: str) -> None:
    import torch

    assert a.keys() == b.keys(), what
    for k in a:
        if isinstance(a[k], dict):
            _same(a[k], b[k], f"{what}/{k}")
        else:
            assert torch.equal(a[k], b[k]), f"{what}/{k} differs"


def _worker(rank, world, direction, stage, round_robin, bf16, ckpt, port):
    from datetime import timedelta

    import deepspeed
    import torch.distributed as dist

    from ntp_ds.engine.recut import recut_zero

    timeout = timedelta(seconds=60)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timeout)
    deepspeed.init_distributed(dist_backend="gloo", timeout=timeout)
    singles = [dist.new_group([r]) for r in range(world)]
    before = list(range(3)) if direction == "shrink" else [0, 1]
    old = dist.new_group(before)
    engine = _engine(_config(stage, round_robin, bf16, len(before)), _Mpu(old, singles[rank])) \
        if rank in before else None
    if engine is not None:
        _train(engine, 3, seed=1)
        whole, step = _whole_state(engine), 3
    if direction == "shrink":
        # Rank 2 leaves; ranks 0 and 1 meet in a new default group of two, as survivors do.
        dist.destroy_process_group()
        if rank == 2:
            return None
        store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=timeout)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=2, timeout=timeout)
        after_ranks = [0, 1]
    else:
        # Rank 2 joins: the whole state travels to it (here, whole, from rank 0), as a grow's transfers would.
        payload = [whole, step] if rank == 0 else [None, None]
        dist.broadcast_object_list(payload, src=0)
        whole, step = payload
        after_ranks = [0, 1, 2]
    if direction == "shrink":  # the new world's groups of one
        singles = [dist.new_group([r]) for r in after_ranks]
    mpu = _Mpu(dist.new_group(after_ranks), singles[rank])
    config = _config(stage, round_robin, bf16, len(after_ranks))
    fresh = _engine(config, mpu)
    _install(fresh, whole, step)
    if engine is not None:
        recut_zero(engine, mpu)
    else:  # the joiner: its fresh engine is the one it trains (installed again, in step with the others)
        engine, fresh = fresh, None
    _install(engine, whole, step)
    out = {"fields": _fields(engine), "state": _state(engine)}
    if fresh is not None:
        out["fresh_fields"], out["fresh_state"] = _fields(fresh), _state(fresh)
    # DeepSpeed's own checkpoint of the (re-cut) engines, loaded into engines built fresh on the new group.
    engine.save_checkpoint(ckpt, tag="recut")
    loaded = _engine(config, mpu)
    loaded.load_checkpoint(ckpt, tag="recut")
    out["loaded_state"] = _state(loaded)
    _train(engine, 2, seed=2)
    _train(loaded, 2, seed=2)
    out["after"], out["loaded_after"] = _state(engine), _state(loaded)
    return out


CASES = [("shrink", 1, False, False), ("shrink", 2, False, True), ("shrink", 2, True, False),
         ("grow", 1, True, True), ("grow", 2, False, False)]


@pytest.mark.parametrize("direction, stage, round_robin, bf16", CASES,
                         ids=[f"{d}-zero{s}{'-rr' if r else ''}{'-bf16' if b else ''}" for d, s, r, b in CASES])
def test_a_recut_engine_is_the_engine_deepspeed_builds_on_the_new_group(tmp_path, direction, stage, round_robin,
                                                                          bf16):
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    results = run_ranks(_worker, 3, direction, stage, round_robin, bf16, str(tmp_path), free_port(), timeout=240)
    ranks = [r for r in results if r is not None]
    assert len(ranks) == (2 if direction == "shrink" else 3)
    for rank, out in enumerate(ranks):
        if "fresh_fields" in out:
            assert out["fields"] == out["fresh_fields"], f"rank {rank}: the re-cut bookkeeping is not DeepSpeed's"
            _same(out["state"], out["fresh_state"], f"rank {rank}: installed state")
        _same(out["state"], out["loaded_state"], f"rank {rank}: checkpoint round trip")
        _same(out["after"], out["loaded_after"], f"rank {rank}: two steps after")
    assert ranks[0]["fields"]["dp"] == len(ranks)
