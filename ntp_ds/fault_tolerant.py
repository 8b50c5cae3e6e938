"""Fault tolerance in the caller's own training loop, and the one recovery seam of `ntp-ds train`.

`ntp_ds.initialize(model=..., config=..., ntp={..., "fault_tolerance": True})` returns a `FaultTolerantEngine`:
the DeepSpeed engine API (`engine(batch)`, `backward`, `step`, checkpoints, every attribute of the current
`NTPEngine`) plus three entries that make a DeepSpeed loop survive a lost GPU:

    for step in engine.train_steps(num_steps):          # yields again a step that a failure interrupted
        with engine.attempt(step):                        # a peer's failure in here is recovered, not raised
            for batch in engine.micro_batches(dataset):   # this replica's share of the step's global batch
                loss = engine(batch)                      # or a loss of your own on engine.logits(batch)
                engine.backward(loss)
                engine.step()

The handle stays valid across recoveries and joins: each of them builds a new `NTPEngine` for the new topology, and
the handle goes on with it, so the caller's reference never goes stale (the inner engine, `engine.engine`, must not
be kept across steps). Between steps it takes in workers that join (a repaired GPU), re-plans the batch away from a
slow replica (`ntp.straggler`), stops the job cleanly at one step every rank agrees on after SIGINT or SIGTERM, and
reports every event to `on_event(kind, step, fields)`. A rank whose own device fails leaves the job (exit status
0); an error of the caller's own code is raised as is. `recover`, `finish_step` and `take_joiners` are the pieces
`train_steps` and `attempt` are made of, for a loop that calls them itself (`ntp_ds.run.trainer.Trainer` does).
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator

from ntp_ds.batch.loader import GlobalBatchSampler, replica_micro_batches
from ntp_ds.comm import wire
from ntp_ds.engine.balancer import StepWork
from ntp_ds.engine.config import ConfigError, NTPConfig, env_world_size
from ntp_ds.envs import JOIN_ENV, JOIN_STEP_ENV, RANK, WORLD_SIZE
from ntp_ds.supervise.sentinel import become_sentinel, under_foreign_launcher

log = logging.getLogger(__name__)

EventCallback = Callable[[str, int, dict], None]
"""`on_event(kind, step, fields)`: kind is "recovery", "join", "stop" or "leave"; step the last completed step."""


def initialize(model, config, ntp=None, optimizer=None, lr_scheduler=None, seq_len: int | None = None, store=None,
               on_event: EventCallback | None = None) -> FaultTolerantEngine:
    """Build this rank's engine under live recovery, or, in a worker its launcher started to join a running job
    (NTP_JOIN), receive it from the job's members. Every check runs before a process group is built."""
    from ntp_ds.control.faults import FaultSchedule, send_fault
    from ntp_ds.control.store import job_store
    from ntp_ds.testing import register_test_backend

    register_test_backend()
    ntp = NTPConfig.from_any(ntp)
    ft = ntp.fault_tolerance
    ntp.validate(env_world_size())
    world = env_world_size() or 1
    try:
        schedule = FaultSchedule.from_config(list(ft.faults), world, where="ntp.fault_tolerance.faults")
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if under_foreign_launcher():
        # deepspeed and torchrun act on a worker's death: this process supervises the worker, started again below it.
        sys.exit(become_sentinel(schedule.repairs()))
    hosts_store = False
    if store is None:
        store, hosts_store = job_store(ntp.timeout_s)
    if store is None:
        raise ConfigError("ntp.fault_tolerance needs the job's coordination store: start the job with ntp-ds launch "
                          "(NTP_STORE), torchrun or deepspeed (rank 0 hosts it at MASTER_PORT+1), or pass store=")
    if schedule.repairs() and int(os.environ.get(RANK, "0")) == 0 and not os.environ.get(JOIN_ENV) \
            and not hosts_store:
        # `ntp-ds launch` starts a replacement for a repaired rank's worker; it learns of repairs sent to the job.
        for fault in schedule.faults:
            if fault.kind == "repair":
                send_fault(store, fault)
    return start(model, config, ntp, store, schedule, hosts_store=hosts_store, optimizer=optimizer,
                 lr_scheduler=lr_scheduler, seq_len=seq_len, on_event=on_event)


