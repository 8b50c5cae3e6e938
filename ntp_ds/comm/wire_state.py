"""The wire's state in this process: the current generation's settings (`configure`), what each group's backend
requires of its tensors (`is_nccl`, `device_of`), and what every call passes before it is posted (`_check`: refused on
an aborted communicator, offered to the recorders) and after (`_count`: the traffic meter).

Part of `ntp_ds.comm.wire`, which re-exports its names: callers use `wire.name`.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.distributed as dist

from ntp_ds.comm import device
from ntp_ds.comm.failures import PeerFailure

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


@dataclass(frozen=True)
class TreeGroup:
    """One group of the generation's control tree that this rank belongs to (`ntp_ds.comm.groups.control_tree`)."""

    group: object
    leader: int
    """Its first member (global rank): the one that carries its reduction up and the result back down."""
    top: bool


_abort_lock = threading.RLock()
"""Held by every abort, the teardown and each look at the ledger: no abort falls between a look at a group and a
look at an op of it (`ntp_ds.comm.ledger`), and no teardown runs while an abort still walks torch's registry."""


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
