"""Bounded waits: every wait ends when its work completes, when the liveness watcher declares a peer dead (`verdict`),
when the members that left a group for a recovery have left this rank's op on it unmatched (`on_departure`), or at
the group's timeout; and the look, without a wait, at whether a group's ops have all completed (`drained`).

Part of `ntp_ds.comm.wire`, which re-exports its names: callers use `wire.name`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from datetime import timedelta
from typing import Callable

import torch.distributed as dist

from ntp_ds.comm.activity import waiting
from ntp_ds.comm.failures import PeerFailure
from ntp_ds.comm.ledger import _live, _prove, proven
from ntp_ds.comm.wire_state import _abort_lock, _state, is_nccl

log = logging.getLogger(__name__)

SLICE_S = 0.1
"""How often a blocked gloo wait looks at the liveness verdict."""


def wait(works, group=None, what: str = "collective", p2p: bool = False, heed_failure: bool = True,
         proofs=None) -> None:
    """Wait for `works` within the bound, raising PeerFailure as soon as a peer is declared dead (unless
    `heed_failure` is False: salvaging transfers from live peers after a failure).

    A gloo collective is waited on in slices (its timed wait can be repeated). A gloo point-to-point work cannot be
    (a timed-out wait closes the connection) and reports no completion before it is waited on, so it is waited on
    whole: the group's timeout bounds it, and a hung peer is ended sooner by its launcher once the liveness
    watcher asks for it to be fenced (its connections close, and the wait fails at once).
    """
    with waiting():
        _wait(works, group, what, p2p, heed_failure, proofs)


def on_departure(check: Callable | None) -> None:
    """Install `check(group)`: how many operations the members of `group` that left it for a recovery had posted on
    it (-1 if not all the same), or None while none has (the recovery publishes that through the store as it
    begins). Without one, every wait ends at a verdict."""
    _state.departed = check


DEPARTURE_CHECK_S = 1.0
"""How long a wait on a group without a suspect runs, after a verdict, between two looks at its members' departures
(`on_departure`): one store request per look, made only by a wait that is really stuck, so a job-wide failure costs
the store at most one request per waiting rank per second (healthy replicas' operations complete in far less)."""


def _suspect(group) -> bool:
    """Whether a wait on `group` must end at once: a verdict came, and the group holds a suspect (`peer_failed`;
    the default group holds everyone), or none were named, or nothing can tell departures."""
    if not _state.failed.is_set():
        return False
    if _state.suspects is None or group is None or _state.departed is None:
        return True
    try:
        return bool(_state.suspects & set(dist.get_process_group_ranks(group)))
    except (KeyError, RuntimeError, ValueError):  # a group torch no longer knows (aborted)
        return True


def verdict(timeout_s: float = 0.0) -> bool:
    """Whether a peer's failure has been declared in this generation (`peer_failed`), waiting up to `timeout_s`."""
    return _state.failed.wait(timeout_s) if timeout_s > 0 else _state.failed.is_set()


def check_verdict(group, what: str) -> None:
    """Raise `PeerFailure` before `what` starts when a verdict has already broken this generation for `group`: a
    collective begun on it would only fail later, having changed its tensors meanwhile."""
    if _suspect(group):
        raise PeerFailure(f"{what} not started: {_state.reason}")


DEPARTURE_POLL_S = 0.25
"""Under NCCL, how often the abort thread looks at the departures from the spared groups (one store request per
group while nobody has left it), until the training thread reaches the recovery (at most `arrival_s`)."""


def _departed(group, guess: bool = True) -> bool:
    """Whether this rank holds an operation on `group` (one without a suspect) that nobody will match: its members
    that left it for the recovery had posted fewer, or not all the same number. So the members of such a group (a
    healthy replica's TP group) go on together up to the first operation that involves the dead, with equally many
    operations posted on the group, which is what lets a recovery keep it (`keep.keep`); a member that got one
    further is released as soon as the others have left. Asked from the training thread and the abort thread
    alike: one at a time."""
    check = _state.departed
    if check is None:
        return guess
    try:
        with _departure_lock:
            left = check(group)
        return left is not None and (left < 0 or left < ops_posted(group))
    except Exception as err:  # the store cannot say: do not wait on a guess (`guess`: what to say then)
        log.debug("departure check failed: %s", err)
        return guess


_departure_lock = threading.Lock()


def _wait(works, group, what: str, p2p: bool, heed_failure: bool, proofs=None) -> None:
    nccl = is_nccl(group)
    deadline = time.monotonic() + _state.timeout_s
    look = time.monotonic() + DEPARTURE_CHECK_S
    works = works if isinstance(works, (list, tuple)) else [works]
    for i, work in enumerate(works):
        if heed_failure and _suspect(group):
            raise PeerFailure(f"{what} abandoned: {_state.reason}")
        if nccl or p2p:
            work.wait()  # NCCL: orders the current stream after the work; an abort ends a kernel blocked on a peer
            if nccl and heed_failure and _state.failed.is_set() and not (proofs is not None and proven([proofs[i]])):
                # An op the abort cut looks finished (its wait returned, its buffers hold part of the result); one seen
                # complete before the abort (`Posted`) stands.
                with _abort_lock:
                    cut = _suspect(group) or not _live(group)
                if cut:
                    raise PeerFailure(f"{what} abandoned: {_state.reason}")
            continue
        while True:
            try:
                work.wait(timedelta(seconds=SLICE_S))
                break
            except RuntimeError:
                if work.is_completed():
                    work.wait()  # it finished as the slice ran out: return, or raise its own error
                    break
            if heed_failure and _suspect(group):
                raise PeerFailure(f"{what} abandoned: {_state.reason}")
            if heed_failure and _state.failed.is_set() and time.monotonic() > look:
                if _departed(group):
                    raise PeerFailure(f"{what} abandoned: its members left the group without it ({_state.reason})")
                look = time.monotonic() + DEPARTURE_CHECK_S
            if time.monotonic() > deadline:
                raise TimeoutError(f"{what} did not complete within timeout_s={_state.timeout_s}")


def ops_posted(group) -> int:
    """How many operations this process has posted on `group` (torch's per-group sequence number; the NCCL model's
    own count): members of a group that agree on it have no operation of it left unmatched."""
    counted = getattr(group, "ops_posted", None)
    return int(counted() if callable(counted) else group._get_sequence_number_for_group())


def drained(group, within_s: float) -> bool:
    """Whether every data op this rank posted on `group` is seen complete within `within_s`: looked at, never
    waited on (no device sync). A group carried into the next generation must hold no kernel still running: a kernel
    that never ends there (a member's device stopped) would block the next generation's ops and device syncs, and
    its communicator's abort, for ever. An op cut by an abort is not complete, nor is one the members that left the
    group for the recovery never posted (`_departed`, looked at once a second while an op is pending: under gloo
    nothing aborts such a group, and its op never completes)."""
    deadline = time.monotonic() + within_s
    look = time.monotonic()
    while True:
        with _abort_lock:
            queue = _state.ledger.get(group, deque())
            while queue and _prove(queue[0]):
                queue.popleft()
            if not queue:
                return True
            if queue[0].cut:
                return False
        now = time.monotonic()
        if now > deadline:
            return False
        if now >= look:
            if _departed(group, guess=False):
                return False
            look = now + DEPARTURE_CHECK_S
        time.sleep(SLICE_S / 10)
