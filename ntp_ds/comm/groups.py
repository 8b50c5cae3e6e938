"""Process groups of a nonuniform topology, the generation's control group, and the `mpu` DeepSpeed reads."""

from __future__ import annotations

import contextlib
import hashlib
import logging
import math
import os
import weakref
from array import array
from dataclasses import dataclass
from datetime import timedelta
from types import SimpleNamespace

import torch
import torch.distributed as dist

from ntp_ds.comm import wire
from ntp_ds.envs import (GLOO_LAZY_ENV, NCCL_ASYNC_ERROR_HANDLING, NCCL_DUMP_ENV, NCCL_DUMP_WAIT_ENV,
                         NCCL_MONITORING_ENV, NONBLOCKING_TIMEOUT_ENV, TEST_BACKEND_ENV)
from ntp_ds.layout import SyncPlan, Topology
from ntp_ds.layout.domains import ring_neighbours  # noqa: F401 (the watchers' ring: imported from here too)

log = logging.getLogger(__name__)


def backend_for_device() -> str:
    """NCCL where CUDA is present, gloo on CPU: one code path for both (NTP_TEST_BACKEND overrides it)."""
    chosen = os.environ.get(TEST_BACKEND_ENV, "")
    if chosen not in ("", "gloo", "nccl", "nccl_model"):
        raise ValueError(f"{TEST_BACKEND_ENV}={chosen!r}: choose nccl_model, gloo or nccl")
    if chosen == "nccl_model" and chosen not in dist.Backend.backend_list:
        raise ValueError(f"{TEST_BACKEND_ENV}=nccl_model: the test backend is not registered in this process; it "
                         "registers itself when imported (ntp_ds.testing.register_test_backend(), which "
                         "ntp_ds.initialize, the test spawner and the tests' conftest call)")
    return chosen or ("nccl" if torch.cuda.is_available() else "gloo")


NCCL_SET_ENV = {
    NCCL_ASYNC_ERROR_HANDLING: "0",
    NCCL_DUMP_ENV: "0",
    NCCL_DUMP_WAIT_ENV: "100",
    NCCL_MONITORING_ENV: "0",
}
"""What the product sets under NCCL before the first process group (`prepare_backend` says why)."""


def prepare_backend(timeout_s: float | None = None) -> None:
    """Set what the backend needs before the first process group.

    Under NCCL, the abort that ends a kernel blocked on a dead peer is documented for
    TORCH_NCCL_ASYNC_ERROR_HANDLING=0 (the default, 3, would tear the surviving process down instead). And no
    flight-recorder dumps on a failed op (TORCH_NCCL_DUMP_ON_TIMEOUT=0; `initialize.prepare` refuses a 1): with them on,
    a rank whose op fails (as every survivor's does at a peer's death) writes a dump signal into the store, and the
    monitor thread of every process's first NCCL group polls the store for it, then dumps and ends its process one
    heartbeat timeout later (torch's ProcessGroupNCCL.cpp, `HeartbeatMonitor::runLoop`). A survivor aborts the
    group whose monitor that is; a worker that joins later starts a first group of its own, whose monitor would find
    the signal an earlier failure left and end the joiner.

    The watchdog of a group whose op failed sleeps four times TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC (15 s by default)
    per failed op, holding the group's list of works, whatever the dump setting: the next op posted on that group
    waits behind it. 100 ms: a failure costs a kept group 0.4 s at most. The heartbeat monitor
    (TORCH_NCCL_ENABLE_MONITORING) ends a process whose watchdog has not looped for 480 s, as a stuck abort or a
    wedged device would make it: off, since ntp_ds judges its ranks itself (heartbeats, the training thread's and
    the device's progress) and fences a stuck one through its launcher, after a recovery the monitor knows nothing
    of.

    The groups' communicators are created non-blocking (`creation_options`), and torch bounds their creation (and
    every NCCL call still in progress) by TORCH_NCCL_NONBLOCKING_TIMEOUT: set to the job's `timeout_s`.
    """
    if backend_for_device() in wire.NCCL_LIKE:
        os.environ.update(NCCL_SET_ENV)
        if timeout_s is not None:
            os.environ[NONBLOCKING_TIMEOUT_ENV] = str(max(1, math.ceil(timeout_s)))
    skip_shm_comm_op()


