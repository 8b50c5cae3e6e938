"""Ending a generation's communicators: at a peer's failure (`peer_failed`: under NCCL an abort, which spares the
groups a recovery may keep until the training thread `arrive`s) and when the generation ends (`teardown`); and telling
a failure of the wire from this rank's own error (`is_wire_failure`).

Part of `ntp_ds.comm.wire`, which re-exports its names: callers use `wire.name`.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import threading
import time
import weakref

import torch
import torch.distributed as dist

from ntp_ds.comm import ledger  # `ledger._observe`, looked up at each abort: a test replaces it
from ntp_ds.comm.failures import PeerFailure
from ntp_ds.comm.waits import DEPARTURE_CHECK_S, DEPARTURE_POLL_S, _departed
from ntp_ds.comm.wire_state import _abort_lock, _state, is_nccl

log = logging.getLogger(__name__)


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


_WIRE_FILES = ("/torch/distributed/", "/deepspeed/comm/", "/ntp_ds/testing/nccl_model.py",
               *(f"/ntp_ds/comm/{name}.py" for name in ("wire", "wire_state", "activity", "ledger", "waits", "aborts")))
"""Where an error raised by a collective or point-to-point op comes from (its traceback passes through one): torch's
and DeepSpeed's communication, the NCCL model, and `ntp_ds.comm.wire` with the modules it is made of."""


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
                ledger._observe(left)  # not the groups set aside to be kept (`set_aside`): their ops are not cut
                dist.distributed_c10d._abort_process_group()
            else:  # the world already aborted, groups spared then left: each alone
                _abort_groups(left)
        except Exception as err:  # aborting is best effort: the groups are discarded either way
            log.warning("abort of the process groups failed: %s", err)


def _abort_groups(groups) -> None:
    """Abort `groups`, within one NCCL group call where NCCL is underneath (as torch aborts its world, so that no
    two communicators' aborts wait on each other, pytorch#119797). They stay in torch's registry, marked aborted
    here (`_check` refuses them) until the teardown discards them. What completed on them by now is proven first."""
    ledger._observe(groups)
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
