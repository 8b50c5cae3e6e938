"""What a recovery or a grow keeps of the generation's process groups, and what it closes at once.

A failure makes *suspects* of the dead and the rest of their replicas: the groups holding one change with the
topology, so waits on them end at once and, under NCCL, their communicators are aborted. A group without a suspect
(a healthy replica's TP group) carries on: its members go on to the first operation that involves the dead, and
each survivor says, as its recovery begins, that it has left its groups and how many operations it had posted on
each (`depart`), which ends a peer's wait on an operation the leaver never posted. After the agreement, the members
of every group the new topology builds again with the same members decide together whether it is drained
(`keep`): kept, it is carried into the next generation (`ntp_ds.comm.groups.adopt`); not, it is closed.
docs/design.md, "What a recovery keeps"."""

from __future__ import annotations

import logging

import torch.distributed as dist

from ntp_ds.comm import wire
from ntp_ds.comm.groups import adopt, discard_unused, role_of, wanted_groups
from ntp_ds.control.keys import departure_key, drain_key
from ntp_ds.control.membership import barrier
from ntp_ds.layout import SyncPlan, Topology

log = logging.getLogger("ntp_ds.recovery")


def positions(members: tuple[int, ...]) -> dict[int, int]:
    """Launch rank -> global rank of `members` (in global-rank order, which a joiner's place can make unsorted)."""
    return {r: i for i, r in enumerate(members)}


def suspects(topology: Topology, members: tuple[int, ...], dead) -> list[int]:
    """Global ranks of every replica of `topology` that holds one of `dead` (launch ranks)."""
    hit = {topology.locate(members.index(r))[0] for r in dead if r in members}
    return [g for replica in sorted(hit) for g in topology.ranks_of(replica)]


def depart(store, generation: int) -> None:
    """Say, for each group this rank holds, that it posts nothing more on it in `generation`, and how many operations
    it had posted on it. The first member to leave a group sets its count; one that leaves with another count marks
    the group -1 (its members did not stop together: every wait on it is lost). A peer still waiting on the group
    (one without a suspect: `wire.on_departure`) stops once the count is below its own: its operation will never be
    matched."""
    world = dist.distributed_c10d._world
    # Read first: under NCCL the abort thread may be taking the world's groups out of torch's registry meanwhile.
    held = [(world.pg_names.get(g), _posted(g)) for g in list(world.pg_map)]
    for name, posted in held:
        if name is None:
            continue
        key, mine = departure_key(generation, name), str(posted)
        stands = store.compare_set(key, "", mine).decode()
        if stands not in (mine, "-1"):
            store.compare_set(key, stands, "-1")


def _posted(group) -> int:
    try:
        return wire.ops_posted(group)
    except (RuntimeError, ValueError):  # a group that can no longer say (aborted): its count matches nobody's
        return -1


def departed(store, generation: int, group) -> int | None:
    """How many operations the members of `group` that left it for a recovery of `generation` had posted on it
    (`depart`; -1: not all the same), or None while none has left it."""
    key = departure_key(generation, dist.distributed_c10d._world.pg_names[group])
    return int(store.get(key)) if store.check([key]) else None


def close_hit(candidates, topology: Topology, old_members: tuple[int, ...], dead) -> list:
    """Close at once the groups of `candidates` that hold a rank of a replica that lost one (`dead`, launch ranks):
    such a group changes with the topology, and a peer may still be blocked in it (in ZeRO's reductions over a
    data-parallel group, say), which the close ends. Return the others."""
    if not candidates:
        return []
    hit = set(suspects(topology, old_members, dead))
    others = [g for g in candidates if not hit & set(dist.get_process_group_ranks(g))]
    wire.discard([g for g in candidates if g not in others])
    return others


