"""Nonuniform training ends where one process training the unsharded model on the same samples ends."""

import functools

import pytest

from ntp_ds.testing.spawn import run_ranks
from tests.helpers.reference import assert_matches_reference, reference_init
from tests.helpers.training import train_ntp, train_reference

STEPS = 10


def run_case(degrees, stage, optim, policy="preserve_global_batch", global_batch=12, micro=2, tp=None,
             late_rank=None, **ntp):
    from tests.helpers.training import full_model, tiny_config

    reference_init.clear()
    reference_init.update({n: p.detach().clone() for n, p in full_model(tiny_config()).named_parameters()})
    ntp = {"tp": tp or max(degrees), "replicas": len(degrees), "degrees": degrees, "batch_policy": policy, **ntp}
    train = functools.partial(train_ntp, late_rank=late_rank)
    results = run_ranks(train, sum(degrees), ntp, optim, stage, global_batch, micro, STEPS, timeout=240)
    assert all(r["global_steps"] == STEPS for r in results)
    # DeepSpeed's sample count (checkpointed, its monitor's x axis) counts the global batch on every rank.
    assert [r["samples_seen"] for r in results] == [STEPS * results[0]["global_samples"]] * len(results)
    reference = train_reference(optim, results[0]["global_samples"], STEPS)
    assert_matches_reference(results, reference, optim)
    return results


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_tp3_tp2_sgd(stage):
    run_case((3, 2), stage, "sgd")


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_tp3_tp2_adamw(stage):
    run_case((3, 2), stage, "adamw")


def test_tp2_tp1_adamw_streamed_in_small_buckets():
    run_case((2, 1), 2, "adamw", global_batch=6, micro=1, bucket_size=1500)


def test_three_replicas_tp2_tp2_tp1():
    run_case((2, 2, 1), 1, "adamw")


def test_a_contributor_that_ends_late_still_gets_its_last_parameters():
    # The anchors finish first; their last parameter messages to the contributor (rank 4) are still queued behind the
    # contributor's window of receives. `close()` holds everyone until they arrived; a rank that left at once would
    # drop them (under nccl_model the contributor's receives then fail, the job's store gone with rank 0).
    run_case((2, 2, 1), 1, "adamw", bucket_size=1500, late_rank=4)


def test_proportional_unequal_local_batches():
    results = run_case((3, 2), 1, "sgd", policy="proportional", global_batch=12, micro=2)
    assert results[0]["global_samples"] == 10  # 6 on the healthy replica, 4 on the TP-2 one
