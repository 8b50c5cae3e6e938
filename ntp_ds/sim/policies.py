"""Failure-handling policies as per-level lookup tables.

A replica's state is summarised by ``K``, the number of failed GPUs in its
worst pipeline stage (``0 <= K <= t``).  Each policy maps ``K`` to the
replica's contribution ``v[K]`` in units of a healthy replica:

* ``dp_drop``: ``v = 1`` if ``K == 0`` else ``0``;
* ``ntp``: the stage runs at ``t' = t - K`` rounded down to a multiple of
  ``tp_step`` and contributes ``t'/t``, or nothing once ``t' < min_tp``;
* ``ntp_pw``: as ``ntp``, but the degraded group's GPUs raise their power up
  to ``1 + cap`` times TDP to win back throughput (see ``throughput``);
* ``ckpt_restart``: the capacity of ``dp_drop`` (the job restarts without the
  broken replicas), plus a job-wide stop per failure handled by the engine.

Each level also has a batch ``share`` (sequences, relative to a healthy
replica) and a step ``time`` (relative to a healthy step).  Synchronous
training runs at the pace of the slowest replica it keeps, so the job keeps
the set of levels that maximises ``sum(hist * share) / (R * max time)``
(``job_capacity``).  With ``ntp.batch_granularity=fluid`` a degraded replica
takes exactly ``t'/t`` of the batch at the healthy pace (the ideal model);
with ``sequence`` its share and time come from ``granularity``.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional

import numpy as np

from .cluster import Layout
from .config import BoostConfig, CheckpointConfig, NTPConfig, SimConfig
from .granularity import level_cost, sequences_per_replica
from .throughput import StepBreakdown, boost_level, perf_at_power

POLICIES = ("dp_drop", "ntp", "ntp_pw", "ckpt_restart")
REBALANCED = ("ntp", "ntp_pw")


@dataclass(frozen=True)
class LevelTables:
    """Per-level contribution and power; arrays of length ``t + 1``."""

    tp: int
    degree: np.ndarray              # TP degree each level runs at (0 = stopped)
    value: dict[str, np.ndarray]    # policy -> contribution per level (share / time)
    power: np.ndarray               # ntp_pw relative power per level (1 = TDP)
    share: Optional[dict[str, np.ndarray]] = None  # policy -> batch share per level (0: not running)
    time: Optional[dict[str, np.ndarray]] = None   # policy -> step time per level (1 = healthy)
    rebalance: bool = True

    def __post_init__(self):
        if self.share is None:   # fluid tables: rebalanced shares at the healthy pace
            object.__setattr__(self, "share", {p: v.copy() for p, v in self.value.items()})
            object.__setattr__(self, "time", {p: np.ones_like(v) for p, v in self.value.items()})


def degraded_degree(tp: int, failed: np.ndarray, ntp: NTPConfig) -> np.ndarray:
    """TP degree a group with ``failed`` dead GPUs runs at under NTP (0 = stop)."""
    k = np.asarray(failed)
    live = tp - k
    deg = np.where(k == 0, tp, (live // ntp.tp_step) * ntp.tp_step)
    return np.where(deg >= max(ntp.min_tp, 1), deg, 0)


def scaled_ntp(tp: int, base_tp: int, ntp: NTPConfig) -> NTPConfig:
    """NTP settings for a swept TP degree: ``min_tp`` and ``tp_step`` keep the
    same fraction of the degree as they have for the configured ``tp``."""
    if tp == base_tp:
        return ntp
    return replace(ntp, min_tp=max(1, int(np.ceil(ntp.min_tp / base_tp * tp - 1e-9))),
                   tp_step=max(1, ntp.tp_step * tp // base_tp))


def level_tables(tp: int, ntp: NTPConfig, boost: BoostConfig, phi: float) -> LevelTables:
    k = np.arange(tp + 1)
    deg = degraded_degree(tp, k, ntp)
    ratio = deg / tp
    drop = (k == 0).astype(float)
    pw, power = boost_level(ratio, boost.cap, boost.perf_exponent, phi)
    value = {"dp_drop": drop, "ntp": ratio.astype(float), "ntp_pw": pw,
             "ckpt_restart": drop.copy()}
    return LevelTables(tp=tp, degree=deg, value=value, power=power)


def job_capacity(hist: np.ndarray, share: np.ndarray, time: np.ndarray) -> np.ndarray:
    """Job throughput relative to a healthy job, from level histograms.

    ``hist[..., K]`` counts replicas at level ``K``; a replica there takes
    ``share[K]`` of a healthy replica's sequences and needs ``time[K]`` of a
    healthy step.  The synchronous step lasts as long as the slowest replica
    kept, so the job keeps every level up to a time limit and picks the limit
    that maximises ``sum(hist * share) / (R * limit)``.
    """
    hist = np.asarray(hist, dtype=float)
    share = np.asarray(share, dtype=float)
    time = np.asarray(time, dtype=float)
    total = hist.sum(axis=-1)
    total = np.where(total > 0, total, 1.0)
    run = np.flatnonzero(share > 0)
    if run.size == 0:
        return np.zeros(hist.shape[:-1])
    order = run[np.argsort(time[run], kind="stable")]
    work = np.cumsum(hist[..., order] * share[order], axis=-1)
    return (work / time[order]).max(axis=-1) / total


def capacity(hist: np.ndarray, value: np.ndarray, rebalance: bool) -> np.ndarray:
    """Fluid capacity: a level contributes ``value[K]``, rebalanced or at the pace of the slowest.

    Without rebalancing every running replica takes a full share at ``1/value``
    of the healthy pace.
    """
    value = np.asarray(value, dtype=float)
    if rebalance:
        return job_capacity(hist, value, np.ones_like(value))
    with np.errstate(divide="ignore"):
        slow = np.where(value > 0, 1.0 / np.where(value > 0, value, 1.0), 0.0)
    return job_capacity(hist, (value > 0).astype(float), slow)


def policy_capacity(hist: np.ndarray, tables: LevelTables) -> dict:
    return {p: job_capacity(hist, tables.share[p], tables.time[p]) for p in POLICIES}


def capacity_deficit_domains(cap: np.ndarray, layout: Layout) -> np.ndarray:
    """Missing capacity in domains: ``(1 - capacity) * R * t*pp / S``."""
    return (1.0 - np.asarray(cap, dtype=float)) * layout.num_gpus / layout.domain_size


def step_parts(step: StepBreakdown, tp_overlap: float, dp_overlap: float) -> dict:
    """Seconds of a healthy step that scale with a replica's work, and the rest."""
    return {"compute": step.compute_s + step.bubble_s,
            "tp_comm": step.tp_comm_s * (1.0 - tp_overlap),
            "fixed": step.dp_comm_s * (1.0 - dp_overlap), "step": step.step_s}