def skip_shm_comm_op() -> None:
    """Keep `deepspeed.init_distributed` from JIT-compiling DeepSpeed's CPU shared-memory comm op (40-90 s on a
    machine whose torch extensions cache lacks it): the op only serves `inference_all_reduce`, which ntp_ds never
    calls. DeepSpeed 0.19 reads no environment variable or config key for this; its `build_shm_op` builds the op only
    when `deepspeed.ops.__compatible_ops__` marks it compatible, a dict it probes once and keeps (its comment: edits
    to it persist), so mark it not compatible there. Only under DeepSpeed's CPU accelerator: the others have no such
    op, so `build_shm_op` never reads the dict, and reading it here would probe every op (nvcc on a CUDA machine)."""
    from deepspeed.accelerator import get_accelerator

    if get_accelerator().device_name() != "cpu":
        return
    import deepspeed.ops
    from deepspeed.ops.op_builder.cpu import ShareMemCommBuilder

    deepspeed.ops.__compatible_ops__[ShareMemCommBuilder.NAME] = False


@contextlib.contextmanager
def unconnected_default_group(backend: str, world_size: int, fanout: int):
    """Create the generation's default group inside this block without connecting its members where it carries no
    traffic: under gloo once the world is larger than one control group (`fanout`), when the control tree's own groups
    carry the control traffic and the exchange families the data. A gloo group made while TORCH_GLOO_LAZY_INIT is set
    connects a pair when it first talks (torch reads the variable as each group is made; only this one is). A world
    of at most `fanout` ranks under gloo uses the default group as its control group, which stays eager: a peer that
    died before first contact is then seen at once, not at the group's timeout. Under NCCL torch creates the group
    unbound, with no communicator until its first op, which never comes. The NCCL model's gloo underneath stays
    eager: made lazy, a recovery test saw every rank's beats stall for about 4.5 s, as it later did eager too (the
    store's reverse DNS lookups: `control.store._ipv4_listener`); lazy was not tried again. The model shows instead
    that no op runs on the group (`nccl_model.communicator_sizes`)."""
    lazy = backend == "gloo" and world_size > fanout
    saved = os.environ.get(GLOO_LAZY_ENV)
    if lazy:
        os.environ[GLOO_LAZY_ENV] = "1"
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop(GLOO_LAZY_ENV, None)
        else:
            os.environ[GLOO_LAZY_ENV] = saved


_SEEN: weakref.WeakSet = weakref.WeakSet()
"""The process groups that existed when `mark_communicators` was last called."""


def _registered_groups() -> list:
    """Every process group this process holds (torch's registry: no public call lists them)."""
    from torch.distributed import distributed_c10d

    return list(distributed_c10d._world.pg_map)


def mark_communicators() -> None:
    """Remember the process groups that exist now: a recovery or a grow calls it before it changes any."""
    _SEEN.update(_registered_groups())


def count_communicators() -> tuple[int, int]:
    """(created, kept): the current generation's process groups whose lowest member is this rank (so a sum over the
    ranks counts each group once), created since `mark_communicators` or kept from before it."""
    me, created, kept = dist.get_rank(), 0, 0
    for group in _registered_groups():
        if min(dist.get_process_group_ranks(group)) == me:
            kept, created = (kept + 1, created) if group in _SEEN else (kept, created + 1)
    return created, kept


CONTROL_FANOUT = 32
"""Members of one group of the control tree (`ntp.control_fanout`)."""


