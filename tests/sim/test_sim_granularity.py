"""Granularity, spares, repair queue, power domains, Young/Daly, calibration, seeds, sweeps."""
from __future__ import annotations

import csv
import json
import math
import statistics

import numpy as np
import pytest

from ntp_ds.layout.pace import max_rank_work
from ntp_ds.layout.shard_layout import ModelUnits, ShardLayout
from ntp_ds.sim import run, run_seeds
from ntp_ds.sim.calibration import load as load_calibration
from ntp_ds.sim.cli import main
from ntp_ds.sim.cluster import Layout
from ntp_ds.sim.config import FailureConfig, ModelConfig
from ntp_ds.sim.policies import young_daly_minutes
from ntp_ds.sim.failures import HW, POWER, SW, FailureEvents, events_for
from ntp_ds.sim.granularity import load_ratio, model_units, planned_samples, rank_units, unit_flops
from ntp_ds.sim.timeline import SpareSetup, replay

from .conftest import small_config

PAPER_MODEL = ModelConfig(params_billion=480.0, hidden=20480, heads=128, layers=100, seq_len=16384,
                          tokens_per_batch=16777216)


# ---------------------------------------------------------------------------
# the engine's layout and planner

def test_tp30_head_imbalance_by_hand():
    # The count rule, kept for comparison: every kind split evenly by count, the 5-head ranks doing more.
    ranks = rank_units(ModelUnits(heads=128, kv_heads=128, ffn=81920, vocab=128256), 32, 30)
    heads = sorted(r["heads"] for r in ranks)
    assert len(ranks) == 30 and sum(heads) == 128
    assert heads.count(5) == 8 and heads.count(4) == 22     # 128 = 8*5 + 22*4
    assert max(r["ffn"] for r in ranks) == 2731               # ceil(81920 / 30)
    assert max(r["vocab"] for r in ranks) == 4276             # ceil(128256 / 30)
    # GQA with 8 KV heads of 16 query heads: a 5-head rank may straddle two KV groups
    gqa = rank_units(ModelUnits(heads=128, kv_heads=8, ffn=81920, vocab=128256), 32, 30)
    assert {(r["heads"], r["kv"]) for r in gqa} == {(4, 1), (5, 2)}


def test_tp30_most_loaded_rank_by_hand():
    # d = 20480/128 = 160. Per token and layer: a head 4*20480*160 + 4*16384*160, a KV head
    # 4*20480*160, an FFN column 4*20480, a vocabulary row 2*20480/100.
    head, kv, ffn, vocab = 23592960.0, 13107200.0, 81920.0, 409.6
    assert unit_flops(PAPER_MODEL) == {"heads": head, "kv": kv, "ffn": ffn, "vocab": vocab}
    healthy = 4 * head + 4 * kv + 2560 * ffn + 4008 * vocab
    # The count rule: ranks 0-5 hold all four maxima.
    units = model_units(PAPER_MODEL)
    assert max_rank_work(ShardLayout.balanced(units, 32)) == pytest.approx(healthy, rel=1e-12)
    counted = ShardLayout.balanced(units, 32).without_ranks(frozenset({30, 31}), balance="count")
    worst = 5 * head + 5 * kv + 2731 * ffn + 4276 * vocab
    assert max_rank_work(counted) == pytest.approx(worst, rel=1e-12)
    # The work rule: the 8 ranks with a fifth head hold fewer FFN columns, so every rank does about 32/30.
    ranks = rank_units(units, 32, 30)
    assert sorted(r["heads"] for r in ranks).count(5) == 8
    assert max(r["ffn"] for r in ranks if r["heads"] == 5) < min(r["ffn"] for r in ranks if r["heads"] == 4)
    assert load_ratio(PAPER_MODEL, 32, 30) == pytest.approx(32 / 30, rel=1e-3)
    assert load_ratio(PAPER_MODEL, 32, 32) == 1.0


