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

The calls themselves are defined here; what they stand on lives beside this module, which re-exports it, so that
callers use `wire.name` for all of it: the generation's settings, device rules and records (`wire_state`), the
training thread's progress (`activity`), the ledger of posted ops and their proofs (`ledger`), bounded waits and
departures (`waits`), aborts and the teardown (`aborts`).
"""

from __future__ import annotations

import pickle
from typing import Callable, Mapping, Sequence

import torch
import torch.distributed as dist

from ntp_ds.comm.aborts import (abort_all, arrive, discard, is_wire_failure, peer_failed, set_aside, stop_watching,
                                teardown)
from ntp_ds.comm.activity import Progress, progress, settle_device, timed_event, waiting, working
from ntp_ds.comm.failures import PeerFailure
from ntp_ds.comm.ledger import Posted, _enter, mark, outstanding, proven, require_arrived
from ntp_ds.comm.waits import (DEPARTURE_CHECK_S, DEPARTURE_POLL_S, SLICE_S, check_verdict, drained, on_departure,
                               ops_posted, verdict, wait)
from ntp_ds.comm.wire_state import (NCCL_LIKE, CallRecord, TreeGroup, _check, _count, _nbytes, _state, backend_of,
                                    configure, control_group, device_of, has_control, is_nccl, recording, traffic,
                                    traffic_since)

__all__ = [
    "CallRecord", "DEPARTURE_CHECK_S", "DEPARTURE_POLL_S", "Exchange", "LOWEST", "NCCL_LIKE", "PeerFailure", "Posted",
    "Progress", "SLICE_S", "TreeGroup", "abort_all", "all_gather_object", "all_reduce", "arrive", "backend_of",
    "barrier", "broadcast", "broadcast_object", "check_verdict", "collect", "configure", "control_all_reduce",
    "control_group", "device_of", "discard", "drained", "exchange", "gather_object", "has_control", "has_copy_lane",
    "is_nccl", "is_wire_failure", "mark", "on_departure", "open_for_batches", "ops_posted", "outstanding",
    "peer_failed", "progress", "proven", "recording", "reduce_ints", "require_arrived", "set_aside", "set_routes",
    "settle_device", "stop_watching", "sum_counts", "teardown", "timed_event", "traffic", "traffic_since",
    "verdict", "vote", "vote_with_notice", "wait", "waiting", "working",
]


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


def vote_with_notice(ready: bool, notice: bool, name: str = "vote") -> tuple[bool, bool]:
    """`vote` over the generation carrying one more bit in the same reduction: whether every rank is ready, and
    whether any rank raised `notice` (one min over (ready, -notice))."""
    flags = torch.tensor([1 if ready else 0, -1 if notice else 0], dtype=torch.int32)
    out = control_all_reduce(flags, "min", name)
    return bool(out[0].item()), bool(out[1].item() < 0)


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


LOWEST = -(1 << 62)
"""Below every value a rank passes to a max of `reduce_ints`: what a rank that has no value passes."""


def reduce_ints(values: list[int], op: str = "sum", name: str = "reduce_ints") -> list[int]:
    """Reduce a few host integers (`op`: "sum", "max" or "min") over the generation, along the control tree."""
    return control_all_reduce(torch.tensor(values, dtype=torch.int64), op, name).tolist()


def collect(obj) -> dict:
    """Every rank's `obj` that is not None, by global rank, on every rank of the generation (along the control
    tree): what a rank receives grows with the objects sent, not with the world, so the ranks with something to
    say (an exception to a rule all of them apply) speak and the others pass None."""
    if _state.tree is not None:
        return _tree_collect({} if obj is None else {dist.get_rank(): obj})
    return {r: o for r, o in enumerate(all_gather_object(obj)) if o is not None}


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
