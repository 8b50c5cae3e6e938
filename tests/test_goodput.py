"""Goodput arithmetic: buckets add up to the wall time, goodput and rates follow their definitions."""

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ntp_ds.goodput import BUCKETS, GoodputMeter, StepTiming, active_fraction, goodput, split_failure_time


def timing(step, wall=1.0, compute=0.6, comm=0.3, tokens=1000, degrees=(4, 4)):
    return StepTiming(step=step, wall_s=wall, compute_s=compute, comm_wait_s=comm, tokens=tokens, degrees=degrees)


def test_failure_free_goodput_is_the_compute_fraction():
    meter = GoodputMeter(allocated_gpus=8, healthy_tp=4)
    for s in range(1, 6):
        m = meter.record_step(timing(s))
    assert m["goodput"] == pytest.approx(0.6)
    assert m["step_goodput"] == pytest.approx(0.6)
    assert m["active_gpu_fraction"] == 1.0
    assert m["tokens_per_s"] == pytest.approx(1000)
    assert m["throughput_ratio"] == pytest.approx(1.0)
    assert m["tp_degree/replica_0"] == 4 and m["tp_degree/replica_1"] == 4
    assert meter.seconds["other"] == pytest.approx(5 * 0.1)


def test_degraded_replica_lowers_goodput_by_its_idle_gpus():
    meter = GoodputMeter(allocated_gpus=8, healthy_tp=4)
    meter.record_step(timing(1))  # warm-up, left out of the failure-free rate
    meter.record_step(timing(2))
    m = meter.record_step(timing(3, tokens=750, degrees=(4, 3)))
    assert m["step_goodput"] == pytest.approx(0.6 * 7 / 8)
    assert m["active_gpus"] == 7 and m["active_gpu_fraction"] == pytest.approx(7 / 8)
    assert m["failure_free_tokens_per_s"] == pytest.approx(1000)
    assert m["throughput_ratio"] == pytest.approx(0.75)
    assert m["goodput"] == pytest.approx((0.6 * 8 * 2 + 0.6 * 7) / (3 * 8))


def test_failure_free_rate_is_the_median_of_healthy_steps():
    meter = GoodputMeter(allocated_gpus=2, healthy_tp=1, warmup_steps=1)
    for s, wall in enumerate([10.0, 1.0, 1.0, 5.0], start=1):  # slow first step, one straggler
        meter.record_step(timing(s, wall=wall, compute=0.5, comm=0.1, tokens=100, degrees=(1, 1)))
    assert meter.failure_free_rate(0.0, 1.0) == pytest.approx(100.0)


def test_started_degraded_scales_the_current_rate_up():
    meter = GoodputMeter(allocated_gpus=4, healthy_tp=2)
    m = meter.record_step(timing(1, tokens=300, degrees=(2, 1)))
    assert m["failure_free_tokens_per_s"] == pytest.approx(400)
    assert m["throughput_ratio"] == pytest.approx(0.75)


def test_reference_rate_wins():
    meter = GoodputMeter(allocated_gpus=8, healthy_tp=4, reference_tokens_per_s=2000.0)
    assert meter.record_step(timing(1))["throughput_ratio"] == pytest.approx(0.5)


def test_a_failure_free_run_reads_one_whatever_its_first_step_and_checkpoints_cost():
    meter = GoodputMeter(allocated_gpus=8, healthy_tp=4)
    for s, wall in enumerate([9.0, 1.0, 1.2, 0.9, 1.0], start=1):  # a slow first step, some noise
        meter.record_step(timing(s, wall=wall, compute=0.5, comm=0.3))
    meter.record_lost("checkpoint", 4.0, active_gpus=8)
    s = meter.summary()
    assert s["throughput_ratio"] == 1.0 and s["failure_free_s"] == s["wall_s"]
    assert s["tokens_per_s"] < s["failure_free_tokens_per_s"]  # the rates differ: the first step and the checkpoint


def test_a_runs_ratio_takes_out_what_its_failures_cost():
    # 3 healthy steps at 1000 tokens/s (the first one warm-up), a failure costing 0.5 s detection, 2 s recovery and
    # 0.5 s redone, then 2 degraded steps of 750 tokens at 1.0 s: 0.75 s each at the failure-free rate.
    meter = GoodputMeter(allocated_gpus=8, healthy_tp=4)
    for s in range(1, 4):
        meter.record_step(timing(s))
    for bucket, seconds in (("detection", 0.5), ("recovery", 2.0), ("redone", 0.5)):
        meter.record_lost(bucket, seconds, active_gpus=7)
    for s in (4, 5):
        meter.record_step(timing(s, tokens=750, degrees=(4, 3)))
    meter.record_lost("checkpoint", 1.0, active_gpus=7)
    s = meter.summary()
    assert s["wall_s"] == pytest.approx(3 + 3 + 2 + 1)
    assert s["failure_free_s"] == pytest.approx(3 + 2 * 0.75 + 1)
    assert s["throughput_ratio"] == pytest.approx(5.5 / 9)


