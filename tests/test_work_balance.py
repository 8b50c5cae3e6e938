"""Work-balanced degraded layouts: every survivor of a degraded replica does about t/t' of a healthy rank's work."""

from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ntp_ds.layout import ModelUnits, ShardLayout, Topology, UnitCost, max_rank_work
from ntp_ds.layout import units as U
from ntp_ds.layout.shard_layout import OWNED_KINDS
from ntp_ds.recovery.plan import plan_unit_moves, rebalanced_moves
from ntp_ds.sim.config import ModelConfig
from ntp_ds.sim.granularity import load_ratio, model_units
from ntp_ds.testing.shapes import llama_70b

SIM_70B = ModelConfig(hidden=8192, heads=64, kv_heads=8, ffn_hidden=28672, vocab=128256, layers=80, seq_len=8192)
SIM_480B = ModelConfig(params_billion=480.0, hidden=20480, heads=128, layers=100, seq_len=16384)
CASES = [(SIM_70B, 64, 63), (SIM_70B, 64, 56), (SIM_70B, 8, 7), (SIM_480B, 32, 30)]


def degraded(units: ModelUnits, tp: int, degree: int, balance: str = "work") -> ShardLayout:
    return ShardLayout.balanced(units, tp).without_ranks(frozenset(range(degree, tp)), balance=balance)


