"""The device's own progress, as the heartbeat judges it: events recorded on the current stream at this rank's phase
points and around its waits, looked at from the heartbeat's thread.

A host can beat on while its device has stopped (a kernel that never ends, a wedged GPU), and a host blocked in a
wait on its own stuck device looks, by host progress alone, like a rank waiting on its peers. So the training thread
records an event on its stream at each phase point and at the start of each wait ("own": everything queued before it
is this rank's own work) and at the end of each wait ("peers": what the wait queued, collectives included, may wait
on other ranks). Events complete in stream order. The oldest event not yet complete says what the device is doing:
its own work (an own event), or waiting on its peers (a peers event), or nothing (none pending). A device busy with
its own work whose events stop completing is stuck, whatever its host does (`DeviceWatch.busy`); the progress the
heartbeat sends (`ntp_ds.comm.wire.progress`) counts the device's completions and says the rank is not waiting while
its device is busy with its own work, so that peers waiting on it judge it hung after `hang_timeout_s`.

A backend whose device is not CUDA's (the test backend `nccl_model`) registers its own events (`register`); on the
CPU under gloo the host computes synchronously and nothing is recorded.
"""

from __future__ import annotations

import threading
from collections import deque
from typing import Callable, Protocol

import torch

MAX_PENDING = 4096
"""Events kept at most; past it, a new event replaces the newest one (it completes after it: the oldest, which
says what the device is doing, stays)."""

HANG_CYCLES = 1 << 62
"""A device-side spin this long never ends in a job's life (a stopped device, for fault injection)."""


class Event(Protocol):
    def query(self) -> bool: ...


_RECORDERS: dict[str, Callable[[], Event]] = {}
_HANGS: dict[str, Callable[[], None]] = {}


def register(backend: str, record: Callable[[], Event], hang: Callable[[], None]) -> None:
    """Give `backend` its own device: `record()` returns an event recorded where the training thread's work goes
    (`query()`: whether the device has run everything queued before it), `hang()` stops the device for good."""
    _RECORDERS[backend] = record
    _HANGS[backend] = hang


def _cuda_event() -> Event:
    event = torch.cuda.Event()
    event.record()
    return event


def recorder(backend: str | None) -> Callable[[], Event] | None:
    """How events are recorded under `backend` (None where the host computes synchronously: nothing to watch)."""
    if backend in _RECORDERS:
        return _RECORDERS[backend]
    if backend == "nccl" and torch.cuda.is_available():
        return _cuda_event
    return None


def _cuda_timed_event() -> torch.cuda.Event:
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return event


def timer(backend: str | None) -> Callable[[], torch.cuda.Event] | None:
    """How spans of device time are marked under `backend`: timing events on the current stream under CUDA (their
    `elapsed_time` is the device's time between them, whatever the host did); None where the host computes
    synchronously, and its clock is the device's."""
    if backend == "nccl" and torch.cuda.is_available():
        return _cuda_timed_event
    return None


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
    """Events the training thread records (`mark`) and the heartbeat's thread looks at (`look`)."""

    def __init__(self):
        self._items: deque[tuple[Event, bool]] = deque()  # (event, own)
        self._lock = threading.Lock()
        self.done = 0
        """Events seen complete so far: the device's progress."""

    def mark(self, record: Callable[[], Event] | None, own: bool) -> None:
        """Record an event of this rank's own work (`own`) or of a wait on peers (no-op without `record`)."""
        if record is None:
            return
        event = record()
        with self._lock:
            self._drain()
            if len(self._items) >= MAX_PENDING:
                self._items[-1] = (event, own)
            else:
                self._items.append((event, own))

    def look(self) -> tuple[int, bool]:
        """(events completed so far, whether the device is busy with this rank's own work now)."""
        with self._lock:
            self._drain()
            return self.done, bool(self._items) and self._items[0][1]

    def clear(self) -> None:
        """Forget the events (the process leaves its device behind)."""
        with self._lock:
            self._items.clear()

    def _drain(self) -> None:
        while self._items and self._items[0][0].query():
            self._items.popleft()
            self.done += 1
