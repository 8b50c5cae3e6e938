"""Failure process, spares, throughput model and config checks."""
from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ntp_ds.sim import ConfigError, SimConfig, run
from ntp_ds.sim.cluster import Layout
from ntp_ds.sim.config import FailureConfig, HardwareConfig, ModelConfig
from ntp_ds.sim.failures import HW, SW, generate, load_trace
from ntp_ds.sim.throughput import flops_per_token, step_breakdown
from ntp_ds.sim.timeline import replay, time_quantile

from .conftest import small_config

LAYOUT = Layout(num_gpus=8192, domain_size=8, tp=8, pp=1)


def test_exponential_events_rate_mix_and_repairs():
    f = FailureConfig(gpu_mtbf_hours=1000.0, hw_fraction=0.7,
                      hw_repair_hours=[72.0, 120.0], sw_repair_hours=[2.0, 4.0])
    ev = generate(f, LAYOUT, 500.0, np.random.default_rng(0))
    expect = LAYOUT.num_gpus / 1000.0 * 500.0
    assert abs(len(ev) - expect) < 5 * math.sqrt(expect)
    assert np.all(np.diff(ev.time) >= 0) and ev.time.max() < 500.0
    assert ev.hw_count / len(ev) == pytest.approx(0.7, abs=0.02)
    hw, sw = ev.repair[ev.kind == HW], ev.repair[ev.kind == SW]
    assert hw.min() >= 72 and hw.max() <= 120 and hw.mean() == pytest.approx(96, abs=1)
    assert sw.min() >= 2 and sw.max() <= 4
    assert np.all(ev.size == 1)


def test_blast_radius_and_domain_events_are_aligned_blocks():
    f = FailureConfig(gpu_mtbf_hours=1000.0, blast_radius=2, domain_fraction=0.25)
    ev = generate(f, LAYOUT, 200.0, np.random.default_rng(1))
    assert set(np.unique(ev.size)) == {2, 8}
    assert np.mean(ev.size == 8) == pytest.approx(0.25, abs=0.03)
    assert np.all(ev.first % ev.size == 0)