def start(model, config, ntp: NTPConfig, store, schedule, *, hosts_store: bool = False, optimizer=None,
          lr_scheduler=None, seq_len: int | None = None, on_event: EventCallback | None = None,
          stop_on_signals: bool = True) -> FaultTolerantEngine:
    """Build this rank's engine on the job's `store` and put it under live recovery, with the liveness bounds of
    `ntp.fault_tolerance` and the faults of `schedule` (a `FaultSchedule`) armed; a worker its launcher started to
    join a running job (NTP_JOIN) receives its engine from the members instead (`JoinRefused`, `JoinFailed` or
    `JoinTimeout` when it cannot). `ntp-ds train` starts its ranks through here too."""
    from ntp_ds.control.faults import FaultInjector
    from ntp_ds.engine.initialize import initialize as build
    from ntp_ds.engine.initialize import prepare
    from ntp_ds.recovery.manager import Recovery
    from ntp_ds.testing import register_test_backend

    register_test_backend()
    ft = ntp.fault_tolerance
    rank = int(os.environ.get(RANK, "0"))
    liveness = dict(heartbeat_interval_s=ft.heartbeat_interval_s, heartbeat_timeout_s=ft.heartbeat_timeout_s,
                    hang_timeout_s=ft.hang_timeout_s, last_good_dir=ft.last_good_dir)
    injector = FaultInjector(schedule, rank, store)
    if os.environ.get(JOIN_ENV):
        spec, _ = prepare(model, config, ntp, optimizer, lr_scheduler, seq_len)
        recovery = Recovery.join(spec, store, rank, not_before=int(os.environ.get(JOIN_STEP_ENV, "0")),
                                 timeout_s=ft.join_timeout_s, on_phase=injector.check, **liveness)
        engine = recovery.engine
    else:
        engine = build(model, config, ntp, optimizer, lr_scheduler, seq_len, store)
        recovery = Recovery(engine, store, rank, **liveness)
    recovery.expect_joiners(schedule.repairs().values())  # a repair takes effect at its step
    # Faults sent to the running job reach it with an alarm: the training thread reads the store only then.
    recovery.heartbeat.on_alarm.append(injector.listen(lambda: recovery.heartbeat.hears_alarms))
    return FaultTolerantEngine(engine, recovery, injector=injector, on_event=on_event, hosts_store=hosts_store,
                               stop_on_signals=stop_on_signals)


