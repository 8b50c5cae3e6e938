"""Gradient clipping by the global norm: every element of the model counted once, whatever the layouts.

Each case trains with DeepSpeed's `gradient_clipping` below every step's norm (so the clip is active) and must end
where one process clipping the unsharded model's gradients with torch's `clip_grad_norm_` ends. SGD: its update is
proportional to the clip coefficient, so a norm counted wrong anywhere shows in the weights.
"""

import functools

import pytest
import torch

from ntp_ds.engine.initialize import model_config_of
from ntp_ds.layout.sharding import shard_tensor
from ntp_ds.models import empty_shard
from ntp_ds.testing.spawn import run_ranks
from tests.helpers.training import train_ntp, train_reference

STEPS, GLOBAL_BATCH, MICRO = 4, 12, 2
CLIP = 0.5

# The tiny model has 6 query heads on 2 KV heads: TP 2 splits them evenly (no KV head shared); TP 3 and the uneven
# TP 4 (2/2/1/1 heads) share a KV head between two ranks; (3, 2) adds a contributor replica to a TP 3 anchor.
CASES = [((1, 1), 2), ((2, 2), 1), ((2, 2), 0), ((3, 3), 2), ((4,), 0), ((4,), 1), ((3, 2), 2), ((3, 2), 0)]


@pytest.mark.parametrize("degrees, stage", CASES,
                         ids=[f"{'x'.join(map(str, d))}-zero{s}" for d, s in CASES])
def test_clipped_update_equals_the_unsharded_reference(degrees, stage):
    ntp = {"tp": max(degrees), "replicas": len(degrees), "degrees": degrees}
    norms = []
    reference = train_reference("sgd", GLOBAL_BATCH, STEPS, clip=CLIP, norms=norms)
    assert len(norms) == STEPS and min(norms) > CLIP, f"the clip must act at every step: norms {norms}"
    unclipped = train_reference("sgd", GLOBAL_BATCH, STEPS)
    results = run_ranks(functools.partial(train_ntp, clip=CLIP), sum(degrees), ntp, "sgd", stage, GLOBAL_BATCH,
                        MICRO, STEPS, timeout=240)
    ref = dict(reference.named_parameters())
    specs = empty_shard(model_config_of(reference), device="meta").param_specs()
    for res in results:
        assert res["global_steps"] == STEPS
        for name, shard in res["shards"].items():
            want = shard_tensor(ref[name].detach(), specs[name][0], res["layout"], res["tp_rank"])
            torch.testing.assert_close(shard, want, msg=lambda m: f"replica {res['replica']} tp rank "
                                                                  f"{res['tp_rank']} {name}: {m}")
    full = next(r["full"] for r in results if r["full"] is not None)
    for name, tensor in full.items():
        torch.testing.assert_close(tensor, ref[name].detach(), msg=lambda m: f"consolidated {name}: {m}")
    # The comparison tells clipped from unclipped training apart.
    gap = max((ref[n] - p).abs().max().item() for n, p in unclipped.named_parameters())
    assert gap > 1e-3, f"clipping changed the weights by only {gap:.3g}"


def test_each_shared_kv_head_is_counted_by_its_lowest_holder_alone():
    from ntp_ds.engine.clipping import counted_kv_units
    from ntp_ds.layout import ShardLayout
    from tests.helpers.training import tiny_config

    units = tiny_config().units()
    tp3 = ShardLayout.balanced(units, 3)  # heads 0-1 | 2-3 | 4-5 over KV heads {0: 0-2, 1: 3-5}
    assert [counted_kv_units(tp3, r) for r in range(3)] == [(True,), (False, True), (False,)]
    tp2 = ShardLayout.balanced(units, 2)
    assert not tp2.shares_kv() and [counted_kv_units(tp2, r) for r in range(2)] == [(True,), (True,)]