def test_planner_gives_what_the_most_loaded_rank_finishes_in_a_healthy_step():
    """Whole sequences, as many as the replica's predicted pace fits in a healthy replica's step (not t'/t)."""
    for share, tp, degree in [(32, 32, 30), (8, 8, 7), (3, 32, 16), (40, 32, 31)]:
        pace = load_ratio(PAPER_MODEL, tp, degree)
        n = planned_samples(PAPER_MODEL, share, tp, degree)
        assert n * pace <= share * (1 + 1e-9) < (n + 1) * pace, (share, tp, degree, n, pace)
    # 1 / 1.048 rounds down to none, but preserve_global_batch leaves no running replica without a sample: it takes
    # one, and the step waits for it (or the job drops it)
    assert planned_samples(PAPER_MODEL, 1, 32, 30) == 1
    assert planned_samples(PAPER_MODEL, 5, 8, 0) == 0
    assert planned_samples(PAPER_MODEL, 5, 8, 8) == 5


def test_more_sequences_per_replica_let_ntp_rebalance():
    """With 32 sequences per replica a TP30 replica takes what it finishes in a healthy step and keeps the healthy
    pace; with one it cannot finish a whole sequence in that time: it takes its one, at a longer step, which the
    job waits for or drops it, whichever loses less."""
    cfg = small_config()
    cfg.cluster.domain_size, cfg.cluster.tp = 32, 32
    cfg.cluster.num_gpus = 4096
    cfg.model = ModelConfig(params_billion=0.0, hidden=4096, heads=32, layers=32, seq_len=4096,
                            tokens_per_batch=4096 * 128 * 32)
    cfg.ntp.min_tp, cfg.ntp.tp_step = 28, 2
    cfg.sweep.tp_degrees = [32]
    res = run(cfg)
    tp30 = [lv for lv in res.levels if lv[0] == 30]
    assert tp30 and tp30[0][1] == pytest.approx(planned_samples(cfg.model, 32, 32, 30) / 32)
    assert tp30[0][1] >= 29 / 32
    cfg.model.tokens_per_batch = 4096 * 128                       # one sequence per replica
    one = run(cfg)
    one30 = [lv for lv in one.levels if lv[0] == 30][0]
    assert one30[1] == 1.0 and one30[2] > 1.0
    assert any("TP30 of TP32 takes 1 of 1 sequences" in n for n in one.notes)
    # 32 heads over 30 ranks leave 2 ranks with 2 heads, which hold fewer FFN columns: with its
    # planned share the replica keeps up with the healthy ones
    assert tp30[0][2] <= 1.0
    assert one.outcomes["ntp"].mean_capacity <= res.outcomes["ntp"].mean_capacity


# ---------------------------------------------------------------------------
# failure process extensions

def test_infinite_mtbf_means_no_failures(tmp_path, capsys):
    cfg = small_config()
    cfg.failures.gpu_mtbf_hours = math.inf
    res = run(cfg)
    assert res.failures.events == 0
    for p in ("dp_drop", "ntp", "ntp_pw"):
        assert res.outcomes[p].goodput == 1.0
    assert main(["sim.cluster.num_gpus=2048", "sim.duration_days=2", "sim.sweep.trials=1",
                 "sim.failures.gpu_mtbf_hours=inf", f"out={tmp_path}"]) == 0
    assert "0 failure events" in capsys.readouterr().out