def control_tree(rank: int, world: int, fanout: int) -> list[tuple[tuple[int, ...], bool]]:
    """The groups of the generation's control tree that `rank` belongs to, lowest level first: (members, leader
    first; whether it is the top group). Pure.

    Level 0 cuts the ranks into blocks of `fanout`; each block's first rank, its leader, takes part in level 1, whose
    groups are blocks of `fanout` such leaders, and so on up to the one group that holds rank 0 and every other
    leader left. A rank belongs to one group per level it leads below, plus one: at most ceil(log_fanout(world)),
    4 at 100,000 ranks with 32. A leader at the end of the ranks may lead a group of one at some levels (listed; it
    carries nothing, and `start_generation` builds no group for it)."""
    if fanout < 2:
        raise ValueError(f"control_fanout={fanout} must be at least 2")
    out, span = [], 1
    while span < world and rank % span == 0:
        block = span * fanout
        start = rank - rank % block
        out.append((tuple(range(start, min(start + block, world), span)), block >= world))
        span = block
    return out


_ROLES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
"""The role (`tp`, `tp-control`, `dp`, `solo`, `tree`) of every group `named_group` built."""
KEEPABLE = ("tp", "tp-control", "dp", "solo")
"""Roles of the groups a recovery may keep for the next generation (the control tree's are rebuilt: its blocks follow
the generation's ranks, which move past a dead rank)."""
_KEPT: dict = {}
"""(role, global ranks in the new generation) -> a group kept from the generation before (`adopt`), until
`named_group` hands it out."""
_GENERATION = [0]
"""The membership generation whose groups are being built: part of every group's name."""
_BUILT: dict[str, int] = {}
"""How many groups of each name (role and members) this process has built in the current generation: a second build
of the same group (two engines in one generation, as `benchmarks/steady_state.py` builds) gets a name of its own,
alike on every member, since each member of a group builds it as often, in the same order."""


def creation_options(backend: str, timeout: timedelta):
    """The options a group's communicator is created with under `backend`: non-blocking under NCCL (and its model,
    which takes options of the same shape), None elsewhere.

    A communicator is created at its group's first op. A blocking init (torch's default for groups created lazily)
    waits for a member that died before reaching it for ever, in C++, where no abort reaches it (torch adds the
    communicator to the map an abort walks only once the init returns). A non-blocking one is waited for at its first
    use at most TORCH_NCCL_NONBLOCKING_TIMEOUT (`prepare_backend`: the job's `timeout_s`), which then raises, and the
    recovery starts again without the dead member. No group is bound to a device when it is built
    (`members_only`), so none is connected eagerly."""
    if backend == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options.is_high_priority_stream = False
        options._timeout = timeout
        options.config.blocking = 0
        return options
    if backend == "nccl_model":
        return SimpleNamespace(config=SimpleNamespace(blocking=0))
    return None


def named_group(name: str, ranks, timeout: timedelta, backend: str | None = None, role: str = "tree"):
    """A process group of `ranks` (global ranks of the generation), built by its members alone under a name the
    job chooses: `name`, unique among the generation's groups. Non-members get None and wait for nothing. A group
    of the same role and ranks kept from the generation before (`adopt`) is handed out instead of a new one.

    torch's own way to build a group among its members (`new_group(use_local_synchronization=True)`) names it after
    its ranks and the number of groups the calling process already holds, so its members meet on the same store keys
    only if each holds as many groups as the others: a rank that kept a group another did not, or a joiner, would
    wait on keys nobody writes. Here the name comes from the job (the generation and the group's role in it), and the
    group is built by the same torch helper `new_group` calls, registered the same way (global to group ranks), so
    every torch and DeepSpeed call works on it alike. Built unbound (`members_only`): no split of a parent."""
    from torch.distributed import distributed_c10d as c10d

    ranks = sorted(ranks)
    me = dist.get_rank()
    if me not in ranks:
        return None
    kept = _KEPT.pop((role, tuple(ranks)), None)
    if kept is not None:
        return kept
    default = c10d._get_default_group()
    default_backend, store = c10d._world.pg_map[default]
    # The members are part of the name: two builds of one role with other members (two engines in one generation)
    # never share a name, so the count below only tells apart builds of the very same group.
    members = hashlib.sha1(array("q", ranks).tobytes(), usedforsecurity=False).hexdigest()[:12]
    full = f"ntp:{_GENERATION[0]}/{name}/{members}"
    built = _BUILT.get(full, 0)
    _BUILT[full] = built + 1
    group_name = c10d.GroupName(f"{full}#{built}" if built else full)
    chosen = dist.Backend(backend or default_backend)
    with members_only():
        group, _ = c10d._new_process_group_helper(len(ranks), ranks.index(me), ranks, chosen, store, group_name,
                                                  backend_options=creation_options(str(chosen), timeout),
                                                  timeout=timeout, group_desc=name)
    c10d._world.pg_group_ranks[group] = {r: i for i, r in enumerate(ranks)}
    _ROLES[group] = role
    return group


