"""Everything that crosses the wire: collectives, pairwise exchanges and control traffic, each on a named group.

The rules NCCL imposes, kept on gloo too, so one code path is right on both:
- a data call's tensors live on its group's device (`device_of`): the current CUDA device under NCCL, CPU under
  gloo; a tensor elsewhere is refused here, with the call named, instead of failing inside NCCL;
- small host-side control traffic (the ready vote, metadata, Python objects) goes over a gloo *control* group,
  never an NCCL group, so it is synchronous and needs no device;
- a pairwise exchange posts all of a rank's sends and receives of one call together (`batch_isend_irecv`) and
  never relies on tags: messages between two ranks match in the order they are posted;
- every wait is bounded: it ends when the work completes, when the liveness watcher declares a peer dead
  (`PeerFailure`), or at the group's timeout. gloo cannot interrupt a blocked operation (its abort does not
  unblock a wait), so gloo collectives are waited on in slices that look at the verdict; a gloo point-to-point
  wait cannot be sliced and is ended by fencing the dead peer (its launcher kills it, its connections close). An
  NCCL work's `wait` only orders the current stream; a blocked NCCL kernel is ended by aborting the communicators
  (`peer_failed`).

Nothing received is used on the strength of its wait alone. Under NCCL an op cut by an abort reports complete and
its wait returns without raising, its buffer holding part of the message; so every data op is entered in a ledger,
and its arrival counts as proven only once its completion was seen while its communicator was live (`Posted`):
whoever consumes received data asks `Exchange.proven` or `proven(entries)`, and every abort first looks at the
ops still in flight on the communicators it aborts.

Every call is offered to the recorders (`recording()`), which tests use to check the rules above on real runs,
and counted by the traffic meter (`traffic()`): bytes this rank posted to send and to receive, per call name,
measured on the tensors (and pickled objects) handed to torch.distributed, so a report never quotes a plan.
"""

from __future__ import annotations

import contextlib
import gc
import itertools
import logging
import pickle
import threading
import time
import weakref
from collections import Counter, deque
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Callable, Mapping, Sequence

import torch
import torch.distributed as dist

from ntp_ds.comm import device
from ntp_ds.comm.failures import PeerFailure

log = logging.getLogger(__name__)

SLICE_S = 0.1
"""How often a blocked gloo wait looks at the liveness verdict."""

NCCL_LIKE = ("nccl", "nccl_model")
"""Backends with NCCL's rules: `nccl_model` (ntp_ds.testing.nccl_model) keeps them on CPU, and takes every branch
NCCL takes, so no code path runs only on GPUs."""


@dataclass(frozen=True)
class CallRecord:
    """One call as the recorders see it: what, on which group and backend, with which tensors and peers."""

    op: str
    rank: int
    backend: str
    group_ranks: tuple[int, ...]
    devices: tuple[str, ...]
    dtypes: tuple[str, ...]
    sends: tuple[tuple[int, int], ...] = ()
    """(peer, numel) of every send posted in this call (pairwise exchanges only)."""
    recvs: tuple[tuple[int, int], ...] = ()
    """(peer, numel) of every receive posted in this call."""
    expected_device: str = ""
    """The device type this call's group requires of its tensors."""
    generation: int = 0
    """How many generations this process had joined when it made the call."""


@dataclass
class _State:
    timeout_s: float = 300.0
    failed: threading.Event = field(default_factory=threading.Event)
    reason: str = ""
    control: object = None
    generation: int = 0
    tree: tuple | None = None
    """This rank's groups of the generation's control tree, lowest level first (`TreeGroup`)."""
    recorders: list = field(default_factory=list)
    traffic: Counter = field(default_factory=Counter)
    backend: str = ""
    """The generation's default backend, read when it began: torch forgets it once the groups are aborted."""
    backends: weakref.WeakKeyDictionary = field(default_factory=weakref.WeakKeyDictionary)
    aborted: bool = False
    """The generation's communicators were aborted: nothing can be posted on them any more."""
    suspects: frozenset | None = None
    """Global ranks the verdict made suspect: the dead and the rest of their replicas (None: every group is)."""
    departed: Callable | None = None
    """departed(group): the operations posted on `group` by the members that left it for a recovery, -1 if they
    differ, None while none has (`on_departure`)."""
    aborted_groups: weakref.WeakSet = field(default_factory=weakref.WeakSet)
    """Groups aborted one by one (the rest of the generation's stay usable)."""
    spared: list = field(default_factory=list)
    """Under NCCL, the groups a failure's abort left alone (none of their members is dead) until the recovery meets
    them (`arrive`): the groups a recovery may keep."""
    arrived: threading.Event = field(default_factory=threading.Event)
    """The training thread reached the recovery after a failure (so it is blocked on no kernel)."""
    handed: list = field(default_factory=list)
    """Under NCCL, the spared groups `arrive` handed to the recovery, still watched for departures until the
    recovery has decided which it keeps (`stop_watching`)."""
    routes: dict | None = None
    """peer -> the group a pairwise exchange with that peer runs on (`set_routes`); None: the default group."""
    route_order: dict = field(default_factory=dict)
    """group -> its place in the order every rank posts an exchange's batches in (a family's TP index)."""
    open_pair: Callable | None = None
    """open_pair(peer): a group of this rank and `peer` alone, for a peer no route reaches (built at first use)."""
    copy_routes: dict | None = None
    """peer -> the group the state copies with that peer run on, where they have a lane of their own (`set_routes`);
    None: they share the routes of every other exchange."""
    ledger: dict = field(default_factory=dict)
    """group -> the data ops posted on it in this generation whose arrival is not proven yet (`Posted`), oldest
    first."""
    record_event: Callable | None = None
    """How the training thread records an event on its device (`ntp_ds.comm.device.recorder`; None: a host that
    computes synchronously)."""
    timed_event: Callable | None = None
    """How it marks a span of device time (`ntp_ds.comm.device.timer`; None: the host's clock is the device's)."""


