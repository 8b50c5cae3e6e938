"""``run(config) -> SimResult``: the simulator's Python entry point."""
from __future__ import annotations

import time as _time
from dataclasses import dataclass, field

import numpy as np

from .cluster import Layout
from .config import SimConfig
from .failures import FailureEvents, events_for, steady_failed_fraction
from .policies import (POLICIES, REBALANCED, LevelTables, capacity, extra_power_fraction,
                       level_tables, ntp_deficit_domains)
from .sweep import LossPoint, loss_vs_failures
from .throughput import StepBreakdown, step_breakdown
from .timeline import History, integral, replay, time_quantile


@dataclass(frozen=True)
class PolicyOutcome:
    """One policy over the simulated run."""

    policy: str
    goodput: float              # useful work / (healthy job * wall time)
    mean_capacity: float        # time-average throughput share, before stalls
    interruptions: int          # job-wide stalls (reconfig) or restarts
    downtime_hours: float       # whole-job stopped time (restarts, stalls)
    lost_work_hours: float      # healthy-job hours lost to stops and rework
    spare_domains_needed: int   # for pause-free training at a fixed minibatch
    mean_extra_power: float     # boost power above TDP / job TDP (ntp_pw)
    max_power: float            # highest relative GPU power (1 = TDP)


@dataclass(frozen=True)
class FailureSummary:
    events: int
    hardware: int
    software: int
    mean_failed_fraction: float      # time average over the run
    peak_failed_fraction: float
    steady_failed_fraction: float    # Little's law prediction
    spare_swaps: int


@dataclass
class SimResult:
    config: SimConfig
    layout: str
    step: StepBreakdown
    loss_vs_failures: list[LossPoint]
    outcomes: dict[str, PolicyOutcome]
    failures: FailureSummary
    timeline_hours: np.ndarray      # bin edges, hours
    timeline: dict[str, np.ndarray] = field(default_factory=dict)  # goodput per bin
    wall_seconds: float = 0.0

    @property
    def spares(self) -> dict[str, int]:
        return {p: o.spare_domains_needed for p, o in self.outcomes.items()}

    def loss(self, policy: str, tp: int, fraction: float) -> float:
        for row in self.loss_vs_failures:
            if row.policy == policy and row.tp == tp and np.isclose(row.failed_fraction, fraction):
                return row.throughput_loss
        raise KeyError((policy, tp, fraction))


