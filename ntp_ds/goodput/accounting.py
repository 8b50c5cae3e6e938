"""Goodput accounting: where a run's wall time went, and how much of the allocation did model-update work.

Pure arithmetic over timings the trainer measures; nothing here reads a clock. Definitions:
- The wall time of a run is split into buckets: `compute` (forward and backward of committed steps),
  `comm_wait` (the accumulation-boundary `engine.step`: gradient exchange, data-parallel reduction, optimizer and
  parameter sync), `detection`, `recovery` and `redone` (work lost to a failure and done again), `checkpoint`,
  and `other` (data, logging, anything unaccounted).
- Goodput = productive model-update work / (wall time x GPUs allocated), where productive work is the compute time
  of committed steps times the GPUs that were active in them. A failure-free run's goodput is its compute
  fraction; a replica at t' of t GPUs lowers it by the idle (t - t') GPUs it still holds.
- The failure-free token rate is `reference_tokens_per_s` when given, else the median rate of the steps run with
  every replica healthy (after `warmup_steps`; the median ignores stragglers), else the current rate scaled by
  allocated/active GPUs. A step's `throughput_ratio` is its rate over that one.
- A run's `throughput_ratio` (the summary's) is the time the same run would have taken without its failures over
  the time it took: its wall time less the time failures cost (detection, recovery, redone work) and less what its
  degraded steps took beyond their tokens at the failure-free rate (never less than nothing: a run with a failure
  reads below 1.00, even where its degraded steps happened to run faster). A failure-free run reads 1.00, however slow its
  first step or its checkpoints (a run without failures pays those too); start-up is not in the wall time at all.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

BUCKETS = ("compute", "comm_wait", "detection", "recovery", "redone", "checkpoint", "other")
LOST_BUCKETS = ("detection", "recovery", "redone", "checkpoint", "other")


@dataclass(frozen=True)
class StepTiming:
    """One committed step as measured on rank 0 (the ranks advance in lockstep)."""

    step: int
    """Step number, 1-based."""
    wall_s: float
    """From the end of the previous step to the end of this one."""
    compute_s: float
    """Forward and backward of every micro-batch."""
    comm_wait_s: float
    """Time inside `engine.step()`: gradient exchange, reduction, optimizer, parameter sync."""
    tokens: int
    """Tokens of the step's global batch."""
    degrees: tuple[int, ...]
    """TP degree of each replica during the step; 0 for a dropped replica."""

    def __post_init__(self):
        if self.wall_s < 0 or self.compute_s < 0 or self.comm_wait_s < 0:
            raise ValueError(f"step {self.step}: timings must be non-negative, got wall_s={self.wall_s}, "
                             f"compute_s={self.compute_s}, comm_wait_s={self.comm_wait_s}")
        if self.compute_s + self.comm_wait_s > self.wall_s * (1 + 1e-9) + 1e-9:
            raise ValueError(f"step {self.step}: compute_s + comm_wait_s = {self.compute_s + self.comm_wait_s:.6g} "
                             f"exceeds wall_s={self.wall_s:.6g}")


def goodput(productive_gpu_s: float, wall_s: float, allocated_gpus: int) -> float:
    """Productive GPU-seconds over allocated GPU-seconds; 0 before any time has passed."""
    if allocated_gpus < 1:
        raise ValueError(f"allocated_gpus={allocated_gpus} must be at least 1")
    return productive_gpu_s / (wall_s * allocated_gpus) if wall_s > 0 else 0.0


def active_fraction(degrees, allocated_gpus: int) -> float:
    return sum(degrees) / allocated_gpus


