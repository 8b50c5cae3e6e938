"""The training loop of one rank: data, steps, goodput accounting, records, the final weights.

Everything the loop needs comes in through the constructor (engine, recorder, clock), so tests can hand it fakes.
Recovery seam: the engine is the `FaultTolerantEngine` a user's own loop gets (`ntp_ds.fault_tolerant`), whose
injector sits on the engine's phase boundaries. When a step raises, `_recover` hands the error to
`engine.recover(error)`, which goes on with the recovered engine (the handle stays the same) and returns the
`recovery` event's fields; the trainer accounts the time (detection, recovery, redone work), runs the interrupted
step again and records the event in events.jsonl and W&B once that step has completed (with the time from the
failure to it). Joiners come in through `engine.take_joiners` after a completed step. On a plain `NTPEngine` (no
job store to coordinate through) an error ends the run.

With `parallel.straggler.enabled`, the handle measures each micro-batch's work and, every `every_steps` completed
steps, re-plans the batch across replicas (`ntp_ds.engine.balancer`); `engine.finish_step(step)` returns that
re-plan, which the trainer records as a `replan` event. A `slow` fault stretches this rank's micro-batches
(`injector.stretch`, inside the handle's `backward`).

Stop requests (SIGINT, SIGTERM) come in through `stop`: after every completed step the trainer asks whether the job
stops there (every rank gets the same answer, `ntp_ds.supervise.stop`); a stopped run writes the weights and checkpoint
of that step, a `run_stopped` event and a summary with status `stopped`. A run started from a checkpoint
(`existing_run=resume`: the engine has loaded it, so `engine.global_steps` is its step) records `run_resumed`
instead of `run_start` and goes on from the next step.

One rank writes the run's records (`is_writer`): TP rank 0 of an anchor replica (the lowest launch rank among
them, so a worker that joins never takes the role from one that trained all along). Its step timings stand for the job's (an anchor runs the full DeepSpeed step; a
contributor waits on its anchor). A recovery can move that role (the writer died, or its replica became a
contributor): the old writer, if alive, hands its records over, and the new one resumes them through
`switch_writer(True)`, appending to the same files and W&B run.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist

from ntp_ds.batch.loader import GlobalBatchSampler, replica_micro_batches
from ntp_ds.comm import wire
from ntp_ds.goodput import GoodputMeter, StepTiming, split_failure_time
from ntp_ds.run.config import RunConfig
from ntp_ds.run.records import CHECKPOINTS, FINAL_WEIGHTS, RunRecorder
from ntp_ds.supervise.stop import signal_name

log = logging.getLogger("ntp_ds.train")


TRAINER_FIELDS = ("detection_s", "degrees_before", "degrees_after")
"""Fields of a recovery's event that the trainer measures itself (on its own clock) and records."""


class LiveEngine(Protocol):
    """What the trainer uses of a `FaultTolerantEngine` beyond the DeepSpeed engine's API."""

    members: tuple[int, ...]
    injector: Any
    """Fault injection (`ntp_ds.control.FaultInjector`); its `stretch` slows a `slow` fault's rank."""

    def recover(self, error: BaseException) -> dict: ...

    def take_joiners(self, completed: int, num_steps: int | None = None) -> dict | None: ...


class Stop(Protocol):
    """Stop requests (`ntp_ds.supervise.stop.StopSignals`): whether the job stops once this rank completed `step`."""

    signal: int | None

    def should_stop(self, completed: int, publish: bool = False) -> bool: ...