_state = _State()


# -- configuration and liveness --------------------------------------------------------------------------------
@dataclass(frozen=True)
class TreeGroup:
    """One group of the generation's control tree that this rank belongs to (`ntp_ds.comm.groups.control_tree`)."""

    group: object
    leader: int
    """Its first member (global rank): the one that carries its reduction up and the result back down."""
    top: bool


def configure(timeout_s: float, control_group=None, tree=None) -> None:
    """Set the bound on every wait, the control group and the control tree (`TreeGroup`s, lowest level first; None:
    control reductions run on the control group) of this generation; clear any earlier failure."""
    _state.timeout_s = float(timeout_s)
    _state.control = control_group
    _state.tree = None if tree is None else tuple(tree)
    _state.backend = dist.get_backend() if dist.is_initialized() else ""
    _state.record_event = device.recorder(_state.backend)
    _state.timed_event = device.timer(_state.backend)
    _state.backends = weakref.WeakKeyDictionary()
    _state.aborted = False
    _state.aborted_groups = weakref.WeakSet()
    _state.suspects = None
    _state.spared = []
    _state.handed = []
    _state.arrived.clear()
    _state.routes, _state.route_order, _state.open_pair, _state.copy_routes = None, {}, None, None
    _state.ledger = {}
    _state.generation += 1
    _state.failed.clear()
    _state.reason = ""


def peer_failed(reason: str, suspects=None, arrival_s: float = 5.0) -> None:
    """Declare this generation broken (called by the liveness watcher's thread when a peer is dead).

    Every wait in progress or to come on a group that holds one of `suspects` raises `PeerFailure` (with no
    suspects named, every wait). Under NCCL those communicators are aborted as well, which is what ends a kernel
    blocked on the dead peer (requires TORCH_NCCL_ASYNC_ERROR_HANDLING=0, set by `join`); the abort runs on a thread
    of its own: aborting can take seconds, and the watcher must go on beating.

    `suspects`: global ranks, the dead and the rest of their replicas (whose groups change with the topology). The
    groups without any (a healthy replica's TP group), and the default group, which holds everyone, are left to the
    recovery to keep, if the training thread reaches it (`arrive`) within `arrival_s`. Meanwhile one of them whose
    members have left it for the recovery having posted fewer operations on it than this rank (`on_departure`)
    holds an operation of this rank that nobody will match, which the training thread may be blocked on, directly
    or through the device: a wait on it ends, and under NCCL it is aborted at once. What is still spared when the
    arrival bound passes is aborted then. The groups the training thread takes over when it arrives stay watched
    the same way until the recovery has decided which it keeps (`stop_watching`): on a GPU its host may have run
    ahead of such an operation, and its next device sync (the snapshot's) would wait on it for ever.
    """
    if _state.failed.is_set():
        return
    _state.reason = reason
    _state.suspects = None if suspects is None else frozenset(suspects)
    _state.failed.set()
    if is_nccl():
        log.warning("aborting NCCL communicators: %s", reason)
        threading.Thread(target=_abort_for, args=(_state.generation, _state.suspects, arrival_s), name="ntp-abort",
                         daemon=True).start()