def test_correlated_failures_keep_the_rate_and_cluster_in_a_domain():
    f = FailureConfig(gpu_mtbf_hours=2000.0, correlation=0.5, correlation_window_hours=0.5)
    ev = generate(f, LAYOUT, 2000.0, np.random.default_rng(2))
    expect = LAYOUT.num_gpus / 2000.0 * 2000.0
    assert abs(len(ev) - expect) < 0.1 * expect
    base = generate(FailureConfig(gpu_mtbf_hours=2000.0), LAYOUT, 2000.0,
                    np.random.default_rng(2))
    # follow-ups land in the same domain soon after: consecutive events share
    # a domain far more often than with independent failures
    same = lambda e: np.mean(np.diff(e.first // 8) == 0)  # noqa: E731
    assert same(ev) > 10 * max(same(base), 1e-3)


def test_trace_rows_are_read_and_missing_fields_drawn(tmp_path):
    path = tmp_path / "t.csv"
    path.write_text("time_hours,gpu,kind,repair_hours,blast\n"
                    "5,17,sw,2,\n1,3,hw,,domain\n2,40,,7,2\n999,1,hw,1,\n")
    f = FailureConfig(model="trace", trace=str(path))
    ev = load_trace(f, LAYOUT, 100.0, np.random.default_rng(0))
    assert list(ev.time) == [1.0, 2.0, 5.0]               # sorted, past the run dropped
    assert list(ev.first) == [0, 40, 17] and list(ev.size) == [8, 2, 1]
    assert ev.kind[0] == HW and ev.kind[2] == SW
    assert 72 <= ev.repair[0] <= 120 and ev.repair[1] == 7 and ev.repair[2] == 2


@pytest.mark.parametrize("text,reason", [
    ("time,gpu\n1,2\n", "columns"),
    ("time_hours,gpu\n1,99999\n", "gpu index"),
    ("time_hours,gpu,kind\n1,2,xx\n", "line 2"),
    ("time_hours,gpu,blast\n1,2,3\n", "blast"),
])
def test_bad_trace_names_the_field(tmp_path, text, reason):
    path = tmp_path / "bad.csv"
    path.write_text(text)
    f = FailureConfig(model="trace", trace=str(path))
    with pytest.raises(ConfigError) as err:
        load_trace(f, LAYOUT, 100.0, np.random.default_rng(0))
    assert err.value.field == "failures.trace" and reason in str(err.value)


def test_replay_counts_down_gpus_and_repairs():
    f = FailureConfig(gpu_mtbf_hours=500.0)
    ev = generate(f, LAYOUT, 300.0, np.random.default_rng(3))
    h = replay(ev, LAYOUT, 300.0)
    assert np.all(h.hist.sum(axis=1) == LAYOUT.num_replicas)
    # with tp == domain_size, broken replicas == bad domains
    assert np.array_equal(h.hist[:, 1:].sum(axis=1), h.bad_domains)
    t = 150.0
    live = (ev.time <= t) & (ev.time + ev.repair > t)
    down = np.zeros(LAYOUT.num_gpus, bool)
    for first, size in zip(ev.first[live], ev.size[live]):
        down[first:first + size] = True
    i = np.searchsorted(h.time, t, side="right") - 1
    assert h.down_gpus[i] == down.sum()


def test_spares_restore_capacity_and_needs_are_ordered():
    cfg = small_config()
    base = run(cfg)
    need = base.spares
    assert need["ntp_pw"] <= need["ntp"] <= need["dp_drop"]
    cfg.spares.domains = need["dp_drop"] + 8
    cfg.spares.swap_hours = 0.0
    spared = run(cfg)
    assert spared.failures.spare_swaps > 0
    assert spared.outcomes["dp_drop"].mean_capacity > 0.999
    assert spared.outcomes["dp_drop"].mean_capacity > base.outcomes["dp_drop"].mean_capacity
    cfg.spares.swap_hours = 2.0                     # a slower swap helps less
    slow = run(cfg)
    assert base.outcomes["dp_drop"].mean_capacity < slow.outcomes["dp_drop"].mean_capacity \
        < spared.outcomes["dp_drop"].mean_capacity


def test_one_sequence_per_replica_gives_ntp_nothing_without_boost(tmp_path):
    """TP = domain, one sequence per replica: a TP7 replica cannot finish a whole sequence in a
    healthy step, so the planner's one sequence would hold back every step, and the job drops it
    as DP-DROP would.  The NTP spare
    count then equals DP-DROP's, which is the broken-domain peak read off the trace itself."""
    trace = tmp_path / "t.csv"
    trace.write_text("time_hours,gpu,kind,repair_hours\n1,3,hw,10\n2,12,hw,10\n3,13,sw,1\n"
                     "30,40,hw,5\n")
    cfg = small_config(duration_days=2.0)
    cfg.failures.model, cfg.failures.trace = "trace", str(trace)
    cfg.model.tokens_per_batch = cfg.model.seq_len * 256       # 256 replicas, 1 sequence each
    res = run(cfg)
    # GPUs 12 and 13 are in one TP group: TP7 and, for an hour, TP6
    assert [(d, sh, kept) for d, sh, _, kept in res.levels] == [(7, 1.0, False), (6, 1.0, False)]
    assert res.outcomes["ntp"].mean_capacity == pytest.approx(res.outcomes["dp_drop"].mean_capacity)
    # GPUs 12 and 13 share domain 1: at most 2 broken domains at once (h 2-3)
    assert res.spares["ntp"] == res.spares["dp_drop"] == 2
    assert any("TP7 of TP8 takes 1 of 1 sequences" in n and "leaves data parallelism" in n for n in res.notes)
    # the ideal fluid model gives NTP 7/8 of each broken replica back
    cfg.ntp.batch_granularity = "fluid"
    fluid = run(cfg)
    lost = (10 * 1 + 10 * 1 + 5 * 1) / 256 / 48                 # replica-hours lost / (R T)
    assert fluid.outcomes["dp_drop"].mean_capacity == pytest.approx(1 - lost)
    # replica 0: 10 h at 7/8; replica 1: 1 h at 7/8, 1 h at 6/8, 8 h at 7/8; replica 5: 5 h at 7/8
    ntp_lost = (10 / 8 + 9 / 8 + 2 / 8 + 5 / 8) / 256 / 48
    assert fluid.outcomes["ntp"].mean_capacity == pytest.approx(1 - ntp_lost)
    # without rebalancing the fluid model also waits or drops: no better than DP-DROP here
    cfg.ntp.rebalance = False
    assert run(cfg).outcomes["ntp"].mean_capacity == pytest.approx(
        fluid.outcomes["dp_drop"].mean_capacity)


@settings(max_examples=30, deadline=None, derandomize=True)
@given(values=st.lists(st.integers(0, 50), min_size=1, max_size=30),
       weights=st.lists(st.floats(0.0, 5.0), min_size=30, max_size=30),
       q=st.floats(0.01, 1.0))
def test_time_quantile_covers_q_of_the_time(values, weights, q):
    w = np.array(weights[:len(values)])
    v = np.array(values, dtype=float)
    x = time_quantile(v, w, q)
    if w.sum() > 0:
        assert w[v <= x].sum() >= q * w.sum() - 1e-9
        assert x in v[w > 0]
        if q == 1.0:
            assert x == v[w > 0].max()


def test_step_model_closed_forms():
    m = ModelConfig(params_billion=0.0, hidden=1024, heads=8, layers=4, seq_len=512,
                    tokens_per_batch=2 ** 20)
    hw = HardwareConfig(tp_overlap=0.0, dp_overlap=0.0)
    assert flops_per_token(m) == 6 * 12 * 4 * 1024 ** 2 + 12 * 4 * 1024 * 512
    one = step_breakdown(Layout(64, 8, 1, 1), m, hw, 8)
    eight = step_breakdown(Layout(64, 8, 8, 1), m, hw, 8)
    assert one.tp_comm_s == 0.0
    # same GPUs, same per-GPU compute; TP trades DP all-reduce for TP traffic
    assert eight.compute_s == pytest.approx(one.compute_s)
    assert eight.tp_comm_s > 0 and eight.dp_comm_s < one.dp_comm_s
    piped = step_breakdown(Layout(64, 8, 4, 2), m, hw, 4)
    assert piped.bubble_s == pytest.approx(piped.compute_s / 4)
    for s in (one, eight, piped):
        assert s.step_s == pytest.approx(s.compute_s + s.bubble_s + s.tp_comm_s + s.dp_comm_s)
        assert 0 < s.mfu <= hw.utilisation + 1e-12 and 0 < s.compute_fraction <= 1


def test_from_dict_and_validate_name_the_field():
    with pytest.raises(ConfigError) as err:
        SimConfig.from_dict({"cluster": {"tp": 64}}).validate()
    assert err.value.field == "cluster.tp" and err.value.value == 64
    with pytest.raises(ConfigError) as err:
        SimConfig.from_dict({"cluster": {"nope": 1}})
    assert err.value.field == "cluster.nope"
    with pytest.raises(ConfigError) as err:
        SimConfig.from_dict({"failures": {"hw_repair_hours": "x"}})
    assert err.value.field == "failures.hw_repair_hours"
    with pytest.raises(ConfigError) as err:
        SimConfig.from_dict({"cluster": {"num_gpus": 1000, "domain_size": 72, "tp": 8}}).validate()
    assert err.value.field == "cluster.num_gpus"
    ok = SimConfig.from_dict({"cluster": {"num_gpus": 72 * 64, "domain_size": 72, "tp": 72,
                                          "pp": 2}, "ntp": {"min_tp": 64},
                              "model": {"layers": 80, "heads": 72},
                              "sweep": {"tp_degrees": [36, 72]}})
    assert ok.validate().cluster.domain_size == 72
