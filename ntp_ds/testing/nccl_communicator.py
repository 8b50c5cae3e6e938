"""A communicator of the `nccl_model` backend: created at its group's first op (`create`), its ops run one after
another on its stream (`order`: a point-to-point op only once the peer's matching op heads the peer's stream), an op
past its group's timeout caught by the watchdog (`watchdog`), pending ops cut by an abort (`abort`).

`nccl_model.ModelGroup`, the process group torch sees, is this communicator with the ops a caller posts on it.
"""

from __future__ import annotations

import itertools
import logging
import os
import queue
import threading
import time
import weakref
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Callable

import torch.distributed as dist
from torch._C._distributed_c10d import PrefixStore, ProcessGroupGloo

from ntp_ds.testing.nccl_device import add_communicator
from ntp_ds.testing.nccl_rules import (DEADLOCK_ENV, DUMP_WAIT_ENV, DUMP_WAIT_MS, NONBLOCKING_TIMEOUT_ENV, Deadlock,
                                       DeviceStopped, rule_on)

log = logging.getLogger("ntp_ds.testing.nccl_model")  # the backend logs under one name, whichever of its modules logs


# -- the stream: one op at a time per communicator ----------------------------------------------------------------
@dataclass
class StreamOp:
    """One op (or batch) posted on a communicator's stream."""

    work: dist.Work
    """The op's Work (a `nccl_model.ModelWork`)."""
    run: Callable[[dist.Work], list]
    """Posts the op's gloo works (on the work's private buffers) and returns them."""
    p2p: list[tuple[str, int, int]] = field(default_factory=list)
    """(kind, peer, index) of every point-to-point message: the index-th message between the pair that way."""
    number: int = 0
    behind_stop: bool = False
    """Posted after the device stopped: it never starts."""
    started: list | None = None
    """The gloo works, when the op was started at posting (the `order` rule off)."""


