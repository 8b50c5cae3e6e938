"""`nccl_model`: a torch.distributed backend that runs over gloo and fails where NCCL would.

gloo forgives what NCCL does not: its point-to-point ops complete without a matching op posted in the same order,
its results are in place once the host passes the call, its Works are per op, its timeouts end any op. Importing
this module registers `nccl_model`, which wraps a gloo group and keeps NCCL's rules instead, so a CPU test of code
that would break on GPUs fails on CPU. Each rule can be switched off alone (`NTP_NCCL_MODEL_OFF=rule,rule`), to
show it is the one that catches a given bug:

- `coalesce`: `batch_isend_irecv` and the coalesced collectives return ONE Work for the whole batch, and it fails
  as a unit. torch takes its coalesced path only for a plain ProcessGroup with a C++ backend, which a Python group
  is not, so this module wraps `torch.distributed.batch_isend_irecv` for its own groups (other groups are passed
  through untouched).
- `async`: an op's outputs (a collective's result, a received buffer) hold a poison pattern (NaN for floating
  tensors, the type's extreme value for integers) until its Work is waited or reports completion, and its inputs
  must not change before then: the wait raises `RuleViolation` when an input was written while in flight (NCCL
  would send whatever the buffer held when its kernel read it).
- `order`: each group runs its ops one after another, as an NCCL communicator's stream does, and a point-to-point
  op (alone or in a batch) runs only once the peer's matching op reaches the head of the peer's stream. A send
  posted before its receive on both sides of a pair (or around a ring) never progresses: after
  `NTP_NCCL_MODEL_DEADLOCK_S` seconds (default 60) its Work fails with `Deadlock`, naming the ops and ranks.
- `tags`: tags are ignored; messages between a pair match in posting order.
- `first`: a communicator's first op may be a batch of point-to-point ops only if it involves every rank of the
  group (torch documents anything else as undefined under NCCL); start a group with a collective.
- `abort`: no timeout ends an op (async error handling 0): an op whose peer died stays pending until the group is
  aborted. `abort()` ends every pending op as torch 2.13's `ProcessGroupNCCL` does: the aborted kernel exits, so
  the Work reports complete (`WorkNCCL::isCompleted` skips its error check once the communicator is aborted) and
  its wait returns without raising (`WorkNCCL::wait` only orders the stream); each output holds some chunks of the
  message (NCCL moves a message over several channels, in no fixed order) and what the memory held before
  elsewhere (here: the poison). Any later op on the group raises, as on an aborted NCCL communicator. Only a
  completion observed before the abort proves that an op's data arrived (`ntp_ds.comm.wire`, "proofs").
- `create`: a communicator is created at its group's first op (torch's `ProcessGroupNCCL::collective` and
  `pointToPoint` call `initNCCLComm` when the group has none; no device is bound at group creation), by a blocking
  `ncclCommInitRank` on the posting thread, which returns only once every member of the group has reached its own
  first op: the host blocks in the post, even of an async op, and no abort reaches it (torch enters the communicator
  in the map an abort walks only after the init returns). A member that never gets there strands the others: NCCL
  hangs for good; after `NTP_NCCL_MODEL_DEADLOCK_S` seconds the post raises `Deadlock`, naming the missing ranks.
  A non-blocking communicator (`config.blocking = 0` in the group's options, else
  `TORCH_NCCL_USE_COMM_NONBLOCKING=1`) is created the same way, but its first use waits for it at most
  `TORCH_NCCL_NONBLOCKING_TIMEOUT` seconds (1800 by default; torch's `NCCLComm::waitReady`) and then raises
  `DistBackendError` ("NCCL timeout"); no abort ends that wait either (it holds the communicator's mutex).
- `device`: the process has one device, which can stop (`hang_device`: a kernel that never ends on the stream the
  training thread queues to, as `torch.cuda._sleep` spins): an op posted after it never starts (ProcessGroupNCCL
  orders each op's stream after the current stream), pending until the group is aborted, and a device event
  recorded after it never completes (`record_event`, registered with `ntp_ds.comm.device`). With the rule off the
  device never stops.
- `sync`: a device sync (`synchronize`, registered with `ntp_ds.comm.device`; the product's `settle_device`) returns
  only once the device has run what it waits for. A stream sync (`torch.cuda.current_stream().synchronize()`, as a
  `.item()` or `.tolist()` of a device tensor makes) waits for everything queued on the training thread's stream: it
  never returns once the device has stopped (a spin kernel is not ended by an abort). A sync of the whole device
  (`torch.cuda.synchronize()`) also waits for every kernel still running on any of the process's communicators,
  until it completes or an abort of its communicator ends it. (A stream sync does not wait for a communicator's
  ops: the current stream waits on an op only once its Work is waited, and here a wait blocks the host.) NCCL
  hangs for good; after `NTP_NCCL_MODEL_DEADLOCK_S` seconds the sync raises `Deadlock`.
- `watchdog`: an op still pending at its group's timeout is caught by the group's watchdog, as torch's
  `Watchdog::runLoop` does under async error handling 0: nothing is aborted and the caller's Work does not change
  (the watchdog marks its own copy: the op stays incomplete, its wait returns nothing new, its exception stays
  None), but the watchdog then sleeps 4 x `TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC` (15 s by default) holding the
  group's work list, whatever the dump setting, so the next op posted on the group blocks its host until the sleep
  ends (one sleep per op that timed out, one after another).

Tensors live on the CPU; the package's `nccl` branches are taken for `nccl_model` too (`ntp_ds.comm.wire.is_nccl`).
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

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import AllgatherOptions, PrefixStore, ProcessGroupGloo

from ntp_ds import envs
from ntp_ds.comm import device

log = logging.getLogger(__name__)

NAME = "nccl_model"
RULES = ("coalesce", "async", "order", "tags", "first", "abort", "device", "create", "sync", "watchdog")
OFF_ENV = envs.MODEL_OFF_ENV
DEADLOCK_ENV = envs.MODEL_DEADLOCK_ENV
NONBLOCKING_ENV = envs.NONBLOCKING_ENV
NONBLOCKING_TIMEOUT_ENV = envs.NONBLOCKING_TIMEOUT_ENV
DUMP_WAIT_ENV = envs.NCCL_DUMP_WAIT_ENV
DUMP_WAIT_MS = 15_000
"""torch's default for DUMP_WAIT_ENV: the watchdog sleeps four times this after each op that timed out."""


