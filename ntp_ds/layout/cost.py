"""What one sharding unit costs a rank: forward FLOPs per token, from the model's shapes.

Pure logic, no torch. The degraded layouts balance this cost across unit kinds (`ShardLayout.without_ranks`) and the
simulator measures a replica's pace with it (`ntp_ds.sim.granularity`): one cost model for both.
"""

from __future__ import annotations

from dataclasses import dataclass
from collections.abc import Sequence
from typing import TYPE_CHECKING

from ntp_ds.layout import units as U

if TYPE_CHECKING:
    from ntp_ds.layout.shard_layout import ShardLayout

COSTED_KINDS = ("heads", "kv", "ffn", "vocab")


@dataclass(frozen=True)
class UnitCost:
    """Forward FLOPs per token of one unit of each kind, per layer (vocabulary rows spread over the layers)."""

    heads: float
    """A query head: its Q and O projections and its attention over the sequence."""
    kv: float
    """A KV head's K and V projections, paid by every rank that holds it."""
    ffn: float
    """An FFN column: one column or row of each FFN projection."""
    vocab: float
    """A vocabulary row of the output layer."""

    def __post_init__(self):
        for kind in COSTED_KINDS:
            if not getattr(self, kind) > 0:
                raise ValueError(f"cost.{kind}={getattr(self, kind)} must be positive")


def unit_cost(hidden: int, head_dim: int, layers: int, seq_len: int, ffn_matrices: int = 3) -> UnitCost:
    """Cost of each unit kind of a decoder with these shapes.

    A query head of width ``d`` projects Q and O (``4 h d``) and attends over the sequence (``4 s d``); a KV head
    projects K and V (``4 h d``); an FFN column is ``2 h`` per projection (3 for SwiGLU's gate, up and down, 2 for
    an up and a down); a vocabulary row of the output layer is ``2 h``, once per model.
    """
    return UnitCost(heads=4.0 * hidden * head_dim + 4.0 * seq_len * head_dim, kv=4.0 * hidden * head_dim,
                    ffn=2.0 * ffn_matrices * hidden, vocab=2.0 * hidden / layers)


def rank_work(layout: "ShardLayout", rank: int, cost: UnitCost | None = None) -> float:
    """FLOPs per token and layer that `rank` of `layout` computes (its units, KV heads counted once)."""
    cost = cost or layout.units.cost
    if cost is None:
        raise ValueError("the layout's units carry no cost: build them from the model's shapes (config.units())")
    return sum(getattr(cost, kind) * U.count(layout.owned(kind, rank)) for kind in COSTED_KINDS)


def max_rank_work(layout: "ShardLayout", cost: UnitCost | None = None) -> float:
    """Work of the most loaded rank: the one that sets the replica's pace."""
    return max(rank_work(layout, r, cost) for r in range(layout.tp))


def replica_paces(layouts: Sequence["ShardLayout"], healthy_tp: int) -> tuple[float, ...]:
    """Each replica's predicted time per sample over a healthy replica's: its most loaded rank's work over that of a
    balanced TP-`healthy_tp` layout of the same units (1.0 for a healthy replica)."""
    first = layouts[0]
    healthy = max_rank_work(type(first).balanced(first.units, healthy_tp))
    work: dict = {}  # replicas of one layout (most of them, at scale) share its work
    return tuple((work[lay] if lay in work else work.setdefault(lay, max_rank_work(lay))) / healthy
                 for lay in layouts)