def keepable(groups) -> list:
    """Those of `groups` a recovery may keep (`KEEPABLE` roles)."""
    return [g for g in groups if _ROLES.get(g) in KEEPABLE]


def role_of(group) -> str | None:
    return _ROLES.get(group)


def adopt(kept, new_rank: dict[int, int]) -> None:
    """Carry groups kept across a teardown (`wire.teardown(keep=...)`) into the new generation: renumber their
    members from the old world's global ranks to the new one's (`new_rank`: old -> new; the members keep their
    order, as the survivors keep theirs), and offer each to `named_group` for its role and ranks."""
    world = dist.distributed_c10d._world
    for group in kept:
        old = list(world.pg_group_ranks[group])
        new = [new_rank[r] for r in old]
        if new != sorted(new):
            raise RuntimeError(f"a kept group's members {old} would change order as ranks {new}")
        world.pg_group_ranks[group] = {r: i for i, r in enumerate(new)}
        _KEPT[(_ROLES[group], tuple(new))] = group


def discard_unused() -> None:
    """Close the kept groups no `named_group` call took (none, when the recovery kept only what the new topology
    builds: a safety net)."""
    unused = list(_KEPT.values())
    _KEPT.clear()
    if unused:
        wire.discard(unused)


def start_generation(timeout_s: float, fanout: int = CONTROL_FANOUT, generation: int = 0) -> None:
    """After the default group of a generation exists: build its gloo control tree and arm the wire.

    Every rank builds its tree groups lowest level first, and only their members meet: a group's members have built
    every lower group they belong to before it, so no two ranks wait on each other in opposite orders. Each group is
    named after its level and its leader (`named_group`), so no rank needs to hold as many groups as another.
    `generation`: the membership generation, which names its groups."""
    _GENERATION[0] = generation
    _BUILT.clear()
    timeout = timedelta(seconds=timeout_s)
    # Under gloo the default group is the control group, and a world of at most `fanout` ranks uses it as its tree.
    # Under NCCL no world-sized gloo group is built: control traffic goes along the tree alone.
    control = dist.group.WORLD if dist.get_backend() == "gloo" else None
    world = dist.get_world_size()

    def group_of(level: int, members: tuple[int, ...]):
        if len(members) == world and control is not None:
            return control
        return named_group(f"tree/{level}/{members[0]}", members, timeout, backend="gloo", role="tree")

    tree = [wire.TreeGroup(group_of(level, members), members[0], top)
            for level, (members, top) in enumerate(control_tree(dist.get_rank(), world, fanout)) if len(members) > 1]
    wire.configure(timeout_s, control, tree)


@dataclass
class ReplicaGroups:
    """This rank's place in the topology and the groups it communicates in.

    `tp_group` spans this rank's replica. `dp_group` is DeepSpeed's data-parallel group: the anchor-class ranks at
    this TP index, or this rank alone on a contributor replica (which runs no optimizer of its own).
    """

    topology: Topology
    plan: SyncPlan
    rank: int
    replica: int
    tp_rank: int
    tp_ranks: list[int]
    dp_ranks: list[int]
    tp_group: dist.ProcessGroup
    dp_group: dist.ProcessGroup
    tp_control: dist.ProcessGroup
    """The TP group's gloo twin, for host-side objects (the TP group itself under gloo)."""

    @property
    def is_anchor(self) -> bool:
        return self.plan.is_anchor(self.replica)

    @property
    def layout(self):
        return self.topology.layouts[self.replica]


