"""What a degraded replica really costs: whole sequences, its most loaded rank, the gradient exchange.

A replica does not take an arbitrary fraction of the global batch: the engine's batch planner
(``ntp_ds.batch.planner.plan_batch``) gives it whole sequences, as many as its most loaded rank finishes in a
healthy replica's step (``share / load_ratio``, rounded down), and one when that rounds to zero: the step then waits
for it, or the job drops it, whichever loses less.  Inside the replica the engine's layout
(``ntp_ds.layout.ShardLayout.balanced(...).without_ranks(...)``) hands the lost ranks' heads, KV heads,
FFN columns and vocabulary rows to the survivors, balancing their work (``ntp_ds.layout.cost``): 128 heads
over 30 ranks leave 8 ranks with 5 heads where TP32 gives every rank 4, and those hold fewer FFN columns.
The slowest rank sets the group's pace.  Before the data-parallel reduction the degraded replica reshards
its gradients into the healthy layout over the scale-up link and reshards the update back, mostly hidden
behind the backward pass.

Pure functions; the layout and planner imports are the engine's own pure modules.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from ntp_ds.batch.planner import BatchError, plan_batch
from ntp_ds.layout import units as U
from ntp_ds.layout.cost import UnitCost, unit_cost
from ntp_ds.layout.pace import max_rank_work
from ntp_ds.layout.shard_layout import ModelUnits, ShardLayout

from .config import ModelConfig


def model_units(m: ModelConfig) -> ModelUnits:
    """Sharding units of the simulated model (query heads, KV heads, FFN columns, vocabulary rows) and their cost."""
    return ModelUnits(heads=m.heads, kv_heads=m.kv_heads or m.heads, ffn=m.ffn_hidden or 4 * m.hidden,
                      vocab=m.vocab, cost=model_cost(m))


def model_cost(m: ModelConfig) -> UnitCost:
    """Cost of each unit kind of the simulated model: ``layout.cost.unit_cost`` with heads of width
    ``hidden/heads`` and an FFN of an up and a down projection."""
    return unit_cost(m.hidden, m.hidden / m.heads, m.layers, m.seq_len, ffn_matrices=2)


def unit_flops(m: ModelConfig) -> dict[str, float]:
    """Forward FLOPs per token of one unit of each kind, per layer (vocabulary rows spread over layers)."""
    return dataclasses.asdict(model_cost(m))


def rank_units(units: ModelUnits, tp: int, degree: int) -> list[dict[str, int]]:
    """Units per rank of a TP-``tp`` replica that runs at ``degree`` ranks, as the engine assigns them."""
    layout = _layout(units, tp, degree)
    return [{k: U.count(layout.owned(k, r)) for k in ("heads", "kv", "ffn", "vocab")}
            for r in range(layout.tp)]


@lru_cache(maxsize=256)
def _layout(units: ModelUnits, tp: int, degree: int) -> ShardLayout:
    healthy = ShardLayout.balanced(units, tp)
    return healthy if degree == tp else healthy.without_ranks(frozenset(range(degree, tp)))


def load_ratio(m: ModelConfig, tp: int, degree: int) -> float:
    """Most loaded rank's work at ``degree`` over a healthy TP-``tp`` rank's, same tokens."""
    units = model_units(m)
    return max_rank_work(_layout(units, tp, degree)) / max_rank_work(_layout(units, tp, tp))


def planned_samples(m: ModelConfig, share: int, tp: int, degree: int) -> int:
    """Sequences the engine's planner gives a replica at ``degree`` next to healthy ones (0: a stopped replica):
    what its most loaded rank finishes in a healthy step, and at least one whole sequence. Under the engine's
    default ``preserve_global_batch`` no running replica is left without a sample (``balance_samples``): where one
    sequence takes it longer than a healthy step, the step waits for it, which `level_cost` charges, and the job
    keeps it or drops it, whichever loses less."""
    if degree <= 0:
        return 0
    if degree >= tp:
        return share
    try:
        plan = plan_batch((1.0, load_ratio(m, tp, degree)), 2 * share, 1, "proportional")
    except BatchError:  # it finishes no whole sequence in a healthy step
        return 1
    return plan.replicas[1].samples


def sequences_per_replica(m: ModelConfig, replicas: int) -> float:
    return m.tokens_per_batch / m.seq_len / replicas


@dataclass(frozen=True)
class LevelCost:
    """Per level ``K``: batch share and step time of a replica, relative to a healthy one."""

    share: np.ndarray     # sequences / healthy sequences (0: the replica takes no part)
    time: np.ndarray      # its step time / a healthy step (the job waits for the slowest)
    compute: np.ndarray   # part of ``time`` that faster clocks shorten


def level_cost(degree: np.ndarray, tp: int, share: int, m: ModelConfig, parts: dict,
               rebalance: bool, exchange_overlap: float, scaleup_gbps: float,
               grad_bytes: int, params: float, slowdown=None) -> LevelCost:
    """Share and step time of a replica at each level's ``degree`` (0 = stopped).

    ``parts`` holds the healthy step's seconds: ``compute`` (with the bubble), ``tp_comm`` and
    ``fixed`` (the exposed DP all-reduce) and ``step``.  With ``rebalance`` the planner's share is
    used, else every running replica takes the healthy share.  ``slowdown(x)``, when given, is the
    engine's measured step-time ratio at ``x = degree/tp`` and replaces the layout and exchange model.
    """
    deg = np.asarray(degree)
    n = deg.size
    shr, time, comp = np.zeros(n), np.zeros(n), np.zeros(n)
    step = parts["step"]
    for k, t1 in enumerate(deg.tolist()):
        if t1 <= 0:
            continue
        samples = planned_samples(m, share, tp, t1) if rebalance else share
        if samples <= 0:
            continue
        sigma = samples / share
        shr[k] = sigma
        if t1 == tp:
            time[k], comp[k] = 1.0, parts["compute"] / step
            continue
        if slowdown is not None:
            time[k] = sigma * float(slowdown(t1 / tp))
            comp[k] = time[k] * parts["compute"] / step
            continue
        c = parts["compute"] * sigma * load_ratio(m, tp, t1)
        exchange = 2.0 * params * grad_bytes / (t1 * scaleup_gbps * 1e9) * (1.0 - exchange_overlap)
        time[k] = (c + parts["tp_comm"] * sigma + parts["fixed"] + exchange) / step
        comp[k] = c / step
    return LevelCost(share=shr, time=time, compute=comp)
