"""An anchor that keeps its place through a recovery keeps its engine (`NTPEngine.detach`, then `rebind`): detached,
it must hold none of the old generation's process groups, or gloo would keep their connections open through the
teardown and a live peer blocked in one of them would wait for its timeout instead of failing at once.

The recoveries and grows in which anchors keep their engines are judged by final state in tests/test_kept_groups.py
and every recovery test (the weights equal the failure-free run's)."""

from __future__ import annotations

import pytest

from ntp_ds.testing.spawn import run_ranks

pytestmark = pytest.mark.timeout(240)


def _detached(rank, world, model, detach):
    import gc
    import weakref

    import torch
    import torch.distributed as dist

    import ntp_ds
    from ntp_ds.batch.loader import GlobalBatchSampler, replica_micro_batches
    from ntp_ds.comm import wire
    from tests.helpers.training import dataset, deepspeed_config, full_model, tiny_config, tiny_qwen2

    source = tiny_qwen2() if model == "hf" else full_model(tiny_config())
    engine = ntp_ds.initialize(model=source, config=deepspeed_config("adamw", 2, 4, 1),
                               ntp={"tp": 2, "replicas": 2})
    data, sampler = dataset(tiny_config()), GlobalBatchSampler(256, seed=1)  # (both models have 96 tokens)
    for batch in replica_micro_batches(data, sampler, engine.batch_plan, engine.ntp_groups.replica, 0):
        engine.backward(engine(batch))
        engine.step()
    before = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    groups = [weakref.ref(g) for g in dist.distributed_c10d._world.pg_map]
    if detach:
        engine.detach()
    wire.teardown()
    gc.collect()
    left = sum(g() is not None for g in groups)
    kept = all(torch.equal(before[n], p.detach()) for n, p in engine.module.named_parameters())
    return {"groups": len(groups), "left": left, "tensors_kept": kept}


@pytest.mark.parametrize("model", ["llama", "hf"])
def test_a_detached_engine_holds_no_process_group_of_its_generation(model):
    results = run_ranks(_detached, 4, model, True, timeout=180)
    for rank, out in enumerate(results):
        assert out["groups"] > 2, out
        assert out["left"] == 0, f"rank {rank}: {out['left']} process group(s) still referenced after the teardown"
        assert out["tensors_kept"], f"rank {rank}: the detached engine lost its parameters"


def test_an_engine_not_detached_keeps_its_groups_open():
    # The check above bites: an engine left attached holds its TP and data-parallel groups through the teardown.
    results = run_ranks(_detached, 4, "llama", False, timeout=180)
    assert all(out["left"] > 0 for out in results), results


GLOBAL_BATCH, MICRO = 12, 2


def _state(engine) -> dict:
    """This rank's parameters and, on an anchor, its fp32 partitions and their optimizer tensors (host copies)."""
    from ntp_ds.engine.fragments import inner_optimizer

    engine.settle_parameters()  # a contributor's parameters of the last step may still be on their way
    out = {f"param/{n}": p.detach().float().clone() for n, p in engine.module.named_parameters()}
    if engine.is_anchor:
        inner = inner_optimizer(engine)
        for i, flat in enumerate(engine.optimizer.single_partition_of_fp32_groups):
            out[f"fp32/{i}"] = flat.detach().clone()
            out.update({f"{k}/{i}": v.detach().clone() for k, v in inner.state[flat].items()})
    return out


def _one_step(engine, step: int) -> None:
    from ntp_ds.batch.loader import GlobalBatchSampler, replica_micro_batches
    from tests.helpers.training import dataset, tiny_config

    data, sampler = dataset(tiny_config()), GlobalBatchSampler(256, seed=1)
    for batch in replica_micro_batches(data, sampler, engine.batch_plan, engine.ntp_groups.replica, step):
        engine.backward(engine(batch))
        engine.step()


def _recover_then_save(rank, world, stage, ckpt):
    """3 replicas at TP 2; rank 5 dies in step 2's backward. After step 3 the survivors save a DeepSpeed
    checkpoint, then train step 4."""
    from ntp_ds.control.faults import FaultSchedule
    from ntp_ds.control.store import connect_from_env
    from ntp_ds.engine.config import NTPConfig
    from ntp_ds.fault_tolerant import start
    from tests.helpers.training import deepspeed_config, full_model, tiny_config

    ntp = NTPConfig.from_any({"tp": 2, "replicas": 3, "timeout_s": 12.0,
                              "fault_tolerance": {"heartbeat_timeout_s": 2.0, "hang_timeout_s": None}})
    crash = FaultSchedule.from_config([{"rank": 5, "step": 2, "phase": "backward", "kind": "crash"}], world)
    engine = start(full_model(tiny_config()), deepspeed_config("adamw", stage, GLOBAL_BATCH, MICRO), ntp,
                   connect_from_env(12.0), crash, stop_on_signals=False)
    first = engine.engine
    for step in engine.train_steps(3):
        with engine.attempt(step):
            _one_step(engine, step)
    engine.save_checkpoint(ckpt, tag="after_recovery")
    saved = _state(engine.engine)
    _one_step(engine, 3)
    out = {"kept": engine.engine is first, "saved": saved, "after": _state(engine.engine),
           "degrees": tuple(engine.ntp_groups.topology.degrees)}
    engine.close()
    return out


