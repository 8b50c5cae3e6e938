"""The training loop of one rank: data, steps, goodput accounting, records, the final weights.

Everything the loop needs comes in through the constructor (engine, recorder, recovery, injector, clock), so tests
can hand it fakes. The injector, wired only together with a recovery, is attached to the engine's `on_phase` hook
(forward, backward, grad_sync and optimizer boundaries). Recovery seam: when a step raises and a `recovery` is
given, `_recover` calls `recovery.recover(trainer, step, error)`, which returns a `RecoveryReport` carrying the
rebuilt engine and its timings; the trainer accounts them (detection, recovery, redone work), records a `recovery`
event in events.jsonl and W&B, and runs the step again. Without a recovery an error ends the run, and scheduled
faults are not injected (they would only kill the job): each is recorded as a `fault_skipped` event instead.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist

from ntp_ds.batch.loader import GlobalBatchSampler, SyntheticTokens, replica_micro_batches
from ntp_ds.goodput import GoodputMeter, StepTiming, split_failure_time
from ntp_ds.run.config import RunConfig
from ntp_ds.run.records import FINAL_WEIGHTS, RunRecorder

log = logging.getLogger("ntp_ds.train")


@dataclass
class RecoveryReport:
    """What one recovery did: the engine to go on with and where the time went."""

    engine: Any
    """The engine of the new topology (the same object if it was rebuilt in place)."""
    detection_s: float
    """From the failure to its detection."""
    recovery_s: float
    """Agreement, regroup, reshard and re-plan, up to the point training can resume."""
    fields: dict = field(default_factory=dict)
    """Extra fields of the `recovery` event: degrees before/after, bytes moved, lossless, ..."""


class Recovery(Protocol):
    """Live recovery, as the trainer calls it."""

    def recover(self, trainer: Trainer, step: int, error: BaseException) -> RecoveryReport: ...


class Injector(Protocol):
    """Fault injection at the engine's phase boundaries (`ntp_ds.control.FaultInjector`); step is 1-based."""

    def check(self, step: int, phase: str) -> None: ...


