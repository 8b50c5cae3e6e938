"""Fault injection: make a chosen rank crash, hang, lose its device or slow down at a chosen step and phase.

Faults come from the Hydra `fault` group (a schedule fixed at launch) or are sent to a running job through the
store (`send_fault`, as `ntp-ds inject` does). The engine calls `FaultInjector.check(step, phase)` at every phase
boundary; the injector polls the store at most every `poll_interval_s`, so a check costs no round trip in between.
A scheduled fault fires at exactly its step (a job resumed past it does not replay it); a fault sent to a running
job fires at the first boundary of its phase at or after its step. Each fault fires once.

A `slow` fault does not end the rank: from the boundary where it fires, each of the rank's micro-batches takes
`factor` times as long (the rank sleeps `factor - 1` times the forward and backward work it measured, as a throttled
device would compute), until another `slow` fault for the rank replaces the factor (1: full speed again).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from ntp_ds.comm.failures import DeviceError
from ntp_ds.control.keys import FAULT_COUNT_KEY, fault_key, fired_key
from ntp_ds.control.liveness_store import raise_alarm

log = logging.getLogger(__name__)

PHASES = ("forward", "backward", "grad_sync", "optimizer", "in_optimizer", "refresh", "recovery", "rendezvous",
          "groups", "transfer")
"""Where a fault fires: the phase boundaries of a step (`optimizer`: before the ready vote; `in_optimizer`: inside
DeepSpeed's optimizer step, after a parameter group's update; `refresh`: as the redundant copies of the step just
applied set off), and of a recovery."""
KINDS = ("crash", "hang", "device_error", "slow", "repair", "oom", "stall", "device_hang")
"""`hang`: the whole process stops (SIGSTOP), beats included; `stall`: the training thread blocks for good while the
heartbeat thread goes on beating (a deadlock in the rank's own code), so only its lack of progress gives it away;
`device_hang`: the rank's device stops (a kernel that never ends) while its host goes on, queueing work behind it and
then waiting in its next wait, so only its device's lack of progress gives it away (`ntp_ds.comm.device`); `oom`:
this rank's own work runs out of memory (raises torch.OutOfMemoryError): the rank ends, its peers recover without
it."""
REPAIR_PHASE = "boundary"
"""The phase of a `repair`: the failed rank's replacement joins at a step boundary (step = the first it trains)."""
FIELDS = ("rank", "step", "phase", "kind")
OPTIONAL_FIELDS = ("factor",)
"""`factor`: only with kind `slow`, how many times as long the rank's micro-batches take (at least 1)."""


def fired_faults(store, ranks) -> list[dict]:
    """The injected faults that `ranks` fired, with when they fired (`fired_key`), for the ranks that fired one."""
    keys = [fired_key(r) for r in ranks]
    return [json.loads(store.get(k)) for k in keys if store.check([k])]


def detection_from_faults(fired: list[dict], noticed: float, measured: float) -> float:
    """Detection time of a failure: from the injected faults' instant when they fired on this host (a monotonic clock
    this rank shares) to `noticed` (this rank's step failed, same clock); otherwise `measured`, the recovery's own
    figure (each reporter's silence on its own clock): clocks of different hosts are never subtracted."""
    if fired and all(f.get("clock") == clock_domain() for f in fired):
        return max(0.0, noticed - min(f["monotonic"] for f in fired))
    return measured


def clock_domain() -> str:
    """What makes two processes' monotonic clocks comparable: the same boot of the same host (Linux's boot id;
    elsewhere the host name)."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return socket.gethostname()


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_fields(where: str, rank, step, phase, kind, factor=None, world_size: int | None = None) -> None:
    """Raise ValueError naming the first field of a fault that is wrong, e.g. `fault.faults[0].rank=7 ...`."""
    if not _is_int(rank) or rank < 0:
        raise ValueError(f"{where}.rank={rank!r} must be a non-negative integer")
    if world_size is not None and rank >= world_size:
        raise ValueError(f"{where}.rank={rank} does not exist (world size {world_size})")
    if not _is_int(step) or step < 0:
        raise ValueError(f"{where}.step={step!r} must be a non-negative integer")
    if kind not in KINDS:
        raise ValueError(f"{where}.kind={kind!r} must be one of {', '.join(KINDS)}")
    if kind == "slow":
        if factor is None:
            raise ValueError(f"{where}.factor is missing; a slow fault needs a factor (how many times as long the "
                             f"rank's micro-batches take, e.g. 1.5)")
        if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not factor >= 1:
            raise ValueError(f"{where}.factor={factor!r} must be a number of at least 1 (how many times as long the "
                             f"rank's micro-batches take; 1: full speed again)")
    elif factor is not None:
        raise ValueError(f"{where}.factor={factor!r} applies only to kind slow, not {kind}")
    if kind == "repair":
        if phase != REPAIR_PHASE:
            raise ValueError(f"{where}.phase={phase!r}: a repair happens at a step boundary (omit phase, or write "
                             f"{REPAIR_PHASE!r})")
    elif phase not in PHASES:
        raise ValueError(f"{where}.phase={phase!r} must be one of {', '.join(PHASES)}")


@dataclass(frozen=True)
class Fault:
    """Make launch rank `rank` fail in `kind` way when it reaches `phase` of step `step`."""

    rank: int
    step: int
    phase: str
    kind: str
    factor: float | None = None
    """Kind `slow` only: how many times as long the rank's micro-batches take from then on."""

    def __post_init__(self):
        _check_fields("fault", self.rank, self.step, self.phase, self.kind, self.factor)

    def as_dict(self) -> dict:
        """The fault's fields, without `factor` when it has none (as a schedule entry is written)."""
        return {k: v for k, v in asdict(self).items() if k in FIELDS or v is not None}

    def encode(self) -> str:
        return json.dumps(self.as_dict(), sort_keys=True)

    @classmethod
    def from_mapping(cls, item, where: str = "fault", world_size: int | None = None) -> Fault:
        """Build a fault from a mapping of its four fields (and `factor` for kind slow); errors name `where.FIELD`."""
        if not isinstance(item, Mapping):
            raise ValueError(f"{where} must be a mapping with keys {', '.join(FIELDS)}; got {item!r}")
        if item.get("kind") == "repair" and "phase" not in item:
            item = {**item, "phase": REPAIR_PHASE}
        for key in item:
            if key not in FIELDS + OPTIONAL_FIELDS:
                raise ValueError(f"{where}.{key} is not a fault field; valid: {', '.join(FIELDS + OPTIONAL_FIELDS)}")
        for key in FIELDS:
            if key not in item:
                raise ValueError(f"{where}.{key} is missing; a fault needs {', '.join(FIELDS)}")
        factor = item.get("factor")
        _check_fields(where, *(item[k] for k in FIELDS), factor, world_size=world_size)
        return cls(*(item[k] for k in FIELDS), factor=None if factor is None else float(factor))

    @classmethod
    def decode(cls, raw: bytes | str) -> Fault:
        return cls.from_mapping(json.loads(raw))


@dataclass(frozen=True)
class FaultSchedule:
    """Faults fixed at launch, validated against the world size."""

    faults: tuple[Fault, ...] = ()

    @classmethod
    def from_config(cls, items: Sequence[Mapping] | None, world_size: int,
                    where: str = "fault.faults") -> FaultSchedule:
        """Read the Hydra `fault.faults` list; raise ValueError naming the entry and field at fault."""
        if items is None:
            return cls()
        if isinstance(items, (str, bytes, Mapping)) or not isinstance(items, Iterable):
            raise ValueError(f"{where} must be a list of {{{', '.join(FIELDS)}}} entries; got {items!r}")
        faults, seen = [], {}
        for i, item in enumerate(items):
            fault = Fault.from_mapping(item, f"{where}[{i}]", world_size)
            point = (fault.rank, fault.step, fault.phase)
            if point in seen:
                raise ValueError(f"{where}[{i}] repeats rank {fault.rank}, step {fault.step}, phase {fault.phase} "
                                 f"of {where}[{seen[point]}]; a rank fails at most once per point")
            seen[point] = i
            if fault.kind == "repair" and not any(f.rank == fault.rank and f.kind != "repair" and f.step < fault.step
                                                  for f in faults):
                raise ValueError(f"{where}[{i}] repairs rank {fault.rank} at step {fault.step}, but no earlier entry "
                                 f"makes rank {fault.rank} fail before step {fault.step}")
            faults.append(fault)
        return cls(tuple(faults))

    def repairs(self) -> dict[int, int]:
        """Rank -> the step from which its replacement trains (`repair` entries)."""
        return {f.rank: f.step for f in self.faults if f.kind == "repair"}

    def for_rank(self, rank: int) -> tuple[Fault, ...]:
        return tuple(f for f in self.faults if f.rank == rank)


def send_fault(store, fault: Fault) -> int:
    """Send `fault` to the running job through its store, and raise the alarm that has the ranks read it (their
    injectors read the store only when told: `FaultInjector.listen`); return its sequence number."""
    n = store.add(FAULT_COUNT_KEY, 1)
    store.set(fault_key(n), fault.encode())
    raise_alarm(store)
    return n


def trigger(fault: Fault) -> None:
    """Make this process fail as `fault` says: SIGKILL itself, SIGSTOP itself, block the calling (training) thread
    for good, stop its device and return, raise DeviceError or run out of memory (a `slow` fault is the injector's
    own: it stretches the micro-batches, `FaultInjector.stretch`)."""
    if fault.kind == "oom":
        import torch

        raise torch.OutOfMemoryError(f"injected out of memory on rank {fault.rank} at step {fault.step}, "
                                     f"phase {fault.phase}")
    if fault.kind == "crash":
        os.kill(os.getpid(), signal.SIGKILL)
    elif fault.kind == "hang":
        os.kill(os.getpid(), signal.SIGSTOP)
    elif fault.kind == "stall":
        threading.Event().wait()  # unbounded on purpose: the peers must find it hung, and its launcher kill it
    elif fault.kind == "device_hang":
        import torch.distributed as dist

        from ntp_ds.comm import device

        device.hang(dist.get_backend() if dist.is_initialized() else None)
    else:
        raise DeviceError(f"injected device error on rank {fault.rank} at step {fault.step}, phase {fault.phase}")


class FaultInjector:
    """Fire this rank's faults at the phase boundaries the engine reports; also pick up faults sent to the job."""

    def __init__(self, schedule: FaultSchedule, rank: int, store=None, *, poll_interval_s: float = 0.5,
                 clock: Callable[[], float] = time.monotonic, wall: Callable[[], float] = time.time,
                 fire: Callable[[Fault], None] = trigger, sleep: Callable[[float], None] = time.sleep):
        if not poll_interval_s >= 0:
            raise ValueError(f"poll_interval_s={poll_interval_s} must be non-negative")
        self.rank, self.store, self.poll_interval_s = rank, store, poll_interval_s
        self._clock, self._wall, self._fire, self._sleep = clock, wall, fire, sleep
        self._pending: list[tuple[Fault, bool]] = [(f, True) for f in schedule.for_rank(rank)]
        self._received = 0
        self._next_poll = float("-inf")
        self._told: threading.Event | None = None
        self._hearing: Callable[[], bool] = lambda: False
        self.slow_factor = 1.0
        """How many times as long this rank's micro-batches take (set by a `slow` fault)."""

    @property
    def pending(self) -> tuple[Fault, ...]:
        """Return this rank's faults not fired yet."""
        return tuple(f for f, _ in self._pending)

    def check(self, step: int, phase: str) -> None:
        """Fire the fault due at this step and phase, if any; poll the store when the poll interval has passed."""
        if phase not in PHASES:
            raise ValueError(f"phase={phase!r} must be one of {', '.join(PHASES)}")
        if self.store is not None and self._due():
            self.poll()
        for i, (fault, exact) in enumerate(self._pending):
            if fault.phase == phase and (step == fault.step if exact else step >= fault.step):
                del self._pending[i]
                self._record(fault, step)
                if fault.kind == "slow":
                    self.slow_factor = fault.factor
                else:
                    self._fire(fault)
                return

    def stretch(self, busy_s: float) -> float:
        """Sleep for what a slowed rank would have taken beyond `busy_s` of micro-batch work; return the seconds slept."""
        extra = (self.slow_factor - 1.0) * max(busy_s, 0.0)
        if extra > 0:
            self._sleep(extra)
        return extra

    def listen(self, hearing: Callable[[], bool]) -> Callable[[], None]:
        """Read the store only when told (an alarm: `send_fault` raises one) instead of every `poll_interval_s`, while
        `hearing()` says the alarms reach this rank (else, as before, by the clock); return the callback that tells
        it. It reads once first: faults sent before it listened."""
        self._told, self._hearing = threading.Event(), hearing
        self._told.set()
        return self._told.set

    def _due(self) -> bool:
        if self._told is not None and self._hearing():
            if not self._told.is_set():
                return False
            self._told.clear()  # before the read: an alarm raised during it is read at the next phase point
            return True
        return self._clock() >= self._next_poll

    def poll(self) -> None:
        """Read the faults sent to the job since the last poll and keep this rank's."""
        self._next_poll = self._clock() + self.poll_interval_s
        count = self.store.add(FAULT_COUNT_KEY, 0)
        while self._received < count:
            key = fault_key(self._received + 1)
            if not self.store.check([key]):
                break  # its sender has counted it but not written it yet; read it at the next poll
            self._received += 1
            fault = Fault.decode(self.store.get(key))
            if fault.rank == self.rank:
                self._pending.append((fault, False))

    def _record(self, fault: Fault, step: int) -> None:
        what = f"slow (x{fault.factor:g})" if fault.kind == "slow" else fault.kind
        log.warning("injecting %s on rank %d at step %d, phase %s", what, self.rank, step, fault.phase)
        if self.store is not None and fault.kind != "slow":  # the record times a failure's detection
            # The wall time for people; the monotonic instant, with its clock's domain, for a detection time that a
            # rank on the same host may subtract from its own.
            self.store.set(fired_key(self.rank), json.dumps({**fault.as_dict(), "at_step": step, "wall": self._wall(),
                                                             "monotonic": self._clock(), "clock": clock_domain()}))
