"""Pure recovery planning: which units a new layout must fetch, and from whom."""

from __future__ import annotations

import contextlib
import functools
import gc
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass

from ntp_ds.layout import KINDS, Topology, plan_gradient_sync
from ntp_ds.layout.shard_layout import OWNED_KINDS
from ntp_ds.layout import units as U


@contextlib.contextmanager
def collector_paused():
    """Hold Python's cyclic garbage collector for a recovery.

    Planning at scale allocates many small objects over a heap that already holds every member's gathered offer
    (100,000 of them at 100K ranks): each full collection the allocations trigger rescans that heap, about 0.2 s
    apiece, and a plan triggered two. What a recovery leaves behind is freed by reference counting; cycles wait for
    the first collection after it (an explicit `gc.collect()`, such as the wire's teardown, still runs)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


@dataclass(frozen=True)
class UnitMove:
    """After a regroup: new rank `dst` fetches units of `kind` from new rank `src`, which holds them in its old
    layout."""

    src: int
    dst: int
    kind: str
    units: U.Ranges


def old_ranks(old_members, new_members) -> dict[int, int]:
    """Map each new global rank whose worker was a member before to its old global rank (members: launch ranks in
    global-rank order). Linear in the members: a lookup of each in the other list would be quadratic, minutes at
    100K ranks."""
    old_position = {m: i for i, m in enumerate(old_members)}
    return {i: old_position[m] for i, m in enumerate(new_members) if m in old_position}


def keeps_place(old: Topology, old_rank: int, new: Topology, new_rank: int) -> bool:
    """Whether a rank (global rank `old_rank` of `old`, `new_rank` of `new`) holds the same place on both sides of
    a change: an anchor before and after, of a replica with the same layout, at the same TP index. Its shard is then
    the same, and only its ZeRO partition changes with its data-parallel group: the rank may keep its engine
    (`NTPEngine.rebind`)."""
    (old_replica, old_tp), (new_replica, new_tp) = old.locate(old_rank), new.locate(new_rank)
    return (plan_gradient_sync(old).is_anchor(old_replica) and plan_gradient_sync(new).is_anchor(new_replica)
            and old_tp == new_tp and old.layouts[old_replica] == new.layouts[new_replica])


def plan_unit_moves(old: Topology, new: Topology, old_rank_of: dict[int, int],
                    stale: dict[int, dict[str, U.Ranges]] | None = None) -> list[UnitMove]:
    """Units every new rank needs but did not hold before, each fetched once from a surviving holder.

    `old_rank_of` maps each new global rank to its global rank in the old topology (a joiner has none). A unit a rank
    held before stays in place; a missing one comes from the least-loaded survivor holding it in another replica
    (survivors ordered by: in another replica first, then load, then rank). `stale[new_rank]` lists units (by kind)
    that rank holds only at the previous step (a streamed copy that never arrived): it holds them for nobody, itself
    included.

    O(W) cheap checks (a replica whose members kept their places and layout needs nothing) plus, for each rank that
    needs units, a scan of the survivors in that order which stops once they are found: not a sort of all W.
    """
    stale = stale or {}
    survivors = sorted(old_rank_of)

    @functools.cache  # only the ranks the plan looks at: those that need units, and their sources
    def held(rank: int, kind: str) -> U.Ranges:
        if rank not in old_rank_of:  # a joiner
            return ()
        return _held(old, old_rank_of[rank], kind, stale.get(rank, {}).get(kind, ()))

    load: dict[int, int] = defaultdict(int)
    moves = []
    for replica in range(len(new.layouts)):
        if _unchanged(old, new, replica, old_rank_of, stale):
            continue
        for tp_rank, new_rank in enumerate(new.ranks_of(replica)):
            for kind in KINDS:
                missing = U.subtract(new.layouts[replica].owned(kind, tp_rank), held(new_rank, kind))
                if not missing:
                    continue
                # Another replica's copy first (the own replica's survivors hold none of a lost unit), least loaded
                # first: the loads as they stand now (a sort of every survivor by them, walked lazily).
                for src in _by_load(survivors, dict(load), lambda h: new.locate(h)[0] == replica):
                    piece = U.intersect(missing, held(src, kind))
                    if piece:
                        moves.append(UnitMove(src, new_rank, kind, piece))
                        load[src] += U.count(piece)
                        missing = U.subtract(missing, piece)
                        if not missing:
                            break
                if missing:
                    raise LookupError(f"no survivor holds {kind} units {list(missing)}")
    return sorted(moves, key=lambda m: (m.src, m.dst, m.kind))


def _unchanged(old: Topology, new: Topology, replica: int, old_rank_of: dict[int, int], stale) -> bool:
    """Whether every member of new `replica` holds, at the same TP index of the same layout, what it held before
    (and nothing of it is stale): it then needs no unit. Called for every replica: ranges and lookups, no lists."""
    ranks = new.rank_range(replica)
    first = old_rank_of.get(ranks[0])
    if first is None:
        return False
    old_replica, tp_rank = old.locate(first)
    if tp_rank != 0 or len(old.rank_range(old_replica)) != len(ranks):
        return False
    old_layout, new_layout = old.layouts[old_replica], new.layouts[replica]
    if old_layout is not new_layout and old_layout != new_layout:
        return False
    shift = first - ranks[0]
    return all(old_rank_of.get(r) == r + shift and not stale.get(r) for r in ranks)


def _by_load(survivors: list[int], load: dict[int, int], same_replica) -> Iterator[int]:
    """`survivors` (sorted) in the order of `sorted(survivors, key=lambda h: (same_replica(h), load[h], h))`, made
    lazily: the unloaded ones are walked in rank order, and only the few loaded ones are sorted."""
    loaded = sorted(load, key=lambda h: (load[h], h))
    for own in (False, True):
        yield from (h for h in survivors if h not in load and bool(same_replica(h)) == own)
        yield from (h for h in loaded if bool(same_replica(h)) == own)


def _held(old: Topology, old_rank: int, kind: str, stale: U.Ranges) -> U.Ranges:
    replica, tp_rank = old.locate(old_rank)
    return U.subtract(old.layouts[replica].owned(kind, tp_rank), stale)


def rereplicated_moves(old: Topology, new: Topology, old_rank_of: dict[int, int],
                       moves: list[UnitMove]) -> list[UnitMove]:
    """The KV-head moves that copy a head some survivor of the same replica already held.

    A degraded replica's new layout can hand a query head to a rank that lacks its KV head although a sibling holds
    it; fetching that KV head is not rebuilding lost state but replicating it once more (GQA), so recovery reports
    those bytes apart from the lost shard's.
    """
    out = []
    for m in moves:
        if m.kind != "kv":
            continue
        replica = new.locate(m.dst)[0]
        siblings = U.union(*(_held(old, old_rank_of[r], "kv", ()) for r in new.ranks_of(replica) if r in old_rank_of))
        units = U.intersect(m.units, siblings)
        if units:
            out.append(UnitMove(m.src, m.dst, m.kind, units))
    return out


def rebalanced_moves(old: Topology, new: Topology, old_rank_of: dict[int, int],
                     moves: list[UnitMove]) -> list[UnitMove]:
    """The moves of owned units (heads, FFN columns, vocabulary rows) to a member that another member of its
    replica held before.

    A work-balanced degraded layout has a survivor that took a lost head give some of its own FFN columns to its
    siblings, and growing back returns them; those bytes even out work rather than rebuild lost state, so recovery
    reports them apart from the lost shard's. A joiner's moves are never counted here: its whole shard is new.
    """
    out = []
    for m in moves:
        if m.kind not in OWNED_KINDS or m.dst not in old_rank_of:
            continue
        replica = new.locate(m.dst)[0]
        siblings = U.union(*(_held(old, old_rank_of[r], m.kind, ()) for r in new.ranks_of(replica)
                             if r in old_rank_of and r != m.dst))
        units = U.intersect(m.units, siblings)
        if units:
            out.append(UnitMove(m.src, m.dst, m.kind, units))
    return out