class DeviceStopped(RuntimeError):
    """An op queued behind a kernel that never ends: it never starts (pending until its group is aborted)."""


class RuleViolation(RuntimeError):
    """The program broke a rule NCCL imposes (a buffer used while its op was in flight)."""


class Deadlock(BaseException):
    """NCCL would hang here for good (a point-to-point op that never met its match, a blocking communicator
    creation a member never reached, a device sync behind a kernel that never ends). Not an Exception: the code
    under test cannot take it for a failure it recovers from, since on NCCL its thread would never return."""


class Aborted(RuntimeError):
    """An op was posted on an aborted communicator (its pending ops were cut: they report complete, and their
    outputs hold part of the message at most)."""


CHANNELS = 4
"""The chunks an output of an op cut by an abort is written in: the even ones arrived, the odd ones did not."""


def rule_on(rule: str) -> bool:
    """Whether `rule` is enforced (all are, unless named in NTP_NCCL_MODEL_OFF)."""
    if rule not in RULES:
        raise ValueError(f"unknown nccl_model rule {rule!r}; rules: {', '.join(RULES)}")
    off = {r.strip() for r in os.environ.get(OFF_ENV, "").split(",") if r.strip()}
    unknown = off - set(RULES)
    if unknown:
        raise ValueError(f"{OFF_ENV} names unknown rules {sorted(unknown)}; rules: {', '.join(RULES)}")
    return rule not in off


def poison(t: torch.Tensor) -> None:
    """Fill `t` with the pattern an unfinished op's output holds."""
    if t.dtype.is_floating_point or t.dtype.is_complex:
        t.fill_(float("nan"))
    elif t.dtype == torch.bool:
        t.fill_(True)
    else:
        info = torch.iinfo(t.dtype)
        t.fill_(info.min if info.min < 0 else info.max)