def assert_valid(layout: ShardLayout) -> None:
    """Every query head, FFN column and vocabulary row owned once; every rank holds the KV heads its heads read."""
    for kind in OWNED_KINDS:
        owned = Counter(u for r in range(layout.tp) for u in U.units_of(layout.owned(kind, r)))
        assert owned == Counter(range(layout.units.count(kind))), kind
    g = layout.units.group
    for r in range(layout.tp):
        needed = U.from_units(h // g for h in U.units_of(layout.owned("heads", r)))
        assert U.intersect(layout.owned("kv", r), needed) == needed, f"rank {r} lacks a KV head it reads"


@pytest.mark.parametrize("model, tp, degree", CASES, ids=[f"{c[0].heads}h-tp{c[1]}-to-{c[2]}" for c in CASES])
def test_most_loaded_rank_is_within_3_percent_of_ideal(model, tp, degree):
    ratio = load_ratio(model, tp, degree)
    assert ratio <= 1.03 * tp / degree, f"{ratio:.4f} against ideal {tp / degree:.4f}"
    counted = degraded(model_units(model), tp, degree, balance="count")
    assert max_rank_work(counted) > max_rank_work(degraded(model_units(model), tp, degree))
    assert_valid(degraded(model_units(model), tp, degree))


@pytest.mark.parametrize("tp, degree", [(64, 63), (64, 56), (8, 7)])
def test_the_engines_70b_config_balances_as_well(tp, degree):
    # The engine's own costs: a SwiGLU FFN (three projections per column) at the recipe's 8192-token sequences.
    units = llama_70b().units(8192)
    ratio = max_rank_work(degraded(units, tp, degree)) / max_rank_work(ShardLayout.balanced(units, tp))
    assert ratio <= 1.03 * tp / degree


def test_the_taker_of_a_head_gives_ffn_columns_and_keeps_its_heads():
    # 70B TP 64 -> 63: rank 56 (same KV group as the lost rank 63) takes head 63 and its KV head comes free; with
    # two heads it must hold fewer FFN columns than it had, so it gives some away. Nobody else gives anything.
    units = model_units(SIM_70B)
    healthy = ShardLayout.balanced(units, 64)
    new = healthy.without_ranks({63})
    taker = next(r for r in range(63) if U.count(new.owned("heads", r)) == 2)
    assert U.units_of(new.owned("heads", taker)) == [taker, 63]
    assert U.count(new.owned("kv", taker)) == 1
    for r in range(63):
        assert U.subtract(healthy.owned("heads", r), new.owned("heads", r)) == ()
        given = {k: U.count(U.subtract(healthy.owned(k, r), new.owned(k, r))) for k in ("ffn", "vocab")}
        assert (given["ffn"] > 0) == (r == taker) and given["vocab"] == 0, (r, given)


def test_lost_units_alone_even_out_the_work_when_they_suffice():
    # 70B TP 8 -> 7: each survivor has room for two more heads (one copy of their KV head), so the lost rank's 8 heads
    # (one KV group) pack onto 4 survivors, 4 KV copies instead of 7; its FFN columns go mostly to the others, and no
    # survivor gives a unit away.
    units = model_units(SIM_70B)
    healthy = ShardLayout.balanced(units, 8)
    new = healthy.without_ranks({7})
    for r in range(7):
        for kind in OWNED_KINDS:
            assert U.subtract(healthy.owned(kind, r), new.owned(kind, r)) == ()
    heads = [U.count(new.owned("heads", r)) for r in range(7)]
    assert sorted(heads) == [8, 8, 8, 10, 10, 10, 10]
    assert sum(U.count(new.owned("kv", r)) for r in range(7)) == 7 + 4
    ffn = [U.count(new.owned("ffn", r)) for r in range(7)]
    assert all(ffn[a] > ffn[b] for a in range(7) for b in range(7) if heads[a] < heads[b])


def test_units_without_a_cost_and_the_count_rule_keep_every_survivor_unit():
    units = model_units(SIM_70B)
    costless = ModelUnits(units.heads, units.kv_heads, units.ffn, units.vocab)
    for lay in (degraded(units, 64, 63, balance="count"), degraded(costless, 64, 63)):
        for r in range(63):
            for kind in OWNED_KINDS:
                healthy = ShardLayout.balanced(units, 64).owned(kind, r)
                assert U.intersect(lay.owned(kind, r), healthy) == healthy
    with pytest.raises(ValueError, match="balance='heads'"):
        ShardLayout.balanced(units, 4).without_ranks({3}, balance="heads")


def test_units_given_between_survivors_are_reported_apart_from_the_lost_shard():
    units = ModelUnits(heads=8, kv_heads=8, ffn=64, vocab=64, cost=UnitCost(heads=100.0, kv=100.0, ffn=10.0,
                                                                              vocab=1.0))
    old = Topology.from_degrees(units, (8, 8))
    new = Topology((old.layouts[0], old.layouts[1].without_ranks({7})))
    old_rank_of = {i: i for i in range(15)}
    moves = plan_unit_moves(old, new, old_rank_of)
    extra = rebalanced_moves(old, new, old_rank_of, moves)
    assert extra and all(m.kind in ("ffn", "vocab") and new.locate(m.dst)[0] == 1 for m in extra)
    before, after = old.layouts[1], new.layouts[1]
    for kind in OWNED_KINDS:
        fetched = U.union(*(m.units for m in moves if m.kind == kind and new.locate(m.dst)[0] == 1))
        given = U.union(*(e.units for e in extra if e.kind == kind))
        # What the survivors gave each other, plus the lost rank's units: nothing else moved.
        assert given == U.union(*(U.subtract(before.owned(kind, r), after.owned(kind, r)) for r in range(7)))
        assert fetched == U.union(given, before.owned(kind, 7))


@st.composite
def costed_units(draw):
    kv = draw(st.integers(1, 4))
    heads = kv * draw(st.integers(2 if kv == 1 else 1, 4))  # at least two heads: something to lose
    weights = [draw(st.floats(0.01, 1000.0)) for _ in range(4)]
    return ModelUnits(heads=heads, kv_heads=kv, ffn=draw(st.integers(heads, 60)), vocab=draw(st.integers(heads, 60)),
                      cost=UnitCost(*weights))


@settings(max_examples=150, deadline=None)
@given(costed_units(), st.data())
def test_any_loss_keeps_every_unit_once_and_the_kv_heads_each_rank_reads(units, data):
    layout = ShardLayout.balanced(units, data.draw(st.integers(2, units.heads)))
    for _ in range(data.draw(st.integers(1, 2))):  # a second loss starts from an uneven layout
        if layout.tp == 1:
            break
        lost = data.draw(st.sets(st.integers(0, layout.tp - 1), min_size=1, max_size=layout.tp - 1))
        survivors = [r for r in range(layout.tp) if r not in lost]
        new = layout.without_ranks(lost)
        assert new.tp == len(survivors)
        assert_valid(new)
        for i, old in enumerate(survivors):  # heads stay; only FFN columns and vocabulary rows may leave
            assert U.subtract(layout.owned("heads", old), new.owned("heads", i)) == ()
        layout = new
