"""Analytic step-time model for one healthy data-parallel replica.

The model follows the usual Megatron-style accounting:

* compute: ``tokens * flops_per_token / (t * pp * peak * utilisation)`` with
  ``flops_per_token = 6 P + 12 L h s`` (dense GEMMs plus attention scores,
  forward and backward);
* pipeline bubble: ``compute * (pp - 1) / microbatches``;
* TP communication: four all-reduces of the layer activations per layer
  (two forward, two backward), ring cost ``2 (t-1)/t * bytes / B_up`` on the
  scale-up link, partly overlapped;
* DP gradient all-reduce: ``2 (R-1)/R * (P * grad_bytes / (t*pp)) / B_out`` on
  the scale-out link, mostly overlapped with the backward pass.

Synchronous data parallelism makes every replica take the same step time.
Under NTP the batch is rebalanced: a replica at ``t'`` of ``t`` GPUs gets
``t'/t`` of a healthy replica's tokens, so its per-GPU work and its step time
stay the same and it contributes ``t'/t`` of a healthy replica's throughput.

Power boost only speeds up the compute part of a step: with relative power
``p`` (1 = TDP) a GPU computes ``perf(p) = p ** alpha`` times faster, so a
step whose compute fraction is ``phi`` runs ``g(p) = 1 / (phi / perf(p) + 1 -
phi)`` times faster.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .cluster import Layout
from .config import HardwareConfig, ModelConfig


@dataclass(frozen=True)
class StepBreakdown:
    """Healthy step of one replica, in seconds, and derived rates."""

    compute_s: float
    bubble_s: float
    tp_comm_s: float
    dp_comm_s: float
    step_s: float
    tokens_per_s: float        # whole job, all replicas healthy
    mfu: float                 # model FLOPs utilisation of the whole job
    compute_fraction: float    # share of the step that a faster clock shortens
    params: float
    flops_per_token: float


def model_params(m: ModelConfig) -> float:
    if m.params_billion > 0:
        return m.params_billion * 1e9
    return 12.0 * m.layers * m.hidden ** 2


def flops_per_token(m: ModelConfig) -> float:
    return 6.0 * model_params(m) + 12.0 * m.layers * m.hidden * m.seq_len


def step_breakdown(layout: Layout, m: ModelConfig, hw: HardwareConfig,
                   microbatches: int) -> StepBreakdown:
    t, pp, R = layout.tp, layout.pp, layout.num_replicas
    params = model_params(m)
    fpt = flops_per_token(m)
    tokens = m.tokens_per_batch / R
    peak = hw.peak_tflops * 1e12
    compute = tokens * fpt / (t * pp * peak * hw.utilisation)
    bubble = compute * (pp - 1) / microbatches
    act_bytes = tokens * m.hidden * hw.act_bytes
    ring_tp = 2.0 * (t - 1) / t
    tp_comm = 4.0 * (m.layers / pp) * ring_tp * act_bytes / (hw.scaleup_gbps * 1e9)
    ring_dp = 2.0 * (R - 1) / R
    dp_comm = ring_dp * params * hw.grad_bytes / (t * pp) / (hw.scaleout_gbps * 1e9)
    step = (compute + bubble + tp_comm * (1.0 - hw.tp_overlap)
            + dp_comm * (1.0 - hw.dp_overlap))
    tps = m.tokens_per_batch / step
    mfu = tps * fpt / (layout.num_gpus * peak)
    return StepBreakdown(compute_s=compute, bubble_s=bubble, tp_comm_s=tp_comm,
                         dp_comm_s=dp_comm, step_s=step, tokens_per_s=tps, mfu=mfu,
                         compute_fraction=(compute + bubble) / step, params=params,
                         flops_per_token=fpt)


# --------------------------------------------------------------------------
# power boost

def perf_at_power(power: np.ndarray | float, exponent: float) -> np.ndarray:
    """Relative compute speed at relative power ``power`` (1 = TDP)."""
    return np.power(np.asarray(power, dtype=float), exponent)


def step_speedup(power: np.ndarray | float, exponent: float, phi: float) -> np.ndarray:
    """Whole-step speed-up when only the compute fraction ``phi`` scales."""
    perf = perf_at_power(power, exponent)
    return 1.0 / (phi / perf + (1.0 - phi))


def power_for_speedup(speedup: np.ndarray | float, exponent: float,
                      phi: float) -> np.ndarray:
    """Inverse of :func:`step_speedup`; ``inf`` where no power suffices."""
    g = np.asarray(speedup, dtype=float)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        denom = 1.0 / g - (1.0 - phi)          # = phi / perf
        perf = np.where(denom > 0, phi / np.where(denom > 0, denom, 1.0), np.inf)
        if exponent == 0:
            return np.where(g <= 1.0, 1.0, np.inf)
        power = np.power(perf, 1.0 / exponent)
    return np.where(g <= 1.0, 1.0, power)


def boost_level(degraded_ratio: np.ndarray, cap: float, exponent: float,
                phi: float) -> tuple[np.ndarray, np.ndarray]:
    """Contribution and power of a TP group running at ``degraded_ratio = t'/t``.

    The group asks for just enough power to restore a healthy replica's
    throughput, but never more than ``1 + cap`` times TDP.  Returns
    ``(contribution, relative_power)``; groups with ratio 0 (stopped) draw no
    boost and contribute nothing.
    """
    r = np.asarray(degraded_ratio, dtype=float)
    with np.errstate(divide="ignore"):
        need = np.where(r > 0, 1.0 / np.where(r > 0, r, 1.0), 1.0)
    wanted = power_for_speedup(need, exponent, phi)
    helps = (r > 0) & (exponent > 0) & (phi > 0)          # extra power buys speed
    power = np.where(helps, np.minimum(wanted, 1.0 + cap), 1.0)
    reached = (r > 0) & (wanted <= 1.0 + cap)             # includes healthy groups
    contrib = np.where(reached, 1.0,
                       np.minimum(1.0, r * step_speedup(power, exponent, phi)))
    return contrib, power
