"""The simulator against closed forms and exact expectations."""
from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ntp_ds.sim import run
from ntp_ds.sim.cluster import Layout
from ntp_ds.sim.config import BoostConfig, ClusterConfig, NTPConfig
from ntp_ds.sim.failures import group_failed_counts, sample_failed_gpus
from ntp_ds.sim.policies import (capacity, ckpt_availability, job_capacity, level_tables,
                                 policy_capacity)
from ntp_ds.sim.sweep import level_histograms, snapshot_capacity

from .conftest import small_config

PROPS = settings(max_examples=15, deadline=None, derandomize=True)


def _snapshot(layout: Layout, f: float, blast: int, trials: int, seed: int,
              ntp: NTPConfig | None = None, boost: BoostConfig | None = None,
              phi: float = 0.7) -> dict[str, float]:
    rng = np.random.default_rng(seed)
    down = sample_failed_gpus(layout, f, blast, 0.0, trials, rng)
    hist = level_histograms(group_failed_counts(down, layout), layout)
    tables = level_tables(layout.tp, ntp or NTPConfig(min_tp=1), boost or BoostConfig(), phi)
    return {p: float(np.mean(c)) for p, c in policy_capacity(hist, tables).items()}


def _binomial_pmf(n: int, p: float) -> np.ndarray:
    return np.array([math.comb(n, k) * p ** k * (1 - p) ** (n - k) for k in range(n + 1)])


