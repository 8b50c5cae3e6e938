"""What the training thread is doing, for the heartbeat to tell its peers (`progress`): waiting on them (`waiting`)
or busy with its own work (`working`), and how far it has got, on its host and on its device (`ntp_ds.comm.device`).

Part of `ntp_ds.comm.wire`, which re-exports its names: callers use `wire.name`.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass

import torch.distributed as dist

from ntp_ds.comm import device
from ntp_ds.comm.wire_state import NCCL_LIKE, CallRecord, _state


@dataclass(frozen=True)
class Progress:
    """What the heartbeat tells peers of the training thread: a counter that moves at every phase point, every wait's
    start and end and every device event seen complete, and whether the rank is waiting on peers now (a rank blocked
    waiting is not hung): its device's oldest pending event says so first, whatever its host does (busy with its own
    work: not waiting; behind a wait: waiting), its host's waits otherwise (`ntp_ds.comm.device`)."""

    count: int
    waiting: bool
    device_busy: bool = False
    """The device is busy with this rank's own work (the oldest event not complete is an own one)."""
    since: float | None = None
    """When (`time.monotonic`) the count or what it says of waiting last changed, as far as this process saw."""


class _Progress:
    def __init__(self):
        self.count = 0
        self.depth = 0  # nested waits; 0 while the thread does its own work
        self.changed_at = time.monotonic()

    def bump(self) -> None:
        self.count += 1
        self.changed_at = time.monotonic()


_progress = _Progress()
_device = device.DeviceWatch()


def progress() -> Progress:
    """This process's training progress now (read from the heartbeat thread): the host's, and its device's. The rank
    waits on peers while its device does (its oldest pending event is a wait's), or while its host does and its
    device is not busy with its own work."""
    done, own = _device.look()
    return Progress(_progress.count + done, own is False or (own is None and _progress.depth > 0), own is True,
                    max(_progress.changed_at, _device.changed_at))


def timed_event():
    """A timing event recorded now on the device (CUDA), or None where the host's clock times the device's work."""
    return _state.timed_event() if _state.timed_event is not None else None


@contextlib.contextmanager
def waiting():
    """Mark the block as waiting on peers: a wait of the wire, or a DeepSpeed call that communicates (its
    collectives are not ours to mark one by one). A stalled counter does not make a waiting rank hung, unless its
    device is busy with its own work: the work queued before the wait is marked own, what the wait queued is marked
    as waiting on peers (`ntp_ds.comm.device`)."""
    if not _progress.depth:
        _device.mark(_state.record_event, own=True)
    _progress.bump()
    _progress.depth += 1
    try:
        yield
    finally:
        _progress.depth -= 1
        _progress.bump()
        if not _progress.depth:
            _device.mark(_state.record_event, own=False)


@contextlib.contextmanager
def working():
    """Mark the block as this rank's own work, inside a waiting block too (a phase point inside DeepSpeed's step):
    a stall in here is this rank's, and peers waiting on it may declare it hung. Its device event is own only
    outside a wait (inside, the stream may hold the wait's collectives)."""
    _device.mark(_state.record_event, own=not _progress.depth)
    depth, _progress.depth = _progress.depth, 0
    _progress.bump()
    try:
        yield
    finally:
        _progress.depth = depth
        _progress.bump()


def settle_device() -> None:
    """Wait until the device has done what this host queued on it (CUDA: the current stream), before the host reads
    what device work wrote (non-blocking copies into host memory); nothing to wait for on the CPU."""
    for rec in _state.recorders:
        rec(CallRecord("settle_device", dist.get_rank() if dist.is_initialized() else -1, _state.backend, (), (), (),
                       generation=_state.generation))
    if _state.backend in NCCL_LIKE:
        with waiting():  # the stream holds collectives that wait on peers
            device.synchronize(_state.backend)