@dataclass
class GoodputMeter:
    """Accumulates step timings and lost time; every `record_*` returns the metrics to log."""

    allocated_gpus: int
    """GPUs the job holds: replicas x healthy TP, whether or not they are working."""
    healthy_tp: int
    """TP degree of a healthy replica."""
    reference_tokens_per_s: float | None = None
    """Failure-free token rate, if known (e.g. from a previous run); otherwise measured."""
    warmup_steps: int = 1
    """Leading steps left out of the measured failure-free rate (first-step compilation and allocation)."""
    seconds: dict = field(default_factory=lambda: dict.fromkeys(BUCKETS, 0.0))
    productive_gpu_s: float = 0.0
    active_gpu_s: float = 0.0
    tokens: int = 0
    steps: int = 0
    _healthy_rates: list = field(default_factory=list)
    degraded_wall_s: float = 0.0
    """Wall time of the steps run with a replica below the healthy degree (or dropped)."""
    degraded_tokens: int = 0

    def __post_init__(self):
        if self.allocated_gpus < 1 or self.healthy_tp < 1:
            raise ValueError(f"allocated_gpus={self.allocated_gpus} and healthy_tp={self.healthy_tp} must be >= 1")

    @property
    def wall_s(self) -> float:
        return sum(self.seconds.values())

    def failure_free_rate(self, current_rate: float, active_share: float) -> float:
        """The reference rate, else the measured healthy rate, else `current_rate` scaled up to every GPU."""
        if self.reference_tokens_per_s:
            return self.reference_tokens_per_s
        if self._healthy_rates:
            rates, n = self._healthy_rates, len(self._healthy_rates)
            return rates[n // 2] if n % 2 else (rates[n // 2 - 1] + rates[n // 2]) / 2
        return current_rate / active_share if active_share > 0 else 0.0

    def record_step(self, t: StepTiming) -> dict:
        """Account one committed step; return its metrics."""
        active = sum(t.degrees)
        self.seconds["compute"] += t.compute_s
        self.seconds["comm_wait"] += t.comm_wait_s
        self.seconds["other"] += t.wall_s - t.compute_s - t.comm_wait_s
        self.productive_gpu_s += t.compute_s * active
        self.active_gpu_s += t.wall_s * active
        self.tokens += t.tokens
        self.steps += 1
        rate = t.tokens / t.wall_s if t.wall_s > 0 else 0.0
        healthy = all(d >= self.healthy_tp for d in t.degrees)
        if healthy and self.steps > self.warmup_steps and rate > 0:
            bisect.insort(self._healthy_rates, rate)
        if not healthy:
            self.degraded_wall_s += t.wall_s
            self.degraded_tokens += t.tokens
        baseline = self.failure_free_rate(rate, active / self.allocated_gpus)
        metrics = {
            "step": t.step,
            "step_time_s": t.wall_s,
            "tokens": self.tokens,
            "tokens_per_s": rate,
            "failure_free_tokens_per_s": baseline,
            "throughput_ratio": rate / baseline if baseline > 0 else 0.0,
            "step_goodput": goodput(t.compute_s * active, t.wall_s, self.allocated_gpus),
            "goodput": goodput(self.productive_gpu_s, self.wall_s, self.allocated_gpus),
            "active_gpus": active,
            "allocated_gpus": self.allocated_gpus,
            "active_gpu_fraction": active_fraction(t.degrees, self.allocated_gpus),
            "time/compute_s": t.compute_s,
            "time/comm_wait_s": t.comm_wait_s,
            "time/other_s": t.wall_s - t.compute_s - t.comm_wait_s,
        }
        metrics.update({f"tp_degree/replica_{r}": d for r, d in enumerate(t.degrees)})
        return metrics

    def record_lost(self, bucket: str, seconds: float, active_gpus: int = 0) -> None:
        """Account time outside committed steps: failure detection, recovery, redone work, checkpoints."""
        if bucket not in LOST_BUCKETS:
            raise ValueError(f"bucket={bucket!r} must be one of {', '.join(LOST_BUCKETS)}")
        if seconds < 0:
            raise ValueError(f"seconds={seconds} for bucket {bucket!r} must be non-negative")
        self.seconds[bucket] += seconds
        self.active_gpu_s += seconds * active_gpus

    def failure_free_s(self, baseline: float) -> float:
        """The run's wall time without what its failures cost: the detection, recovery and redone seconds, and the
        degraded steps' time beyond their tokens at the failure-free rate `baseline`."""
        lost = sum(self.seconds[b] for b in ("detection", "recovery", "redone"))
        # A degraded replica holds fewer GPUs, so it is never faster than the healthy one; where it seems so (ranks
        # sharing a host's cores run faster when one of them is gone) it costs nothing, and earns nothing.
        slower = max(0.0, self.degraded_wall_s - (self.degraded_tokens / baseline if baseline > 0 else 0.0))
        return self.wall_s - lost - slower

    def summary(self) -> dict:
        """Totals of the run so far: goodput, token rates, bucket seconds and shares."""
        wall = self.wall_s
        rate = self.tokens / wall if wall > 0 else 0.0
        active_share = self.active_gpu_s / (wall * self.allocated_gpus) if wall > 0 else 0.0
        baseline = self.failure_free_rate(rate, active_share)
        failure_free = self.failure_free_s(baseline)
        out = {
            "steps": self.steps,
            "wall_s": wall,
            "tokens": self.tokens,
            "tokens_per_s": rate,
            "failure_free_tokens_per_s": baseline,
            "failure_free_s": failure_free,
            "throughput_ratio": failure_free / wall if wall > 0 else 0.0,
            "goodput": goodput(self.productive_gpu_s, wall, self.allocated_gpus),
            "active_gpu_fraction": active_share,
            "allocated_gpus": self.allocated_gpus,
        }
        for b in BUCKETS:
            out[f"time/{b}_s"] = self.seconds[b]
            out[f"share/{b}"] = self.seconds[b] / wall if wall > 0 else 0.0
        return out


def split_failure_time(lost_in_step_s: float, recover_wall_s: float, detection_s: float) -> tuple[float, float, float]:
    """Split the time one failure cost into (detection, recovery, redone), summing to the time lost.

    `lost_in_step_s` runs from the start of the failed step to the error, `recover_wall_s` is the recovery call, and
    `detection_s` (failure to detection) comes from the recovery. The failure happened during the step, so detection
    is taken out of the step first; the rest of the step is redone work, and detection that did not fit in the step
    comes out of the recovery call.
    """
    if lost_in_step_s < 0 or recover_wall_s < 0:
        raise ValueError(f"lost_in_step_s={lost_in_step_s} and recover_wall_s={recover_wall_s} must be non-negative")
    detection = min(max(detection_s, 0.0), lost_in_step_s + recover_wall_s)
    in_step = min(detection, lost_in_step_s)
    return detection, recover_wall_s - (detection - in_step), lost_in_step_s - in_step
