"""Straggler-aware batch planning: a replica slower than its peers (thermal throttling, a slow link) takes a smaller
share of the global batch.

Pure logic. A replica's busy time per step (its forward and backward work, not its waits on peers) divided by its
samples is its time per sample; the balanced plan spreads the same global batch so that every replica's predicted
time (time per sample x samples) is as even as whole samples allow. Hysteresis keeps the plan from flapping: step
times are medians over a window of steps run under one plan, a replica's time per sample is the median of its last
`HISTORY` windows (a time per sample does not depend on the plan, so windows under earlier plans still count), there
is one decision per window, and a new plan is adopted only when it predicts a step more than `threshold` shorter
than the current plan's. The global batch and each
replica's place in it (offsets in replica order) keep their meaning, so under `preserve_global_batch` the update is
the failure-free run's whatever the split.
"""

from __future__ import annotations

import heapq
import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from ntp_ds.batch.planner import BatchError, BatchPlan, split_micro_batches

HISTORY = 3
"""Windows whose times per sample a decision takes the median of: one noisy window cannot move the plan alone."""


@dataclass(frozen=True)
class Replan:
    """A re-plan the measured times call for."""

    plan: BatchPlan
    per_sample_s: tuple[float, ...]
    """Measured busy seconds per sample of each replica, under the current plan."""
    before_s: float
    """Predicted step time (the slowest replica's busy time) under the current plan."""
    after_s: float
    """Predicted step time under the new plan."""


def balance_samples(per_sample_s: Sequence[float], total: int, floors: Sequence[int] | None = None) -> list[int]:
    """Whole samples per replica summing to `total`, each at least its floor (default 1), that minimise the largest
    `per_sample_s[r] * samples[r]`; ties go to the lower replica index, so every rank computes the same split."""
    floors = list(floors) if floors is not None else [1] * len(per_sample_s)
    if total < sum(floors):
        raise BatchError(f"{total} samples cannot give {len(floors)} replicas their minimum of {floors}")
    cost = [max(float(c), 1e-12) for c in per_sample_s]
    samples = list(floors)
    heap = [(cost[r] * (n + 1), r) for r, n in enumerate(samples)]
    heapq.heapify(heap)
    for _ in range(total - sum(floors)):
        _, r = heapq.heappop(heap)
        samples[r] += 1
        heapq.heappush(heap, (cost[r] * (samples[r] + 1), r))
    return samples


def rebalance(plan: BatchPlan, per_sample_s: Sequence[float], micro_batch: int, anchors: tuple[int, ...] = (),
              micro_limits: tuple[int, ...] | None = None, threshold: float = 0.05) -> Replan | None:
    """The plan that balances the replicas' measured times per sample, or None when it would not shorten the
    predicted step by more than `threshold` (a fraction) or cannot be laid out.

    Anchor replicas reduce together in every backward, so they share one micro-batch count: each anchor keeps at
    least as many samples as that count.
    """
    now = [r.samples for r in plan.replicas]
    if len(per_sample_s) != len(now):
        raise ValueError(f"per_sample_s has {len(per_sample_s)} entries for a plan of {len(now)} replicas")
    limits = micro_limits or (micro_batch,) * len(now)
    floors = [1] * len(now)
    for _ in range(len(now) + 1):
        try:
            samples = balance_samples(per_sample_s, sum(now), floors)
        except BatchError:  # the anchors' shared count needs more samples than the batch has
            return None
        shared = max((math.ceil(samples[a] / min(micro_batch, limits[a])) for a in anchors), default=1)
        short = [a for a in anchors if samples[a] < shared]
        if not short:
            break
        for a in short:
            floors[a] = shared
    else:
        return None
    before = max(c * n for c, n in zip(per_sample_s, now))
    after = max(c * n for c, n in zip(per_sample_s, samples))
    if samples == now or not after < (1.0 - threshold) * before:
        return None
    try:
        new = split_micro_batches(samples, micro_batch, anchors, micro_limits, "the straggler-aware plan")
    except BatchError:
        return None
    return Replan(new, tuple(float(c) for c in per_sample_s), before, after)


def replica_step_times(windows: Sequence[tuple[int, Sequence[float]]], replicas: int) -> tuple[float, ...]:
    """Each replica's busy seconds per step from every rank's window of `(replica, [busy seconds per step])`: the
    median over the window (robust to one slow first step), the slowest rank of the replica (its TP peers wait on it).
    """
    out = [0.0] * replicas
    for replica, busy in windows:
        if busy:
            out[replica] = max(out[replica], statistics.median(busy))
    return tuple(out)


def per_sample_estimate(history: Sequence[Sequence[float]]) -> tuple[float, ...]:
    """Each replica's time per sample: the median over the windows in `history` (oldest first) of its measured time
    per sample; the trainer keeps the last `HISTORY` windows since the topology last changed."""
    return tuple(statistics.median(window[r] for window in history) for r in range(len(history[-1])))