def _abort_for(generation: int, suspects, arrival_s: float) -> None:
    if suspects is None:
        abort_all(generation)
        return
    with _abort_lock:
        if generation != _state.generation or _state.aborted:
            return
        default = dist.distributed_c10d._get_default_group() if dist.is_initialized() else None
        _state.spared = [g for g in list(dist.distributed_c10d._world.pg_map)
                         if g is not default and not suspects & set(dist.get_process_group_ranks(g))]
    abort_all(generation, spare=_state.spared)
    deadline = time.monotonic() + arrival_s
    while generation == _state.generation:
        if _state.arrived.is_set():  # a look a second (DEPARTURE_CHECK_S): what it guards is rare, the store busy
            time.sleep(DEPARTURE_CHECK_S)
            arrived = True
        else:
            arrived = _state.arrived.wait(DEPARTURE_POLL_S)
        # A spared group whose members left for the recovery with fewer operations posted on it than this rank holds
        # an operation of this rank they will never match; the training thread may be blocked on it (in its wait,
        # or on the device behind its kernel): abort that group now, not at the arrival bound.
        with _abort_lock:
            watched = list(_state.handed if arrived else _state.spared)
        if arrived and not watched:
            return
        # Before the arrival a look that cannot tell aborts (the training thread may be blocked); after it, it does
        # not: the recovery meanwhile takes its groups out of torch's registry for a while (`set_aside`), and an
        # abort on a guess would drop a group its peers keep.
        lost = [g for g in watched if _departed(g, guess=not arrived)]
        if lost:
            with _abort_lock:
                if generation == _state.generation:
                    if _state.arrived.is_set():
                        lost = [g for g in lost if g in _state.handed]
                        _state.handed = [g for g in _state.handed if g not in lost]
                    else:
                        lost = [g for g in lost if g in _state.spared]
                        _state.spared = [g for g in _state.spared if g not in lost]
                    _abort_groups(lost)
        if not arrived and time.monotonic() > deadline:
            with _abort_lock:
                if generation == _state.generation and not _state.arrived.is_set() and _state.spared:
                    log.warning("the training thread did not reach the recovery within %.1f s: aborting the rest",
                                arrival_s)
                    _abort_groups(_state.spared)
                    _state.spared = []
            return


def arrive() -> list:
    """The training thread has reached the recovery (under NCCL): return the groups spared by the failure's abort
    (`peer_failed`), which stay usable, and abort everything else (all of it, when no abort spared any)."""
    with _abort_lock:
        _state.arrived.set()
        spared = [g for g in _state.spared if g in dist.distributed_c10d._world.pg_map]
        _state.spared = []
        _state.handed = list(spared)
        abort_all(_state.generation, spare=spared)
        return spared


def stop_watching(kept) -> list:
    """The recovery has decided to keep `kept` of the groups `arrive` handed it: stop watching them for departures
    and return those not aborted meanwhile (none, when the members decided alike: a departure that aborts a group
    also makes its members' counts differ, `keep.keep`)."""
    with _abort_lock:
        _state.handed = []
        return [g for g in kept if g not in _state.aborted_groups]


_WIRE_FILES = ("/torch/distributed/", "/deepspeed/comm/", "/ntp_ds/comm/wire.py", "/ntp_ds/testing/nccl_model.py")
"""Where an error raised by a collective or point-to-point op comes from (its traceback passes through one)."""


_OWN_DEVICE_ERRORS = tuple(t for t in (getattr(torch, "AcceleratorError", None),) if t is not None)
"""Errors of this rank's own device, never the wire's."""


def is_wire_failure(error: BaseException) -> bool:
    """Whether `error` is a failure of the wire (a collective or point-to-point op that failed, timed out or was
    aborted: a peer's failure, to recover from) rather than this rank's own error (out of memory, a shape or dtype
    bug, an assertion, a device error: this rank ends, its peers recover without it).

    Once the generation is broken (a peer was declared dead, the communicators aborted), whatever fails next is its
    consequence: DeepSpeed's own calls, for one, assert on an aborted world. But an error of this rank's own device
    (`torch.AcceleratorError`: an Xid, an illegal address, an uncorrectable ECC error) is its own wherever it
    surfaces, a collective's frame included: the context is dead, and a recovery on it would fail or hang."""
    if isinstance(error, _OWN_DEVICE_ERRORS):
        return False
    if _state.failed.is_set() or _state.aborted or isinstance(error, (PeerFailure, TimeoutError, ConnectionError)):
        return True
    if not isinstance(error, RuntimeError) or isinstance(error, torch.OutOfMemoryError):
        return False
    tb = error.__traceback__
    while tb is not None:
        if any(part in tb.tb_frame.f_code.co_filename for part in _WIRE_FILES):
            return True
        tb = tb.tb_next
    return False


def abort_all(generation: int | None = None, spare=()) -> None:
    """Abort every communicator of this process but those of `spare` (NCCL); the aborted process groups are unusable
    afterwards. `generation`: only if that generation is still the current one (an abort ordered for a generation
    this rank has left must not touch the next one's groups).

    torch's abort clears its registry of groups only after it has aborted each of them, while the training thread,
    woken by the first, may already be leaving the generation: the lock keeps `teardown` from running meanwhile."""
    with _abort_lock:
        if generation is not None and generation != _state.generation:
            return
        world = dist.distributed_c10d._world
        left = [g for g in world.pg_map if g not in spare and g not in _state.aborted_groups]
        if _state.aborted and not left:
            return
        _state.aborted = True
        try:
            if spare:  # each alone, all registered still: the spared ones are never out of torch's registry
                _abort_groups(left)
            elif dist.is_initialized():
                _observe(left)  # not the groups set aside to be kept (`set_aside`): their ops are not cut
                dist.distributed_c10d._abort_process_group()
            else:  # the world already aborted, groups spared then left: each alone
                _abort_groups(left)
        except Exception as err:  # aborting is best effort: the groups are discarded either way
            log.warning("abort of the process groups failed: %s", err)