def _stall_events(h: History, value: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Failure events that hit a contributing replica: (times, event index).

    Such a failure interrupts the synchronous step of the whole job, whatever
    the replica contributes afterwards.
    """
    if h.trans_event.size == 0:
        return np.zeros(0), np.zeros(0, dtype=np.int64)
    hit = value[h.trans_old] > 0
    ev, first = np.unique(h.trans_event[hit], return_index=True)
    return h.trans_time[hit][first], ev


def _down_intervals(times: np.ndarray, length_h: float, interval_h: float | None,
                    cap_F) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Whole-job stops after failures, and the work redone after each one.

    Each event stops the job for ``length_h``; an event during a stop extends
    it.  With checkpointing (``interval_h``) the work since the last
    checkpoint, counted from the end of the previous stop, is lost as well.
    Returns ``(start, end, rework_time, rework)``.
    """
    starts: list[float] = []
    ends: list[float] = []
    rt: list[float] = []
    rw: list[float] = []
    up_since = 0.0
    for tau in np.sort(times):
        if ends and tau < ends[-1]:
            ends[-1] = tau + length_h
            up_since = ends[-1]
            continue
        if interval_h is not None:
            since = (tau - up_since) % interval_h
            rt.append(tau)
            rw.append(cap_F(tau) - cap_F(tau - since))
        starts.append(tau)
        ends.append(tau + length_h)
        up_since = tau + length_h
    return (np.asarray(starts), np.asarray(ends), np.asarray(rt), np.asarray(rw))


def _useful_work(x: np.ndarray, F, down: tuple, write: float) -> np.ndarray:
    """Cumulative useful work at times ``x`` (healthy-job hours)."""
    a, b, rt, rw = down
    w = F(x)
    if a.size:
        xc = x[:, None]
        w = w - (F(np.minimum(b[None, :], xc)) - F(np.minimum(a[None, :], xc))).sum(axis=1)
    if rt.size:
        cum = np.concatenate([[0.0], np.cumsum(rw)])
        w = w - cum[np.searchsorted(rt, x, side="left")]
    return w * write


def _evaluate(cfg: SimConfig, layout: Layout, h: History, h0: History,
              tables: LevelTables, step_s: float,
              grid: np.ndarray) -> tuple[dict, dict]:
    T = h.duration
    dt = h.dt
    ck = cfg.checkpoint
    outcomes, series = {}, {}
    for p in POLICIES:
        value = tables.value[p]
        cap = capacity(h.hist, value, cfg.ntp.rebalance and p in REBALANCED)
        knots, cum = integral(h, cap)

        def F(x, k=knots, c=cum):
            return np.interp(x, k, c)

        work = float(cum[-1])
        stall_t, _ = _stall_events(h, value)
        if p == "ckpt_restart":
            down = _down_intervals(stall_t, ck.restart_minutes / 60.0,
                                   ck.interval_minutes / 60.0, lambda x: float(F(x)))
            write = 1.0 - ck.write_minutes / ck.interval_minutes
        else:
            stall_h = cfg.ntp.reconfig_minutes / 60.0 + step_s / 3600.0
            down = _down_intervals(stall_t, stall_h, None, None)
            write = 1.0
        useful = _useful_work(grid, F, down, write)
        good = float(_useful_work(np.array([T]), F, down, write)[0])
        downtime = float(np.sum(np.minimum(down[1], T) - down[0]))
        # spare domains for pause-free training at a fixed minibatch (no spares)
        if p in REBALANCED:
            deficit = np.ceil(ntp_deficit_domains(h0.hist, value, layout) - 1e-9)
        else:
            deficit = h0.bad_domains.astype(float)
        need = int(round(time_quantile(deficit, h0.dt, cfg.spares.quantile)))
        if p == "ntp_pw":
            extra = extra_power_fraction(h.hist, tables, layout)
            mean_extra = float((extra * dt).sum() / T)
            present = (h.hist[:, 1:] > 0) & (dt[:, None] > 0)
            levels = np.flatnonzero(present.any(axis=0)) + 1
            max_power = float(tables.power[levels].max()) if levels.size else 1.0
        else:
            mean_extra, max_power = 0.0, 1.0
        outcomes[p] = PolicyOutcome(
            policy=p, goodput=max(0.0, good / T), mean_capacity=work / T,
            interruptions=int(stall_t.size), downtime_hours=downtime,
            lost_work_hours=work - good, spare_domains_needed=need,
            mean_extra_power=mean_extra, max_power=max_power)
        series[p] = np.diff(useful) / np.diff(grid)
    return outcomes, series


def run(config: SimConfig) -> SimResult:
    """Simulate ``config``: the static loss sweep and one timed run."""
    start = _time.perf_counter()
    cfg = config.validate()
    sweep_rng, fail_rng = (np.random.default_rng(s)
                           for s in np.random.SeedSequence(cfg.seed).spawn(2))
    layout = Layout.from_config(cfg.cluster)
    step = step_breakdown(layout, cfg.model, cfg.hardware, cfg.cluster.microbatches)
    rows = loss_vs_failures(cfg, sweep_rng)

    T = cfg.duration_days * 24.0
    events: FailureEvents = events_for(cfg.failures, layout, T, fail_rng)
    h0 = replay(events, layout, T)
    h = h0 if cfg.spares.domains == 0 else replay(
        events, layout, T, cfg.spares.domains, cfg.spares.swap_hours)
    tables = level_tables(layout.tp, cfg.ntp, cfg.boost, step.compute_fraction)
    grid = np.linspace(0.0, T, cfg.timeline_points)
    outcomes, series = _evaluate(cfg, layout, h, h0, tables, step.step_s, grid)

    down = h0.down_gpus / layout.num_gpus
    summary = FailureSummary(
        events=len(events), hardware=events.hw_count, software=len(events) - events.hw_count,
        mean_failed_fraction=float((down * h0.dt).sum() / T),
        peak_failed_fraction=float(down[h0.dt > 0].max()) if np.any(h0.dt > 0) else 0.0,
        steady_failed_fraction=steady_failed_fraction(cfg.failures, layout.domain_size),
        spare_swaps=h.swaps)
    return SimResult(config=cfg, layout=layout.describe(), step=step, loss_vs_failures=rows,
                     outcomes=outcomes, failures=summary, timeline_hours=grid,
                     timeline=series, wall_seconds=_time.perf_counter() - start)