def _ntp_value(t: int, k: int, min_tp: int, step: int) -> float:
    deg = t if k == 0 else ((t - k) // step) * step
    return deg / t if deg >= min_tp else 0.0


# ---------------------------------------------------------------------------
# DP-DROP keeps (1 - f)^t of the replicas

@PROPS
@given(f=st.floats(0.0005, 0.05), t=st.sampled_from([1, 2, 4, 8, 16, 32]),
       seed=st.integers(0, 2 ** 16))
def test_dp_drop_keeps_one_minus_f_to_the_t(f, t, seed):
    layout = Layout(num_gpus=65536, domain_size=32, tp=t, pp=1)
    trials = 4
    kept = _snapshot(layout, f, 1, trials, seed)["dp_drop"]
    expect = (1 - f) ** t
    sigma = math.sqrt(expect * (1 - expect) / (layout.num_replicas * trials))
    assert abs(kept - expect) <= 5 * sigma + 1e-12


@pytest.mark.parametrize("t,pp,blast", [(8, 2, 1), (8, 1, 2), (16, 1, 4), (4, 4, 1)])
def test_dp_drop_closed_form_with_pipeline_and_blast(t, pp, blast):
    layout = Layout(num_gpus=32768, domain_size=16, tp=t, pp=pp)
    f, trials = 0.01, 8
    kept = _snapshot(layout, f, blast, trials, seed=7)["dp_drop"]
    expect = (1 - f) ** (t * pp // blast)        # each block of `blast` GPUs fails as one
    sigma = math.sqrt(expect * (1 - expect) / (layout.num_replicas * trials))
    assert abs(kept - expect) <= 5 * sigma


# ---------------------------------------------------------------------------
# NTP: a replica at t' of t contributes t'/t, so loss -> f for one-GPU blasts

@PROPS
@given(t=st.sampled_from([4, 8, 16, 32]), f=st.floats(0.001, 0.1),
       floor=st.floats(0.0, 1.0), step=st.sampled_from([1, 2]),
       seed=st.integers(0, 2 ** 16))
def test_ntp_matches_exact_binomial_expectation(t, f, floor, step, seed):
    min_tp = max(1, int(floor * t))
    ntp = NTPConfig(min_tp=min_tp, tp_step=step)
    layout = Layout(num_gpus=32768, domain_size=32, tp=t, pp=1)
    trials = 4
    got = _snapshot(layout, f, 1, trials, seed, ntp=ntp)["ntp"]
    values = np.array([_ntp_value(t, k, min_tp, step) for k in range(t + 1)])
    pmf = _binomial_pmf(t, f)
    expect = float(pmf @ values)
    sigma = math.sqrt(float(pmf @ (values - expect) ** 2) / (layout.num_replicas * trials))
    assert abs(got - expect) <= 5 * sigma + 1e-12


def test_ntp_loss_is_f_without_a_floor():
    layout = Layout(num_gpus=65536, domain_size=32, tp=32, pp=1)
    f = 0.01
    loss = 1 - _snapshot(layout, f, 1, 32, seed=3, ntp=NTPConfig(min_tp=1))["ntp"]
    assert loss == pytest.approx(f, rel=0.03)


def test_ntp_loss_tends_to_f_as_blast_radius_shrinks():
    layout = Layout(num_gpus=65536, domain_size=32, tp=32, pp=1)
    ntp = NTPConfig(min_tp=28, tp_step=1)
    f = 0.002
    excess = {}
    for blast in (16, 8, 4, 2, 1):
        loss = 1 - _snapshot(layout, f, blast, 64, seed=11, ntp=ntp)["ntp"]
        excess[blast] = (loss - f) / f
    # a blast larger than t - min_tp takes a whole group down with it
    assert excess[8] > 2.0 and excess[16] > 0.5
    assert abs(excess[1]) < 0.05
    assert abs(excess[1]) <= min(abs(excess[b]) for b in (16, 8, 4, 2)) + 0.05


def test_ntp_is_never_worse_than_dp_drop_and_boost_never_worse_than_ntp():
    cfg = small_config()
    layout = Layout.from_config(cfg.cluster)
    for f in (0.001, 0.01, 0.05):
        caps = snapshot_capacity(cfg, layout, f, np.random.default_rng(0))
        assert caps["dp_drop"] <= caps["ntp"] <= caps["ntp_pw"] <= 1.0


# ---------------------------------------------------------------------------
# power boost never exceeds its cap

@PROPS
@given(t=st.integers(1, 72), cap=st.floats(0.0, 1.0), exponent=st.floats(0.0, 1.0),
       phi=st.floats(0.01, 1.0), min_frac=st.floats(0.0, 1.0), step=st.integers(1, 4))
def test_boost_power_never_exceeds_cap(t, cap, exponent, phi, min_frac, step):
    ntp = NTPConfig(min_tp=max(1, int(min_frac * t)), tp_step=min(step, t))
    tables = level_tables(t, ntp, BoostConfig(cap=cap, perf_exponent=exponent), phi)
    assert np.all(tables.power <= 1.0 + cap + 1e-12)
    assert np.all(tables.power >= 1.0)
    pw, plain = tables.value["ntp_pw"], tables.value["ntp"]
    assert np.all(pw <= 1.0) and np.all(pw >= plain - 1e-12)
    assert np.all(np.diff(pw) <= 1e-12)                    # monotone in failures
    if exponent == 0.0:                       # power that buys nothing is not drawn
        assert np.all(tables.power == 1.0)


def test_boost_hand_worked_tp30_example():
    # phi = 0.5, perf = p^0.5, cap 0.3: TP30 of 32 needs a step speed-up of 32/30, i.e.
    # 0.5/perf + 0.5 = 30/32 -> perf = 0.5/0.4375 = 8/7 -> p = 64/49 = 1.30612 > 1.3:
    # capped at 1.3, perf = sqrt(1.3) = 1.140175, speed-up 1/(0.438529 + 0.5) = 1.065497,
    # contribution 30/32 * 1.065497 = 0.998903
    tables = level_tables(32, NTPConfig(min_tp=28, tp_step=2), BoostConfig(cap=0.3, perf_exponent=0.5),
                          0.5)
    assert tables.power[1] == pytest.approx(1.3)
    assert tables.value["ntp_pw"][1] == pytest.approx(0.998903, abs=2e-6)
    # with a 31% cap TP30 is hidden completely at exactly 64/49 of TDP
    tables = level_tables(32, NTPConfig(min_tp=28, tp_step=2), BoostConfig(cap=0.31, perf_exponent=0.5),
                          0.5)
    assert tables.value["ntp_pw"][1] == 1.0
    assert tables.power[1] == pytest.approx(64 / 49)


def test_boost_run_respects_cap_and_restores_tp30():
    cfg = small_config()
    cfg.cluster = ClusterConfig(num_gpus=4096, domain_size=32, tp=32)
    cfg.ntp = NTPConfig(min_tp=28, tp_step=2)
    cfg.sweep.tp_degrees = [32]
    cfg.boost.cap = 0.3
    res = run(cfg)
    assert res.outcomes["ntp_pw"].max_power <= 1.3 + 1e-12
    tables = level_tables(32, cfg.ntp, cfg.boost, res.step.compute_fraction)
    assert tables.value["ntp_pw"][1] == 1.0            # TP30 fully hidden
    assert tables.value["ntp_pw"][3] < 1.0             # TP28 only partly
    assert tables.power[1] < 1.3


# ---------------------------------------------------------------------------
# synchronous training without rebalancing waits for the slowest replica

def test_capacity_without_rebalance_keeps_the_best_fast_set():
    value = np.array([1.0, 30 / 32, 0.0])
    hist = np.array([1000, 24, 0])                    # 1024 replicas, 24 at TP30
    rebalanced = capacity(hist, value, True)
    waiting = capacity(hist, value, False)
    assert rebalanced == pytest.approx((1000 + 24 * 30 / 32) / 1024)
    assert waiting == pytest.approx(1000 / 1024)      # dropping the slow ones wins
    many = np.array([100, 924, 0])
    assert capacity(many, value, False) == pytest.approx(30 / 32)  # all slow down


@PROPS
@given(hist=st.lists(st.integers(0, 40), min_size=2, max_size=6),
       share=st.lists(st.sampled_from([0.0, 0.25, 0.5, 0.875, 1.0]), min_size=6, max_size=6),
       time=st.lists(st.floats(0.5, 2.0), min_size=6, max_size=6))
def test_job_capacity_is_the_best_subset_of_levels(hist, share, time):
    """Brute force over every set of levels the job could keep in its step."""
    import itertools

    n = len(hist)
    h, s, t = np.array(hist, float), np.array(share[:n]), np.array(time[:n])
    s[0], t[0] = 1.0, 1.0                                  # healthy level
    total = max(h.sum(), 1.0)
    best = 0.0
    for size in range(1, n + 1):
        for keep in itertools.combinations(range(n), size):
            k = [i for i in keep if s[i] > 0]
            if k:
                best = max(best, sum(h[i] * s[i] for i in k) / total / max(t[i] for i in k))
    assert job_capacity(h, s, t) == pytest.approx(best, rel=1e-12, abs=1e-15)


def test_job_capacity_hand_worked():
    # 1000 healthy replicas; 24 take a full share but need 1.1 steps; 8 take half a share at
    # the healthy pace; 4 are stopped (share 0)
    hist = np.array([1000, 24, 8, 4])
    share = np.array([1.0, 1.0, 0.5, 0.0])
    time = np.array([1.0, 1.1, 1.0, 0.0])
    keep_fast = (1000 + 4) / 1036                    # leave the slow 24 out
    wait = (1000 + 24 + 4) / 1.1 / 1036               # wait for them
    assert job_capacity(hist, share, time) == pytest.approx(max(keep_fast, wait))
    assert keep_fast > wait
    # many slow replicas: waiting wins
    hist = np.array([100, 900, 0, 0])
    assert job_capacity(hist, share, time) == pytest.approx(1000 / 1.1 / 1000)


# ---------------------------------------------------------------------------
# checkpoint-restart

def test_ckpt_availability_matches_a_direct_renewal_simulation():
    """Failures at rate lam over up time; each stops the job R and loses the work since the
    last checkpoint; checkpoints every C of up time block for w.  Simulated directly."""
    from ntp_ds.sim.config import CheckpointConfig

    ck = CheckpointConfig(interval_minutes=30.0, restart_minutes=12.0, write_minutes=3.0)
    lam = 0.5                                          # failures per hour
    rng = np.random.default_rng(5)
    C, R, w = 0.5, 0.2, 0.05
    wall = useful = 0.0
    for _ in range(20000):
        up = rng.exponential(1 / lam)                  # up time until the next failure
        done = (up // C) * C                           # work saved at the last checkpoint
        useful += done * (1 - w / C)
        wall += up + R
    got = useful / wall
    assert float(ckpt_availability(lam, ck)) == pytest.approx(got, rel=0.01)
    # and the first-order form it reduces to when failures are rare against the interval
    rare = 0.01
    first_order = (1 - w / C) / (1 + rare * (R + C / 2))
    assert float(ckpt_availability(rare, ck)) == pytest.approx(first_order, rel=1e-4)
    assert float(ckpt_availability(0.0, ck)) == pytest.approx(1 - w / C)


def test_single_failure_trace_exact_goodput(tmp_path):
    trace = tmp_path / "trace.csv"
    trace.write_text("time_hours,gpu,kind,repair_hours\n1.1,5,hw,10\n")
    cfg = small_config(duration_days=1.0)
    cfg.failures.model, cfg.failures.trace = "trace", str(trace)
    cfg.ntp.batch_granularity = "fluid"       # the ideal t'/t model, exact by hand
    cfg.ntp.reconfig_minutes = 0.0
    cfg.ntp.rejoin_minutes = 6.0              # the repaired GPU rejoins at 11.1 h
    cfg.checkpoint.interval_minutes = 15.0
    cfg.checkpoint.restart_minutes = 6.0
    res = run(cfg)
    T, R = 24.0, cfg.cluster.num_gpus // cfg.cluster.tp
    out = res.outcomes
    assert out["dp_drop"].mean_capacity == pytest.approx(1 - 10 / (R * T))
    assert out["ntp"].mean_capacity == pytest.approx(1 - 10 / (8 * R * T))
    step_h = res.step.step_s / 3600
    stalled = step_h * (1 - 1 / (8 * R)) / T
    rejoin = 0.1 / T                          # 6 minutes at full capacity
    assert out["ntp"].goodput == pytest.approx(out["ntp"].mean_capacity - stalled - rejoin)
    assert out["ntp"].rejoins == 1 and out["dp_drop"].rejoins == 1
    # restart: 0.1 h redone (1.1 h mod 0.25 h), 0.1 h stopped at (R-1)/R capacity
    expect = out["dp_drop"].mean_capacity - (0.1 + 0.1 * (R - 1) / R) / T
    assert out["ckpt_restart"].goodput == pytest.approx(expect)
    assert out["ckpt_restart"].interruptions == 1
    assert out["dp_drop"].spare_domains_needed == 1
    assert out["ntp"].spare_domains_needed == 1


# ---------------------------------------------------------------------------
# determinism and the failure process

def test_same_seed_same_result_and_other_seed_differs():
    a, b = run(small_config()), run(small_config())
    assert a.outcomes == b.outcomes
    assert a.loss_vs_failures == b.loss_vs_failures
    for p in a.timeline:
        assert np.array_equal(a.timeline[p], b.timeline[p])
    c = run(dataclasses.replace(small_config(), seed=1))
    assert c.outcomes != a.outcomes


def test_time_average_failed_fraction_follows_littles_law():
    cfg = small_config(duration_days=60.0)
    cfg.cluster.num_gpus = 16384
    cfg.failures.hw_repair_hours = [24.0, 48.0]
    res = run(cfg)
    f = res.failures
    expect_events = cfg.cluster.num_gpus / cfg.failures.gpu_mtbf_hours * 60 * 24
    assert abs(f.events - expect_events) < 5 * math.sqrt(expect_events)
    assert f.hardware / f.events == pytest.approx(0.78, abs=0.05)
    # the run starts healthy: subtract the ramp-up of the 36 h mean repair
    assert f.mean_failed_fraction == pytest.approx(f.steady_failed_fraction, rel=0.1)
    # DP-DROP's time-average capacity ~ (1 - f)^t
    t = cfg.cluster.tp
    assert res.outcomes["dp_drop"].mean_capacity == pytest.approx(
        (1 - f.mean_failed_fraction) ** t, abs=0.01)
