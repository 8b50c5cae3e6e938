"""Straggler-aware batch planning: a replica slower than its peers (thermal throttling, a slow link) takes a smaller
share of the global batch.

Pure logic. A replica's work per step (its forwards and backwards, not its waits on peers) is modelled as
`micro-batches x fixed_s + samples x per_sample_s` (`StepCost`): a micro-batch pays a fixed cost whatever its size
(launching its kernels, DeepSpeed's hooks) besides its samples' compute. The distinction matters twice: a replica
that gives up samples also sheds micro-batches only where it runs its own count, and under ZeRO 2 the anchors share
one (`lockstep_replicas`), so a sample moved off a slow anchor does not take its micro-batch with it; a
time-per-sample model, blind to both, mispredicts every plan that changes a count.

The costs are fitted from each replica's micro-batches, timed one by one and summarised per window as the median
time of each micro-batch size (`summarise_micro_batches`). Replicas of one TP degree run the same shapes, so their
costs are taken to differ by a speed factor only (a throttled device is slower at both): one ratio of fixed to
per-sample cost per degree, fitted over the last `HISTORY` windows of all its replicas, and one speed per replica,
the median over those windows (one noisy window cannot move it alone). A ratio needs micro-batches of two sizes on one
replica; until a degree has them (every split so far even), its fixed cost is taken as zero.

The re-plan (`rebalance`) is the batch planner's own rule (`balance_samples`) on the measured costs in place of the
layout's predicted ones. Hysteresis keeps the plan from flapping: one decision per window, and a new plan only when
it predicts a step more than `threshold` shorter than the current plan's. The global batch and each replica's place
in it (offsets in replica order) keep their meaning, so under `preserve_global_batch` the update is the failure-free
run's whatever the split.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from ntp_ds.batch.planner import (BatchError, BatchPlan, StepCost, balance_samples, predict_step_s,
                                  split_micro_batches)

HISTORY = 3
"""Windows a decision fits its costs over: one noisy window cannot move the plan alone."""

RATIO_STEPS = 400
"""Candidate ratios of fixed to per-sample cost tried by the fit, evenly from 0 to `RATIO_SPAN` x the largest size
(then refined around the best)."""
RATIO_SPAN = 8.0

MicroTimes = Mapping[int, tuple[int, float]]
"""Micro-batch size -> (how many were timed, their median seconds): one replica's micro-batches in one window."""


@dataclass(frozen=True)
class Replan:
    """A re-plan the measured times call for."""

    plan: BatchPlan
    costs: tuple[StepCost, ...]
    """The replicas' fitted costs the decision used."""
    before_s: float
    """Predicted step time (the slowest replica's work) under the current plan."""
    after_s: float
    """Predicted step time under the new plan."""


def summarise_micro_batches(points: Sequence[tuple[int, float]]) -> dict[int, tuple[int, float]]:
    """(size, seconds) of each micro-batch a rank ran in a window -> size -> (count, median seconds)."""
    by_size: dict[int, list[float]] = {}
    for size, seconds in points:
        by_size.setdefault(int(size), []).append(float(seconds))
    return {size: (len(times), statistics.median(times)) for size, times in sorted(by_size.items())}


def replica_micro_times(summaries: Sequence[tuple[int, MicroTimes]],
                        replicas: int) -> list[dict[int, tuple[int, float]]]:
    """Each replica's micro-batch times from every rank's `(replica, summary)`: per size, the slowest rank's median
    (its TP peers wait on it)."""
    out: list[dict[int, tuple[int, float]]] = [{} for _ in range(replicas)]
    for replica, summary in summaries:
        for size, (count, seconds) in summary.items():
            old = out[replica].get(size)
            out[replica][size] = (max(count, old[0]), max(seconds, old[1])) if old else (count, seconds)
    return out


def _speed(window: MicroTimes, ratio: float) -> float:
    """Least-squares factor k of `seconds = k (ratio + size)` over one window's sizes, weighted by count."""
    num = sum(n * t * (ratio + s) for s, (n, t) in window.items())
    den = sum(n * (ratio + s) ** 2 for s, (n, t) in window.items())
    return num / den if den > 0 else 0.0


