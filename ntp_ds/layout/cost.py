"""What one sharding unit costs a rank: forward FLOPs per token, from the model's shapes.

Pure logic, no torch. The degraded layouts balance this cost across unit kinds (`ShardLayout.without_ranks`), and a
layout's pace is measured with it (`ntp_ds.layout.pace`, which the simulator uses too): one cost model for both.
"""

from __future__ import annotations

from dataclasses import dataclass

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
