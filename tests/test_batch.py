"""Batch planning and the deterministic loader (pure and single-process)."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ntp_ds.batch import BatchError, lockstep_replicas, max_micro_batch, plan_batch
from ntp_ds.batch.loader import FeistelPermutation, GlobalBatchSampler, SyntheticTokens, replica_micro_batches


import itertools
import math

from ntp_ds.batch import StepCost, predict_step_s
from ntp_ds.batch.straggler import rebalance

PACES = st.lists(st.sampled_from([1.0, 1.0, 1.0, 1.02, 1.07, 1.143, 1.5, 2.0, 3.5]), min_size=1, max_size=4)


def _step(plan, paces):
    """The plan's step in healthy per-sample times: its slowest replica's predicted work."""
    return predict_step_s(plan, [StepCost(0.0, p) for p in paces])


@settings(max_examples=150, deadline=None)
@given(PACES, st.integers(1, 5), st.integers(1, 4))
def test_preserve_global_batch_keeps_every_sample_once_at_the_least_step(paces, share, micro):
    """Whole samples, offsets in replica order, the failure-free global batch, and a charged step that no split
    of the batch beats (by enumeration); slower replicas never take more than faster ones."""
    global_batch = share * len(paces)
    plan = plan_batch(tuple(paces), global_batch, micro, "preserve_global_batch")
    assert plan.global_samples == global_batch
    offsets = [(r.offset, r.offset + r.samples) for r in plan.replicas]
    assert offsets[0][0] == 0 and all(a[1] == b[0] for a, b in zip(offsets, offsets[1:]))
    for part in plan.replicas:
        assert max(part.micro_sizes) <= micro and min(part.micro_sizes) >= 1
    best = min(max(p * n for p, n in zip(paces, (b - a for a, b in zip((0, *cut), (*cut, global_batch)))))
               for cut in itertools.combinations(range(1, global_batch), len(paces) - 1))
    assert _step(plan, paces) == pytest.approx(best, rel=1e-12)
    assert _step(plan, paces) >= share  # never shorter than the failure-free step
    for (p, a), (q, b) in itertools.combinations(zip(paces, plan.replicas), 2):
        assert (p <= q or a.samples <= b.samples) and (q <= p or b.samples <= a.samples)


@given(PACES, st.integers(1, 64))
def test_proportional_takes_what_a_replica_finishes_in_a_healthy_step(paces, share):
    """A replica at pace p takes floor(share / p): the healthy step is not lengthened and one more sample would."""
    if any(share < p for p in paces):
        with pytest.raises(BatchError, match="no sample"):
            plan_batch(tuple(paces), share * len(paces), 2, "proportional")
        return
    plan = plan_batch(tuple(paces), share * len(paces), 2, "proportional")
    for p, part in zip(paces, plan.replicas):
        assert part.samples * p <= share * (1 + 1e-9) < (part.samples + 1) * p
    assert _step(plan, paces) <= share * (1 + 1e-9)


def test_shares_follow_the_predicted_pace_not_the_degree():
    """A replica whose slowest rank does 1.02x a healthy rank's work takes about 1/1.02 of a healthy share, where
    t'/t = 63/64 would give it 63."""
    plan = plan_batch((1.0,) * 7 + (1.02,), 8 * 64, 1, "proportional")
    assert [p.samples for p in plan.replicas] == [64] * 7 + [math.floor(64 / 1.02)]
    keep = plan_batch((1.0,) * 7 + (1.02,), 8 * 64, 1, "preserve_global_batch")
    assert keep.global_samples == 8 * 64 and _step(keep, (1.0,) * 7 + (1.02,)) <= 64 * 1.02


def test_measured_costs_take_over_from_the_predicted_ones_with_hysteresis():
    """The launch plan follows the layouts' paces; measured costs that match them leave it alone, measured costs
    that do not re-plan it by the same rule, and a gain under the threshold is not taken."""
    paces = (1.0, 1.0, 1.5)
    plan = plan_batch(paces, 24, 4, "preserve_global_batch")
    assert [p.samples for p in plan.replicas] == [9, 9, 6]
    as_predicted = [StepCost(0.0, 0.01 * p) for p in paces]
    assert rebalance(plan, as_predicted, 4, threshold=0.0) is None
    equal = [StepCost(0.0, 0.01)] * 3  # the TP degree costs nothing measurable: the shares even out
    replan = rebalance(plan, equal, 4, threshold=0.05)
    assert [p.samples for p in replan.plan.replicas] == [8, 8, 8] and replan.after_s < replan.before_s
    assert rebalance(plan, equal, 4, threshold=0.2) is None  # 9 -> 8 is an 11% shorter step


def test_proportional_shrinks_the_global_batch():
    plan = plan_batch((1.0, 4 / 3, 1.0), 24, 2, "proportional")
    assert [r.samples for r in plan.replicas] == [8, 6, 8]


def test_lockstep_replicas_share_one_micro_batch_count_and_the_others_run_their_own():
    plan = plan_batch((1.0, 1.0, 2.0), 15, 2, "preserve_global_batch", lockstep=(0, 1))
    assert [r.samples for r in plan.replicas] == [6, 6, 3]
    assert [r.micro_steps for r in plan.replicas] == [3, 3, 2]
    plan = plan_batch((1.0, 1.0, 2.0), 18, 2, "preserve_global_batch", lockstep=(0, 1))
    assert [r.samples for r in plan.replicas] == [8, 7, 3]
    assert [r.micro_steps for r in plan.replicas] == [4, 4, 2] and plan.replicas[1].micro_sizes == (2, 2, 2, 1)
    plan = plan_batch((1.0, 1.0, 2.0), 18, 2, "preserve_global_batch")
    assert [r.micro_steps for r in plan.replicas] == [4, 4, 2] and plan.replicas[1].micro_sizes == (2, 2, 2, 1)