def healthy_share(cfg: SimConfig, layout: Layout) -> int:
    """Sequences per healthy replica; at least one for swept degrees with more replicas."""
    return max(1, int(round(sequences_per_replica(cfg.model, layout.num_replicas))))


def tables_for(cfg: SimConfig, layout: Layout, step: StepBreakdown, ntp: NTPConfig,
               slowdown=None) -> LevelTables:
    """Level tables of every policy at ``layout.tp`` under the configured batch granularity."""
    t = layout.tp
    fluid = level_tables(t, ntp, cfg.boost, step.compute_fraction)
    if ntp.batch_granularity == "fluid":
        if ntp.rebalance:
            return replace(fluid, rebalance=True)
        run = {p: (v > 0).astype(float) for p, v in fluid.value.items()}
        with np.errstate(divide="ignore"):
            slow = {p: np.where(v > 0, 1.0 / np.where(v > 0, v, 1.0), 0.0)
                    for p, v in fluid.value.items()}
        return replace(fluid, share=run, time=slow, rebalance=False)
    hw = cfg.hardware
    cost = level_cost(fluid.degree, t, healthy_share(cfg, layout), cfg.model,
                      step_parts(step, hw.tp_overlap, hw.dp_overlap), ntp.rebalance,
                      ntp.exchange_overlap, hw.scaleup_gbps, hw.grad_bytes, step.params,
                      slowdown)
    drop_share = fluid.value["dp_drop"].copy()
    drop_time = drop_share.copy()
    time_pw, power = boosted_time(cost.time, cost.compute, cfg.boost)
    power = np.where(cost.share > 0, power, 1.0)
    share = {"dp_drop": drop_share, "ntp": cost.share, "ntp_pw": cost.share.copy(),
             "ckpt_restart": drop_share.copy()}
    time = {"dp_drop": drop_time, "ntp": cost.time, "ntp_pw": time_pw,
            "ckpt_restart": drop_time.copy()}
    with np.errstate(divide="ignore", invalid="ignore"):
        value = {p: np.where(share[p] > 0, share[p] / np.where(time[p] > 0, time[p], 1.0), 0.0)
                 for p in POLICIES}
    return LevelTables(tp=t, degree=fluid.degree, value=value, power=power, share=share,
                       time=time, rebalance=ntp.rebalance)