def _poisoned_like(t: torch.Tensor) -> torch.Tensor:
    out = torch.empty_like(t)
    poison(out)
    return out


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality (NaN equals NaN)."""
    if a.dtype.is_floating_point:
        return bool(((a == b) | (a.isnan() & b.isnan())).all())
    return torch.equal(a, b)


def _overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


# -- Works -------------------------------------------------------------------------------------------------------
class ModelWork(dist.Work):
    """One pending op (or batch): completes when its stream ran it; hands over its outputs at the wait."""

    def __init__(self, what: str, inputs: list[torch.Tensor], outputs: list[torch.Tensor]):
        super().__init__()
        self.what = what
        self.posted_at = time.monotonic()
        self.watched = False
        """Seen past its group's timeout by the watchdog (`watchdog`)."""
        self._done = threading.Event()
        self._error: BaseException | None = None
        self._delivered = False
        self._cut = False
        self._lock = threading.Lock()
        self._poisoned: list[torch.Tensor] = []
        if not rule_on("async"):  # gloo's way: the op reads and writes the caller's buffers directly
            self._inputs = [(t, t) for t in inputs]
            self._outputs = [(t, t) for t in outputs]
            return
        # Outputs: the op writes a private buffer; the caller's holds poison until the wait copies the result in.
        # An input that aliases an output (in-place collectives) travels in that output's private copy.
        self._outputs = [(t, t.clone() if any(_overlaps(t, i) for i in inputs) else _poisoned_like(t))
                         for t in outputs]
        # Other inputs: a snapshot travels, and the caller's buffer must stay unchanged until the wait.
        self._inputs = [(t, t.clone()) for t in inputs if not any(_overlaps(t, o) for o in outputs)]
        for t in outputs:
            poison(t)
        self._poisoned = [t.clone() for t in outputs]

    # what the stream's worker sees
    def sent(self) -> list[torch.Tensor]:
        """The tensors the op reads (snapshots under the async rule)."""
        return [s for _, s in self._inputs]

    def received(self) -> list[torch.Tensor]:
        """The private buffers the op writes."""
        return [p for _, p in self._outputs]

    def finish(self, error: BaseException | None = None) -> None:
        with self._lock:
            if self._done.is_set():
                return
            self._error = error
            self._done.set()

    def cut(self) -> None:
        """End the op as an abort ends its kernel: complete, no error, outputs partly written (`_deliver`)."""
        with self._lock:
            if self._done.is_set():
                return
            self._cut = True
            self._done.set()

    # the caller's side
    def wait(self, timeout: timedelta | None = None) -> bool:
        seconds = None if timeout is None or timeout == timedelta(0) else timeout.total_seconds()
        if not self._done.wait(seconds):
            raise RuntimeError(f"nccl_model: {self.what} did not complete within {timeout}")
        self._deliver()
        return True

    def is_completed(self) -> bool:
        if not self._done.is_set():
            return False
        if self._error is None:
            self._deliver()
        return True

    def is_success(self) -> bool:
        return self._done.is_set() and self._error is None

    def exception(self):
        return self._error

    def get_future(self):
        fut = torch.futures.Future()
        self.wait()
        fut.set_result([o for o, _ in self._outputs])
        return fut

    def _deliver(self) -> None:
        with self._lock:
            if self._error is not None:
                raise self._error
            if self._delivered:
                return
            self._delivered = True
            if self._cut:  # what reached the buffer before the abort: some chunks, the memory's old bytes elsewhere
                for t, private in self._outputs:
                    if private is not t and t.is_contiguous():
                        for i, (dst, src) in enumerate(zip(t.view(-1).chunk(CHANNELS),
                                                           private.view(-1).chunk(CHANNELS))):
                            if i % 2 == 0:
                                dst.copy_(src)
                return
            for t, snap in self._inputs:
                if not _same(t, snap):
                    raise RuleViolation(f"nccl_model: an input of {self.what} ({tuple(t.shape)}, {t.dtype}) was "
                                        "written before the op's Work completed; NCCL reads it asynchronously "
                                        "and would have sent whatever it held then")
            for (t, private), seen in itertools.zip_longest(self._outputs, self._poisoned):
                if seen is not None and not _same(t, seen):
                    raise RuleViolation(f"nccl_model: the output of {self.what} ({tuple(t.shape)}, {t.dtype}) was "
                                        "written before the op's Work completed; NCCL would overwrite it")
                if private is not t:
                    t.copy_(private)


