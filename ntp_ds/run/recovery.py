"""Live recovery behind the Trainer's seam: `ntp_ds.recovery.Recovery` and the fault injector, wired for one rank.

The Trainer asks `recover(trainer, step, error)` for the engine to go on with; this adapter turns the error into
what the recovery needs to hear:
- `DeviceError` (this rank's own device failed): the rank leaves the job (`QuiescedExit`, exit status 0) and the
  others recover without it;
- a peer or collective failure (`RuntimeError`, `TimeoutError`, `ConnectionError`): the survivors agree on the dead,
  regroup and reshard in memory, and the Trainer goes on with the returned engine;
- anything else is a bug and is raised as is.
`RecoveryImpossible` (no replica left, or some state has no copy on any survivor) propagates to the worker, which
stops the run with one line.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

from ntp_ds.comm import wire
from ntp_ds.control.faults import DeviceError, FaultInjector, clock_domain, fired_key
from ntp_ds.recovery.manager import Recovery
from ntp_ds.run.config import RunConfig
from ntp_ds.run.records import LAST_GOOD
from ntp_ds.run.trainer import RecoveryReport

log = logging.getLogger("ntp_ds.train")

TRAINER_FIELDS = ("detection_s", "degrees_before", "degrees_after")
"""Fields of the recovery's event that the Trainer measures itself (on its own clock) and records."""


class LiveRecovery:
    """One rank's live recovery and fault injector, as the Trainer calls them."""

    def __init__(self, recovery: Recovery, injector: FaultInjector | None = None):
        self.recovery, self.injector = recovery, injector
        if injector is not None:
            recovery.on_phase = injector.check

    @classmethod
    def start(cls, cfg: RunConfig, engine, rank: int, run_dir: Path) -> LiveRecovery:
        """Start beating to the job's store and arm this rank's scheduled faults (and those sent to the job)."""
        p = cfg.parallel
        recovery = Recovery(engine, engine.store, rank, heartbeat_interval_s=p.heartbeat_interval_s,
                            heartbeat_timeout_s=p.heartbeat_timeout_s, hang_timeout_s=p.hang_timeout_s,
                            last_good_dir=Path(run_dir) / LAST_GOOD)
        recovery.expect_joiners(cfg.fault_schedule().repairs().values())  # a repair takes effect at its step
        return cls(recovery, FaultInjector(cfg.fault_schedule(), rank, engine.store))

    @classmethod
    def join(cls, cfg: RunConfig, store, rank: int, run_dir: Path, not_before: int = 0) -> LiveRecovery:
        """Join the job running on `store` as launch rank `rank` (bounded by `parallel.join_timeout_s`); the
        recovery's engine is this rank's, ready for the step after the boundary it was taken in at."""
        from ntp_ds.engine.initialize import prepare

        p = cfg.parallel
        spec, _ = prepare(cfg.model.source(), cfg.ds_config(), p.ntp(), seq_len=cfg.data.seq_len)
        recovery = Recovery.join(spec, store, rank, not_before=not_before, timeout_s=p.join_timeout_s,
                                 heartbeat_interval_s=p.heartbeat_interval_s, heartbeat_timeout_s=p.heartbeat_timeout_s,
                                 hang_timeout_s=p.hang_timeout_s, last_good_dir=Path(run_dir) / LAST_GOOD)
        return cls(recovery, FaultInjector(cfg.fault_schedule(), rank, store))

    @property
    def events(self) -> list[dict]:
        return self.recovery.events

    @property
    def members(self) -> tuple[int, ...]:
        """Launch ranks of the generation's members, in global-rank order (who writes the records)."""
        return self.recovery.members

    def recover(self, trainer, step: int, error: BaseException) -> RecoveryReport:
        """Leave on this rank's own device error; otherwise recover and return the new engine with its event."""
        if isinstance(error, DeviceError):
            log.warning("rank %d: %s; leaving the job (exit 0), the others go on without this rank",
                        self.recovery.rank, error)
            self.recovery.leave(f"device error at step {step}")
        if not wire.is_wire_failure(error):
            raise error  # this rank's own error: it ends here, and its peers recover without it
        noticed = time.monotonic()
        outcome = self.recovery.recover(error)
        event = outcome.event
        fields = {k: v for k, v in event.items() if k not in TRAINER_FIELDS}
        fired = self._fired(event.get("dead", ()))
        if fired:
            fields["faults"] = [f"{f['kind']} on rank {f['rank']} at step {f['at_step']} ({f['phase']})" for f in fired]
        detection_s = detection_from_faults(fired, noticed, event.get("detection_s", 0.0))
        recovery_s = sum(event.get(k, 0.0) for k in ("agreement_s", "regroup_s", "reshard_s"))
        return RecoveryReport(outcome.engine, detection_s=detection_s, recovery_s=recovery_s, fields=fields)

    def at_boundary(self, trainer, step: int) -> RecoveryReport | None:
        """Take in the workers that join after step `step`; return the grown engine's report, or None."""
        outcome = self.recovery.at_boundary(step, trainer.cfg.train.steps)
        if outcome is None:
            return None
        fields = {k: v for k, v in outcome.event.items() if k not in TRAINER_FIELDS}
        return RecoveryReport(outcome.engine, detection_s=0.0, recovery_s=outcome.event["grow_s"], fields=fields)

    def _fired(self, dead) -> list[dict]:
        """The injected faults the dead ranks fired (with when they fired), if any."""
        store = self.recovery.store
        keys = [fired_key(r) for r in dead]
        return [json.loads(store.get(k)) for k in keys if store.check([k])]

    def close(self, finished: bool = False) -> None:
        """Stop beating (at the end of the run, or when it stops); once `finished`, answer the joiners still
        waiting."""
        self.recovery.close(finished)


def detection_from_faults(fired: list[dict], noticed: float, measured: float) -> float:
    """Detection time of a failure: from the injected faults' instant when they fired on this host (a monotonic clock
    this rank shares) to `noticed` (this rank's step failed, same clock); otherwise `measured`, the event's own
    figure (each reporter's silence on its own clock): clocks of different hosts are never subtracted."""
    if fired and all(f.get("clock") == clock_domain() for f in fired):
        return max(0.0, noticed - min(f["monotonic"] for f in fired))
    return measured