def test_degraded_steps_that_ran_faster_earn_nothing():
    # On a host whose cores the ranks share, a replica that lost a rank may run faster per token than a healthy one:
    # the run's ratio still takes out its detection and recovery, and is below one.
    meter = GoodputMeter(allocated_gpus=8, healthy_tp=4)
    for s in range(1, 4):
        meter.record_step(timing(s))
    meter.record_lost("detection", 0.2, active_gpus=7)
    meter.record_lost("recovery", 0.3, active_gpus=7)
    for s in range(4, 10):
        meter.record_step(timing(s, wall=0.5, compute=0.3, comm=0.1, degrees=(4, 3)))  # twice the failure-free rate
    s = meter.summary()
    assert s["failure_free_s"] == pytest.approx(s["wall_s"] - 0.5)
    assert s["throughput_ratio"] == pytest.approx((s["wall_s"] - 0.5) / s["wall_s"]) and s["throughput_ratio"] < 1


def test_lost_time_enters_the_wall_but_not_the_work():
    meter = GoodputMeter(allocated_gpus=8, healthy_tp=4)
    meter.record_step(timing(1))
    meter.record_lost("detection", 0.5, active_gpus=7)
    meter.record_lost("recovery", 1.5, active_gpus=7)
    meter.record_lost("checkpoint", 1.0, active_gpus=7)
    s = meter.summary()
    assert s["wall_s"] == pytest.approx(4.0)
    assert s["goodput"] == pytest.approx(0.6 * 8 / (4.0 * 8))
    assert s["share/recovery"] == pytest.approx(1.5 / 4.0)
    assert s["active_gpu_fraction"] == pytest.approx((8 * 1 + 7 * 3) / (8 * 4))
    assert {f"time/{b}_s" for b in BUCKETS} <= set(s)


def test_bad_input_names_the_value():
    with pytest.raises(ValueError, match="bucket='compute'"):
        GoodputMeter(allocated_gpus=1, healthy_tp=1).record_lost("compute", 1.0)
    with pytest.raises(ValueError, match="exceeds wall_s"):
        timing(1, wall=0.5)
    with pytest.raises(ValueError, match="allocated_gpus=0"):
        goodput(1.0, 1.0, 0)
    assert goodput(1.0, 0.0, 4) == 0.0
    assert active_fraction((2, 1), 4) == 0.75


def test_failure_time_split():
    assert split_failure_time(2.0, 3.0, 0.5) == pytest.approx((0.5, 3.0, 1.5))
    # detection longer than the failed step: the remainder comes out of the recovery call
    assert split_failure_time(1.0, 3.0, 2.0) == pytest.approx((2.0, 2.0, 0.0))


@given(st.lists(st.tuples(st.floats(0.01, 10), st.floats(0, 1), st.floats(0, 1), st.integers(0, 4)), min_size=1,
                max_size=30),
       st.floats(0, 5), st.floats(0, 5), st.floats(0, 10))
def test_buckets_add_up_and_goodput_stays_in_range(steps, lost, recover, detect):
    meter = GoodputMeter(allocated_gpus=8, healthy_tp=4)
    walls = 0.0
    for i, (wall, cf, kf, lost_gpus) in enumerate(steps, start=1):
        compute = wall * cf * 0.5
        comm = wall * kf * 0.5
        meter.record_step(timing(i, wall, compute, comm, tokens=64, degrees=(4, 4 - lost_gpus)))
        walls += wall
    parts = split_failure_time(lost, recover, detect)
    assert sum(parts) == pytest.approx(lost + recover)
    assert all(p >= -1e-12 for p in parts)
    for bucket, seconds in zip(("detection", "recovery", "redone"), parts):
        meter.record_lost(bucket, max(seconds, 0.0))
    s = meter.summary()
    assert s["wall_s"] == pytest.approx(walls + lost + recover)
    assert sum(s[f"time/{b}_s"] for b in BUCKETS) == pytest.approx(s["wall_s"])
    assert 0.0 <= s["goodput"] <= 1.0 + 1e-9
    assert 0.0 <= s["active_gpu_fraction"] <= 1.0 + 1e-9
    assert math.isfinite(s["throughput_ratio"])
