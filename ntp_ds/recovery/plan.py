"""Pure recovery planning: where redundant optimizer copies live, and which units a new layout must fetch."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from ntp_ds.layout import KINDS, SyncPlan, Topology
from ntp_ds.layout import units as U


def plan_buddies(topology: Topology, plan: SyncPlan, zero_stage: int, copies: int) -> dict[int, tuple[int, ...]]:
    """For every anchor rank, the ranks of other replicas that keep a copy of its optimizer fragments.

    Without ZeRO and with two or more anchors every anchor already holds the full state of its TP index, so no copy
    is kept. Otherwise copy number k of anchor replica a goes to the k-th next replica (anchors first, then
    contributors), at the same TP index where that replica is wide enough.
    """
    if copies <= 0 or (zero_stage == 0 and len(plan.anchors) >= 2):
        return {}
    order = list(plan.anchors) + sorted(plan.anchor_of)
    out = {}
    for a in plan.anchors:
        others = order[order.index(a) + 1:] + order[:order.index(a)]
        for tp_rank, rank in enumerate(topology.ranks_of(a)):
            out[rank] = tuple(topology.ranks_of(r)[tp_rank % topology.degrees[r]] for r in others[:copies])
    return out


@dataclass(frozen=True)
class UnitMove:
    """After a regroup: new rank `dst` fetches units of `kind` from new rank `src`, which holds them in its old
    layout."""

    src: int
    dst: int
    kind: str
    units: U.Ranges


def plan_unit_moves(old: Topology, new: Topology, old_rank_of: dict[int, int]) -> list[UnitMove]:
    """Units every new rank needs but did not hold before, each fetched once from a surviving holder.

    `old_rank_of` maps each new global rank to its global rank in the old topology. A unit a rank held before stays
    in place; a missing one comes from the least-loaded survivor holding it in another replica.
    """
    holders: dict[tuple[str, int], list[int]] = defaultdict(list)
    for new_rank, old_rank in old_rank_of.items():
        replica, tp_rank = old.locate(old_rank)
        lay = old.layouts[replica]
        for kind in KINDS:
            for u in U.units_of(lay.owned(kind, tp_rank)):
                holders[(kind, u)].append(new_rank)
    load: dict[int, int] = defaultdict(int)
    moves: dict[tuple[int, int, str], list[int]] = defaultdict(list)
    for new_rank in range(new.world_size):
        replica, tp_rank = new.locate(new_rank)
        before = old.locate(old_rank_of[new_rank])
        for kind in KINDS:
            held = old.layouts[before[0]].owned(kind, before[1])
            for u in U.units_of(U.subtract(new.layouts[replica].owned(kind, tp_rank), held)):
                sources = [h for h in holders[(kind, u)] if new.locate(h)[0] != replica] or holders[(kind, u)]
                if not sources:
                    raise LookupError(f"no survivor holds {kind} unit {u}")
                src = min(sources, key=lambda h: (load[h], h))
                load[src] += 1
                moves[(src, new_rank, kind)].append(u)
    return [UnitMove(s, d, k, U.from_units(us)) for (s, d, k), us in sorted(moves.items())]


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
        siblings = [old.locate(old_rank_of[r]) for r in range(new.world_size) if new.locate(r)[0] == replica]
        held = set()
        for old_replica, tp in siblings:
            held |= set(U.units_of(old.layouts[old_replica].owned("kv", tp)))
        units = [u for u in U.units_of(m.units) if u in held]
        if units:
            out.append(UnitMove(m.src, m.dst, m.kind, U.from_units(units)))
    return out