def test_power_domain_events_take_aligned_groups_of_racks():
    layout = Layout(num_gpus=32 * 64, domain_size=32, tp=32, pp=1)
    f = FailureConfig(gpu_mtbf_hours=math.inf, power_domain_mtbf_hours=500.0, power_domain_domains=4,
                      power_repair_hours=[6.0, 6.0])
    ev = events_for(f, layout, 10000.0, np.random.default_rng(0))
    assert np.all(ev.kind == POWER) and np.all(ev.size == 32) and np.all(ev.repair == 6.0)
    outages = len(ev) // 4
    expect = 16 / 500.0 * 10000.0                                 # 16 power domains
    assert abs(outages - expect) < 5 * math.sqrt(expect)
    domains = (ev.first // 32).reshape(-1, 4)                      # same time: same group
    assert np.all(domains % 4 == np.arange(4)) and np.all(domains[:, 0] % 4 == 0)


def _events(rows) -> FailureEvents:
    t, first, size, kind, rep = (np.array(c) for c in zip(*rows))
    return FailureEvents(t.astype(float), first.astype(np.int64), size.astype(np.int64),
                         kind.astype(np.int64), rep.astype(float))


def _down_at(h, t):
    return int(h.down_gpus[np.searchsorted(h.time, t, side="right") - 1])


def test_repair_queue_serves_hardware_one_at_a_time():
    layout = Layout(num_gpus=64, domain_size=8, tp=8, pp=1)
    ev = _events([(0.0, 0, 1, HW, 10.0), (0.0, 8, 1, HW, 10.0), (0.0, 16, 1, HW, 10.0),
                  (1.0, 24, 1, SW, 2.0)])
    h = replay(ev, layout, 100.0, spares=SpareSetup(repair_slots=1))
    assert [_down_at(h, t) for t in (0.5, 2.5, 9.9, 10.5, 19.9, 20.5, 29.9, 30.5)] == \
        [3, 4, 3, 2, 2, 1, 1, 0]                 # the software restart (1-3 h) never queues
    assert h.repair_wait_hours == pytest.approx(10.0 + 20.0)
    free = replay(ev, layout, 100.0)
    assert _down_at(free, 10.5) == 0


def test_hot_spares_cover_failures_until_they_run_out():
    """NVL72 as TP64 + 8 hot spares: physical slots 0-63 active, 64-71 spares."""
    layout = Layout(num_gpus=128, domain_size=64, tp=64, pp=1)
    rows = [(1.0 + i, i, 1, HW, 100.0) for i in range(9)]           # 9 failures in domain 0
    rows.append((20.0, 72 + 70, 1, HW, 5.0))                       # an idle spare of domain 1
    h = replay(_events(rows), layout, 300.0, spares=SpareSetup(hot_spares=8))
    assert _down_at(h, 8.5) == 0                                    # 8 covered by spares
    assert _down_at(h, 9.5) == 1 and h.hist[np.searchsorted(h.time, 9.5) - 1][1] == 1
    assert _down_at(h, 100.5) == 1                                  # first repair at 101
    assert _down_at(h, 101.5) == 0                                  # it fills the hole
    assert h.hot_swaps == 9
    # the hole's own repair (at 109) returns a spare instead
    assert _down_at(h, 150.0) == 0


def test_tp64_with_hot_spares_on_nvl72_runs_and_beats_no_spares():
    base = dict(num_gpus=64 * 64, tp=64)
    cfg = small_config(duration_days=20.0)
    cfg.cluster.domain_size, cfg.cluster.hot_spares = 72, 8
    cfg.cluster.num_gpus, cfg.cluster.tp = base["num_gpus"], base["tp"]
    cfg.model.heads = 64
    cfg.model.tokens_per_batch = cfg.model.seq_len * 64
    cfg.ntp.min_tp = 56
    cfg.failures.gpu_mtbf_hours = 2000.0
    cfg.sweep.tp_degrees = [64]
    spared = run(cfg)
    assert "64 x NVL64" in spared.layout and spared.failures.hot_swaps > 0
    cfg.cluster.domain_size, cfg.cluster.hot_spares = 64, 0
    bare = run(cfg)
    assert spared.outcomes["dp_drop"].mean_capacity > bare.outcomes["dp_drop"].mean_capacity + 0.05


def test_idle_spare_domains_fail_while_waiting():
    cfg = small_config()
    cfg.spares.domains, cfg.spares.swap_hours = 64, 0.5
    on = run(cfg)
    assert on.failures.idle_spare_failures > 0
    cfg.spares.idle_failures = False
    assert run(cfg).failures.idle_spare_failures == 0


# ---------------------------------------------------------------------------
# checkpoint interval

def test_young_daly_interval():
    # Young: sqrt(2 d M); Daly adds (1 + sqrt(d/2M)/3 + d/18M) and subtracts d
    assert young_daly_minutes(1.0, 600.0) == pytest.approx(
        math.sqrt(1200) * (1 + math.sqrt(1 / 1200) / 3 + 1 / 10800) - 1)
    assert young_daly_minutes(1.0, 600.0) == pytest.approx(math.sqrt(1200), rel=0.02)
    assert young_daly_minutes(50.0, 20.0) == 20.0          # d >= 2M: checkpoint once per MTBF
    assert young_daly_minutes(1.0, math.inf) == math.inf


def test_young_daly_beats_other_intervals_in_the_timed_run():
    cfg = small_config(duration_days=20.0)
    cfg.failures.gpu_mtbf_hours = 20000.0
    cfg.checkpoint.write_minutes, cfg.checkpoint.restart_minutes = 2.0, 5.0
    cfg.checkpoint.interval_policy = "young_daly"
    best = run(cfg)
    c = best.checkpoint_interval_minutes
    mtbf_min = 20000.0 / 2048 * 60
    assert c == pytest.approx(young_daly_minutes(2.0, mtbf_min))
    cfg.checkpoint.interval_policy = "fixed"
    for factor in (0.3, 3.0):
        cfg.checkpoint.interval_minutes = c * factor
        other = run(cfg)
        assert other.outcomes["ckpt_restart"].goodput < best.outcomes["ckpt_restart"].goodput


# ---------------------------------------------------------------------------
# calibration from a run directory

def _write_run(path, steps):
    path.mkdir()
    with (path / "metrics.jsonl").open("w") as fh:
        for step, secs, degrees in steps:
            rec = {"step": step, "step_time_s": secs}
            rec.update({f"tp_degree/replica_{i}": d for i, d in enumerate(degrees)})
            fh.write(json.dumps(rec) + "\n")
    events = [{"event": "run_start", "step": 0},
              {"event": "recovery", "step": 5, "failure_to_step_s": 3.0},
              {"event": "recovery", "step": 8, "failure_to_step_s": 5.0}]
    (path / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))