class Trainer:
    """Run `cfg.train.steps` steps of this rank's replica and account their goodput."""

    def __init__(self, cfg: RunConfig, engine: LiveEngine | Any, recorder: RunRecorder, *, run_dir: Path,
                 switch_writer: Callable[[bool], RunRecorder] | None = None, stop: Stop | None = None,
                 clock: Callable[[], float] = time.perf_counter, progress=None, startup_s: float = 0.0,
                 joined: bool = False):
        self.cfg, self.engine, self.recorder, self.run_dir = cfg, engine, recorder, Path(run_dir)
        self.live = callable(getattr(type(engine), "recover", None))
        """The engine recovers from failures (a `FaultTolerantEngine`); on a plain engine an error ends the run."""
        self.joined = joined
        """This rank joined the running job (the members record the join; it starts no clock with them)."""
        self.startup_s = startup_s
        self.stop = stop
        """Asked after every completed step whether the job stops there (SIGINT/SIGTERM, `ntp_ds.supervise.stop`)."""
        self.stopped_by: int | None = None
        """Number of the signal the run stopped for, if it stopped before `train.steps`."""
        self.clock, self.progress = clock, progress
        self.switch_writer = switch_writer
        """After a recovery, called with True when this rank becomes the writer (returns the resumed records) and
        with False when it stops being the writer (returns the recorder of a rank that writes nothing)."""
        self.dataset = cfg.data.dataset(cfg.model.model_config().vocab_size)
        self.sampler = GlobalBatchSampler(len(self.dataset), cfg.data.seed)
        self.meter = GoodputMeter(cfg.allocated_gpus, cfg.parallel.tp)
        self.step = int(getattr(engine, "global_steps", 0))
        """Last completed step: 0 for a new run, the checkpoint's step for a resumed one."""
        self.resumed_from = self.step
        self.recoveries = 0
        self.first_loss = self.last_loss = math.nan
        self.global_loss: float | None = None
        """Mean loss of the last step over the whole global batch (None without a control group to sum it over)."""
        self._last_end = clock()
        self._unfinished: dict | None = None
        """The latest recovery's event, recorded once the step it interrupted has completed."""
        self.step_samples: list[int] = []
        """Samples each replica ran in the last step (a re-plan at its end changes the next step's)."""
        self._replan: dict | None = None
        """The `replan` event of the last step, recorded after its metrics."""
        self._losses: tuple[int, list] = (0, [])
        """(step, [(loss, samples)]) of the micro-batches the step under way has run its forward on; after a recovery
        in which this rank's replica kept its finished backward (`kept_grads_step`), the step's rest adds to them."""
        self._stall: float | None = None
        """`healthy_stall_s` of the recovery whose re-run step just completed (None: no such step)."""

    @property
    def rank(self) -> int:
        """Global rank in the current generation's process group."""
        return dist.get_rank() if dist.is_initialized() else 0

    @property
    def writer(self) -> bool:
        return is_writer(self.engine, self.engine.members if self.live else None)

    # -- topology ----------------------------------------------------------------------------------------------
    @property
    def degrees(self) -> tuple[int, ...]:
        """TP degree of each replica of the current topology (a dropped replica's successors move up), then a 0 for
        each configured replica dropped."""
        live = tuple(self.engine.ntp_groups.topology.degrees)
        return live + (0,) * (self.cfg.parallel.replicas - len(live))

    # -- loop --------------------------------------------------------------------------------------------------
    def train(self) -> dict:
        """Run every step, write the final weights and return the summary."""
        if not self.joined:
            self._announce()
        if dist.is_initialized() and not self.joined:
            wire.barrier()  # start the clocks together, after rank 0's W&B and file set-up
        self._last_end = self.clock()
        if self.stop is not None:  # a request made during start-up: stop after the first step
            self.stop.should_stop(self.step, publish=self.writer)
        log_every = max(1, self.cfg.train.steps // 10)
        step = self.step + 1
        while step <= self.cfg.train.steps:
            try:
                timing, loss = self.train_step(step)
            except Exception as error:  # a peer or device failure; without recovery it ends the run
                step = self._recover(step, error)
                continue
            self.step, self.last_loss = step, loss
            self.first_loss = loss if math.isnan(self.first_loss) else self.first_loss
            metrics = {**self.meter.record_step(timing), "loss": loss}
            if self.global_loss is not None:
                metrics["global_loss"] = self.global_loss
            if self.cfg.parallel.straggler.enabled:
                metrics.update({f"samples/replica_{r}": n for r, n in enumerate(self.step_samples)})
            self.recorder.step(metrics)
            if self._replan is not None:
                self.recorder.event("replan", step, **self._replan)
                self._replan = None
            self._record_recovery(step)
            if self.stop is not None and self.stop.should_stop(step, publish=self.writer) \
                    and step < self.cfg.train.steps:
                self.stopped_by = self.stop.signal
                self._report_step(metrics, verbose=True)
                break
            self._report_step(metrics, verbose=step % log_every == 0 or step == self.cfg.train.steps)
            every = self.cfg.train.checkpoint_every
            if every and step % every == 0 and step < self.cfg.train.steps:
                self.save_checkpoint()
            if step < self.cfg.train.steps:
                step = self._grow(step)
            step += 1
        if self.cfg.train.save_final:
            self.save_final()
        if self.cfg.train.save_checkpoint:
            self.save_checkpoint()
        return self.finish()

    def train_step(self, step: int) -> tuple[StepTiming, float]:
        """Run one optimizer step over this replica's micro-batches; return its timing and mean loss."""
        engine, clock = self.engine, self.clock
        compute_s = comm_s = 0.0
        if not (self._losses[0] == step and getattr(engine, "kept_grads_step", None) == step):
            self._losses = (step, [])  # else its replica kept its backward: those micro-batches' losses stay
        losses = self._losses[1]
        plan, replica = engine.batch_plan, engine.ntp_groups.replica
        for batch in replica_micro_batches(self.dataset, self.sampler, plan, replica, step - 1):
            t = clock()
            loss = engine(batch)  # the handle measures each micro-batch's work (and a `slow` fault stretches it)
            losses.append((loss.detach(), int(batch["input_ids"].shape[0])))  # before a failure in its backward
            engine.backward(loss)
            t2 = clock()
            engine.step()
            end = clock()
            compute_s, comm_s = compute_s + t2 - t, comm_s + end - t2
        loss_sum = sum(float(value) * n for value, n in losses)
        samples = sum(n for _, n in losses)
        self.global_loss = self._global_loss(loss_sum, samples)
        self._stall = self._healthy_stall()
        self.step_samples = [part.samples for part in plan.replicas]
        if self.live:
            self._replan = self.engine.finish_step(step)
            if self._replan is not None and self.writer:
                r = self._replan
                log.warning("step %d: re-planned the batch from measured work per step %s s: samples per replica %s "
                            "-> %s (predicted step %.3f -> %.3f s)", step, _seconds(r["step_work_s"]),
                            r["samples_before"], r["samples_after"], r["predicted_step_s_before"],
                            r["predicted_step_s_after"])
        end = clock()
        timing = StepTiming(step=step, wall_s=max(end - self._last_end, compute_s + comm_s), compute_s=compute_s,
                            comm_wait_s=comm_s, tokens=plan.global_samples * self.cfg.data.seq_len,
                            degrees=self.degrees)
        self._last_end = end
        return timing, loss_sum / max(samples, 1)

    def _global_loss(self, loss_sum: float, samples: int) -> float | None:
        """Mean loss over every sample of the global batch, whichever replica ran it.

        `loss` is the mean over this replica's share, which a recovery changes under `preserve_global_batch`; this
        one is the failure-free run's up to reduction order. Every TP rank of a replica holds the replica's sums, so
        each adds 1/degree of them over the generation's control group.
        """
        if not (dist.is_initialized() and wire.has_control()):
            return None
        degree = len(self.engine.ntp_groups.tp_ranks)
        total, count = wire.sum_counts([loss_sum / degree, samples / degree])
        return total / count if count > 0 else None

    def _healthy_stall(self) -> float | None:
        """At the end of a recovery's re-run step: the longest time a rank of a replica that lost nothing spent
        outside training, from the failure to now (each rank's own clock; a max over the control group, once per
        failure); None at any other step."""
        pending = self._unfinished
        if pending is None or pending.get("kind") == "join" or not (dist.is_initialized() and wire.has_control()):
            return None
        mine = self.clock() - pending["failed_at"] if pending["healthy"] else 0.0
        return float(wire.control_all_reduce(torch.tensor([mine], dtype=torch.float64), "max", "healthy_stall")[0])

    # -- failures ----------------------------------------------------------------------------------------------
    def _recover(self, step: int, error: BaseException) -> int:
        """Hand a failed step to live recovery, account its time; return the step to run next.

        Without live recovery the error is raised again.
        """
        if not self.live:
            raise error
        failed_at = self.clock()
        before = self.degrees
        members = self.engine.members
        my_replica = {members[r] for r in self.engine.ntp_groups.tp_ranks} if members else None
        fields = self.engine.recover(error)  # leaves the job on this rank's own device error; raises a bug as is
        self._adopted()  # a failure while re-running a step: the previous recovery is recorded as it is
        resumed_at = self.clock()
        lost_in_step = failed_at - self._last_end
        detection, recovery, redone = split_failure_time(lost_in_step, resumed_at - failed_at,
                                                         fields.get("detection_s", 0.0))
        fields = {k: v for k, v in fields.items() if k not in TRAINER_FIELDS}
        for bucket, seconds in (("detection", detection), ("recovery", recovery), ("redone", redone)):
            self.meter.record_lost(bucket, seconds, active_gpus=sum(self.degrees))
        self.recoveries += 1
        rerun = getattr(self.engine, "global_steps", step - 1) + 1
        event = {"detection_s": detection, "recovery_s": recovery, "redone_s": redone,
                 "degrees_before": list(before), "degrees_after": list(self.degrees), "error": _first_line(error),
                 **fields}
        healthy = my_replica is not None and not my_replica & set(fields.get("dead", ()))
        self._unfinished = {"step": step, "failed_at": failed_at - min(detection, lost_in_step), "event": event,
                            "healthy": healthy}
        if self.writer:
            log.warning(describe_recovery(step, event))
        if rerun != step:
            log.warning("the recovered state has completed %d steps: going on with step %d", rerun - 1, rerun)
        self._last_end = resumed_at
        return rerun

    def _grow(self, step: int) -> int:
        """Take in the workers that join at this boundary (if any do); return the last completed step (a failure at
        the boundary is recovered like a failed step, which re-runs nothing)."""
        if not self.live:
            return step
        started, before = self.clock(), self.degrees
        try:
            fields = self.engine.take_joiners(step, self.cfg.train.steps)
        except Exception as error:
            return self._recover(step + 1, error) - 1
        if fields is None:
            return step
        self._adopted()
        self.meter.record_lost("recovery", self.clock() - started, active_gpus=sum(self.degrees))
        event = {**{k: v for k, v in fields.items() if k not in TRAINER_FIELDS},
                 "degrees_before": list(before), "degrees_after": list(self.degrees)}
        self._unfinished = {"step": step, "failed_at": started, "event": event, "kind": "join"}
        if self.writer:
            log.warning(describe_join(step, event))
        self._last_end = self.clock()
        return step

    def _adopted(self) -> None:
        """Go on in a new topology (after a recovery or a grow): the records with whoever writes now, the pending
        recovery event recorded (the handle measures the new topology's work afresh)."""
        self._replan = None
        self._move_records()
        self._record_recovery(None)

    def _move_records(self) -> None:
        """Hand the records over, or take them over, when a recovery moved the writer's role."""
        if self.switch_writer is None or self.writer == self.recorder.active:
            return
        if self.writer:
            log.warning("this rank takes over the run's records in %s (the writer died or its replica degraded)",
                        self.run_dir)
        else:
            self.recorder.hand_over()
            if self.progress is not None:
                self.progress.close()
                self.progress = None
        self.recorder = self.switch_writer(self.writer)

    def _record_recovery(self, completed_step: int | None) -> None:
        """Record the pending recovery event; `completed_step` is the first step completed after the failure."""
        pending, self._unfinished = self._unfinished, None
        if pending is None:
            return
        event, kind = pending["event"], pending.get("kind", "recovery")
        if completed_step is not None and kind == "join":
            event["boundary_to_step_s"] = self.clock() - pending["failed_at"]
            requested = event.pop("requested_wall", None)
            if requested:  # the joiner's clock: another host's, so only as good as the hosts' clock sync
                event["request_to_step_s"] = time.time() - min(requested)
        elif completed_step is not None:
            event["failure_to_step_s"] = self.clock() - pending["failed_at"]
            if self._stall is not None:
                event["healthy_stall_s"] = self._stall
            if self.writer:
                log.warning("step %d completed %.2f s after the failure", completed_step, event["failure_to_step_s"])
        self.recorder.event(kind, pending["step"], **event)

    def _announce(self) -> None:
        """Record the start of the run, or of a resumed segment of it (`run_resumed`, at the checkpoint's step)."""
        cfg = self.cfg
        faults = cfg.fault_schedule().faults
        self.recorder.event("run_resumed" if self.resumed_from else "run_start", self.step,
                            degrees=list(self.degrees), world_size=cfg.world_size,
                            allocated_gpus=cfg.allocated_gpus, live_recovery=self.live,
                            faults=[f.as_dict() for f in faults])
        if self.resumed_from and self.writer:
            log.info("resuming the run in %s from its checkpoint at step %d", self.run_dir, self.resumed_from)
        if faults and self.writer:
            log.info("faults scheduled: %s", _describe(faults))

    # -- end of run --------------------------------------------------------------------------------------------
    def save_final(self) -> Path:
        """Write the consolidated weights (HF form) to RUN_DIR/final; every rank takes part."""
        path = self.run_dir / FINAL_WEIGHTS
        t = self.clock()
        self.engine.save_pretrained(path)
        if dist.is_initialized():
            wire.barrier()
        self.meter.record_lost("checkpoint", self.clock() - t, active_gpus=sum(self.degrees))
        if self.writer:
            log.info("final weights: %s", path)
        return path

    def save_checkpoint(self) -> Path:
        """Write DeepSpeed's checkpoint of this step to RUN_DIR/checkpoints (what `existing_run=resume` loads)."""
        path = self.run_dir / CHECKPOINTS
        t = self.clock()
        self.engine.save_checkpoint(path)
        self.meter.record_lost("checkpoint", self.clock() - t, active_gpus=sum(self.degrees))
        if self.writer:
            log.info("checkpoint of step %d: %s", self.step, path)
        return path

    def finish(self) -> dict:
        self._record_recovery(None)
        status = "stopped" if self.stopped_by is not None else "finished"
        summary = {**self.meter.summary(), "status": status, "last_step": self.step,
                   "resumed_from_step": self.resumed_from, "first_loss": self.first_loss, "final_loss": self.last_loss,
                   "degrees_end": list(self.degrees),
                   "world_size": self.cfg.world_size, "model": self.cfg.model.name, "recipe": self.cfg.recipe,
                   "startup_s": self.startup_s, "recoveries": self.recoveries,
                   "live_recovery": self.live,
                   "faults_scheduled": len(self.cfg.fault_schedule().faults), "run_dir": str(self.run_dir),
                   "final_weights": str(self.run_dir / FINAL_WEIGHTS) if self.cfg.train.save_final else None,
                   "checkpoint": str(self.run_dir / CHECKPOINTS) if self.cfg.train.save_checkpoint else None}
        if self.stopped_by is not None:
            name = signal_name(self.stopped_by)
            summary["stopped_by"] = name
            self.recorder.event("run_stopped", self.step, reason=f"stopped by {name}", signal=name,
                                degrees=list(self.degrees))
        else:
            self.recorder.event("run_end", self.step, degrees=list(self.degrees))
        self.recorder.finish(summary)
        if self.progress is not None:
            self.progress.close()
        if self.writer and self.stopped_by is not None:
            written = [w for w, on in (("weights", self.cfg.train.save_final),
                                       ("checkpoint", self.cfg.train.save_checkpoint)) if on] + ["summary"]
            resume = ("continue with existing_run=resume" if self.cfg.train.save_checkpoint
                      else "no checkpoint (train.save_checkpoint=false): it cannot be resumed")
            log.warning("stopped by %s after step %d of %d: %s written; %s", signal_name(self.stopped_by), self.step,
                        self.cfg.train.steps, ", ".join(written), resume)
        elif self.writer:
            log.info("done: %d steps, goodput %.3f, %.2f of failure-free, %.0f tokens/s, active GPUs %.0f%%, "
                     "loss %.4f at the first step, %.4f at the last (start-up %.1f s, not counted)", summary["steps"],
                     summary["goodput"], summary["throughput_ratio"], summary["tokens_per_s"],
                     100 * summary["active_gpu_fraction"], self.first_loss, self.last_loss, self.startup_s)
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


def is_writer(engine, members=None) -> bool:
    """Whether this rank writes the run's records: TP rank 0 of an anchor replica; with `members` (launch ranks in
    global-rank order), of the one whose launch rank is lowest, so that a worker that just joined (a fresh launch
    rank) never takes the records from a rank that has trained all along; without, of the first anchor replica."""
    g = engine.ntp_groups
    if g.tp_rank != 0 or g.replica not in g.plan.anchors:
        return False
    if members is None:
        return g.replica == g.plan.anchors[0]
    firsts = [g.topology.ranks_of(a)[0] for a in g.plan.anchors]
    return members[g.rank] == min(members[r] for r in firsts)


def _describe(faults) -> str:
    return "; ".join(f"{_kind(f)} on rank {f.rank} at step {f.step} ({f.phase})" for f in faults)


def _kind(fault) -> str:
    return f"slow (x{fault.factor:g})" if fault.kind == "slow" else fault.kind


def _seconds(values) -> str:
    return "[" + ", ".join(f"{v:.3f}" for v in values) + "]"


def _first_line(error: BaseException) -> str:
    """The error's type and first sentence, without a source-location prefix such as `[.../pair.cc:553] `."""
    text = str(error).strip().splitlines()[0] if str(error).strip() else ""
    if text.startswith("[") and "] " in text:
        text = text.split("] ", 1)[1]
    return f"{type(error).__name__}: {text.split('. ')[0]}"[:200]


def describe_recovery(step: int, event: dict) -> str:
    """One line for the log: who died, the degrees, where the time went, the bytes moved, whether it was lossless."""
    dead = event.get("dead") or []
    lost = f" from the loss of rank{'s' if len(dead) > 1 else ''} {', '.join(map(str, dead))}" if dead else ""
    phases = "".join(f", {k.removesuffix('_s')} {event[k]:.2f} s" for k in ("agreement_s", "regroup_s", "reshard_s")
                     if k in event)
    parts = [f"recovered at step {step}{lost}", f"TP degrees {event['degrees_before']} -> {event['degrees_after']}",
             f"detection {event['detection_s']:.2f} s, recovery {event['recovery_s']:.2f} s{phases}, redone "
             f"{event['redone_s']:.2f} s"]
    if "bytes_moved" in event:
        rebalanced = (f", {_bytes(event['rebalanced_bytes'])} moved between survivors to even out work"
                      if event.get("rebalanced_bytes") else "")
        parts.append(f"moved {_bytes(event['bytes_moved'])} of parameters (lost shard "
                     f"{_bytes(event.get('lost_shard_bytes', 0))}{rebalanced}) and "
                     f"{_bytes(event.get('optimizer_bytes_moved', 0))} of optimizer state")
    if event.get("rolled_back"):
        parts.append(f"step {step} was half applied or its copies lost: rolled back to step {step - 1}")
    if "lossless" in event:
        parts.append("lossless" if event["lossless"] else "NOT lossless: some state had no surviving copy")
    return "; ".join(parts)


def describe_join(step: int, event: dict) -> str:
    """One line for the log: who joined, the degrees, the time, the bytes received against the joiners' shards."""
    joined = event.get("joined") or []
    return (f"rank{'s' if len(joined) > 1 else ''} {', '.join(map(str, joined))} joined after step {step}: TP "
            f"degrees {event['degrees_before']} -> {event['degrees_after']} in {event['grow_s']:.2f} s; received "
            f"{_bytes(event.get('bytes_moved', 0))} of parameters (the joiners' shards: "
            f"{_bytes(event.get('joiner_shard_bytes', 0))}) and {_bytes(event.get('optimizer_bytes_moved', 0))} of "
            f"optimizer state; {'lossless' if event.get('lossless') else 'NOT lossless'}")


def _bytes(n: float) -> str:
    if n < 1024:
        return f"{n:.0f} B"
    for unit in ("KiB", "MiB", "GiB"):
        n /= 1024
        if n < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}"


def seed_everything(seed: int) -> None:
    """Seed torch's global generator the same on every rank (fresh weights are drawn from it)."""
    torch.manual_seed(seed)