@contextlib.contextmanager
def members_only():
    """Build groups among their members alone, whatever the default group is bound to.

    When the default group is bound to a device (`init_process_group(device_id=...)`, which DeepSpeed's
    `init_distributed` passes on CUDA), torch makes every later `new_group` an NCCL split of the default group's
    communicator, which every rank of the world must join, non-members included. A group built with
    `use_local_synchronization` is built by its members alone, so its members would wait for the rest of the world
    forever; after a death, any split of a communicator holding the dead rank would. Unbound for the block, the
    groups' communicators are created among their members (`ncclCommInitRank`), as with an unbound default group;
    the binding is restored after."""
    default = dist.distributed_c10d._get_default_group()
    bound = default.bound_device_id
    if bound is None:
        yield
        return
    default.bound_device_id = None
    try:
        yield
    finally:
        default.bound_device_id = bound


def group_ranks(topology: Topology, plan: SyncPlan, rank: int) -> tuple[list[int], list[int]]:
    """(TP ranks, data-parallel ranks) of global rank `rank`'s groups in `topology`."""
    replica, tp_rank = topology.locate(rank)
    if plan.is_anchor(replica):
        return topology.ranks_of(replica), [topology.ranks_of(a)[tp_rank] for a in plan.anchors]
    return topology.ranks_of(replica), [rank]


def exchange_families(topology: Topology, plan: SyncPlan, rank: int) -> list[tuple[int, tuple[int, ...]]]:
    """(TP index t, members) of every exchange family `rank` belongs to, by t. Pure; the same sets on every rank.

    Family t holds, of every replica r, its rank at TP index t mod r's degree (an anchor's rank at t, the one a copy
    of an anchor's state at t goes to: `plan_buddies`), and every contributor rank with a gradient or parameter
    transfer to or from an anchor's rank at t. Every pairwise exchange of the generation (the copies, the
    contributors' streams, a recovery's moves into the new layout) joins two members of one family, so each runs on
    a group of about one rank per replica, never on the world. An anchor belongs to one family, its TP index's."""
    anchors = plan.anchors
    width = topology.degrees[anchors[0]]
    replica, tp = topology.locate(rank)
    extra: dict[int, set[int]] = {}  # t -> contributor ranks linked to an anchor's rank at t by a transfer
    for transfer in (*plan.grad_transfers, *plan.param_transfers):
        for anchor_rank, other in ((transfer.src, transfer.dst), (transfer.dst, transfer.src)):
            a, t = topology.locate(anchor_rank)
            if plan.is_anchor(a) and not plan.is_anchor(topology.locate(other)[0]):
                extra.setdefault(t, set()).add(other)
    if plan.is_anchor(replica):
        mine = {tp}
    else:
        degree = topology.degrees[replica]
        mine = {t for t in range(width) if t % degree == tp} | {t for t, ranks in extra.items() if rank in ranks}
    out = []
    for t in sorted(mine):
        members = {topology.rank_range(r)[t % d] for r, d in enumerate(topology.degrees)} | extra.get(t, set())
        out.append((t, tuple(sorted(members))))
    return out


def build_exchange_families(topology: Topology, plan: SyncPlan, rank: int, timeout: timedelta,
                            copy_lane: bool = False) -> list:
    """Build `rank`'s exchange families (`exchange_families`), lowest TP index first, and route the generation's
    pairwise exchanges over them (`wire.set_routes`): a peer is reached on the lowest family both belong to.
    `copy_lane`: each family gets a twin of the same members for the state copies (`wire.exchange(lane="copies")`),
    so that copies in flight during a step never hold its parameter buckets and gradients behind them.

    Under NCCL a group's first call must be a collective of all its members before batched point-to-point calls
    may involve only some of them, so each family starts with an all-reduce of one element, which also creates its
    communicator (of the family's members alone). Every rank builds its families in increasing order, each one's
    twin right after it, so no two members wait on each other in opposite orders."""
    routes, copy_routes, order, built = {}, {}, {}, []
    lanes = [("family", routes)] + ([("family-copies", copy_routes)] if copy_lane else [])
    for t, members in exchange_families(topology, plan, rank):
        if len(members) < 2:
            continue
        for lane, table in lanes:
            group = named_group(f"{lane}/{t}", members, timeout, role=lane)
            wire.open_for_batches(group)
            order[group] = t
            built.append(group)
            for m in members:
                if m != rank:
                    table.setdefault(m, group)

    def open_pair(peer: int):
        pair = (min(rank, peer), max(rank, peer))
        group = named_group(f"pair/{pair[0]}/{pair[1]}", pair, timeout, role="pair")
        wire.open_for_batches(group)
        log.info("rank %d exchanges with rank %d on a group of the pair: they share no exchange family", rank, peer)
        return group

    wire.set_routes(routes, order, open_pair, copy_routes if copy_lane else None)
    return built