def _load_and_step(rank, world, stage, ckpt):
    """A fresh job at the recovered degrees: load the checkpoint, then train step 4."""
    import ntp_ds
    from tests.helpers.training import deepspeed_config, full_model, tiny_config

    engine = ntp_ds.initialize(model=full_model(tiny_config(), seed=1),
                               config=deepspeed_config("adamw", stage, GLOBAL_BATCH, MICRO),
                               ntp={"tp": 2, "replicas": 3, "degrees": [2, 2, 1], "timeout_s": 12.0})
    engine.load_checkpoint(ckpt, tag="after_recovery")
    loaded = _state(engine)
    _one_step(engine, 3)
    out = {"loaded": loaded, "after": _state(engine)}
    engine.close()
    return out


def _equal(a: dict, b: dict, what: str) -> None:
    import torch

    assert a.keys() == b.keys(), f"{what}: {sorted(a.keys() ^ b.keys())}"
    for k in a:
        assert torch.equal(a[k], b[k]), f"{what}: {k} differs"


@pytest.mark.parametrize("stage", [2])
def test_a_checkpoint_saved_by_kept_engines_after_a_recovery_loads_into_fresh_engines(tmp_path, stage):
    # The anchors of replicas 0 and 1 keep their engines (ZeRO partitions re-cut from dp 3 to dp 2). DeepSpeed's own
    # checkpoint of the recovered job loads into engines built fresh at the recovered degrees, with every
    # parameter, fp32 partition and optimizer tensor equal, and the next step ends bit for bit equal on both.
    recovered = run_ranks(_recover_then_save, 6, stage, str(tmp_path), timeout=200, store=True)
    assert sorted(recovered) == [0, 1, 2, 3, 4]
    assert [recovered[r]["kept"] for r in range(5)] == [True, True, True, True, False]
    assert all(recovered[r]["degrees"] == (2, 2, 1) for r in range(5))
    fresh = run_ranks(_load_and_step, 5, stage, str(tmp_path), timeout=200)
    for rank in range(5):
        _equal(recovered[rank]["saved"], fresh[rank]["loaded"], f"rank {rank}: the checkpoint loaded")
        _equal(recovered[rank]["after"], fresh[rank]["after"], f"rank {rank}: the step after")


class _Group:
    """A stand-in for a TP group of two (the shard only keeps it and hands it to collectives)."""


@pytest.mark.parametrize("model", ["llama", "hf"])
def test_set_tp_group_moves_every_reference_of_the_shard(monkeypatch, model):
    # A kept shard whose replica's TP group is replaced: every module attribute and hook that used the old group
    # must use the new one, and nothing of the shard may reference the old one (gloo would keep it open).
    import gc
    import weakref

    from ntp_ds.layout import ShardLayout
    from ntp_ds.models import HFCausalLM, HFConfig, Llama, tp_layers
    from tests.helpers.training import tiny_config, tiny_qwen2

    monkeypatch.setattr(tp_layers.dist, "get_world_size", lambda group=None: 2)
    old, new = _Group(), _Group()
    if model == "llama":
        config = tiny_config()
        shard = Llama(config, ShardLayout.balanced(config.units(), 2), 0, old, init=False)
    else:
        hf = tiny_qwen2()
        shard = HFCausalLM(HFConfig.from_transformers(hf.config),
                           ShardLayout.balanced(HFConfig.from_transformers(hf.config).units(), 2), 0, old)
    holding = [name for name, m in shard.named_modules() if old in vars(m).values()]
    assert len(holding) > 3  # the shard, its TP layers, the blocks entering the TP region
    shard.set_tp_group(None)
    gone = weakref.ref(old)
    del old
    gc.collect()
    assert gone() is None, "something of the shard still holds the old group"
    shard.set_tp_group(new)
    assert [name for name, m in shard.named_modules() if new in vars(m).values()] == holding
    assert shard.tp_group is new