def boosted_time(time: np.ndarray, compute: np.ndarray,
                 boost: BoostConfig) -> tuple[np.ndarray, np.ndarray]:
    """Step time of each level when its GPUs draw just enough power to keep the healthy pace.

    Only the compute part ``compute`` of ``time`` shrinks, by ``perf(p)``;
    the power never exceeds ``1 + cap`` and is not drawn where it buys nothing.
    """
    time = np.asarray(time, dtype=float)
    compute = np.asarray(compute, dtype=float)
    rest = time - compute
    slow = (time > 1.0) & (compute > 0) & (boost.perf_exponent > 0)
    with np.errstate(divide="ignore", invalid="ignore"):
        perf_needed = np.where(rest < 1.0, compute / np.where(rest < 1.0, 1.0 - rest, 1.0), np.inf)
        wanted = np.power(perf_needed, 1.0 / boost.perf_exponent) if boost.perf_exponent > 0 \
            else np.full_like(time, np.inf)
    power = np.where(slow, np.minimum(wanted, 1.0 + boost.cap), 1.0)
    new = np.where(slow, compute / perf_at_power(power, boost.perf_exponent) + rest, time)
    return new, power


def extra_power_fraction(hist: np.ndarray, tables: LevelTables, layout: Layout) -> np.ndarray:
    """Boost power above TDP, as a fraction of the whole job's TDP.

    Counts the running GPUs of every degraded replica at its level's power;
    for ``pp > 1`` this is an upper bound (all stages boost as the worst).
    """
    per_level = tables.degree * (tables.power - 1.0) * layout.pp
    return (np.asarray(hist, dtype=float) * per_level).sum(axis=-1) / layout.num_gpus


def young_daly_minutes(write_minutes: float, mtbf_minutes: float) -> float:
    """Daly's higher-order optimum of the compute time between checkpoints.

    ``sqrt(2 d M) (1 + sqrt(d / 2M) / 3 + d / 18M) - d`` for a write cost ``d`` below
    ``2M``, else ``M`` (Young's ``sqrt(2 d M)`` to first order).
    """
    d, M = write_minutes, mtbf_minutes
    if not np.isfinite(M):
        return float("inf")
    if d >= 2.0 * M:
        return float(M)
    return float(np.sqrt(2 * d * M) * (1 + np.sqrt(d / (2 * M)) / 3 + d / (18 * M)) - d)


def ckpt_availability(event_rate_per_h: float | np.ndarray, ck: CheckpointConfig,
                      interval_minutes: float | None = None) -> np.ndarray:
    """Fraction of wall time doing useful work under checkpoint-restart.

    Failures arrive at rate ``lam`` during up time; each stops the job for the
    restart time ``R`` and throws away the work since the last checkpoint;
    checkpoints every ``C`` of up time block for ``w``.  Per renewal cycle the
    saved up time is ``C q / (1 - q)`` with ``q = exp(-lam C)``, so
    ``A = (1 - w/C) lam C q / (1 - q) / (1 + lam R)``, which tends to the
    first-order ``(1 - w/C) / (1 + lam (R + C/2))`` for ``lam C << 1``.
    """
    lam = np.asarray(event_rate_per_h, dtype=float)
    interval = ck.interval_minutes if interval_minutes is None else interval_minutes
    if not np.isfinite(interval):       # no failures: no checkpoint needed
        return np.ones_like(lam)
    C = interval / 60.0
    R = ck.restart_minutes / 60.0
    x = lam * C
    with np.errstate(divide="ignore", invalid="ignore"):
        saved = np.where(x > 0, x * np.exp(-x) / -np.expm1(-np.where(x > 0, x, 1.0)), 1.0)
    return (1.0 - ck.write_minutes / interval) * saved / (1.0 + lam * R)
