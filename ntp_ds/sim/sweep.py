"""Throughput loss against the fraction of failed GPUs (static snapshots).

For each TP degree and failed fraction ``f`` the sweep draws ``trials``
snapshots of failed GPUs (independent blocks of ``blast_radius`` GPUs, plus
whole domains with ``domain_fraction``; with hot spares, over every physical
GPU, after which a domain's healthy spares replace its failed active GPUs),
turns them into replica levels and reads off each policy's throughput.  Checkpoint-restart gets the DP-DROP
capacity times the availability implied by the failure rate that sustains
``f`` in steady state (Little's law over the configured repair-time mix).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .cluster import Layout
from .config import SimConfig
from .failures import (cover_with_hot_spares, event_rate_for_fraction, group_failed_counts,
                       sample_failed_gpus)
from .policies import POLICIES, ckpt_availability, policy_capacity, scaled_ntp, tables_for, young_daly_minutes
from .throughput import step_breakdown


@dataclass(frozen=True)
class LossPoint:
    policy: str
    tp: int
    failed_fraction: float
    throughput_loss: float


def level_histograms(group_failed: np.ndarray, layout: Layout) -> np.ndarray:
    """``(trials, t+1)`` replicas per worst-stage failed count."""
    K = layout.replica_max_failed(group_failed)
    trials = K.shape[0]
    offs = (np.arange(trials) * (layout.tp + 1))[:, None]
    flat = np.bincount((K + offs).ravel(), minlength=trials * (layout.tp + 1))
    return flat.reshape(trials, layout.tp + 1)


def snapshot_capacity(cfg: SimConfig, layout: Layout, fraction: float,
                      rng: np.random.Generator,
                      blast_radius: int | None = None, slowdown=None) -> dict[str, float]:
    """Mean capacity per policy (``ckpt_restart`` excluded) at one fraction."""
    f = cfg.failures
    b = f.blast_radius if blast_radius is None else blast_radius
    H = cfg.cluster.hot_spares
    if H:
        phys = Layout(layout.num_domains * (layout.domain_size + H), layout.domain_size + H, 1, 1)
        down = cover_with_hot_spares(sample_failed_gpus(phys, fraction, b, f.domain_fraction,
                                                        cfg.sweep.trials, rng),
                                     layout.domain_size, H)
    else:
        down = sample_failed_gpus(layout, fraction, b, f.domain_fraction, cfg.sweep.trials, rng)
    hist = level_histograms(group_failed_counts(down, layout), layout)
    step = step_breakdown(layout, cfg.model, cfg.hardware, cfg.cluster.microbatches)
    ntp = scaled_ntp(layout.tp, cfg.cluster.tp, cfg.ntp)
    tables = tables_for(cfg, layout, step, ntp, slowdown)
    caps = policy_capacity(hist, tables)
    return {p: float(np.mean(c)) for p, c in caps.items()}


def _interval(ck, rate_per_h: float) -> float:
    """Checkpoint interval in minutes at a job event rate (Young/Daly when configured)."""
    if ck.interval_policy == "fixed":
        return ck.interval_minutes
    return young_daly_minutes(ck.write_minutes, 60.0 / rate_per_h if rate_per_h > 0 else np.inf)


def loss_vs_failures(cfg: SimConfig, rng: np.random.Generator,
                     slowdown=None) -> list[LossPoint]:
    rows: list[LossPoint] = []
    tps = list(cfg.sweep.tp_degrees) or [cfg.cluster.tp]
    for tp in sorted(set(tps)):
        layout = Layout.from_config(cfg.cluster, tp=tp)
        for frac in cfg.sweep.failed_fractions:
            caps = snapshot_capacity(cfg, layout, float(frac), rng, slowdown=slowdown)
            rate = float(event_rate_for_fraction(frac, layout, cfg.failures))
            caps["ckpt_restart"] = caps["dp_drop"] * float(
                ckpt_availability(rate, cfg.checkpoint, _interval(cfg.checkpoint, rate)))
            for p in POLICIES:
                rows.append(LossPoint(p, tp, float(frac), max(0.0, 1.0 - caps[p])))
    return rows