def _abort_groups(groups) -> None:
    """Abort `groups`, within one NCCL group call where NCCL is underneath (as torch aborts its world, so that no
    two communicators' aborts wait on each other, pytorch#119797). They stay in torch's registry, marked aborted
    here (`_check` refuses them) until the teardown discards them. What completed on them by now is proven first."""
    _observe(groups)
    nccl = None
    if dist.is_nccl_available():
        for group in groups:
            try:
                backend = group._get_backend(torch.device("cuda"))
            except RuntimeError:
                continue
            if isinstance(backend, dist.ProcessGroupNCCL):
                nccl = backend
                break
    if nccl is not None:
        nccl._group_start()
    try:
        for group in groups:
            _state.aborted_groups.add(group)
            try:
                group.abort()
            except Exception as err:
                log.warning("abort of a process group failed: %s", err)
    finally:
        if nccl is not None:
            nccl._group_end()


_abort_lock = threading.RLock()


@contextlib.contextmanager
def set_aside(groups):
    """Take `groups` out of torch's registry of process groups for the block, and put them back after: a destroy of
    the whole world (torch's only way to end a default group) then leaves them alone, connections and communicators
    included. Their global ranks are the old world's until `ntp_ds.comm.groups.adopt` renumbers them."""
    c10d = dist.distributed_c10d
    world = c10d._world
    saved = [(g, *world.pg_map[g], world.pg_names[g], world.pg_backend_config[g], dict(world.pg_group_ranks[g]),
              world.pg_to_tag.get(g)) for g in groups if g in world.pg_map]
    for entry in saved:
        c10d._cleanup_process_group_global_state(entry[0])
    try:
        yield
    finally:
        for group, backend, store, name, config, ranks, tag in saved:
            c10d._register_pg_in_world(group, backend, store, name, config, ranks, pg_tag=tag)


def discard(groups) -> None:
    """Close `groups` (kept across a teardown, then not kept): abort under NCCL, else shut down; out of torch's
    registry either way."""
    c10d = dist.distributed_c10d
    for group in groups:
        if group not in c10d._world.pg_map:
            continue
        try:
            if is_nccl(group):
                _abort_groups([group])
            else:
                group.shutdown()
        except Exception as err:
            log.debug("closing a process group: %s", err)
        c10d._cleanup_process_group_global_state(group)


def ops_posted(group) -> int:
    """How many operations this process has posted on `group` (torch's per-group sequence number; the NCCL model's
    own count): members of a group that agree on it have no operation of it left unmatched."""
    counted = getattr(group, "ops_posted", None)
    return int(counted() if callable(counted) else group._get_sequence_number_for_group())


def teardown(keep=()) -> None:
    """Leave this generation's process groups but those of `keep` (a recovery keeps them for the next generation:
    `ntp_ds.comm.groups.adopt`). A group already aborted is not an error (it cannot be destroyed afterwards, and is
    discarded instead).

    Gloo closes a group's connections when its last reference goes, and a live peer still waiting on this rank then
    fails at once instead of at its timeout. Release the engine first (`NTPEngine.release`); a group something
    still holds in a reference cycle is freed by a full garbage collection here, which costs a fraction of a second
    on a heap the size of DeepSpeed's, so it runs only when a group survives.
    """
    with _abort_lock:
        _teardown(keep)


def _teardown(keep) -> None:
    from deepspeed.utils import groups as ds_groups

    keep = [g for g in keep if g in dist.distributed_c10d._world.pg_map]
    # The ops of the groups kept stay in the ledger (`drained`); the others' go (their groups would not close while
    # named there; what was unproven stays unproven: `_prove`).
    _state.ledger = {g: q for g, q in _state.ledger.items() if g in keep}
    groups = [weakref.ref(g) for g in dist.distributed_c10d._world.pg_map if g not in keep]
    with set_aside(keep):
        if dist.is_initialized():
            if is_nccl():
                abort_all()  # a communicator with a dead peer can block its own destruction
            try:
                dist.destroy_process_group()
            except (AssertionError, RuntimeError, ValueError) as err:  # already aborted: nothing left to destroy
                log.debug("destroy_process_group after abort: %s", err)
        else:  # no world (aborted, or left), but groups kept from it and not kept now
            discard(list(dist.distributed_c10d._world.pg_map))
    # DeepSpeed caches groups in module globals; a new generation must not find the old ones there.
    release = getattr(ds_groups, "_release_process_group_references", None)
    if release is None:
        raise RuntimeError("this DeepSpeed version cannot release its cached process groups; live recovery needs "
                           "deepspeed>=0.19.8")
    release(group=None)
    _state.control = _state.tree = None
    _state.routes, _state.route_order, _state.open_pair, _state.copy_routes = None, {}, None, None
    if any(g() is not None for g in groups):
        gc.collect()
        log.debug("process groups held in reference cycles were collected")