def test_only_zero_2_puts_the_anchors_in_lockstep():
    """ZeRO 2 reduces the anchors' gradients in every backward; ZeRO 0 and 1 in the step's last one only."""
    assert lockstep_replicas((0, 2), 2) == (0, 2)
    assert lockstep_replicas((0, 2), 1) == lockstep_replicas((0, 2), 0) == ()


def test_memory_budget_lowers_the_micro_batch_and_keeps_the_samples():
    limit = max_micro_batch(static_bytes=6 * 2**30, per_sample_bytes=2**30, budget_bytes=8 * 2**30, configured=4)
    assert limit == 2
    plan = plan_batch((1.0, 2.0), 12, 4, "preserve_global_batch", micro_limits=(4, limit))
    assert plan.replicas[1].samples == 4 and max(plan.replicas[1].micro_sizes) == 2
    assert plan.replicas[1].micro_steps == 2
    with pytest.raises(BatchError, match="memory_budget_gb=4.00 cannot hold one sample"):
        max_micro_batch(6 * 2**30, 2**30, 4 * 2**30, 4)


def test_loader_slices_are_disjoint_deterministic_and_cover_the_global_batch():
    data = SyntheticTokens(vocab_size=50, seq_len=8, size=40, seed=1)
    plan = plan_batch((1.0, 1.5), 10, 2, "preserve_global_batch")
    seen = []
    for replica in range(2):
        batches = list(replica_micro_batches(data, GlobalBatchSampler(40, seed=2), plan, replica, step=3))
        again = list(replica_micro_batches(data, GlobalBatchSampler(40, seed=2), plan, replica, step=3))
        assert all((a["input_ids"] == b["input_ids"]).all() for a, b in zip(batches, again))
        seen += [tuple(row.tolist()) for b in batches for row in b["input_ids"]]
        assert all(b["global_tokens"] == 10 * 7 for b in batches)
    expected = [tuple(data[i]["input_ids"].tolist()) for i in GlobalBatchSampler(40, seed=2).indices(3, 10)]
    assert sorted(seen) == sorted(expected)


@given(st.integers(1, 3000), st.integers(0, 2**64 - 1))
def test_feistel_permutation_is_a_bijection_of_the_range(size, key):
    perm = FeistelPermutation(size, key)
    assert sorted(perm(i) for i in range(size)) == list(range(size))


@given(st.integers(1, 500), st.integers(-2**40, 2**40), st.integers(1, 64), st.integers(0, 40), st.integers(0, 99))
def test_sampler_reads_each_epoch_as_a_permutation_and_resumes_at_any_position(size, seed, batch, step, start):
    sampler = GlobalBatchSampler(size, seed)
    epoch_of = [divmod(pos, size)[0] for pos in range(start + step * batch, start + (step + 1) * batch)]
    got = sampler.indices(step, batch, start)
    assert got == GlobalBatchSampler(size, seed).indices(step, batch, start)  # a pure function of the position
    assert all(0 <= i < size for i in got)
    for epoch in set(epoch_of):  # within an epoch no sample repeats
        picked = [i for i, e in zip(got, epoch_of) if e == epoch]
        assert len(set(picked)) == len(picked)
    whole = sampler.indices(0, size, start=size * 3)  # epoch 3, read whole
    assert sorted(whole) == list(range(size))


def test_sampler_needs_no_memory_for_a_huge_dataset_and_epochs_differ():
    sampler = GlobalBatchSampler(10**15, seed=0)
    idx = sampler.indices(10**9, 256)
    assert len(set(idx)) == 256 and all(0 <= i < 10**15 for i in idx)
    small = GlobalBatchSampler(1000, seed=5)
    assert small.indices(0, 1000) != small.indices(1, 1000)
    assert small.indices(0, 1000) != GlobalBatchSampler(1000, seed=6).indices(0, 1000)


def test_the_rest_of_an_interrupted_step_spreads_the_lost_samples_over_every_replica():
    from ntp_ds.batch.planner import resume_plan

    interrupted = plan_batch((1.0, 1.0, 1.0), 24, 2, "preserve_global_batch")  # [0, 8), [8, 16), [16, 24)
    costs = [StepCost(0.0, 1.0), StepCost(0.0, 1.0), StepCost(0.0, 2.0)]  # replica 2 now at half the pace
    rest = resume_plan(interrupted, (0, 1), costs, 2)
    assert rest.kept == 16 and rest.global_samples == 24
    # Replica 2's samples [16, 24), one range from its first, a share of every replica in replica order, at the
    # least modelled time: 8 samples at paces (1, 1, 2) need 4 (the slower replica takes at most 2).
    assert [r.offset for r in rest.replicas] == [16, 16 + rest.replicas[0].samples, 24 - rest.replicas[2].samples]
    assert all(r.samples >= 1 for r in rest.replicas)
    assert max(c.step_s(0, r.samples) for c, r in zip(costs, rest.replicas)) == 4.0
    assert all(max(r.micro_sizes) <= 2 for r in rest.replicas)
    # The lost samples are not one range (replicas 0 and 2 lost them around a kept one): the step is run again.
    assert resume_plan(interrupted, (1,), costs, 2) is None
    # Too few to give every replica a micro-batch, nothing kept, or a rest's rest: run again too.
    small = plan_batch((1.0, 1.0, 1.0), 6, 2, "preserve_global_batch")
    assert resume_plan(small, (0, 1), costs, 2) is None
    assert resume_plan(interrupted, (), costs, 2) is None
    assert resume_plan(rest, (0,), costs, 2) is None
