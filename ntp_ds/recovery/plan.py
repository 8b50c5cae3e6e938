"""Pure recovery planning: which units a new layout must fetch, and from whom."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from ntp_ds.layout import KINDS, Topology
from ntp_ds.layout import units as U


@dataclass(frozen=True)
class UnitMove:
    """After a regroup: new rank `dst` fetches units of `kind` from new rank `src`, which holds them in its old
    layout."""

    src: int
    dst: int
    kind: str
    units: U.Ranges


def plan_unit_moves(old: Topology, new: Topology, old_rank_of: dict[int, int],
                    stale: dict[int, dict[str, U.Ranges]] | None = None) -> list[UnitMove]:
    """Units every new rank needs but did not hold before, each fetched once from a surviving holder.

    `old_rank_of` maps each new global rank to its global rank in the old topology. A unit a rank held before stays
    in place; a missing one comes from the least-loaded survivor holding it in another replica. `stale[new_rank]`
    lists units (by kind) that rank holds only at the previous step (a streamed copy that never arrived): it holds
    them for nobody, itself included.
    """
    stale = stale or {}

    def held_by(new_rank: int, kind: str) -> U.Ranges:
        replica, tp_rank = old.locate(old_rank_of[new_rank])
        return U.subtract(old.layouts[replica].owned(kind, tp_rank), stale.get(new_rank, {}).get(kind, ()))

    holders: dict[tuple[str, int], list[int]] = defaultdict(list)
    for new_rank in old_rank_of:
        for kind in KINDS:
            for u in U.units_of(held_by(new_rank, kind)):
                holders[(kind, u)].append(new_rank)
    load: dict[int, int] = defaultdict(int)
    moves: dict[tuple[int, int, str], list[int]] = defaultdict(list)
    for new_rank in range(new.world_size):
        replica, tp_rank = new.locate(new_rank)
        for kind in KINDS:
            held = held_by(new_rank, kind)
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