# -- the training thread's progress -------------------------------------------------------------------------------
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


# -- devices and records ---------------------------------------------------------------------------------------
def backend_of(group=None) -> str:
    """A group's backend (default: the generation's), still known after the groups were aborted (torch forgets
    them then: `dist.get_backend` raises ValueError)."""
    if group is None:
        if _state.backend:
            return _state.backend
        return dist.get_backend()
    try:
        return _state.backends[group]
    except (KeyError, TypeError):
        pass
    try:
        name = dist.get_backend(group)
    except (ValueError, RuntimeError):  # aborted or destroyed before it was ever asked about
        return _state.backend or "gloo"
    try:
        _state.backends[group] = name
    except TypeError:
        pass
    return name


def is_nccl(group=None) -> bool:
    """Whether a group keeps NCCL's rules (NCCL itself or its CPU model)."""
    if group is None and not _state.backend and not dist.is_initialized():
        return False
    return backend_of(group) in NCCL_LIKE


def device_of(group=None) -> torch.device:
    """The device a group's tensors must live on."""
    if backend_of(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def settle_device() -> None:
    """Wait until the device has done what this host queued on it (CUDA: the current stream), before the host reads
    what device work wrote (non-blocking copies into host memory); nothing to wait for on the CPU."""
    for rec in _state.recorders:
        rec(CallRecord("settle_device", dist.get_rank() if dist.is_initialized() else -1, _state.backend, (), (), (),
                       generation=_state.generation))
    if _state.backend in NCCL_LIKE:
        with waiting():  # the stream holds collectives that wait on peers
            device.synchronize(_state.backend)


def has_control() -> bool:
    """Whether this process has joined a generation's control (a tree, or a control group)."""
    return _state.control is not None or _state.tree is not None


def control_group():
    """The gloo group of the whole generation that carries control traffic where no control tree is configured (the
    default group under gloo; under NCCL there is none: the tree carries it all)."""
    if _state.control is None:
        raise RuntimeError("no control group: join a generation first (ntp_ds.comm.groups.start_generation)")
    return _state.control


@contextlib.contextmanager
def recording():
    """Collect a CallRecord of every call made inside the block (in this process)."""
    records: list[CallRecord] = []
    _state.recorders.append(records.append)
    try:
        yield records
    finally:
        _state.recorders.remove(records.append)


def traffic() -> dict[tuple[str, str], int]:
    """Bytes this process has posted so far, per (call name, "sent" or "received"); subtract two readings to
    measure a stretch of work."""
    return dict(_state.traffic)


def traffic_since(before: dict[tuple[str, str], int]) -> dict[tuple[str, str], int]:
    """Bytes posted since the reading `before`, per (call name, direction), leaving out zeros."""
    return {k: v - before.get(k, 0) for k, v in _state.traffic.items() if v - before.get(k, 0)}


def _count(op: str, sent: int, received: int) -> None:
    _state.traffic[(op, "sent")] += sent
    _state.traffic[(op, "received")] += received


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _check(op: str, group, tensors, sends=(), recvs=()) -> None:
    if _state.aborted and (group is None or group in _state.aborted_groups
                           or group not in dist.distributed_c10d._world.pg_map):
        # torch no longer knows the group (aborted); NCCL would refuse an aborted communicator anyway. A group spared
        # by the abort (`peer_failed`) still carries its operations within their grace.
        raise PeerFailure(f"{op} not posted: this generation's communicators were aborted ({_state.reason})")
    expected = device_of(group)
    if _state.recorders:
        record = CallRecord(op, dist.get_rank(), backend_of(group),
                            tuple(dist.get_process_group_ranks(group or dist.group.WORLD)),
                            tuple(str(t.device) for t in tensors), tuple(str(t.dtype) for t in tensors),
                            tuple(sends), tuple(recvs), expected.type, _state.generation)
        for rec in _state.recorders:
            rec(record)
    for t in tensors:
        if t.device.type != expected.type:
            raise ValueError(f"{op}: a tensor on {t.device} was handed to a {backend_of(group)} group, "
                             f"whose tensors must live on {expected}")


# -- proofs of arrival -------------------------------------------------------------------------------------------
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


# -- waiting -----------------------------------------------------------------------------------------------------
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


# -- data path: collectives and pairwise exchanges ---------------------------------------------------------------
_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


def all_reduce(tensor: torch.Tensor, group, op: str = "sum", name: str = "all_reduce") -> torch.Tensor:
    """All-reduce `tensor` in place over `group` (a group of one is a no-op) and return it; `name` labels the call
    in records and errors."""
    if group is not None and dist.get_world_size(group) == 1:
        return tensor
    _check(name, group, [tensor])
    _count(name, _nbytes([tensor]), _nbytes([tensor]))
    work = dist.all_reduce(tensor, op=_OPS[op], group=group, async_op=True)
    wait(work, group, name, proofs=[_enter(work, group)])
    return tensor


def broadcast(tensor: torch.Tensor, src: int, group, name: str = "broadcast") -> torch.Tensor:
    """Broadcast `tensor` in place from global rank `src` over `group` and return it."""
    if group is not None and dist.get_world_size(group) == 1:
        return tensor
    _check(name, group, [tensor])
    mine = _nbytes([tensor])
    _count(name, mine if dist.get_rank() == src else 0, 0 if dist.get_rank() == src else mine)
    work = dist.broadcast(tensor, src=src, group=group, async_op=True)
    wait(work, group, name, proofs=[_enter(work, group)])
    return tensor


def control_all_reduce(tensor: torch.Tensor, op: str = "sum", name: str = "all_reduce") -> torch.Tensor:
    """All-reduce a small host tensor over the whole generation along its control tree and return it.

    Up: each group the rank belongs to, lowest first, reduces (the top group's members then hold the result). Down:
    a rank that is not in the top group receives the result from the leader of its highest group, and passes it on to
    each group it leads, highest first. O(fanout x log_fanout W) hops from leaf to leaf, against 2(W - 1) for a ring
    over the world; every rank ends with the same value (the top group's reduction, broadcast). Without a tree (a
    caller-built world, or none configured): one all-reduce over the control group."""
    tree = _state.tree
    if tree is None:
        return all_reduce(tensor, control_group(), op, name)
    for level in tree:
        all_reduce(tensor, level.group, op, name)
    if tree and not tree[-1].top:
        broadcast(tensor, tree[-1].leader, tree[-1].group, name)
    for level in reversed(tree[:-1]):
        broadcast(tensor, level.leader, level.group, name)
    return tensor


def open_for_batches(group) -> None:
    """Under NCCL, give `group` (None: the default group) its first op, an all-reduce of one element of all its
    members: a batch of point-to-point ops may then involve only some of them (torch leaves a first op that does not
    undefined). It creates the group's communicator. Nothing to do elsewhere."""
    if is_nccl():
        all_reduce(torch.zeros(1, device=device_of()), group)


def set_routes(routes: Mapping[int, object], order: Mapping[object, int], open_pair: Callable | None = None,
               copy_routes: Mapping[int, object] | None = None) -> None:
    """Route this generation's pairwise exchanges: the transfers with peer p run on `routes[p]` (a group of the
    exchange family both belong to: `ntp_ds.comm.groups.build_exchange_families`), so no exchange needs a
    communicator of the whole world. An exchange touching several groups posts one batch per group, in `order`
    (the same on every rank). A peer without a route gets a group of the pair alone from `open_pair` at first use.

    `copy_routes`: the lane of the state copies (`exchange(lane="copies")`), twins of the routes' groups. An NCCL
    communicator runs its ops one after another on one stream, so copies that travel during the next step
    (`redundancy_overlap`) would hold that step's parameter buckets and gradients behind them on a shared one."""
    _state.routes = dict(routes)
    _state.route_order = dict(order)
    _state.open_pair = open_pair
    _state.copy_routes = None if copy_routes is None else dict(copy_routes)


def has_copy_lane() -> bool:
    """Whether the state copies run on groups of their own in this generation (`set_routes`): only there may they
    be posted at points of their own (between micro-batches), since every other exchange on a group is posted at
    the same point of the step by every member, in one order."""
    return _state.copy_routes is not None


def _route(peers, lane: str = "data") -> dict:
    """group -> the peers of `peers` whose transfers run on it (None: the default group), for this generation, in
    `lane` ("copies": the state copies' own groups where they have them)."""
    if _state.routes is None:
        return {None: sorted(peers)}
    own = _state.copy_routes if lane == "copies" and _state.copy_routes is not None else {}
    out: dict = {}
    for p in sorted(peers):
        group = own.get(p)
        group = _state.routes.get(p) if group is None else group
        if group is None:
            if _state.open_pair is None:
                raise RuntimeError(f"no group of this generation joins rank {dist.get_rank()} and rank {p}")
            if _state.failed.is_set():  # no communicator is created in a broken generation: its peer may be dead
                raise PeerFailure(f"no group opened with rank {p}: {_state.reason}")
            group = _state.routes[p] = _state.open_pair(p)
        out.setdefault(group, []).append(p)
    return dict(sorted(out.items(), key=lambda item: (_state.route_order.get(item[0], len(_state.route_order)),
                                                      item[1][0])))


class Exchange:
    """Pending pairwise transfers posted together (one batch per group they run on); `wait()` completes them within
    the bound.

    NCCL coalesces a batch into ONE Work that completes, or fails, as a unit (gloo gives a Work per op): there,
    every transfer of a batch shares that Work, so completing the receives from one peer completes the batch.
    """

    def __init__(self, batches: list[tuple[list, list[tuple[str, int]], object]]):
        self._works = []  # ((kind, peer), work, group, Posted), until waited
        self._entries = []  # ((kind, peer), Posted): what proves each transfer arrived
        for works, peers, group in batches:
            if works and len(works) != len(peers):
                if len(works) != 1:
                    raise RuntimeError(f"batch_isend_irecv returned {len(works)} Works for {len(peers)} ops")
                works = works * len(peers)
            writes = any(kind == "recv" for kind, _ in peers)
            entries = {id(w): _enter(w, group, writes) for w in _distinct(works)}
            self._works += [(p, w, group, entries[id(w)]) for p, w in zip(peers, works)]
            self._entries += [(p, entries[id(w)]) for p, w in zip(peers, works)]

    def proven(self, peer: int | None = None) -> bool:
        """Whether the receives from `peer` (None: every transfer) are proven to have arrived: each op carrying them
        was seen complete while its communicator was live (`Posted`). A wait that returned is no such proof under
        NCCL; call this before keeping what arrived, once the device has run the receives (`settle_device`)."""
        return proven([e for p, e in self._entries if peer is None or p == ("recv", peer)])

    def wait_proven(self, what: str) -> None:
        """Complete every transfer, let the device run them, and raise `PeerFailure` unless each is proven to have
        arrived: for transfers whose data is kept at once (a recovery's)."""
        self.wait()
        require_arrived([self], what)

    def wait(self) -> None:
        """Complete every transfer (raises on the first that fails, and again at a later wait)."""
        _wait_by_group(self._works, True)
        self._works = []

    def wait_received(self, peer: int, heed_failure: bool = True) -> None:
        """Complete the receives from `peer` (with a coalesced batch: its whole batch), after a failure too, with
        `heed_failure=False`: a live peer's transfer still completes, a dead one's fails (and, coalesced, the
        batch with it)."""
        _wait_by_group([e for e in self._works if e[0] == ("recv", peer)], heed_failure)
        self._works = [e for e in self._works if e[0] != ("recv", peer)]  # (a failed wait keeps them: it fails again)


def _wait_by_group(entries, heed_failure: bool) -> None:
    by_group: dict = {}
    for _, work, group, posted in entries:
        by_group.setdefault(group, {}).setdefault(id(work), (work, posted))  # a coalesced Work once
    for group, works in by_group.items():
        works, proofs = zip(*works.values())
        wait(list(works), group, "exchange", p2p=True, heed_failure=heed_failure, proofs=list(proofs))


def _distinct(works) -> list:
    """Works in order, each once (a coalesced batch's Work stands for all of its ops)."""
    seen, out = set(), []
    for w in works:
        if id(w) not in seen:
            seen.add(id(w))
            out.append(w)
    return out


def exchange(sends: Mapping[int, torch.Tensor | Sequence[torch.Tensor]],
             recvs: Mapping[int, torch.Tensor | Sequence[torch.Tensor]], group=None,
             op: str = "exchange", lane: str = "data") -> Exchange:
    """Post every send and receive of this rank together; return the pending exchange.

    Peers are global ranks; a peer may be given several tensors, which travel as consecutive messages. Two exchanges
    between the same pair in the same `lane` must be posted in the same order on both sides. Without a `group`, each
    peer's transfers run on its route (`set_routes`) in `lane` ("data", or "copies": the state copies, on groups of
    their own where the generation built them): one batch per group, posted in the routes' order.
    """
    if lane not in ("data", "copies"):
        raise ValueError(f"lane={lane!r}: 'data' or 'copies'")
    sends = {p: [t] if torch.is_tensor(t) else list(t) for p, t in sends.items()}
    recvs = {p: [t] if torch.is_tensor(t) else list(t) for p, t in recvs.items()}
    peers = set(sends) | set(recvs)
    routed = {group: sorted(peers)} if group is not None or not peers else _route(peers, lane)
    _count(op, _nbytes(t for ts in sends.values() for t in ts), _nbytes(t for ts in recvs.values() for t in ts))
    batches = []
    for g, routed_peers in routed.items():  # an exchange with no peer still passes the checks (and is recorded)
        mine_s = {p: sends[p] for p in routed_peers if p in sends}
        mine_r = {p: recvs[p] for p in routed_peers if p in recvs}
        tensors = [t for ts in mine_s.values() for t in ts] + [t for ts in mine_r.values() for t in ts]
        _check(op, g, tensors, sends=[(p, t.numel()) for p, ts in sorted(mine_s.items()) for t in ts],
               recvs=[(p, t.numel()) for p, ts in sorted(mine_r.items()) for t in ts])
        ops, kinds = [], []
        for kind, table, fn in (("send", mine_s, dist.isend), ("recv", mine_r, dist.irecv)):
            for p, ts in sorted(table.items()):
                for t in ts:
                    ops.append(dist.P2POp(fn, t.contiguous() if kind == "send" else t, p, g))
                    kinds.append((kind, p))
        if ops:
            batches.append((dist.batch_isend_irecv(ops), kinds, g))
    return Exchange(batches)


# -- control path: votes, barriers and objects over the gloo control group -----------------------------------------
def vote(ready: bool, group=None, name: str = "vote") -> bool:
    """Whether every rank of the group (default: the generation) is ready; synchronous, over gloo. `name` labels
    the call in records."""
    flag = torch.tensor([1 if ready else 0], dtype=torch.int32)
    if group is None:
        return bool(control_all_reduce(flag, "min", name).item())
    return bool(all_reduce(flag, group, "min", name).item())


def barrier(group=None) -> None:
    """Every rank of the group (default: the generation, along the control tree) reaches this point; over gloo,
    bounded."""
    if group is None and _state.tree is not None:
        control_all_reduce(torch.zeros(1, dtype=torch.int32), "sum", "barrier")
        return
    group = group or control_group()
    _check("barrier", group, [])
    wait(dist.barrier(group=group, async_op=True), group, "barrier")


def sum_counts(values: list[float], group=None) -> list[float]:
    """Sum a few host numbers over the group (default: the generation, along the control tree), over gloo."""
    values = torch.tensor(values, dtype=torch.float64)
    if group is None:
        return control_all_reduce(values, "sum", "sum_counts").tolist()
    return all_reduce(values, group, "sum", "sum_counts").tolist()


def _tree_collect(mine: dict) -> dict:
    """Merge every rank's `mine` ({global rank: object}) along the control tree and return the merge on every rank.

    Up: each group a rank belongs to, lowest first, gathers its members' merges on its leader (a rank that does not
    lead the group has sent its part and goes no higher). Down: each group, highest first, broadcasts the whole
    from its leader (the top group's too: unlike a reduction, a gather leaves the whole on its leader alone). Two
    calls per group, a gather then a broadcast, in the same order on every member."""
    tree, me = _state.tree, dist.get_rank()
    held = dict(mine)
    for level in tree:
        parts = gather_object(held, level.leader, level.group)
        if me != level.leader:
            break
        held = {r: o for part in parts for r, o in part.items()}
    for level in reversed(tree):
        held = broadcast_object(held if me == level.leader else None, level.leader, level.group)
    return held


def all_gather_object(obj, group=None) -> list:
    """Every rank's `obj`, in group rank order (default: the generation's, along the control tree), over gloo."""
    if group is None and _state.tree is not None:
        merged = _tree_collect({dist.get_rank(): obj})
        return [merged[r] for r in range(dist.get_world_size())]
    group = group or control_group()
    _check("all_gather_object", group, [])
    out = [None] * dist.get_world_size(group)
    _bounded(lambda: dist.all_gather_object(out, obj, group=group), "all_gather_object")
    mine = _pickled(obj)
    _count("all_gather_object", mine * (len(out) - 1), sum(_pickled(o) for o in out) - mine)
    return out


def gather_object(obj, dst: int, group=None) -> list | None:
    """Every rank's `obj` on global rank `dst` (None elsewhere), over gloo."""
    group = group or control_group()
    _check("gather_object", group, [])
    out = [None] * dist.get_world_size(group) if dist.get_rank() == dst else None
    _bounded(lambda: dist.gather_object(obj, out, dst=dst, group=group), "gather_object")
    mine = _pickled(obj)
    if out is None:
        _count("gather_object", mine, 0)
    else:
        _count("gather_object", 0, sum(_pickled(o) for o in out) - mine)
    return out


def broadcast_object(obj, src: int, group=None):
    """`obj` of global rank `src`, on every rank of the group (default: the generation, along the control tree), over
    gloo."""
    if group is None and _state.tree is not None:
        return _tree_collect({src: obj} if dist.get_rank() == src else {})[src]
    group = group or control_group()
    _check("broadcast_object", group, [])
    box = [obj]
    _bounded(lambda: dist.broadcast_object_list(box, src=src, group=group), "broadcast_object")
    size = _pickled(box[0])
    _count("broadcast_object", size * (dist.get_world_size(group) - 1) if dist.get_rank() == src else 0,
           0 if dist.get_rank() == src else size)
    return box[0]


def _pickled(obj) -> int:
    """Bytes of an object as torch's object collectives send it (pickled)."""
    return len(pickle.dumps(obj))


def _bounded(call: Callable[[], None], what: str) -> None:
    """Run a blocking object collective (torch offers no async form); the group's own timeout bounds it."""
    if _state.failed.is_set():
        raise PeerFailure(f"{what} abandoned: {_state.reason}")
    with waiting():
        call()
