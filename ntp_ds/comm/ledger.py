"""The ledger of the data ops this rank posted, and the proofs that what they wrote arrived whole.

Under NCCL an op cut by an abort reports complete and its wait returns without raising, its buffer holding part of
the message. So every data op is entered here (`_enter`), its arrival counts as proven only once its completion was
seen while its communicator was live (`Posted`), and every abort first looks at the ops still in flight on the
communicators it aborts (`_observe`).

Part of `ntp_ds.comm.wire`, which re-exports its names: callers use `wire.name`.
"""

from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass

import torch.distributed as dist

from ntp_ds.comm.activity import settle_device
from ntp_ds.comm.failures import PeerFailure
from ntp_ds.comm.wire_state import _abort_lock, _state, is_nccl


@dataclass(eq=False)
class Posted:
    """A data op this rank posted, and whether its completion was seen while its communicator was live.

    That sighting is the only proof that the op's outputs hold its whole result: once a communicator is aborted,
    an NCCL op it cut reports complete and its wait returns without raising (torch 2.13's `WorkNCCL::isCompleted`
    skips the error check of an aborted communicator; `WorkNCCL::wait` only orders the stream), while its buffers
    hold the chunks that arrived and old bytes elsewhere. An op not seen complete before its communicator's abort
    is `cut` for good."""

    work: object
    """The Work, until its arrival is settled (proven or cut)."""
    group: object
    generation: int
    seq: int
    """Its place among every data op this process posted (`mark`)."""
    writes: bool
    """It writes this rank's buffers (a collective, or a batch with a receive); a send alone writes nothing here."""
    proven: bool = False
    cut: bool = False


_posted_seq = itertools.count()


def mark() -> int:
    """A point in the sequence of data ops: `outstanding(since=mark())` later covers the ops posted after it."""
    with _abort_lock:
        return next(_posted_seq)


def _enter(work, group, writes: bool = True) -> Posted:
    """Enter a data op in the ledger; drop from its group's front the ops seen complete meanwhile."""
    group = group if group is not None else dist.distributed_c10d._get_default_group()
    with _abort_lock:
        entry = Posted(work, group, _state.generation, next(_posted_seq), writes)
        queue = _state.ledger.setdefault(group, deque())
        while queue and _prove(queue[0]):
            queue.popleft()
        queue.append(entry)
    return entry


def _live(group) -> bool:
    """Whether `group`'s communicator has not been aborted (call with `_abort_lock` held)."""
    if group in _state.aborted_groups:
        return False
    return not (_state.aborted and group not in dist.distributed_c10d._world.pg_map)


def _prove(entry: Posted) -> bool:
    """Whether `entry`'s op is proven to have completed; look at it now if its communicator is still live (call
    with `_abort_lock` held, so that no abort falls between the look at the group and the look at the op)."""
    if entry.proven or entry.cut:
        return entry.proven
    if entry.generation != _state.generation or not _live(entry.group):
        entry.cut = True  # its communicator was aborted (or left) before anyone saw it complete
    elif not entry.work.is_completed():
        return False
    elif entry.work.exception() is not None:
        entry.cut = True  # failed: nothing of it counts
    else:
        entry.proven = True
    entry.work = entry.group = None  # settled: a Work holds its buffers, a group its connections
    return entry.proven


def _observe(groups) -> None:
    """Before `groups` (None: every group) are aborted, look at each of their ops still unproven: what has completed
    by now is proven, the rest will be cut.

    NCCL's groups only: an abort cuts nothing of a gloo op (it fails, or completes whole). And a gloo send's wait
    holds its Work's mutex while it blocks, which `is_completed` takes with the GIL held: asked from this (the
    abort's) thread while the training thread waits, it would stop the whole process, heartbeat included."""
    with _abort_lock:
        chosen = None if groups is None else {id(g) for g in groups}
        for group, queue in _state.ledger.items():
            if (chosen is None or id(group) in chosen) and is_nccl(group):
                for entry in queue:
                    _prove(entry)


def outstanding(since: int = 0) -> list[Posted]:
    """The data ops posted in this generation after the mark `since` that write this rank's buffers and whose
    arrival is not proven yet (to prove later, with `proven`, that what they wrote arrived whole)."""
    with _abort_lock:
        return [e for queue in _state.ledger.values() for e in queue
                if e.writes and e.seq >= since and not _prove(e)]


def proven(entries) -> bool:
    """Whether every op of `entries` (`Posted`) is proven to have completed (looking at those still in flight)."""
    with _abort_lock:
        return all([_prove(e) for e in entries])


def require_arrived(exchanges, what: str) -> None:
    """Raise `PeerFailure` unless every transfer of `exchanges` (waited `Exchange`s) is proven to have arrived,
    waiting for the device first: for data a host is about to keep whose ops may have been cut by an abort."""
    settle_device()
    if not all(e.proven() for e in exchanges):
        raise PeerFailure(f"{what}: a transfer was cut by an abort before it completed ({_state.reason or 'aborted'})")