def _misfit(windows: Sequence[Sequence[MicroTimes]], ratios: np.ndarray) -> np.ndarray:
    """For each candidate ratio, the relative squared error of `seconds = k_r (ratio + size)`, one k_r per replica
    over all its windows (a ratio shows in sizes a replica ran at one speed, in one window or across plans). From
    each replica's weighted sums, so a candidate costs O(replicas)."""
    sums = np.array([[sum(n * s ** i * t ** j for window in replica for s, (n, t) in window.items())
                      for i, j in ((0, 0), (1, 0), (2, 0), (0, 1), (1, 1), (0, 2))] for replica in windows])
    ones, size, size2, time_, time_size, time2 = (sums[:, i][None, :] for i in range(6))
    a = ratios[:, None]
    num = a * time_ + time_size
    den = a * a * ones + 2 * a * size + size2
    residual = time2 - np.divide(num * num, den, out=np.zeros_like(num), where=den > 0)
    return (residual / np.where(time2 > 0, time2, 1.0)).sum(axis=1)


def fit_costs(history: Sequence[Sequence[MicroTimes]], degrees: Sequence[int]) -> tuple[StepCost, ...]:
    """Each replica's `StepCost` from the last windows' micro-batch times (`history`, oldest first, each window a
    `MicroTimes` per replica) and the replicas' TP degrees (replicas of one degree share the fixed-to-per-sample
    ratio). A replica with no timed micro-batch gets the cost of its degree's median replica (zero where none of its
    degree was timed, and `rebalance` then makes no plan)."""
    replicas = len(degrees)
    if any(len(window) != replicas for window in history):
        raise ValueError(f"every window of history must hold {replicas} replicas' times")
    ratios: dict[int, float] = {}
    for degree in set(degrees):
        members = [r for r in range(replicas) if degrees[r] == degree]
        windows = [[history[w][r] for w in range(len(history)) if history[w][r]] for r in members]
        sizes = [{s for window in replica for s in window} for replica in windows]
        if not any(len(s) > 1 for s in sizes):
            ratios[degree] = 0.0
            continue
        largest = max(max(s) for s in sizes if s)
        step = RATIO_SPAN * largest / RATIO_STEPS
        coarse = step * np.arange(RATIO_STEPS + 1)
        best = float(coarse[np.argmin(_misfit(windows, coarse))])  # the first of equal misfits: the smallest ratio
        fine = np.unique(np.maximum(0.0, best + step * (np.arange(41) / 20 - 1)))  # then within a step of it
        ratios[degree] = float(fine[np.argmin(_misfit(windows, fine))])
    speeds = []
    for r in range(replicas):
        ratio = ratios[degrees[r]]
        per_window = [_speed(history[w][r], ratio) for w in range(len(history)) if history[w][r]]
        speeds.append(statistics.median(per_window) if per_window else None)
    for r in range(replicas):
        if speeds[r] is None:
            known = [speeds[q] for q in range(replicas) if degrees[q] == degrees[r] and speeds[q] is not None]
            speeds[r] = statistics.median(known) if known else 0.0
    return tuple(StepCost(speeds[r] * ratios[degrees[r]], speeds[r]) for r in range(replicas))


def rebalance(plan: BatchPlan, costs: Sequence[StepCost], micro_batch: int, lockstep: tuple[int, ...] = (),
              micro_limits: tuple[int, ...] | None = None, threshold: float = 0.05) -> Replan | None:
    """The plan that balances the replicas' measured costs over `plan`'s samples (`balance_samples`: the planner's
    own rule, now on measured costs), or None when it would not shorten the predicted step by more than `threshold`
    (a fraction) or cannot be laid out. A replica without a positive cost per sample (never measured) gives no plan.
    """
    now = [r.samples for r in plan.replicas]
    if len(costs) != len(now):
        raise ValueError(f"costs has {len(costs)} entries for a plan of {len(now)} replicas")
    if not all(c.per_sample_s > 0 and c.fixed_s >= 0 for c in costs):
        return None
    samples = balance_samples(costs, sum(now), micro_batch, lockstep, micro_limits)
    if samples is None or samples == now:
        return None
    try:
        new = split_micro_batches(samples, micro_batch, lockstep, micro_limits, "the straggler-aware plan")
    except BatchError:
        return None
    before, after = predict_step_s(plan, costs), predict_step_s(new, costs)
    if not after < (1.0 - threshold) * before:
        return None
    return Replan(new, tuple(costs), before, after)


def replica_step_times(windows: Sequence[tuple[int, Sequence[float]]], replicas: int) -> tuple[float, ...]:
    """Each replica's busy seconds per step from every rank's window of `(replica, [busy seconds per step])`: the
    median over the window (robust to one slow first step), the slowest rank of the replica (its TP peers wait on it).
    """
    out = [0.0] * replicas
    for replica, busy in windows:
        if busy:
            out[replica] = max(out[replica], statistics.median(busy))
    return tuple(out)
