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
    from tests.training import dataset, deepspeed_config, full_model, tiny_config, tiny_qwen2

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
