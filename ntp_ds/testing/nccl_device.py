"""The device of a process under `nccl_model`, one per process: it can stop (`hang_device`), and its events and syncs
(registered with `ntp_ds.comm.device`) keep the `device` and `sync` rules. It also knows the process's communicators:
a sync of the whole device waits for their kernels, and tests count the ones created (`communicator_sizes`)."""

from __future__ import annotations

import os
import threading
import time
import weakref
from dataclasses import dataclass

from ntp_ds.testing.nccl_rules import DEADLOCK_ENV, Deadlock, rule_on

_stopped = threading.Event()


def hang_device() -> None:
    """Stop this process's device for good, as a kernel that never ends would (the `device` rule); the host goes on."""
    if rule_on("device"):
        _stopped.set()


@dataclass
class ModelEvent:
    """An event recorded on the device: complete at once (the host computed what came before), never once the
    device has stopped."""

    done: bool

    def query(self) -> bool:
        return self.done


def record_event() -> ModelEvent:
    return ModelEvent(not _stopped.is_set())


def synchronize(whole_device: bool = False) -> None:
    """A device sync (the `sync` rule): of the training thread's stream, or of the `whole_device`."""
    if not rule_on("sync"):
        return
    bound = float(os.environ.get(DEADLOCK_ENV, "60"))
    if _stopped.wait(0):
        time.sleep(bound)
        raise Deadlock(f"nccl_model: deadlock: a device sync has waited {bound:g} s behind a kernel that never ends "
                       "(the device stopped); the host waits there for ever")
    if not whole_device:
        return
    deadline = time.monotonic() + bound
    for group in list(_GROUPS):
        with group._lock:
            running = list(group._pending)
        for work in running:
            if not work._done.wait(max(0.0, deadline - time.monotonic())):
                raise Deadlock(f"nccl_model: deadlock: a sync of the whole device has waited {bound:g} s for "
                               f"{work.what}, still running on a communicator; only its completion or an abort of "
                               "its communicator ends it")



_GROUPS: weakref.WeakSet = weakref.WeakSet()
"""The process's communicators (a sync of the whole device waits for their kernels)."""

_CREATED: list[int] = []
"""The size of every communicator this process created (NCCL creates one at its group's first op), in order."""


def communicator_sizes() -> list[int]:
    """Sizes of the communicators this process has created so far (groups that carried an op)."""
    return list(_CREATED)



def device_stopped() -> bool:
    """Whether the device has stopped (`hang_device`): an op posted now never starts."""
    return _stopped.is_set()


def add_communicator(group) -> None:
    """List `group` among the process's communicators (a sync of the whole device waits for its kernels)."""
    _GROUPS.add(group)


def communicator_created(size: int) -> None:
    """Record a communicator of `size` ranks created (NCCL creates one at its group's first op)."""
    _CREATED.append(size)