def wanted_groups(topology: Topology, plan: SyncPlan, rank: int, twins: bool) -> list[tuple[str, tuple[int, ...]]]:
    """(role, ranks) of the keepable groups `build_groups` builds for `rank`, in the order it builds them: what a
    recovery may keep. `twins`: the TP group has a gloo twin (under NCCL)."""
    tp_ranks, dp_ranks = group_ranks(topology, plan, rank)
    anchor = plan.is_anchor(topology.locate(rank)[0])
    wanted = [("tp", tuple(tp_ranks)), ("dp" if anchor else "solo", tuple(dp_ranks))]
    return wanted + [("tp-control", tuple(tp_ranks))] if twins else wanted


def build_groups(topology: Topology, plan: SyncPlan, rank: int, timeout_s: float,
                 copy_lane: bool = False) -> ReplicaGroups:
    """Create only the groups this rank belongs to; members synchronise among themselves, nobody else waits. Groups
    kept from the generation before (`adopt`) are taken instead where their role and ranks match. `copy_lane`: the
    state copies get exchange groups of their own (`build_exchange_families`).

    Every collective on them is bounded by `timeout_s` (a hung peer is only seen at that bound).
    """
    replica, tp_rank = topology.locate(rank)
    tp_ranks, dp_ranks = group_ranks(topology, plan, rank)
    anchor = plan.is_anchor(replica)
    timeout = timedelta(seconds=timeout_s)
    tp_group = named_group(f"tp/{replica}", tp_ranks, timeout, role="tp")
    dp_group = named_group(f"dp/{tp_rank}" if anchor else f"solo/{rank}", dp_ranks, timeout,
                           role="dp" if anchor else "solo")
    tp_control = tp_group
    if dist.get_backend() != "gloo":
        tp_control = named_group(f"tp-control/{replica}", tp_ranks, timeout, backend="gloo", role="tp-control")
    discard_unused()
    build_exchange_families(topology, plan, rank, timeout, copy_lane)
    return ReplicaGroups(topology, plan, rank, replica, tp_rank, tp_ranks, dp_ranks, tp_group, dp_group, tp_control)


class NTPMpu:
    """DeepSpeed's model-parallel-unit contract over ReplicaGroups: model parallel = this replica's TP group."""

    def __init__(self, groups: ReplicaGroups):
        self.groups = groups

    def get_model_parallel_group(self):
        return self.groups.tp_group

    def get_model_parallel_rank(self) -> int:
        return self.groups.tp_rank

    def get_model_parallel_world_size(self) -> int:
        return len(self.groups.tp_ranks)

    def get_data_parallel_group(self):
        return self.groups.dp_group

    def get_data_parallel_rank(self) -> int:
        return self.groups.dp_ranks.index(self.groups.rank)

    def get_data_parallel_world_size(self) -> int:
        return len(self.groups.dp_ranks)

    get_tensor_model_parallel_group = get_model_parallel_group
    get_tensor_model_parallel_rank = get_model_parallel_rank
    get_tensor_model_parallel_world_size = get_model_parallel_world_size

    def get_pipeline_model_parallel_world_size(self) -> int:
        return 1

    def get_pipeline_model_parallel_rank(self) -> int:
        return 0