class Trainer:
    """Run `cfg.train.steps` steps of this rank's replica and account their goodput."""

    def __init__(self, cfg: RunConfig, engine, recorder: RunRecorder, *, run_dir: Path,
                 recovery: Recovery | None = None, injector: Injector | None = None,
                 clock: Callable[[], float] = time.perf_counter, progress=None, startup_s: float = 0.0):
        self.cfg, self.engine, self.recorder, self.run_dir = cfg, engine, recorder, Path(run_dir)
        self.startup_s = startup_s
        self.recovery, self.injector, self.clock, self.progress = recovery, injector, clock, progress
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.dataset = SyntheticTokens(cfg.model.llama_config().vocab_size, cfg.data.seq_len, cfg.data.size,
                                       cfg.data.seed)
        self.sampler = GlobalBatchSampler(cfg.data.size, cfg.data.seed)
        self.meter = GoodputMeter(cfg.allocated_gpus, cfg.parallel.tp)
        self.step = 0
        self.recoveries = 0
        self.last_loss = math.nan
        self._last_end = clock()

    # -- topology ----------------------------------------------------------------------------------------------
    @property
    def degrees(self) -> tuple[int, ...]:
        """TP degree per configured replica; 0 for a replica no longer in the topology."""
        live = tuple(self.engine.ntp_groups.topology.degrees)
        return live + (0,) * (self.cfg.parallel.replicas - len(live))

    # -- loop --------------------------------------------------------------------------------------------------
    def train(self) -> dict:
        """Run every step, write the final weights and return the summary."""
        self._announce()
        if self.recovery is not None:
            self._attach_injector()
        if dist.is_initialized():
            dist.barrier()  # start the clocks together, after rank 0's W&B and file set-up
        self._last_end = self.clock()
        log_every = max(1, self.cfg.train.steps // 10)
        step = self.step + 1
        while step <= self.cfg.train.steps:
            try:
                timing, loss = self.train_step(step)
            except Exception as error:  # a peer or device failure; without recovery it ends the run
                self._recover(step, error)
                continue
            self.step, self.last_loss = step, loss
            metrics = {**self.meter.record_step(timing), "loss": loss}
            self.recorder.step(metrics)
            self._report_step(metrics, verbose=step % log_every == 0 or step == self.cfg.train.steps)
            step += 1
        if self.cfg.train.save_final:
            self.save_final()
        return self.finish()

    def train_step(self, step: int) -> tuple[StepTiming, float]:
        """Run one optimizer step over this replica's micro-batches; return its timing and mean loss."""
        engine, clock = self.engine, self.clock
        compute_s = comm_s = 0.0
        loss_sum, samples = 0.0, 0
        plan, replica = engine.batch_plan, engine.ntp_groups.replica
        for batch in replica_micro_batches(self.dataset, self.sampler, plan, replica, step - 1):
            t = clock()
            loss = engine(batch)
            engine.backward(loss)
            t2 = clock()
            engine.step()
            end = clock()
            compute_s, comm_s = compute_s + t2 - t, comm_s + end - t2
            n = batch["input_ids"].shape[0]
            loss_sum, samples = loss_sum + float(loss.detach()) * n, samples + n
        end = clock()
        timing = StepTiming(step=step, wall_s=max(end - self._last_end, compute_s + comm_s), compute_s=compute_s,
                            comm_wait_s=comm_s, tokens=plan.global_samples * self.cfg.data.seq_len,
                            degrees=self.degrees)
        self._last_end = end
        return timing, loss_sum / max(samples, 1)

    def _attach_injector(self) -> None:
        """Let the engine report its phase boundaries to the injector (`engine.on_phase(step, phase)`)."""
        if self.injector is not None:
            self.engine.on_phase = self.injector.check

    # -- failures ----------------------------------------------------------------------------------------------
    def _recover(self, step: int, error: BaseException) -> None:
        """Hand a failed step to live recovery, account its time and record the event; re-raise without one."""
        if self.recovery is None:
            raise error
        failed_at = self.clock()
        before = self.degrees
        log.warning("step %d failed: %s; recovering", step, error)
        report = self.recovery.recover(self, step, error)
        resumed_at = self.clock()
        self.engine = report.engine
        detection, recovery, redone = split_failure_time(failed_at - self._last_end, resumed_at - failed_at,
                                                         report.detection_s)
        for bucket, seconds in (("detection", detection), ("recovery", recovery), ("redone", redone)):
            self.meter.record_lost(bucket, seconds, active_gpus=sum(self.degrees))
        self._attach_injector()
        self.recoveries += 1
        self.recorder.event("recovery", step, detection_s=detection, recovery_s=recovery, redone_s=redone,
                            degrees_before=list(before), degrees_after=list(self.degrees), error=str(error),
                            **report.fields)
        log.warning("recovered at step %d in %.2f s: TP degrees %s -> %s", step, detection + recovery,
                    list(before), list(self.degrees))
        self._last_end = resumed_at

    def _announce(self) -> None:
        cfg = self.cfg
        self.recorder.event("run_start", self.step, degrees=list(self.degrees), world_size=cfg.world_size,
                            allocated_gpus=cfg.allocated_gpus, recovery_available=self.recovery is not None)
        faults = cfg.fault_schedule().faults
        if not faults or self.recovery is not None:
            return
        if self.rank == 0:
            log.warning("fault injection is scheduled (%s) but live recovery is not available in this build: no "
                        "fault is injected, the run keeps the static topology %s", _describe(faults),
                        list(self.degrees))
        for f in faults:
            self.recorder.event("fault_skipped", f.step, rank=f.rank, phase=f.phase, kind=f.kind,
                                reason="live recovery is not available")

    # -- end of run --------------------------------------------------------------------------------------------
    def save_final(self) -> Path:
        """Write the consolidated weights (HF form) to RUN_DIR/final; every rank takes part."""
        path = self.run_dir / FINAL_WEIGHTS
        t = self.clock()
        self.engine.save_pretrained(path)
        if dist.is_initialized():
            dist.barrier()
        self.meter.record_lost("checkpoint", self.clock() - t, active_gpus=sum(self.degrees))
        if self.rank == 0:
            log.info("final weights: %s", path)
        return path

    def finish(self) -> dict:
        summary = {**self.meter.summary(), "final_loss": self.last_loss, "degrees_end": list(self.degrees),
                   "world_size": self.cfg.world_size, "model": self.cfg.model.name, "recipe": self.cfg.recipe,
                   "startup_s": self.startup_s, "recoveries": self.recoveries, "recovery_available": self.recovery is not None,
                   "faults_scheduled": len(self.cfg.fault_schedule().faults), "run_dir": str(self.run_dir),
                   "final_weights": str(self.run_dir / FINAL_WEIGHTS) if self.cfg.train.save_final else None}
        self.recorder.event("run_end", self.step, degrees=list(self.degrees))
        self.recorder.finish(summary)
        if self.progress is not None:
            self.progress.close()
        if self.rank == 0:
            log.info("done: %d steps, goodput %.3f, %.0f tokens/s (%.2f of failure-free), active GPUs %.0f%%, "
                     "final loss %.4f", summary["steps"], summary["goodput"], summary["tokens_per_s"],
                     summary["throughput_ratio"], 100 * summary["active_gpu_fraction"], self.last_loss)
        return summary

    def _report_step(self, metrics: dict, verbose: bool) -> None:
        text = (f"step {metrics['step']}/{self.cfg.train.steps} loss {metrics['loss']:.4f} "
                f"tokens/s {metrics['tokens_per_s']:.0f} goodput {metrics['goodput']:.3f} "
                f"tp {','.join(map(str, self.degrees))}")
        if self.progress is not None:
            self.progress.set_postfix_str(f"loss {metrics['loss']:.3f} goodput {metrics['goodput']:.2f}",
                                          refresh=False)
            self.progress.update(1)
        log.log(logging.INFO if verbose and self.progress is None else logging.DEBUG, text)


def _describe(faults) -> str:
    return "; ".join(f"{f.kind} on rank {f.rank} at step {f.step} ({f.phase})" for f in faults)


def seed_everything(seed: int) -> None:
    """Seed torch's global generator the same on every rank (fresh weights are drawn from it)."""
    torch.manual_seed(seed)
