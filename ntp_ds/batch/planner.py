"""Batch planning: how many samples each replica takes per step and how it splits them into micro-batches.

Pure logic. A replica at TP t' of a healthy t takes about t'/t of a healthy replica's samples. Under
`proportional` the global batch shrinks accordingly; under `preserve_global_batch` the healthy replicas take the
remainder, so the step sees the same samples as a failure-free run. Under ZeRO 2 the replicas of the anchor class
(see `ntp_ds.layout.SyncPlan`) reduce gradients together in every backward, so they share one micro-batch count
(`lockstep_replicas`); otherwise every replica runs as many micro-batches as its samples fill.
"""

from __future__ import annotations

import math
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

    @property
    def global_samples(self) -> int:
        return sum(r.samples for r in self.replicas)


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


def _largest_remainder(total: int, weights: list[int]) -> list[int]:
    quotas = [total * w / sum(weights) for w in weights]
    out = [math.floor(q) for q in quotas]
    order = sorted(range(len(weights)), key=lambda i: (-(quotas[i] - out[i]), i))
    for i in order[: total - sum(out)]:
        out[i] += 1
    return out


def lockstep_replicas(anchors: tuple[int, ...], zero_stage: int) -> tuple[int, ...]:
    """The replicas that must run one micro-batch count per step.

    Under ZeRO 2 DeepSpeed reduces the anchors' gradients in every backward, so every anchor must run as many
    backwards as the others. Under ZeRO 0 and 1 it reduces them in the step's last backward only, so each replica may
    run its own count (a replica with fewer samples pays fewer micro-batches).
    """
    return tuple(anchors) if zero_stage >= 2 else ()


def plan_batch(degrees: tuple[int, ...], healthy_tp: int, global_batch: int, micro_batch: int, policy: str,
               lockstep: tuple[int, ...] = (), micro_limits: tuple[int, ...] | None = None) -> BatchPlan:
    """Plan one step for replicas at TP `degrees`.

    `global_batch` is the failure-free global batch (`train_batch_size`), `micro_batch` the configured micro-batch
    (`train_micro_batch_size_per_gpu`), `lockstep` the replicas that share one micro-batch count
    (`lockstep_replicas`), `micro_limits` an optional per-replica cap from the memory budget.
    """
    replicas = len(degrees)
    if policy not in POLICIES:
        raise BatchError(f"batch_policy={policy!r} must be one of {POLICIES}")
    if micro_batch < 1:
        raise BatchError(f"train_micro_batch_size_per_gpu={micro_batch} must be at least 1")
    if global_batch % replicas:
        raise BatchError(f"train_batch_size={global_batch} is not divisible by the {replicas} replicas")
    share = global_batch // replicas
    healthy = [r for r, t in enumerate(degrees) if t >= healthy_tp]
    samples = [share if r in healthy else round(share * degrees[r] / healthy_tp) for r in range(replicas)]
    if policy == "preserve_global_batch":
        takers = healthy or list(range(replicas))
        shortfall = global_batch - sum(samples)
        extra = _largest_remainder(shortfall, [degrees[r] for r in takers])
        for r, e in zip(takers, extra):
            samples[r] += e
    for r, n in enumerate(samples):
        if n < 1:
            raise BatchError(f"train_batch_size={global_batch} leaves replica {r} (tp={degrees[r]}) no sample; "
                             f"use a global batch of at least {math.ceil(replicas * healthy_tp / degrees[r])}")
    return split_micro_batches(samples, micro_batch, lockstep, micro_limits, f"train_batch_size={global_batch}")


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