# -- the device: one per process -----------------------------------------------------------------------------------
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


# -- the stream: one op at a time per communicator ----------------------------------------------------------------
@dataclass
class _Op:
    work: ModelWork
    run: Callable[[ModelWork], list]
    """Posts the op's gloo works (on the work's private buffers) and returns them."""
    p2p: list[tuple[str, int, int]] = field(default_factory=list)
    """(kind, peer, index) of every point-to-point message: the index-th message between the pair that way."""
    number: int = 0
    behind_stop: bool = False
    """Posted after the device stopped: it never starts."""
    started: list | None = None
    """The gloo works, when the op was started at posting (the `order` rule off)."""


class ModelGroup(dist.ProcessGroup):
    """An NCCL-like communicator over a gloo group of the same ranks."""

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
        self._pending: set[ModelWork] = set()
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
        _GROUPS.add(self)

    def getBackendName(self) -> str:
        return NAME

    # -- posting -----------------------------------------------------------------------------------------------
    def _post(self, what: str, inputs, outputs, run, p2p=()) -> ModelWork:
        if self._aborted:
            raise Aborted(f"nccl_model: {what} on an aborted communicator ({self._aborted})")
        if self._gloo is None:
            with self._creating:
                if self._gloo is None:
                    self._create(what)
                    self._gloo = ProcessGroupGloo(*self._transport)
        if rule_on("watchdog"):
            self._behind_the_watchdog()
        work = ModelWork(what, list(inputs), list(outputs))
        with self._lock:  # with the abort's check: an op posted as another thread aborts is refused, never left pending
            if self._aborted:
                raise Aborted(f"nccl_model: {what} on an aborted communicator ({self._aborted})")
            self._pending.add(work)
            if not self._posted:  # NCCL creates a communicator at its group's first op
                _CREATED.append(self._size)
            self._posted += 1
        op = _Op(work, run, list(p2p), next(self._numbers), _stopped.is_set())
        if not self._ordered and not op.behind_stop:  # gloo's way: every op starts as it is posted
            op.started = run(work)
        self._queue.put(op)
        return work

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

    def ops_posted(self) -> int:
        """Operations posted on this communicator so far (a batch counts once): NCCL's own sequence number."""
        return self._posted

    def _message(self, kind: str, peer: int) -> int:
        n = self._counts.get((kind, peer), 0)
        self._counts[(kind, peer)] = n + 1
        return n

    def _tag(self, tag: int) -> int:
        return 0 if rule_on("tags") else tag

    # -- the worker ------------------------------------------------------------------------------------------------
    def _next(self, op: _Op, broken: BaseException | None) -> BaseException | None:
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

    def _end(self, work: ModelWork, error: BaseException | None) -> None:
        with self._lock:
            self._pending.discard(work)
            if not work.watched and time.monotonic() > work.posted_at + self._timeout_s:
                self._late.append(work.posted_at + self._timeout_s)  # the watchdog caught it before it ended
        work.finish(error)

    def _rendezvous(self, op: _Op) -> None:
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

    # -- point to point ----------------------------------------------------------------------------------------------
    def send(self, tensors, dst: int, tag: int = 0):
        (t,) = tensors
        if self._batch is not None:
            self._batch.append(("send", t, dst, tag))
            return None
        n = self._message("send", dst)
        return self._post(f"send #{n} to rank {dst}", [t], [],
                          lambda w: [self._gloo.send(w.sent(), dst, self._tag(tag))], [("send", dst, n)])

    def recv(self, tensors, src: int, tag: int = 0):
        (t,) = tensors
        if self._batch is not None:
            self._batch.append(("recv", t, src, tag))
            return None
        n = self._message("recv", src)
        return self._post(f"recv #{n} from rank {src}", [], [t],
                          lambda w: [self._gloo.recv(w.received(), src, self._tag(tag))], [("recv", src, n)])

    def batch(self, post: Callable[[], None]):
        """Run `post` (which posts sends and receives on this group) as one fused batch: one Work."""
        self._batch = []
        try:
            post()
            ops, self._batch = self._batch, None
        finally:
            self._batch = None
        involved = {peer for _, _, peer, _ in ops} | {self._rank}
        if not self._posted and rule_on("first") and len(involved) < self._size:
            raise RuleViolation(f"nccl_model: a batch with ranks {sorted(involved)} of {self._size} is the first op "
                                "of its communicator; its first op must involve every rank (start with a collective)")
        p2p = [(kind, peer, self._message(kind, peer)) for kind, _, peer, _ in ops]
        sends = [t for kind, t, _, _ in ops if kind == "send"]
        recvs = [t for kind, t, _, _ in ops if kind == "recv"]

        def run(w: ModelWork) -> list:
            sent, got, works = iter(w.sent()), iter(w.received()), []
            for kind, _, peer, tag in ops:
                if kind == "send":
                    works.append(self._gloo.send([next(sent)], peer, self._tag(tag)))
                else:
                    works.append(self._gloo.recv([next(got)], peer, self._tag(tag)))
            return works

        what = "batch of " + ", ".join(f"{k} #{n} {'to' if k == 'send' else 'from'} rank {p}" for k, p, n in p2p)
        return self._post(what, sends, recvs, run, p2p)

    # -- collectives ------------------------------------------------------------------------------------------------
    def allreduce(self, tensors, opts=None):
        opts = opts or dist.AllreduceOptions()
        return self._post("allreduce", tensors, tensors, lambda w: [self._gloo.allreduce(w.received(), opts)])

    def allreduce_coalesced(self, tensors, opts=None):
        def run(w):
            one = dist.AllreduceOptions()
            one.reduceOp = opts.reduceOp
            return [self._gloo.allreduce([t], one) for t in w.received()]
        return self._post("allreduce_coalesced", tensors, tensors, run)

    def broadcast(self, tensors, opts=None):
        opts = opts or dist.BroadcastOptions()
        root = opts.rootRank == self._rank
        return self._post("broadcast", tensors, [] if root else tensors,
                          lambda w: [self._gloo.broadcast(w.sent() if root else w.received(), opts)])

    def reduce(self, tensors, opts=None):
        return self._post("reduce", tensors, tensors, lambda w: [self._gloo.reduce(w.received(), opts)])

    def barrier(self, opts=None):
        return self._post("barrier", [], [], lambda w: [self._gloo.allreduce([torch.zeros(1)])])

    def allgather(self, output_lists, inputs, opts=None):
        outs = [t for ts in output_lists for t in ts]
        sizes = [len(ts) for ts in output_lists]

        def run(w):
            return [self._gloo.allgather(_split(w.received(), sizes), self._inputs_for(w, inputs, outs),
                                         opts or AllgatherOptions())]
        return self._post("allgather", inputs, outs, run)

    def all_gather_single(self, output, input, opts=None):
        return self._all_gather_many([output], [input], opts, "all_gather_into_tensor")

    def all_gather_single_coalesced(self, outputs, inputs, opts=None):
        return self._all_gather_many(outputs, inputs, opts, "all_gather_into_tensor_coalesced")

    allgather_into_tensor_coalesced = all_gather_single_coalesced

    def _all_gather_many(self, outputs, inputs, opts, what):
        def run(w):
            sent = self._inputs_for(w, inputs, outputs)
            return [self._gloo._allgather_base(o, i, AllgatherOptions()) for o, i in zip(w.received(), sent)]
        return self._post(what, inputs, outputs, run)

    def reduce_scatter(self, outputs, input_lists, opts=None):
        ins = [t for ts in input_lists for t in ts]

        def run(w):
            sent = _split(self._inputs_for(w, ins, outputs), [len(ts) for ts in input_lists])
            return [self._gloo.reduce_scatter(w.received(), sent, opts)]
        return self._post("reduce_scatter", ins, outputs, run)

    def reduce_scatter_single(self, output, input, opts=None):
        return self._reduce_scatter_many([output], [input], opts, "reduce_scatter_tensor")

    def reduce_scatter_single_coalesced(self, outputs, inputs, opts=None):
        return self._reduce_scatter_many(outputs, inputs, opts, "reduce_scatter_tensor_coalesced")

    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced

    def _reduce_scatter_many(self, outputs, inputs, opts, what):
        def run(w):
            sent = self._inputs_for(w, inputs, outputs)
            one = dist.ReduceScatterOptions()
            one.reduceOp = opts.reduceOp
            return [self._gloo._reduce_scatter_base(o, i, one) for o, i in zip(w.received(), sent)]
        return self._post(what, inputs, outputs, run)

    def all_to_all_single(self, output, input, output_splits, input_splits, opts=None):
        def run(w):
            (sent,) = self._inputs_for(w, [input], [output])
            return [self._gloo.alltoall_base(w.received()[0], sent, output_splits, input_splits,
                                             opts or dist.AllToAllOptions())]
        return self._post("all_to_all_single", [input], [output], run)

    def alltoall(self, outputs, inputs, opts=None):
        def run(w):
            return [self._gloo.alltoall(w.received(), self._inputs_for(w, inputs, outputs),
                                        opts or dist.AllToAllOptions())]
        return self._post("alltoall", inputs, outputs, run)

    @staticmethod
    def _inputs_for(work: ModelWork, inputs, outputs) -> list[torch.Tensor]:
        """The tensors an out-of-place op reads: the snapshots, with inputs that alias an output (in-place
        all-gather or reduce-scatter) read from the private copy of that output."""
        snaps = iter(work.sent())
        out = []
        for t in inputs:
            home = next((i for i, o in enumerate(outputs) if _overlaps(t, o)), None)
            if home is None:
                out.append(next(snaps))
                continue
            o, private = outputs[home], work.received()[home]
            offset = t.storage_offset() - o.storage_offset()
            out.append(private.view(-1)[offset:offset + t.numel()].view_as(t).clone())
        return out