class FaultTolerantEngine:
    """A DeepSpeed engine handle that outlives recoveries and joins (see the module's docstring).

    Attributes the handle does not define are read from the current `NTPEngine`.
    """

    def __init__(self, engine, recovery, *, injector=None, on_event: EventCallback | None = None,
                 hosts_store: bool = False, stop_on_signals: bool = True):
        self._engine, self.recovery, self.injector = engine, recovery, injector
        self.on_event = on_event
        """Called with (kind, step, fields) for every recovery, join, stop and leave of this rank."""
        self.hosts_store = hosts_store
        self.events: list[dict] = []
        """Every event this rank saw, as `{"kind", "step", **fields}`."""
        self.stopped_by: int | None = None
        """Number of the signal the job stopped for, if `train_steps` ended early."""
        self._stop = None
        if stop_on_signals and threading.current_thread() is threading.main_thread():
            from ntp_ds.supervise.stop import StopSignals

            self._stop = StopSignals(recovery.store).install()
        self._closed = False
        self.work = StepWork()
        """This rank's micro-batch work per step (`work.last_step`) and the straggler-aware re-plans it feeds."""
        self._attach()

    # -- the engine's API ----------------------------------------------------------------------------------------
    @property
    def engine(self):
        """The current NTPEngine (a recovery or a join replaces it: use it within a step, never keep it)."""
        return self._engine

    def __getattr__(self, name: str):
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self._engine, name)

    def __call__(self, *inputs, **kwargs):  # a call looks its method up on the class, not through __getattr__
        self.work.forward(self._engine, _samples(inputs, kwargs))
        return self._engine(*inputs, **kwargs)

    def logits(self, batch: dict):
        """The micro-batch's full-vocabulary logits, for a loss function of the caller's own (`NTPEngine.logits`)."""
        self.work.forward(self._engine, _samples((batch,), {}))
        return self._engine.logits(batch)

    def backward(self, loss, *args, **kwargs):
        """DeepSpeed's backward; the micro-batch's work (from its forward, without waits on other replicas) is
        measured for the straggler-aware plan."""
        out = self._engine.backward(loss, *args, **kwargs)
        self.work.backward_done(self._engine, self.injector.stretch if self.injector is not None else None)
        return out

    def finish_step(self, completed: int) -> dict | None:
        """Account the step just completed (`train_steps` calls it; a loop of its own calls it after each step):
        its measured work and, with `ntp.straggler` on, at the end of each window the re-plan, returned as the
        `replan` event's fields (and reported to `on_event`), or None. A failure in its exchange is raised (give it
        to `recover`)."""
        fields = self.work.end_step(self._engine)
        if fields is not None:
            log.info("step %d: re-planned the batch: samples per replica %s -> %s", completed,
                     fields["samples_before"], fields["samples_after"])
            self._event("replan", completed, **fields)
        return fields

    @property
    def members(self) -> tuple[int, ...]:
        """Launch ranks of the current generation's members, in global-rank order."""
        return self.recovery.members

    # -- the loop ------------------------------------------------------------------------------------------------
    def train_steps(self, num_steps: int) -> Iterator[int]:
        """Yield the index of each step to run (the steps completed so far, DeepSpeed's `global_steps`) until
        `num_steps` are complete. A step a failure interrupted is yielded again (after a roll-back, the step before
        it too); joiners are taken in between steps; after SIGINT or SIGTERM the job stops at a step every rank
        agrees on (`stopped_by` then holds the signal). At the end every rank has finished its last step."""
        if isinstance(num_steps, bool) or not isinstance(num_steps, int) or num_steps < 0:
            raise ValueError(f"num_steps={num_steps!r} must be a non-negative integer")
        while self._engine.global_steps < num_steps:
            step = self._engine.global_steps
            self.work.begin_step()
            yield step
            if self._engine.global_steps <= step:
                continue  # the attempt failed and was recovered: run the step again
            done = self._engine.global_steps
            try:
                self.finish_step(done)
            except Exception as error:  # a failure in the work exchange: recovered like one inside a step
                self.recover(error)
                continue
            if self._stop is not None and self._stop.should_stop(done) and done < num_steps:
                self.stopped_by = self._stop.signal
                self._event("stop", done, signal=self._stop.signal)
                break
            if done < num_steps:
                try:
                    self.take_joiners(done, num_steps)
                except Exception as error:  # a failure at the boundary: recovered like one inside a step
                    self.recover(error)
        wire.barrier()  # every rank is done with the steps' collectives before any stops watching its peers

    @contextlib.contextmanager
    def attempt(self, step: int | None = None):
        """Run one step's work; a failure of a peer (or of a collective) in it is recovered: the handle goes on with
        the recovered engine and `train_steps` yields the step to run next. This rank's own device error makes it
        leave the job; any other error is raised."""
        if step is not None and step != self._engine.global_steps:
            raise ValueError(f"attempt(step={step}) but the engine has completed {self._engine.global_steps} steps: "
                             "attempt the step train_steps yields")
        try:
            yield self
        except Exception as error:
            self.recover(error)

    def micro_batches(self, dataset, seed: int = 0) -> Iterator[dict]:
        """This replica's micro-batches of the current step's global batch (DeepSpeed's `train_batch_size`), drawn
        from `dataset` (a map-style dataset of dicts of equal-shaped tensors with `input_ids` and `labels`) in an
        order every rank agrees on (shuffled per epoch by `seed`). Each carries the global batch's token count, which
        weights its loss."""
        engine = self._engine
        return replica_micro_batches(dataset, GlobalBatchSampler(len(dataset), seed), engine.batch_plan,
                                     engine.ntp_groups.replica, engine.global_steps)

    def close(self) -> None:
        """Leave the job (every rank calls it, after its last collective: after `train_steps` and whatever the caller
        saves): stop judging the peers, meet them, stop beating and record this rank's exit. The rank that hosts the
        store waits for the others to leave."""
        from ntp_ds.control.liveness_store import mark_exited, outlive_peers

        if self._closed:
            return
        self._closed = True
        if self._stop is not None:
            self._stop.uninstall()
        # A peer that met us and left would otherwise be declared dead by a watcher still running here.
        self.recovery.heartbeat.watch([])
        if self._engine is not None:
            self._engine.close()  # the transfers in flight complete, then every rank meets
        else:
            wire.barrier()
        self.recovery.close(finished=True)
        wire.teardown()
        store = self.recovery.store
        mark_exited(store, self.recovery.rank, "finished", alarm=False)
        if self.hosts_store:
            outlive_peers(store, self.recovery.rank, int(os.environ.get(WORLD_SIZE, "1")),
                          self.recovery.heartbeat_timeout_s)

    def __enter__(self) -> FaultTolerantEngine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- recoveries and joins ------------------------------------------------------------------------------------
    def recover(self, error: BaseException) -> dict:
        """Go on after `error` broke a step (what `attempt` does; `ntp-ds train`'s Trainer calls it directly).

        This rank's own device error (`DeviceError`) makes it leave the job (`QuiescedExit`, exit status 0); a peer's
        failure or a broken collective is recovered: the survivors agree on the dead, regroup and reshard in memory,
        the handle goes on with the new engine and the `recovery` event's fields are returned (who died, the
        degrees, each phase's seconds, the bytes moved, `detection_s` from the injected fault's firing where one
        fired on this host); any other error is raised as is. `RecoveryImpossible` (no replica left, or some state
        without a surviving copy) propagates."""
        from ntp_ds.comm.failures import DeviceError
        from ntp_ds.control.faults import detection_from_faults, fired_faults
        from ntp_ds.recovery.manager import RecoveryImpossible

        if isinstance(error, RecoveryImpossible):
            raise error
        step = self._engine.global_steps
        if isinstance(error, DeviceError):
            log.warning("rank %d: %s; leaving the job (exit 0), the others go on without this rank",
                        self.recovery.rank, error)
            self._event("leave", step, reason=str(error))
            self.recovery.leave(f"device error at step {step + 1}")
        if not wire.is_wire_failure(error):
            raise error  # the caller's own error: it ends this rank, and its peers recover without it
        noticed = time.monotonic()
        log.info("step %d failed (%s); recovering", step + 1, str(error).splitlines()[0] if str(error) else error)
        self._engine = None  # the recovery releases the old engine: nothing of it may stay reachable from here
        outcome = self.recovery.recover(error)
        self._adopt(outcome.engine)
        fields = dict(outcome.event)
        fired = fired_faults(self.recovery.store, fields.get("dead", ()))
        if fired:
            fields["faults"] = [f"{f['kind']} on rank {f['rank']} at step {f['at_step']} ({f['phase']})"
                                for f in fired]
        fields["detection_s"] = detection_from_faults(fired, noticed, fields.get("detection_s", 0.0))
        self._event("recovery", step, **fields)
        return dict(fields)

    def take_joiners(self, completed: int, num_steps: int | None = None) -> dict | None:
        """At the boundary after step `completed`, take in the workers that join (a repaired GPU, a spare); return
        the `join` event's fields, or None when nobody joins. A failure meanwhile is raised (give it to `recover`)."""
        outcome = self.recovery.at_boundary(completed, num_steps)
        if outcome is None:
            return None
        self._adopt(outcome.engine)
        self._event("join", completed, **outcome.event)
        return dict(outcome.event)

    def _adopt(self, engine) -> None:
        self._engine = engine
        self.work.new_topology()
        self._attach()

    def _attach(self) -> None:
        if self.injector is not None:
            self._engine.on_phase = self.recovery.on_phase = self.injector.check

    def _event(self, kind: str, step: int, **fields) -> None:
        self.events.append({"kind": kind, "step": step, **fields})
        if self.on_event is not None:
            self.on_event(kind, step, fields)


def _samples(inputs: tuple, kwargs: dict) -> int:
    """Samples of a forward's batch: a dict batch's, an `input_ids=` tensor's or the first positional tensor's."""
    batch = inputs[0] if len(inputs) == 1 and isinstance(inputs[0], dict) else kwargs
    ids = batch.get("input_ids", inputs[0] if inputs and not isinstance(inputs[0], dict) else None)
    return int(ids.shape[0]) if hasattr(ids, "shape") and len(ids.shape) else 0
