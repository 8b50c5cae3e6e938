"""A layout's pace: the work of each rank under the unit cost model (`ntp_ds.layout.cost`), and of each replica
relative to a healthy one. Pure logic, no torch."""

from __future__ import annotations

from collections.abc import Sequence

from ntp_ds.layout import units as U
from ntp_ds.layout.cost import COSTED_KINDS, UnitCost
from ntp_ds.layout.shard_layout import ShardLayout


def rank_work(layout: ShardLayout, rank: int, cost: UnitCost | None = None) -> float:
    """FLOPs per token and layer that `rank` of `layout` computes (its units, KV heads counted once)."""
    cost = cost or layout.units.cost
    if cost is None:
        raise ValueError("the layout's units carry no cost: build them from the model's shapes (config.units())")
    return sum(getattr(cost, kind) * U.count(layout.owned(kind, rank)) for kind in COSTED_KINDS)


def max_rank_work(layout: ShardLayout, cost: UnitCost | None = None) -> float:
    """Work of the most loaded rank: the one that sets the replica's pace."""
    return max(rank_work(layout, r, cost) for r in range(layout.tp))


def replica_paces(layouts: Sequence[ShardLayout], healthy_tp: int) -> tuple[float, ...]:
    """Each replica's predicted time per sample over a healthy replica's: its most loaded rank's work over that of a
    balanced TP-`healthy_tp` layout of the same units (1.0 for a healthy replica)."""
    first = layouts[0]
    healthy = max_rank_work(type(first).balanced(first.units, healthy_tp))
    work: dict = {}  # replicas of one layout (most of them, at scale) share its work
    return tuple((work[lay] if lay in work else work.setdefault(lay, max_rank_work(lay))) / healthy
                 for lay in layouts)
