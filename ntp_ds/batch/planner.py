"""Batch planning: how many samples each replica takes per step and how it splits them into micro-batches.

Pure logic. One cost-aware rule plans every step: each replica's work per step is modelled as
`micro-batches x fixed_s + samples x per_sample_s` (`StepCost`), and whole samples go where they lengthen the slowest
replica's work least (`balance_samples`). Before anything is measured, a replica's cost is its layout's predicted
pace (`ntp_ds.layout.replica_paces`: its most loaded rank's work per sample over a healthy rank's) with no fixed
cost; once the straggler planner (`ntp_ds.batch.straggler`) has fitted measured costs, they replace the prediction
through `rebalance`, with its hysteresis.

Under `proportional` a replica takes what its slowest rank can finish in a healthy replica's failure-free step (a
replica at pace 1.02 takes 1/1.02 of a healthy share, rounded down) and the global batch shrinks by the shortfall.
Under `preserve_global_batch` the global batch is kept: the step is charged at the least step time in which the
replicas, each taking the whole samples it can finish in that time, hold the batch (`predict_step_s` of the plan),
which is the failure-free step only when the degraded replicas' shortfall fits in the healthy replicas' rounding.
Every replica, degraded ones included, takes what it can finish in the charged step, so the remainder lands on the
healthy replicas as long as that is the shorter step. Under ZeRO 2 the replicas of the anchor class (see
`ntp_ds.layout.SyncPlan`) reduce gradients together in every backward, so they share one micro-batch count
(`lockstep_replicas`); otherwise every replica runs as many micro-batches as its samples fill.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence
from dataclasses import dataclass

POLICIES = ("proportional", "preserve_global_batch")


class BatchError(ValueError):
    """A batch that cannot be divided as configured; the message names the field and value."""


@dataclass(frozen=True)
class ReplicaBatch:
    """One replica's part of a step: global-batch samples [offset, offset + samples) in micro-batches."""

    offset: int
    micro_sizes: tuple[int, ...]

    @property
    def samples(self) -> int:
        return sum(self.micro_sizes)

    @property
    def micro_steps(self) -> int:
        return len(self.micro_sizes)


@dataclass(frozen=True)
class BatchPlan:
    replicas: tuple[ReplicaBatch, ...]
    kept: int = 0
    """Samples of the step whose gradients some replicas already hold (the rest of an interrupted step,
    `resume_plan`): counted in the global batch, run by nobody."""

    @property
    def global_samples(self) -> int:
        return sum(r.samples for r in self.replicas) + self.kept


@dataclass(frozen=True)
class StepCost:
    """A replica's modelled work: `fixed_s` per micro-batch plus `per_sample_s` per sample."""

    fixed_s: float
    per_sample_s: float

    def step_s(self, micro_batches: int, samples: int) -> float:
        return self.fixed_s * micro_batches + self.per_sample_s * samples


def max_micro_batch(static_bytes: int, per_sample_bytes: int, budget_bytes: int | None, configured: int) -> int:
    """Largest micro-batch that fits the memory budget, at most the configured one."""
    if budget_bytes is None:
        return configured
    fit = (budget_bytes - static_bytes) // max(per_sample_bytes, 1)
    if fit < 1:
        raise BatchError(f"memory_budget_gb={budget_bytes / 2**30:.2f} cannot hold one sample on a rank that "
                         f"needs {static_bytes / 2**30:.2f} GiB before activations")
    return int(min(configured, fit))


def _split(total: int, parts: int) -> tuple[int, ...]:
    base, extra = divmod(total, parts)
    return tuple(base + (1 if i < extra else 0) for i in range(parts))


def lockstep_replicas(anchors: tuple[int, ...], zero_stage: int) -> tuple[int, ...]:
    """The replicas that must run one micro-batch count per step.

    Under ZeRO 2 DeepSpeed reduces the anchors' gradients in every backward, so every anchor must run as many
    backwards as the others. Under ZeRO 0 and 1 it reduces them in the step's last backward only, so each replica may
    run its own count (a replica with fewer samples pays fewer micro-batches).
    """
    return tuple(anchors) if zero_stage >= 2 else ()


def plan_batch(paces: Sequence[float], global_batch: int, micro_batch: int, policy: str,
               lockstep: tuple[int, ...] = (), micro_limits: tuple[int, ...] | None = None) -> BatchPlan:
    """Plan one step for replicas at predicted `paces` (each replica's time per sample over a healthy replica's,
    `ntp_ds.layout.replica_paces`: 1.0 for a healthy one).

    `global_batch` is the failure-free global batch (`train_batch_size`), `micro_batch` the configured micro-batch
    (`train_micro_batch_size_per_gpu`), `lockstep` the replicas that share one micro-batch count
    (`lockstep_replicas`), `micro_limits` an optional per-replica cap from the memory budget.
    """
    replicas = len(paces)
    if policy not in POLICIES:
        raise BatchError(f"batch_policy={policy!r} must be one of {POLICIES}")
    if micro_batch < 1:
        raise BatchError(f"train_micro_batch_size_per_gpu={micro_batch} must be at least 1")
    if global_batch % replicas:
        raise BatchError(f"train_batch_size={global_batch} is not divisible by the {replicas} replicas")
    if not all(p >= 1.0 for p in paces):
        raise ValueError(f"paces={list(paces)} must each be at least 1.0 (a healthy replica's)")
    share = global_batch // replicas
    what = f"train_batch_size={global_batch}"
    if policy == "proportional":
        samples = [math.floor(share / p * (1 + 1e-9)) for p in paces]  # what it finishes in a healthy step
        for r, n in enumerate(samples):
            if n < 1:
                raise BatchError(f"{what} leaves replica {r} (pace {paces[r]:.3f}) no sample; use a global batch of "
                                 f"at least {replicas * math.ceil(paces[r])}")
    else:
        samples = balance_samples(pace_costs(paces), global_batch, micro_batch, lockstep, micro_limits)
        if samples is None:
            raise BatchError(f"{what} cannot be split over {replicas} replicas' micro-batches")
    return split_micro_batches(samples, micro_batch, lockstep, micro_limits, what)


