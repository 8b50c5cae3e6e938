"""Shard/unshard and unit packing round trips over random uneven, non-contiguous layouts."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ntp_ds.layout import units as U
from ntp_ds.layout.shard_layout import ModelUnits, ParamSpec, ShardLayout
from ntp_ds.layout.sharding import gather_units, packed_numel, scatter_units, shard_tensor, unshard_into

HIDDEN = 3


def draw_assignment(draw, n: int, tp: int) -> tuple[U.Ranges, ...]:
    """Give each of n units to one of tp ranks at random, every rank at least one."""
    order = draw(st.permutations(range(n)))
    owner = {u: r for r, u in enumerate(order[:tp])}
    for u in order[tp:]:
        owner[u] = draw(st.integers(0, tp - 1))
    return tuple(U.from_units(u for u in range(n) if owner[u] == r) for r in range(tp))


@st.composite
def layouts(draw):
    kv = draw(st.integers(1, 4))
    heads = kv * draw(st.integers(1, 4))
    ffn, vocab = draw(st.integers(1, 12)), draw(st.integers(1, 20))
    tp = draw(st.integers(1, min(heads, ffn, vocab, 5)))
    return ShardLayout(ModelUnits(heads, kv, ffn, vocab), draw_assignment(draw, heads, tp),
                       draw_assignment(draw, ffn, tp), draw_assignment(draw, vocab, tp))


def specs(units: ModelUnits) -> list[tuple[ParamSpec, tuple[int, ...]]]:
    """One tensor of every sharding pattern the model uses, with unit sizes above one."""
    hd = 2
    return [
        (ParamSpec("heads", 0, hd), (units.heads * hd, HIDDEN)),
        (ParamSpec("heads", 1, hd), (HIDDEN, units.heads * hd)),
        (ParamSpec("kv", 0, hd), (units.kv_heads * hd, HIDDEN)),
        (ParamSpec("ffn", 0, 1), (units.ffn, HIDDEN)),
        (ParamSpec("ffn", 1, 1), (HIDDEN, units.ffn)),
        (ParamSpec("vocab", 0, 1), (units.vocab, HIDDEN)),
        (ParamSpec("replicated"), (HIDDEN,)),
    ]


@settings(max_examples=60, deadline=None)
@given(layouts())
def test_shard_unshard_round_trip(layout):
    for spec, shape in specs(layout.units):
        full = torch.randn(shape)
        rebuilt = torch.zeros(shape)
        for rank in range(layout.tp):
            local = shard_tensor(full, spec, layout, rank)
            assert local.shape == layout.shard_shape(spec, shape, rank)
            unshard_into(rebuilt, local, spec, layout, rank)
        torch.testing.assert_close(rebuilt, full, rtol=0, atol=0)


@settings(max_examples=60, deadline=None)
@given(layouts(), st.data())
def test_gather_scatter_between_ranks(layout, data):
    """Units packed on a source rank land in the right place on any destination rank holding them."""
    for spec, shape in specs(layout.units):
        full = torch.randn(shape)
        src, dst = data.draw(st.integers(0, layout.tp - 1)), data.draw(st.integers(0, layout.tp - 1))
        common = U.units_of(U.intersect(layout.owned(spec.kind, src), layout.owned(spec.kind, dst)))
        moved = U.from_units(data.draw(st.lists(st.sampled_from(common), unique=True))) if common else ()
        buffer = gather_units(shard_tensor(full, spec, layout, src), spec, layout, src, moved)
        assert buffer.dim() == 1 and buffer.numel() == packed_numel(spec, shape, moved)

        received = torch.zeros(layout.shard_shape(spec, shape, dst))
        scatter_units(received, buffer, spec, layout, dst, moved)
        expected = torch.zeros(shape)
        if spec.kind == "replicated":
            expected = full.clone() if moved else expected
        else:
            u = spec.unit_size
            for a, b in moved:
                expected.narrow(spec.dim, a * u, (b - a) * u).copy_(full.narrow(spec.dim, a * u, (b - a) * u))
        torch.testing.assert_close(received, shard_tensor(expected, spec, layout, dst), rtol=0, atol=0)

        out = torch.empty(buffer.numel())
        assert gather_units(received, spec, layout, dst, moved, out=out) is out
        torch.testing.assert_close(out, buffer, rtol=0, atol=0)


def test_gather_rejects_units_not_held():
    layout = ShardLayout(ModelUnits(4, 2, 4, 4), (((0, 1), (3, 4)), ((1, 3),)), (((0, 2),), ((2, 4),)),
                         (((0, 1),), ((1, 4),)))
    spec = ParamSpec("heads", 0, 2)
    local = shard_tensor(torch.randn(8, 3), spec, layout, 0)
    with pytest.raises(ValueError):
        gather_units(local, spec, layout, 0, ((1, 2),))
    with pytest.raises(ValueError):
        scatter_units(local, torch.zeros(5), spec, layout, 0, ((0, 1),))
