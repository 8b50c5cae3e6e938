"""This rank's measured micro-batch work and the straggler-aware re-plan it feeds (`ntp_ds.batch.straggler`).

`StepWork` times each micro-batch from its forward to the end of its backward, less the time the backward spent
waiting on other replicas' gradients (`engine.sync_wait_s`), so a replica is judged by its own work. Under CUDA the
host's clock would time kernel launches (and whatever earlier work a sync waited for), so there the figure is the
device's: timing events at the forward's start and the backward's end, less the device spans of those waits
(`engine.device_waits`), read at the step's end, when the step's work has run. With
`ntp.straggler` on, every `every_steps` steps under one plan the ranks exchange those windows over the control group
(one small all-gather per window) and each computes the same plan from the same numbers; a new plan is taken at that
step boundary (`engine.set_batch_plan`). A new topology (a recovery, a join) starts the measurements afresh.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch.distributed as dist

from ntp_ds.batch.straggler import (HISTORY, fit_costs, replica_micro_times, replica_step_times,
                                    summarise_micro_batches)
from ntp_ds.comm import wire


@dataclass(frozen=True)
class _DeviceWork:
    """A micro-batch timed on the device: timing events at its forward's start and its backward's end, and the
    (start, end) events of the waits on other replicas in between."""

    first: object
    last: object
    waits: tuple
    extra_s: float
    """Seconds a `slow` fault added on the host (a throttled device's extra time)."""

    def seconds(self) -> float:
        if not self.last.query():  # (the step's end settled the device: this returns at once)
            with wire.waiting():
                self.last.synchronize()
        waited = sum(a.elapsed_time(b) for a, b in self.waits)
        return max(0.0, (self.first.elapsed_time(self.last) - waited) / 1000.0) + self.extra_s


class StepWork:
    """Micro-batch work of the current and the last completed step, and the re-plan decisions over windows of it."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter):
        self.clock = clock
        self.last_step: list[tuple[int, float]] = []
        """(samples, work seconds) of each micro-batch of the last completed step."""
        self._current: list[tuple[int, float | _DeviceWork]] = []
        self._pending: tuple | None = None
        self.new_topology()

    def new_topology(self) -> None:
        """Forget the windows and the fitted history: they describe the old topology's replicas."""
        self._window: list[float] = []
        self._micro_window: list[tuple[int, float]] = []
        self._history: list[list[dict]] = []
        self.begin_step()

    def begin_step(self) -> None:
        """A step (or a new attempt of it) starts: what an interrupted attempt measured is dropped."""
        self._current, self._pending = [], None

    def forward(self, engine, samples: int) -> None:
        """A micro-batch of `samples` samples enters the model."""
        first = wire.timed_event()
        if first is not None and getattr(engine, "device_waits", None) is None:
            engine.device_waits = []  # measured from here to the step's end
        waits = getattr(engine, "device_waits", None) or []
        self._pending = (self.clock(), getattr(engine, "sync_wait_s", 0.0), samples, first, len(waits))

    def backward_done(self, engine, stretch: Callable[[float], float] | None = None) -> None:
        """The micro-batch's backward returned; `stretch` (a `slow` fault) sleeps a slowed rank's extra time and
        returns it, which counts as this rank's work."""
        if self._pending is None:
            return
        started, waited, samples, first, seen = self._pending
        self._pending = None
        work = self.clock() - started - (getattr(engine, "sync_wait_s", 0.0) - waited)
        last = wire.timed_event() if first is not None else None  # before a slow fault's sleep, which is added once
        extra = stretch(work) if stretch is not None else 0.0
        if first is None:
            self._current.append((samples, work + extra))
        else:
            waits = (getattr(engine, "device_waits", None) or [])[seen:]
            self._current.append((samples, _DeviceWork(first, last, tuple(waits), extra)))

    def end_step(self, engine) -> dict | None:
        """The step completed: keep its work and, with `ntp.straggler` on, at the end of a window agree on the
        replicas' work and re-plan if it pays; return the `replan` event's fields when a new plan was taken."""
        self.last_step = [(samples, w if isinstance(w, float) else w.seconds()) for samples, w in self._current]
        self._current, self._pending = [], None
        if getattr(engine, "device_waits", None) is not None:
            engine.device_waits = None  # (a loop that never ends a step this way measures nothing on the device)
        cfg = engine.job.ntp.straggler
        if not (cfg.enabled and dist.is_initialized() and wire.has_control()):
            return None
        self._window.append(sum(seconds for _, seconds in self.last_step))
        self._micro_window += self.last_step
        if len(self._window) < cfg.every_steps:
            return None
        window, self._window = self._window, []
        points, self._micro_window = self._micro_window, []
        plan, groups = engine.batch_plan, engine.ntp_groups
        gathered = wire.all_gather_object((groups.replica, window, summarise_micro_batches(points)))
        step_s = replica_step_times([(replica, busy) for replica, busy, _ in gathered], len(plan.replicas))
        times = replica_micro_times([(replica, summary) for replica, _, summary in gathered], len(plan.replicas))
        self._history = (self._history + [times])[-HISTORY:]
        costs = fit_costs(self._history, groups.topology.degrees)
        replan = engine.job.rebalance(groups.topology, groups.plan.anchors, plan, costs)
        if replan is None:
            return None
        engine.set_batch_plan(replan.plan)
        return {"samples_before": [p.samples for p in plan.replicas],
                "samples_after": [p.samples for p in replan.plan.replicas],
                "micro_batches_before": [p.micro_steps for p in plan.replicas],
                "micro_batches_after": [p.micro_steps for p in replan.plan.replicas],
                "step_work_s": list(step_s), "per_sample_s": [c.per_sample_s for c in replan.costs],
                "micro_batch_fixed_s": [c.fixed_s for c in replan.costs],
                "predicted_step_s_before": replan.before_s, "predicted_step_s_after": replan.after_s,
                "window_steps": len(window)}
