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

The tables are monotone non-increasing in ``K``, so a cluster histogram
``hist[K]`` (replicas per level) is enough to compute every policy's
throughput, with or without batch rebalancing.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from .cluster import Layout
from .config import BoostConfig, CheckpointConfig, NTPConfig
from .throughput import boost_level

POLICIES = ("dp_drop", "ntp", "ntp_pw", "ckpt_restart")
REBALANCED = ("ntp", "ntp_pw")


@dataclass(frozen=True)
class LevelTables:
    """Per-level contribution and power; arrays of length ``t + 1``."""

    tp: int
    degree: np.ndarray              # TP degree each level runs at (0 = stopped)
    value: dict[str, np.ndarray]    # policy -> contribution per level
    power: np.ndarray               # ntp_pw relative power per level (1 = TDP)


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


def capacity(hist: np.ndarray, value: np.ndarray, rebalance: bool) -> np.ndarray:
    """Job throughput relative to a healthy job, from level histograms.

    ``hist[..., K]`` counts replicas at level ``K``.  With rebalancing every
    replica's contribution adds up.  Without it synchronous training runs at
    the pace of its slowest member, so the job keeps the best set of the
    fastest replicas: ``max_K (replicas at level <= K) * v[K]``.
    """
    hist = np.asarray(hist, dtype=float)
    total = hist.sum(axis=-1)
    total = np.where(total > 0, total, 1.0)
    if rebalance:
        return (hist * value).sum(axis=-1) / total
    cum = np.cumsum(hist, axis=-1)
    return (cum * value).max(axis=-1) / total


def policy_capacity(hist: np.ndarray, tables: LevelTables, rebalance: bool) -> dict:
    return {p: capacity(hist, tables.value[p], rebalance and p in REBALANCED)
            for p in POLICIES}


def ntp_deficit_domains(hist: np.ndarray, value: np.ndarray, layout: Layout) -> np.ndarray:
    """Missing capacity in domains: ``sum_K hist[K] (1 - v[K]) * t*pp / S``."""
    missing = (np.asarray(hist, dtype=float) * (1.0 - value)).sum(axis=-1)
    return missing * layout.replica_gpus / layout.domain_size


def extra_power_fraction(hist: np.ndarray, tables: LevelTables, layout: Layout) -> np.ndarray:
    """Boost power above TDP, as a fraction of the whole job's TDP.

    Counts the running GPUs of every degraded replica at its level's power;
    for ``pp > 1`` this is an upper bound (all stages boost as the worst).
    """
    per_level = tables.degree * (tables.power - 1.0) * layout.pp
    return (np.asarray(hist, dtype=float) * per_level).sum(axis=-1) / layout.num_gpus


def ckpt_availability(event_rate_per_h: float | np.ndarray, ck: CheckpointConfig) -> np.ndarray:
    """Fraction of wall time doing useful work under checkpoint-restart.

    Each failure event stops the job for the restart time and throws away the
    work since the last checkpoint (on average half an interval); checkpoint
    writes block for ``write_minutes`` every interval.  Renewal argument:
    ``A = (1 - w/C) / (1 + lambda (restart + C/2))``.
    """
    lam = np.asarray(event_rate_per_h, dtype=float)
    C = ck.interval_minutes / 60.0
    cost = ck.restart_minutes / 60.0 + C / 2.0
    return (1.0 - ck.write_minutes / ck.interval_minutes) / (1.0 + lam * cost)
