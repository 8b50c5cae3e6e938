"""``run(config) -> SimResult``: the simulator's Python entry point."""
from __future__ import annotations

import time as _time
from dataclasses import dataclass, field

import numpy as np

from .calibration import Calibration
from .cluster import Layout
from .config import SimConfig
from .failures import POWER, FailureEvents, draw_mix, events_for, steady_failed_fraction
from .policies import (POLICIES, REBALANCED, LevelTables, capacity_deficit_domains,
                       extra_power_fraction, job_capacity, tables_for, young_daly_minutes)
from .sweep import LossPoint, loss_vs_failures
from .throughput import StepBreakdown, step_breakdown
from .timeline import History, SpareSetup, integral, replay, time_quantile

PROGRESS_EVENTS = 200_000   # replays longer than this show progress on a terminal


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
    rejoins: int = 0            # job-wide pauses when repaired GPUs rejoin


@dataclass(frozen=True)
class FailureSummary:
    events: int
    hardware: int
    software: int
    mean_failed_fraction: float      # time average over the run
    peak_failed_fraction: float
    steady_failed_fraction: float    # Little's law prediction
    spare_swaps: int
    power: int = 0                   # racks taken down by power-domain failures
    hot_swaps: int = 0               # failed GPUs replaced by a hot spare in their domain
    idle_spare_failures: int = 0     # spare domains that broke while idle in the pool
    repair_wait_hours: float = 0.0   # time repairs waited for a repair slot


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
    checkpoint_interval_minutes: float = 0.0
    levels: list = field(default_factory=list)    # (degree, share, time, kept) per NTP level
    notes: list = field(default_factory=list)     # what the model did that a reader must know
    calibration: dict | None = None

    @property
    def spares(self) -> dict[str, int]:
        return {p: o.spare_domains_needed for p, o in self.outcomes.items()}

    def loss(self, policy: str, tp: int, fraction: float) -> float:
        for row in self.loss_vs_failures:
            if row.policy == policy and row.tp == tp and np.isclose(row.failed_fraction, fraction):
                return row.throughput_loss
        raise KeyError((policy, tp, fraction))