class ModelCommunicator(dist.ProcessGroup):
    """An NCCL-like communicator over a gloo group of the same ranks: its creation, stream, watchdog and abort."""

    def __init__(self, store, rank: int, size: int, timeout: timedelta, blocking: bool = True):
        super().__init__(rank, size)
        self._blocking = blocking
        self._rank, self._size = rank, size
        # Under `create`, the transport underneath is connected at the group's first op, as NCCL creates its
        # communicator then, and a group's construction waits for nobody; with the rule off, at construction, as
        # gloo connects every member then.
        self._transport = (PrefixStore("gloo/", store), rank, size, timeout)
        self._gloo = None if rule_on("create") else ProcessGroupGloo(*self._transport)
        self._creating = threading.Lock()
        self._store = PrefixStore("match/", store.clone())
        self._deadlock_s = float(os.environ.get(DEADLOCK_ENV, "60"))
        self._ordered = rule_on("order")
        self._queue: queue.Queue = queue.Queue()
        self._pending: set[dist.Work] = set()
        self._lock = threading.Lock()
        self._aborted = ""
        self._counts = {}  # (kind, peer) -> messages posted so far
        self._posted = 0
        self._numbers = itertools.count()
        self._batch: list | None = None
        self._timeout_s = timeout.total_seconds()
        self._dump_wait_s = float(os.environ.get(DUMP_WAIT_ENV, str(DUMP_WAIT_MS))) / 1000
        self._late: list[float] = []  # the timeouts of ops that ended after them, not yet slept on
        self._watched = 0.0  # when the watchdog's sleeps so far end
        # The worker holds the group weakly: a group must never be freed on it (a daemon thread that frees a gloo
        # group while the interpreter exits takes the process down).
        self._thread = threading.Thread(target=_run_stream, args=(weakref.ref(self), self._queue),
                                        name=f"nccl_model-{id(self):x}", daemon=True)
        self._thread.start()
        add_communicator(self)

    # -- creation and the watchdog, on the posting thread -----------------------------------------------------------
    def _create(self, what: str) -> None:
        """The init at the group's first op: wait (on the posting thread, abort or not) until every member has
        reached its own first op, for ever if the init is blocking, at most TORCH_NCCL_NONBLOCKING_TIMEOUT if not.
        (The stream's store client is idle until the group's first op is posted.)"""
        bound = self._deadlock_s if self._blocking else float(os.environ.get(NONBLOCKING_TIMEOUT_ENV, "1800"))
        self._store.set(f"create/{self._rank}", "1")
        try:
            self._store.wait([f"create/{r}" for r in range(self._size)], timedelta(seconds=bound))
        except Exception:
            missing = [r for r in range(self._size) if not self._store.check([f"create/{r}"])]
            if not self._blocking:
                raise dist.DistBackendError(
                    f"NCCL timeout in: nccl_model: the non-blocking communicator of group rank {self._rank} was not "
                    f"ready within {NONBLOCKING_TIMEOUT_ENV}={bound:g} s at its first op ({what}): group rank(s) "
                    f"{missing} never reached theirs") from None
            raise Deadlock(f"nccl_model: deadlock: group rank {self._rank} has waited {self._deadlock_s:g} s in the "
                           f"creation of its communicator at its first op ({what}) for group rank(s) {missing}, "
                           "which never reached theirs (a blocking ncclCommInitRank: no abort ends it)") from None

    def _behind_the_watchdog(self) -> None:
        """Block the post while the watchdog sleeps after the ops that timed out on this group (`watchdog`)."""
        now = time.monotonic()
        with self._lock:
            timed_out = self._late + [w.posted_at + self._timeout_s for w in self._pending
                                      if not w.watched and now > w.posted_at + self._timeout_s]
            for w in self._pending:
                w.watched = w.watched or now > w.posted_at + self._timeout_s
            self._late = []
            for at in sorted(timed_out):
                self._watched = max(self._watched, at) + 4 * self._dump_wait_s
            until = self._watched
        if until > now:
            log.debug("nccl_model: a post waits %.1f s behind the watchdog's sleep", until - now)
            time.sleep(until - now)

    # -- the worker ------------------------------------------------------------------------------------------------
    def _next(self, op: StreamOp, broken: BaseException | None) -> BaseException | None:
        """Run the op at the head of the stream; return what breaks the stream from here on (None if nothing)."""
        if self._aborted:
            return broken
        if isinstance(broken, Deadlock):
            self._end(op.work, Deadlock(f"nccl_model: {op.work.what} is queued behind a deadlock: {broken}"))
            return broken
        if broken is not None:
            return broken  # a stream whose op never completes runs nothing after it: pending until aborted
        if op.behind_stop:
            return DeviceStopped(f"nccl_model: {op.work.what} is queued behind a kernel that never ends")
        try:
            if self._ordered:
                self._store.set(f"head/{self._rank}", f"op #{op.number}: {op.work.what}")  # for deadlock reports
            if self._ordered and op.p2p:
                self._rendezvous(op)
            works = op.started if op.started is not None else op.run(op.work)
        except Deadlock as err:
            self._end(op.work, err)
            return err
        except BaseException as err:  # the op could not be posted (its arguments): the caller's error
            self._end(op.work, err)
            return None
        try:
            for w in works:
                w.wait()
        except BaseException as err:  # the wire failed under it
            if rule_on("abort"):  # NCCL with async error handling 0: no error, no timeout; pending
                log.debug("nccl_model: %s failed underneath (%s); pending until aborted", op.work.what, err)
                return err
            self._end(op.work, err)
            return None
        self._end(op.work, None)
        return None

    def _end(self, work: dist.Work, error: BaseException | None) -> None:
        with self._lock:
            self._pending.discard(work)
            if not work.watched and time.monotonic() > work.posted_at + self._timeout_s:
                self._late.append(work.posted_at + self._timeout_s)  # the watchdog caught it before it ended
        work.finish(error)

    def _rendezvous(self, op: StreamOp) -> None:
        """Announce this stream's point-to-point ops at its head, then wait for each peer's matching op at its."""
        me = self._rank
        mine = [self._key(kind, peer, n, me) for kind, peer, n in op.p2p]
        theirs = [self._key("recv" if kind == "send" else "send", me, n, peer) for kind, peer, n in op.p2p]
        for key in mine:
            self._store.set(key, "1")
        try:
            self._store.wait(theirs, timedelta(seconds=self._deadlock_s))
        except Exception:
            peers = sorted({peer for _, peer, _ in op.p2p})
            heads = {}
            for p in peers:
                try:
                    heads[p] = self._store.get(f"head/{p}").decode() if self._store.check([f"head/{p}"]) else "?"
                except Exception:  # the report is best effort; the deadlock is the finding
                    heads[p] = "?"
            raise Deadlock(f"nccl_model: deadlock: group rank {me} has waited {self._deadlock_s:g} s at op "
                           f"#{op.number} ({op.work.what}) for its peers' matching ops; the peers' stream heads: "
                           + "; ".join(f"rank {p}: {h}" for p, h in heads.items())) from None
        for key in theirs:
            self._store.delete_key(key)

    @staticmethod
    def _key(kind: str, peer: int, n: int, me: int) -> str:
        src, dst = (me, peer) if kind == "send" else (peer, me)
        return f"{kind}/{src}-{dst}/{n}"

    # -- abort ---------------------------------------------------------------------------------------------------
    def abort(self) -> None:
        if not rule_on("abort"):
            return
        with self._lock:
            if self._aborted:
                return
            self._aborted = "aborted by this process"
            pending, self._pending = list(self._pending), set()
        for w in pending:
            w.cut()
        self._queue.put(None)

    def shutdown(self) -> None:
        self._queue.put(None)
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout=0.2)  # a worker blocked on a dead peer is left behind (it holds no reference)


def _run_stream(group_ref, ops: queue.Queue) -> None:
    """A group's stream: its ops one after another, until the group is shut down, aborted or gone."""
    broken = None
    while True:
        op = ops.get()
        group = group_ref()
        if op is None or group is None:
            return
        broken = group._next(op, broken)
        del op, group