def test_calibration_reads_medians_from_a_run(tmp_path):
    steps = [(1, 9.0, (4, 4)), (2, 1.0, (4, 4)), (3, 1.2, (4, 4)), (4, 1.1, (4, 4)),
             (5, 7.0, (4, 3)), (6, 1.5, (4, 3)), (7, 1.7, (4, 3)),
             (8, 6.0, (4, 2)), (9, 2.4, (4, 2))]
    _write_run(tmp_path / "run", steps)
    cal = load_calibration(str(tmp_path / "run"))
    # first step and recovery steps left out
    assert cal.healthy_tp == 4
    assert cal.step_seconds == {4: 1.1, 3: 1.6, 2: 2.4}
    assert cal.recovery_seconds == 4.0 and cal.rejoin_seconds is None
    assert cal.slowdown(1.0) == 1.0
    assert cal.slowdown(0.75) == pytest.approx(1.6 / 1.1)
    assert cal.slowdown(0.875) == pytest.approx((1 + 1.6 / 1.1) / 2)
    assert cal.slowdown(0.25) == pytest.approx(2.4 / 1.1 * 0.5 / 0.25)


def test_calibrated_run_uses_measured_ratios_and_pauses(tmp_path):
    table = tmp_path / "cal.yaml"
    table.write_text("healthy_tp: 8\nstep_seconds: {8: 2.0, 4: 4.4}\nrecovery_seconds: 600\n")
    cfg = small_config()
    cfg.model.tokens_per_batch = cfg.model.seq_len * 256 * 8    # eight sequences per replica
    cal = load_calibration(str(table))
    res = run(cfg, cal)
    # TP7 of 8: interpolated between 1.0 at x=1 and 2.2 at x=0.5 -> 1 + 1.2 * 0.25, times its share
    tp7 = [lv for lv in res.levels if lv[0] == 7][0]
    assert 0 < tp7[1] < 1 and tp7[2] == pytest.approx(tp7[1] * 1.3)
    plain = run(cfg)
    # ten-minute recoveries instead of one minute: more downtime per interruption
    per = res.outcomes["dp_drop"].downtime_hours / res.outcomes["dp_drop"].interruptions
    assert per > 5 * plain.outcomes["dp_drop"].downtime_hours / plain.outcomes["dp_drop"].interruptions
    out = tmp_path / "out"
    assert main(["sim.cluster.num_gpus=2048", "sim.duration_days=2", "sim.sweep.trials=1",
                 f"calibrate={table}", f"out={out}"]) == 0
    assert "step_seconds" in (out / "calibration.yaml").read_text()