def _split(flat: list, sizes: list[int]) -> list[list]:
    """Cut a flat list back into consecutive lists of the given sizes (torch's list-of-lists collectives)."""
    out, i = [], 0
    for n in sizes:
        out.append(flat[i:i + n])
        i += n
    return out


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


# -- registration ---------------------------------------------------------------------------------------------
def _create(opts, options) -> ModelGroup:
    """A group of the model, from torch's extended backend arguments and the group's options, whose shape is
    `ProcessGroupNCCL.Options`' (`config.blocking`: 0 non-blocking, 1 blocking; unset: TORCH_NCCL_USE_COMM_NONBLOCKING,
    as torch's `useNonblocking` reads them)."""
    chosen = getattr(getattr(options, "config", None), "blocking", None)
    blocking = chosen != 0 if chosen is not None else os.environ.get(NONBLOCKING_ENV, "0") not in ("1", "true")
    return ModelGroup(opts.store, opts.group_rank, opts.group_size, opts.timeout, blocking)


_batch_isend_irecv = dist.distributed_c10d.batch_isend_irecv


def batch_isend_irecv(p2p_op_list):
    """torch's `batch_isend_irecv`, with NCCL's coalesced result (one Work) for nccl_model groups."""
    group = p2p_op_list[0].group if p2p_op_list else None
    group = group if group is not None else dist.distributed_c10d._get_default_group()
    if not isinstance(group, ModelGroup):
        return _batch_isend_irecv(p2p_op_list)

    def post():
        for op in p2p_op_list:
            key = "group_dst" if op.op is dist.isend else "group_src"
            op.op(op.tensor, group=op.group, tag=op.tag, **{key: op.group_peer})

    work = group.batch(post)
    return [work] if rule_on("coalesce") else [work] * len(p2p_op_list)


device.register(NAME, record_event, hang_device, synchronize)
if NAME.upper() not in dist.Backend._plugins:
    dist.Backend.register_backend(NAME, _create, extended_api=True, devices=["cpu"])
    dist.distributed_c10d.batch_isend_irecv = batch_isend_irecv
    dist.batch_isend_irecv = batch_isend_irecv
