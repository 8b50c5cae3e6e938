"""The device's own progress, as the heartbeat judges it: events recorded on the current stream at this rank's phase
points and around its waits, looked at from the heartbeat's thread.

A host can beat on while its device has stopped (a kernel that never ends, a wedged GPU), and a host blocked in a
wait on its own stuck device looks, by host progress alone, like a rank waiting on its peers. So the training thread
records an event on its stream at each phase point and at the start of each wait ("own": everything queued before it
is this rank's own work) and at the end of each wait ("peers": what the wait queued, collectives included, may wait
on other ranks). Events complete in stream order. The oldest event not yet complete says what the device is doing:
its own work (an own event), or waiting on its peers (a peers event), or nothing (none pending). A device busy with
its own work whose events stop completing is stuck, whatever its host does (`DeviceWatch.look`); the progress the
heartbeat sends (`ntp_ds.comm.wire.progress`) counts the device's completions and says the rank is not waiting while
its device is busy with its own work, so that peers waiting on it judge it hung after `hang_timeout_s`, and that it
is waiting while its device waits on peers, whatever its host does (under NCCL a host runs ahead of its waits and
may block later, at a `.item()` of the user's, behind a peer's stuck collective: it is a victim, not a culprit).

Limits: a wedged kernel is found only once an own event is queued behind it; inside a waiting region (DeepSpeed's
step, the ZeRO 2 backward) the next event is the region's end, a peers one, so a kernel wedged there is taken for a
wait.

A backend whose device is not CUDA's (the test backend `nccl_model`) registers its own events (`register`); on the
CPU under gloo the host computes synchronously and nothing is recorded.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections import deque
from typing import Callable, Protocol

import torch

log = logging.getLogger(__name__)

MAX_PENDING = 4096
"""Events kept at most; past it, a new event replaces the newest one (it completes after it: the oldest, which
says what the device is doing, stays)."""

HANG_CYCLES = 1 << 62
"""A device-side spin this long never ends in a job's life (a stopped device, for fault injection)."""


class Event(Protocol):
    def query(self) -> bool: ...


_RECORDERS: dict[str, Callable[[], Event]] = {}
_HANGS: dict[str, Callable[[], None]] = {}
_SYNCS: dict[str, Callable[..., None]] = {}


def register(backend: str, record: Callable[[], Event], hang: Callable[[], None],
             sync: Callable[..., None]) -> None:
    """Give `backend` its own device: `record()` returns an event recorded where the training thread's work goes
    (`query()`: whether the device has run everything queued before it), `hang()` stops the device for good,
    `sync(whole_device=False)` waits until the device has run what the training thread's stream (or the whole
    device) holds."""
    _RECORDERS[backend] = record
    _HANGS[backend] = hang
    _SYNCS[backend] = sync


def _cuda_event(timing: bool = False) -> torch.cuda.Event:
    event = torch.cuda.Event(enable_timing=timing)
    event.record()
    return event


def recorder(backend: str | None) -> Callable[[], Event] | None:
    """How events are recorded under `backend` (None where the host computes synchronously: nothing to watch)."""
    if backend in _RECORDERS:
        return _RECORDERS[backend]
    if backend == "nccl" and torch.cuda.is_available():
        return _cuda_event
    return None


def timer(backend: str | None) -> Callable[[], torch.cuda.Event] | None:
    """How spans of device time are marked under `backend`: timing events on the current stream under CUDA (their
    `elapsed_time` is the device's time between them, whatever the host did); None where the host computes
    synchronously, and its clock is the device's."""
    if backend == "nccl" and torch.cuda.is_available():
        return functools.partial(_cuda_event, timing=True)
    return None


def synchronize(backend: str | None, whole_device: bool = False) -> None:
    """Wait until the device has run what the training thread queued on its stream (CUDA: the current stream, which
    holds the waits on collectives already waited), or everything on the `whole_device`; nothing to wait for where
    the host computes."""
    if backend in _SYNCS:
        _SYNCS[backend](whole_device=whole_device)
    elif backend == "nccl" and torch.cuda.is_available():
        if whole_device:
            torch.cuda.synchronize()
        else:
            torch.cuda.current_stream().synchronize()


def hang(backend: str | None) -> None:
    """Stop this rank's device for good while its host goes on (fault injection): a spin kernel on the current
    stream under CUDA, the backend's own stop otherwise."""
    if backend in _HANGS:
        _HANGS[backend]()
    elif torch.cuda.is_available():
        torch.cuda._sleep(HANG_CYCLES)
    else:
        raise RuntimeError(f"no device to stop under backend {backend!r} (the host computes: use a stall)")


class DeviceWatch:
    """Events the training thread records (`mark`) and the heartbeat's thread looks at (`look`).

    Under CUDA the looking thread first makes the training thread's device its own (a thread starts on device 0,
    and a CUDA call there would create a context on another rank's GPU); a look that fails (a broken device) says
    nothing, so that the beat it rides on still goes out."""

    def __init__(self):
        self._items: deque[tuple[Event, bool]] = deque()  # (event, own)
        self._lock = threading.Lock()
        self._device: int | None = None  # the CUDA device the events are recorded on
        self._local = threading.local()
        self.done = 0
        """Events seen complete so far: the device's progress."""
        self.changed_at = 0.0
        """When (`time.monotonic`) an event was last seen complete."""

    def mark(self, record: Callable[[], Event] | None, own: bool) -> None:
        """Record an event of this rank's own work (`own`) or of a wait on peers (no-op without `record`)."""
        if record is None:
            return
        try:
            event = record()
            if record is _cuda_event and self._device is None:
                self._device = torch.cuda.current_device()
        except Exception as err:  # a broken device: the training thread's next device call raises it
            log.debug("no device event recorded: %s", err)
            return
        with self._lock:
            self._drain()
            if len(self._items) >= MAX_PENDING:  # the newest gives way; own only if both were (never a false busy)
                self._items[-1] = (event, own and self._items[-1][1])
            else:
                self._items.append((event, own))

    def look(self) -> tuple[int, bool | None]:
        """(events completed so far, what the oldest pending event says: True, the device is busy with this rank's
        own work; False, it waits on peers; None, nothing pending or nothing known)."""
        try:
            if self._device is not None and getattr(self._local, "device", None) != self._device:
                torch.cuda.set_device(self._device)  # (this thread's only)
                self._local.device = self._device
            with self._lock:
                self._drain()
                return self.done, self._items[0][1] if self._items else None
        except Exception as err:
            log.debug("the device's events could not be read: %s", err)
            return self.done, None

    def _drain(self) -> None:
        while self._items and self._items[0][0].query():
            self._items.popleft()
            self.done += 1
            self.changed_at = time.monotonic()