# ---------------------------------------------------------------------------
# seeds, progress, sweeps

def test_seeds_report_medians_of_independent_runs(tmp_path):
    cfg = small_config(duration_days=5.0)
    ens = run_seeds(cfg, seeds=3, workers=2)
    singles = [run(small_config(duration_days=5.0, seed=s)) for s in (0, 1, 2)]
    g = [r.outcomes["ntp"].goodput for r in singles]
    med, lo, hi = ens.outcome("ntp", "goodput")
    assert med == pytest.approx(statistics.median(g))
    assert lo == pytest.approx(float(np.percentile(g, 5)))
    assert hi == pytest.approx(float(np.percentile(g, 95)))
    need = sorted(r.outcomes["dp_drop"].spare_domains_needed for r in singles)
    assert ens.spares_needed("dp_drop") == need[2]                 # q0.9 of 3 seeds: the top
    assert main(["sim.cluster.num_gpus=2048", "sim.duration_days=5", "sim.sweep.trials=1",
                 "sim.failures.gpu_mtbf_hours=5000", "seeds=3", "workers=2",
                 f"out={tmp_path}"]) == 0
    with (tmp_path / "goodput.csv").open() as fh:
        rows = {r["policy"]: r for r in csv.DictReader(fh)}
    assert float(rows["ntp"]["goodput"]) == pytest.approx(med, abs=1e-6)
    assert rows["ntp"]["seeds"] == "3"


def test_progress_bar_on_request(capsys):
    run(small_config(duration_days=2.0), progress=True)
    assert "replay" in capsys.readouterr().err
    run(small_config(duration_days=2.0))
    assert capsys.readouterr().err == ""


@pytest.mark.long  # .ci/run: its long stage (and the nccl_model stage where its file runs); README suite under 10 min
def test_multirun_sweeps_and_picks_the_best_tp(tmp_path, capsys):
    out = tmp_path / "sweep"
    argv = ["-m", "sim.cluster.num_gpus=2048", "sim.duration_days=3", "sim.sweep.trials=1",
            "sim.sweep.tp_degrees=[4]", "sim.ntp.min_tp=2",
            "sim.cluster.tp=2,4,8", "sim.failures.gpu_mtbf_hours=500,50000", f"out={out}"]
    assert main(argv) == 0
    with (out / "multirun.csv").open() as fh:
        rows = list(csv.DictReader(fh))
    assert len(rows) == 6 and all(r["status"] == "ok" for r in rows)
    assert (out / "best_tp.png").read_bytes()[:4] == b"\x89PNG"
    printed = capsys.readouterr().out
    # the best TP per MTBF, recomputed from each job's own goodput.csv
    for mtbf in ("500", "50000"):
        best = None
        for r in rows:
            if r["sim.failures.gpu_mtbf_hours"] != mtbf:
                continue
            with (out / r["dir"] / "goodput.csv").open() as fh:
                g = {x["policy"]: float(x["goodput"]) for x in csv.DictReader(fh)}
            tps = g["dp_drop"] * float(r["healthy_tokens_per_s"])
            if best is None or tps > best[0]:
                best = (tps, r["sim.cluster.tp"])
        assert f"MTBF {float(mtbf):g} h -> TP{best[1]}" in printed.split("best TP for dp_drop:")[1]


def test_static_snapshots_let_hot_spares_cover_failures():
    from ntp_ds.sim.failures import cover_with_hot_spares

    # 2 domains of 4 active + 2 spare slots
    down = np.array([[1, 1, 1, 0, 0, 0, 0, 1, 0, 0, 0, 1]], dtype=bool)
    got = cover_with_hot_spares(down, 4, 2)
    # domain 0: 3 failed active, 2 healthy spares -> the third stays missing
    # domain 1: active slot 1 failed, one spare broke -> the one healthy spare covers it
    assert got.tolist() == [[False, False, True, False, False, False, False, False]]
    down[0, 9] = True                           # a second active failure in domain 1
    assert cover_with_hot_spares(down, 4, 2).tolist()[0][4:] == [False, False, False, True]