def _count(group, rank: int, timeout_s: float) -> int:
    """How many operations this rank posted on `group`, or -1 if it holds no such group or one whose last operation
    is not seen complete within `timeout_s` (`wire.drained`: a kernel still running there, as behind a member's
    stopped device, must not be carried into the next generation; the departure watch meanwhile aborts a group a
    member left with fewer operations, which ends the look at once)."""
    if group is None:
        return -1
    with wire.waiting():
        if not wire.drained(group, timeout_s):
            log.warning("rank %d: group %s not kept: an operation posted on it did not complete within %.0f s",
                        rank, role_of(group), timeout_s)
            return -1
    return wire.ops_posted(group)


def keep(store, rank: int, candidates, old_members: tuple[int, ...], new_members: tuple[int, ...],
         topology: Topology, sync: SyncPlan, generation: int, timeout_s: float) -> list:
    """Of the groups left open by the teardown (`candidates`), return those the new generation keeps, and close the
    rest. Kept: the new `topology` builds a group of the same role and members (launch ranks) for launch rank `rank`,
    every member still holds it, the members posted equally many operations on it (so none is left half matched:
    a peer that left mid-collective for the recovery makes the counts differ), and each member has seen its own
    operations on it complete (no kernel of the old generation runs on a kept communicator).

    Every member decides alike from the same store records, in O(1) store operations per group whatever its size:
    the group's first member writes its count (-1 if it holds no such group any more: aborted, or closed because its
    replica was hit), every member compares its own with it and counts a mismatch, the members meet on a barrier,
    and the group is kept when nobody counted one."""
    old_rank, new_rank = positions(old_members), positions(new_members)
    held = {}
    for group in candidates:
        launch = tuple(old_members[r] for r in dist.get_process_group_ranks(group))
        renumbered = [new_rank.get(r) for r in launch]
        # Kept only with its members in the same order: a group's ranks are fixed when it is built.
        if None not in renumbered and renumbered == sorted(renumbered):
            held[(role_of(group), launch)] = group
    checks = []
    for role, ranks in wanted_groups(topology, sync, new_rank[rank], twins=wire.is_nccl()):
        launch = tuple(new_members[r] for r in ranks)
        if all(r in old_rank for r in launch):  # a group with a joiner is new
            group = held.get((role, launch))
            checks.append((drain_key(generation, role, launch[0]), launch, group, _count(group, rank, timeout_s)))
    for key, launch, _, count in checks:
        if len(launch) > 1 and launch[0] == rank:
            store.set(f"{key}/first", str(count))
    kept = []
    for key, launch, group, count in checks:
        if len(launch) > 1:
            with wire.waiting():
                first = int(store.get(f"{key}/first"))
                if count < 0 or count != first:
                    store.add(f"{key}/mismatch", 1)
                barrier(store, f"{key}/counted", rank, launch, timeout_s)
                mismatches = store.add(f"{key}/mismatch", 0)
            if mismatches:
                if group is not None:
                    log.warning("rank %d: group %s not kept (%d member(s) posted another count than its first, %d)",
                                rank, key, mismatches, first)
                continue
        if group is not None and count >= 0:
            kept.append(group)
    kept = wire.stop_watching(kept)
    wire.discard([g for g in candidates if g not in kept])
    return kept


def tear_down(candidates, held=None) -> None:
    """Close this rank's connections of the old generation, but for the `candidates` a recovery may keep (and the
    engine `held`, which an attempt before this one may have rebound to its groups, let go of them). Closing fails
    every collective a live peer still waits on with this rank, so it joins the recovery at once instead of at its
    process-group timeout (gloo closes them once unreferenced; NCCL communicators are aborted first). The candidates
    stay open until `keep` decides (a peer waiting in one of them stops once a member has departed: `depart`)."""
    if held is not None:
        held.detach()
    discard_unused()
    wire.teardown(keep=candidates)


def carry(kept, before: tuple[int, ...], after: tuple[int, ...]) -> None:
    """Carry the `kept` groups of the generation of members `before` into the generation of members `after`."""
    if kept:
        new_rank = positions(after)
        adopt(kept, {r: new_rank[before[r]] for g in kept for r in dist.get_process_group_ranks(g)})