def pace_costs(paces: Sequence[float]) -> list[StepCost]:
    """The modelled cost of replicas at predicted `paces`: per sample, no fixed cost (one object per distinct pace:
    a few among thousands of replicas)."""
    by_pace = {p: StepCost(0.0, p) for p in set(paces)}
    return [by_pace[p] for p in paces]


def balance_samples(costs: Sequence[StepCost], total: int, micro_batch: int, lockstep: tuple[int, ...] = (),
                    micro_limits: tuple[int, ...] | None = None) -> list[int] | None:
    """Whole samples per replica (at least one each) summing to `total` whose slowest replica's modelled work is
    least, or None when no split fits the replicas' micro-batches.

    The `lockstep` replicas (`lockstep_replicas`: the anchors under ZeRO 2, which reduce together in every backward)
    share one micro-batch count M: each holds between M and M x its micro-batch size samples. M is tried upwards from
    the smallest whose lockstep replicas can hold the batch, and the search stops once none of them sat at its cap in
    the last M's plan (a larger M only adds fixed cost and raises their floors, so it cannot do better) or even M
    samples each cost more than the best plan so far; ties go to the smaller M. Every other replica runs as many
    micro-batches as its samples fill.
    """
    replicas = len(costs)
    limits = micro_limits or (micro_batch,) * replicas
    micro = [min(micro_batch, limits[r]) for r in range(replicas)]
    locked = [r in lockstep for r in range(replicas)]
    best: tuple[float, list[int]] | None = None
    if not lockstep:
        candidates = range(0, 1)
    else:
        others = replicas - len(lockstep)
        first = 1 if others else max(1, math.ceil(total / sum(micro[a] for a in lockstep)))
        candidates = range(first, (total - others) // len(lockstep) + 1)
    for count in candidates:
        if lockstep and best is not None:
            floor_s = max(costs[a].step_s(count, count) for a in lockstep)
            if floor_s >= best[0]:
                break
        floors = [count if locked[r] else 1 for r in range(replicas)]
        caps = [count * micro[r] if locked[r] else None for r in range(replicas)]
        shared = [count if locked[r] else 0 for r in range(replicas)]
        try:
            samples = _spread(costs, total, floors, caps, shared, micro)
        except BatchError:
            continue
        predicted = max(_work(costs[r], shared[r], micro[r], samples[r]) for r in range(replicas))
        if best is None or predicted < best[0]:
            best = (predicted, samples)
        if lockstep and all(samples[a] < caps[a] for a in lockstep):
            break
    return None if best is None else best[1]


def split_micro_batches(samples, micro_batch: int, lockstep: tuple[int, ...] = (),
                        micro_limits: tuple[int, ...] | None = None, what: str = "the plan") -> BatchPlan:
    """Lay out replicas' sample counts (in replica order) as a plan: micro-batches of at most the micro-batch (or the
    replica's memory limit), the `lockstep` replicas sharing the largest micro-batch count among them."""
    limits = micro_limits or (micro_batch,) * len(samples)
    micro_steps = [math.ceil(n / min(micro_batch, limits[r])) for r, n in enumerate(samples)]
    if lockstep:
        shared = max(micro_steps[a] for a in lockstep)
        if any(samples[a] < shared for a in lockstep):
            raise BatchError(f"{what} gives lockstep replicas (anchors under ZeRO 2) fewer samples than the {shared} "
                             f"micro-batches they must share")
        for a in lockstep:
            micro_steps[a] = shared
    out, offset = [], 0
    for r, n in enumerate(samples):
        out.append(ReplicaBatch(offset, _split(n, micro_steps[r])))
        offset += n
    return BatchPlan(tuple(out))


def resume_plan(interrupted: BatchPlan, kept: Sequence[int], costs: Sequence[StepCost], micro_batch: int,
                micro_limits: tuple[int, ...] | None = None) -> BatchPlan | None:
    """The rest of an `interrupted` step whose `kept` replicas hold their share's gradients whole: the samples of the
    other replicas, spread over every replica of the step's new topology at its cost (`balance_samples`), in replica
    order from the first of them. None where those samples are not one range of the global batch, or too few to give
    every replica a micro-batch: the whole step is then run again.

    `costs` (and `micro_limits`) are the new topology's, one per replica; its replicas are the interrupted plan's,
    in the same order (a recovery that dropped one does not resume). Without lockstep: only a replica that reduces
    nothing inside its backward (ZeRO 0 or 1) can hold its gradients back from a reduction.
    """
    if len(costs) != len(interrupted.replicas) or interrupted.kept:
        return None
    kept = set(kept)
    rest = sorted((interrupted.replicas[r].offset, interrupted.replicas[r].samples)
                  for r in range(len(costs)) if r not in kept)
    if not rest or not kept:
        return None
    start, end = rest[0][0], rest[0][0]
    for offset, samples in rest:
        if offset != end:
            return None
        end += samples
    samples = balance_samples(costs, end - start, micro_batch, (), micro_limits)
    if samples is None:
        return None
    plan = split_micro_batches(samples, micro_batch, (), micro_limits)
    return BatchPlan(tuple(ReplicaBatch(start + r.offset, r.micro_sizes) for r in plan.replicas),
                     kept=interrupted.global_samples - (end - start))


def _work(cost: StepCost, shared: int, micro: int, samples: int) -> float:
    """A replica's modelled work: `shared` micro-batches when it runs in lockstep (> 0), else as many as its samples
    fill at `micro` each."""
    return max(cost.step_s(shared or math.ceil(samples / micro), samples), 1e-12 * samples)


def _spread(costs: Sequence[StepCost], total: int, floors: list[int], caps: Sequence[int | None],
            shared: Sequence[int], micro: Sequence[int]) -> list[int]:
    """Whole samples within [floor, cap] per replica summing to `total` that minimise the largest predicted work: a
    replica with `shared[r]` > 0 runs that many micro-batches, any other ceil(samples / micro[r]).

    The greedy answer (each replica's work grows with its samples, so giving the next sample to the replica whose
    work would stay least, ties to the lower index, is min-max optimal), reached without a step per sample: bisect
    for the largest work level that the replicas' samples at or under it do not yet fill the batch, give each replica
    the samples that level allows, and finish on a heap (the few samples left, all at the level where the batch is
    full). Costs O(replicas x log) per level instead of O(samples x log replicas)."""
    if total < sum(floors):
        raise BatchError(f"{total} samples cannot give {len(floors)} replicas their minimum of {floors}")
    if any(cap is not None and cap < floor for cap, floor in zip(caps, floors)) or (
            None not in caps and sum(caps) < total):
        raise BatchError(f"{total} samples exceed what the replicas' micro-batches can hold")
    replicas = range(len(floors))

    def work(r: int, n: int) -> float:
        return _work(costs[r], shared[r], micro[r], n)

    def most(r: int, level: float) -> int:
        """The most samples replica r takes with its work at most `level`, within its floor and cap."""
        c = costs[r]
        if shared[r]:
            n = (level - c.fixed_s * shared[r]) / c.per_sample_s
        else:
            full = c.fixed_s + c.per_sample_s * micro[r]  # the work of one full micro-batch
            n = max(math.floor(level / full) * micro[r], (level - c.fixed_s * (math.floor(level / full) + 1))
                    / c.per_sample_s)
        top = total if caps[r] is None else caps[r]
        n = min(max(int(math.floor(n)), floors[r]), top) if math.isfinite(n) else floors[r]
        while n > floors[r] and work(r, n) > level:  # exact against the work itself, whatever the rounding
            n -= 1
        while n < top and work(r, n + 1) <= level:
            n += 1
        return n

    samples = list(floors)
    if sum(floors) < total:
        # Replicas alike in cost, lockstep count, micro-batch, floor and cap take alike: one of each kind is asked.
        kinds: dict[tuple, list[int]] = {}
        for r in replicas:
            kinds.setdefault((costs[r], shared[r], micro[r], floors[r], caps[r]), []).append(r)
        members = [(rs[0], len(rs)) for rs in kinds.values()]
        low, high = 0.0, max(work(r, total if caps[r] is None else caps[r]) for r, _ in members)
        for _ in range(200):  # the level below which the batch is not yet full
            mid = (low + high) / 2
            if not low < mid < high:
                break
            if sum(most(r, mid) * n for r, n in members) < total:
                low = mid
            else:
                high = mid
        taken = {r: most(r, low) for r, _ in members}
        samples = [taken[kinds[(costs[r], shared[r], micro[r], floors[r], caps[r])][0]] for r in replicas]
    heap = [(work(r, samples[r] + 1), r) for r in replicas if caps[r] is None or samples[r] < caps[r]]
    heapq.heapify(heap)
    for _ in range(total - sum(samples)):
        _, r = heapq.heappop(heap)
        samples[r] += 1
        if caps[r] is None or samples[r] < caps[r]:
            heapq.heappush(heap, (work(r, samples[r] + 1), r))
    return samples


def predict_step_s(plan: BatchPlan, costs: Sequence[StepCost]) -> float:
    """The slowest replica's modelled work per step under `plan`."""
    return max(c.step_s(p.micro_steps, p.samples) for c, p in zip(costs, plan.replicas))