def _stall_events(h: History, share: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Failure events that hit a running replica: (times, event index).

    Such a failure interrupts the synchronous step of the whole job, whatever
    the replica contributes afterwards.
    """
    if h.trans_event.size == 0:
        return np.zeros(0), np.zeros(0, dtype=np.int64)
    hit = (share[h.trans_old] > 0) & h.trans_fail
    ev, first = np.unique(h.trans_event[hit], return_index=True)
    return h.trans_time[hit][first], ev


def _rejoin_times(h: History, share: np.ndarray, degree: np.ndarray) -> np.ndarray:
    """Times at which repaired or swapped-in GPUs regroup a replica that then runs."""
    if h.trans_time.size == 0:
        return np.zeros(0)
    o, n = h.trans_old, h.trans_new
    back = ~h.trans_fail & (share[n] > 0) & (degree[n] != degree[o])
    return np.unique(h.trans_time[back])


def _down_intervals(times: np.ndarray, length_h, interval_h: float | None,
                    cap_F) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Whole-job stops after failures, and the work redone after each one.

    Each event stops the job for ``length_h`` (one value, or one per event);
    an event during a stop extends it.  With checkpointing (``interval_h``)
    the work since the last checkpoint, counted from the end of the previous
    stop, is lost as well.  Returns ``(start, end, rework_time, rework)``.
    """
    starts: list[float] = []
    ends: list[float] = []
    rt: list[float] = []
    rw: list[float] = []
    up_since = 0.0
    times = np.asarray(times, dtype=float)
    lengths = np.broadcast_to(np.asarray(length_h, dtype=float), times.shape)
    order = np.argsort(times, kind="stable")
    for tau, length_h in zip(times[order], lengths[order]):
        if ends and tau < ends[-1]:
            ends[-1] = max(ends[-1], tau + length_h)
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
    """Cumulative useful work at times ``x`` (healthy-job hours).

    The stops ``[a, b)`` are sorted and disjoint, so the work they take up to
    ``x`` is the sum over the stops that ended plus the part of the one in
    progress: O((stops + points) log stops) time and memory.
    """
    a, b, rt, rw = down
    x = np.asarray(x, dtype=float)
    w = F(x)
    if a.size:
        lost = np.concatenate([[0.0], np.cumsum(F(b) - F(a))])
        ended = np.searchsorted(b, x, side="right")          # stops over by x
        w = w - lost[ended]
        inside = (ended < a.size)
        i = np.minimum(ended, a.size - 1)
        part = np.where(inside & (a[i] < x), F(x) - F(a[i]), 0.0)
        w = w - part
    if rt.size:
        cum = np.concatenate([[0.0], np.cumsum(rw)])
        w = w - cum[np.searchsorted(rt, x, side="left")]
    return w * write


def _evaluate(cfg: SimConfig, layout: Layout, h: History, h0: History,
              tables: LevelTables, step_s: float, grid: np.ndarray,
              pauses: dict) -> tuple[dict, dict]:
    T = h.duration
    dt = h.dt
    ck = cfg.checkpoint
    outcomes, series = {}, {}
    for p in POLICIES:
        share, time = tables.share[p], tables.time[p]
        cap = job_capacity(h.hist, share, time)
        running = share * kept_levels(h0, share, time)   # levels the job keeps in its step
        knots, cum = integral(h, cap)

        def F(x, k=knots, c=cum):
            return np.interp(x, k, c)

        work = float(cum[-1])
        stall_t, _ = _stall_events(h, running)
        rejoin_t = np.zeros(0)
        if p == "ckpt_restart":
            interval_h = pauses["interval_minutes"] / 60.0
            down = _down_intervals(stall_t, ck.restart_minutes / 60.0,
                                   interval_h if np.isfinite(interval_h) else None,
                                   lambda x: float(F(x)))
            write = 1.0 - ck.write_minutes / pauses["interval_minutes"]
        else:
            rejoin_t = _rejoin_times(h, running, tables.degree)
            stall_h = pauses["recovery_minutes"] / 60.0 + step_s / 3600.0
            rejoin_h = pauses["rejoin_minutes"] / 60.0
            lengths = np.concatenate([np.full(stall_t.size, stall_h),
                                      np.full(rejoin_t.size, rejoin_h)])
            down = _down_intervals(np.concatenate([stall_t, rejoin_t]), lengths, None, None)
            write = 1.0
        useful = _useful_work(grid, F, down, write)
        good = float(_useful_work(np.array([T]), F, down, write)[0])
        downtime = float(np.sum(np.minimum(down[1], T) - down[0]))
        # spare domains for pause-free training at a fixed minibatch (no spares)
        if p in REBALANCED:
            cap0 = job_capacity(h0.hist, share, time)
            deficit = np.ceil(capacity_deficit_domains(cap0, layout) - 1e-9)
        else:
            deficit = h0.bad_domains.astype(float)
        need = int(round(time_quantile(deficit, h0.dt, cfg.spares.quantile)))
        if p == "ntp_pw":
            kept = running > 0                   # a group left out of the step draws no boost
            extra = extra_power_fraction(h.hist * kept, tables, layout)
            mean_extra = float((extra * dt).sum() / T)
            present = (h.hist[:, 1:] > 0) & (dt[:, None] > 0) & kept[1:]
            levels = np.flatnonzero(present.any(axis=0)) + 1
            max_power = float(tables.power[levels].max()) if levels.size else 1.0
        else:
            mean_extra, max_power = 0.0, 1.0
        outcomes[p] = PolicyOutcome(
            policy=p, goodput=max(0.0, good / T), mean_capacity=work / T,
            interruptions=int(stall_t.size), downtime_hours=downtime,
            lost_work_hours=work - good, spare_domains_needed=need,
            mean_extra_power=mean_extra, max_power=max_power, rejoins=int(rejoin_t.size))
        series[p] = np.diff(useful) / np.diff(grid)
    return outcomes, series


def job_mtbf_hours(cfg: SimConfig, layout: Layout) -> float:
    """Mean hours between failure events anywhere in the job (GPU and power domain)."""
    f = cfg.failures
    gpus = layout.num_domains * (layout.domain_size + cfg.cluster.hot_spares)
    rate = gpus / f.gpu_mtbf_hours
    if np.isfinite(f.power_domain_mtbf_hours):
        rate += layout.num_domains / f.power_domain_domains / f.power_domain_mtbf_hours
    return float("inf") if rate == 0 else 1.0 / rate


def checkpoint_interval_minutes(cfg: SimConfig, layout: Layout) -> float:
    ck = cfg.checkpoint
    if ck.interval_policy == "fixed":
        return ck.interval_minutes
    return young_daly_minutes(ck.write_minutes, job_mtbf_hours(cfg, layout) * 60.0)


def kept_levels(h: History, share: np.ndarray, time: np.ndarray) -> np.ndarray:
    """Levels the job keeps in its synchronous step over the run (1.0) or leaves out (0.0).

    The time limit is the best one for the run's time-average histogram; a level slower
    than it waits outside data parallelism until repaired.
    """
    mean_hist = (h.hist * h.dt[:, None]).sum(axis=0) / h.duration
    run = np.flatnonzero(share > 0)
    if run.size == 0:
        return np.zeros_like(share)
    order = run[np.argsort(time[run], kind="stable")]
    work = np.cumsum(mean_hist[order] * share[order]) / time[order]
    limit = float(time[order][int(np.argmax(work))])
    return ((share > 0) & (time <= limit + 1e-12)).astype(float)


def _level_notes(cfg: SimConfig, layout: Layout, tables: LevelTables,
                 h: History) -> tuple[list, list]:
    """Per NTP level seen in the run: degree, share, time and whether the job keeps it.

    A level is kept when the best time limit for the run's time-average histogram
    includes it; a slower level is left out of data parallelism until repaired.
    """
    from .policies import healthy_share

    share, time = tables.share["ntp"], tables.time["ntp"]
    keep = kept_levels(h, share, time)
    present = np.flatnonzero(((h.hist > 0) & (h.dt[:, None] > 0)).any(axis=0))
    levels, notes = [], []
    seqs = healthy_share(cfg, layout)
    seen = set()
    for k in present[present > 0]:
        deg = int(tables.degree[k])
        if deg in seen:
            continue
        seen.add(deg)
        kept = bool(keep[k] > 0)
        levels.append((deg, float(share[k]), float(time[k]), kept))
        if share[k] > 0 and time[k] > 1.0 + 1e-9:
            notes.append(
                f"NTP: a replica at TP{deg} of TP{tables.tp} takes {share[k] * seqs:g} of "
                f"{seqs} sequences and needs {time[k]:.3f}x a healthy step; "
                + ("the synchronous step waits for it" if kept else
                   "the job is faster without it, so it leaves data parallelism until repaired"))
    return levels, notes


def run(config: SimConfig, calibration: Calibration | None = None,
        progress: bool | None = None) -> SimResult:
    """Simulate ``config``: the static loss sweep and one timed run.

    ``calibration`` replaces modelled step-time ratios and pauses by the
    engine's measured ones; ``progress`` shows a replay progress bar on stderr
    (by default when stderr is a terminal and the run has many events).
    """
    import sys

    start = _time.perf_counter()
    cfg = config.validate()
    sweep_rng, fail_rng, idle_rng = (np.random.default_rng(s)
                                     for s in np.random.SeedSequence(cfg.seed).spawn(3))
    layout = Layout.from_config(cfg.cluster)
    step = step_breakdown(layout, cfg.model, cfg.hardware, cfg.cluster.microbatches)
    slowdown = calibration.slowdown if calibration is not None else None
    rows = loss_vs_failures(cfg, sweep_rng, slowdown)

    T = cfg.duration_days * 24.0
    H = cfg.cluster.hot_spares
    events: FailureEvents = events_for(cfg.failures, layout, T, fail_rng, H)
    if progress is None:
        progress = len(events) > PROGRESS_EVENTS and sys.stderr.isatty()
    sp = cfg.spares
    setup = SpareSetup(domains=sp.domains, swap_hours=sp.swap_hours, hot_spares=H,
                       repair_slots=sp.repair_slots)
    h0 = replay(events, layout, T, spares=SpareSetup(hot_spares=H,
                                                     repair_slots=sp.repair_slots),
                progress=progress)
    h = h0
    if sp.domains > 0:
        if sp.idle_failures and np.isfinite(cfg.failures.gpu_mtbf_hours):
            S = layout.domain_size
            n = int(idle_rng.poisson(sp.domains * S / cfg.failures.gpu_mtbf_hours * T))
            _, rep = draw_mix(n, cfg.failures, idle_rng)
            setup = SpareSetup(domains=sp.domains, swap_hours=sp.swap_hours, hot_spares=H,
                               repair_slots=sp.repair_slots,
                               idle_time=np.sort(idle_rng.random(n) * T), idle_repair=rep,
                               idle_draw=idle_rng.random(n))
        h = replay(events, layout, T, spares=setup, progress=progress)
    tables = tables_for(cfg, layout, step, cfg.ntp, slowdown)
    grid = np.linspace(0.0, T, cfg.timeline_points)
    interval = checkpoint_interval_minutes(cfg, layout)
    pauses = {"recovery_minutes": cfg.ntp.reconfig_minutes,
              "rejoin_minutes": cfg.ntp.rejoin_minutes, "interval_minutes": interval}
    if calibration is not None:
        if calibration.recovery_seconds is not None:
            pauses["recovery_minutes"] = calibration.recovery_seconds / 60.0
        if calibration.rejoin_seconds is not None:
            pauses["rejoin_minutes"] = calibration.rejoin_seconds / 60.0
    outcomes, series = _evaluate(cfg, layout, h, h0, tables, step.step_s, grid, pauses)
    levels, notes = _level_notes(cfg, layout, tables, h0)
    if cfg.checkpoint.interval_policy == "young_daly":
        notes.append(f"checkpoint-restart: Young/Daly interval {interval:.1f} min for a "
                     f"{cfg.checkpoint.write_minutes:g}-min write and a job MTBF of "
                     f"{job_mtbf_hours(cfg, layout):.2f} h")

    down = h0.down_gpus / layout.num_gpus
    summary = FailureSummary(
        events=len(events), hardware=events.hw_count,
        software=int(np.count_nonzero(events.kind == 1)),
        mean_failed_fraction=float((down * h0.dt).sum() / T),
        peak_failed_fraction=float(down[h0.dt > 0].max()) if np.any(h0.dt > 0) else 0.0,
        steady_failed_fraction=steady_failed_fraction(cfg.failures, layout.domain_size),
        spare_swaps=h.swaps, power=int(np.count_nonzero(events.kind == POWER)),
        hot_swaps=h0.hot_swaps, idle_spare_failures=h.idle_spare_failures,
        repair_wait_hours=h.repair_wait_hours)
    return SimResult(config=cfg, layout=layout.describe(), step=step, loss_vs_failures=rows,
                     outcomes=outcomes, failures=summary, timeline_hours=grid,
                     timeline=series, wall_seconds=_time.perf_counter() - start,
                     checkpoint_interval_minutes=interval, levels=levels, notes=notes,
                     calibration=None if calibration is None else calibration.to_dict())
