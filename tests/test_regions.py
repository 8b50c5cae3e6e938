"""Range arithmetic on parameter grids agrees with element-by-element index maps."""

import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ntp_ds.layout import ModelUnits, ParamSpec, ShardLayout
from ntp_ds.layout.regions import (area, block_in_full, blocks, grid, intersection, rectangles, rects_in_full,
                                   span_in)
from ntp_ds.layout.sharding import shard_tensor

UNITS = ModelUnits(heads=6, kv_heads=3, ffn=7, vocab=9)
SPECS = [(ParamSpec("heads", 0, 2), (12, 5)), (ParamSpec("heads", 1, 2), (4, 12)), (ParamSpec("kv", 0, 2), (6, 5)),
         (ParamSpec("ffn", 1), (3, 7)), (ParamSpec("vocab", 0), (9, 4)), (ParamSpec("replicated"), (5,))]


def _layout(tp: int, lost: frozenset[int]) -> ShardLayout:
    lay = ShardLayout.balanced(UNITS, tp)
    return lay.without_ranks(lost) if lost and len(lost) < tp else lay


def _full_index(spec, shape, layout, tp) -> torch.Tensor:
    return shard_tensor(torch.arange(math.prod(shape)).view(shape), spec, layout, tp).reshape(-1)


@st.composite
def cases(draw):
    spec, shape = draw(st.sampled_from(SPECS))
    old = _layout(draw(st.integers(1, 3)), frozenset(draw(st.sets(st.integers(0, 2), max_size=1))))
    new = _layout(draw(st.integers(1, 3)), frozenset())
    a, b = draw(st.integers(0, old.tp - 1)), draw(st.integers(0, new.tp - 1))
    na, nb = (math.prod(old.shard_shape(spec, shape, a)), math.prod(new.shard_shape(spec, shape, b)))
    s0 = draw(st.integers(0, na - 1))
    s1 = draw(st.integers(s0 + 1, na))
    d0 = draw(st.integers(0, nb - 1))
    d1 = draw(st.integers(d0 + 1, nb))
    return spec, shape, old, a, (s0, s1 - s0), new, b, (d0, d1 - d0)


def _maps(case):
    """Both sides' element maps (each local index's unsharded index) and grids."""
    spec, shape, old, a, _, new, b, _ = case
    return (_full_index(spec, shape, old, a), _full_index(spec, shape, new, b), grid(spec, shape, old, a),
            grid(spec, shape, new, b))


@settings(max_examples=300, deadline=None)
@given(cases())
def test_blocks_match_the_element_maps(case):
    spec, shape, old, a, src, new, b, dst = case
    src_full, dst_full, g_src, g_dst = _maps(case)
    assert g_src.numel == src_full.numel() and g_dst.numel == dst_full.numel()
    pairs = set()
    for blk in blocks(g_src, src, g_dst, dst):
        for r in range(blk.row0, blk.row1):
            for c in range(blk.cols):
                s, d = r * g_src.width + blk.src_col + c, r * g_dst.width + blk.dst_col + c
                assert src[0] <= s < src[0] + src[1] and dst[0] <= d < dst[0] + dst[1]
                assert int(src_full[s]) == int(dst_full[d])
                pairs.add((s, d))
    where = {int(v): i for i, v in enumerate(src_full.tolist()) if src[0] <= i < src[0] + src[1]}
    expected = {(where[int(v)], i) for i, v in enumerate(dst_full.tolist())
                if dst[0] <= i < dst[0] + dst[1] and int(v) in where}
    assert pairs == expected
    lo, hi = span_in(g_src, src, g_dst)
    assert all(lo <= d < hi for _, d in expected)


@given(st.integers(0, 40), st.integers(0, 40), st.integers(1, 9))
def test_rectangles_tile_a_flat_range(start, numel, width):
    assert _cells(rectangles(start, numel, width), width) == list(range(start, start + numel))


def _cells(rects, width: int) -> list[int]:
    """The unsharded flat indices of rectangles of a matrix `width` wide, with repeats."""
    return [r * width + c for r0, r1, c0, c1 in rects for r in range(r0, r1) for c in range(c0, c1)]


@settings(max_examples=300, deadline=None)
@given(cases())
def test_rectangles_in_full_coordinates_match_the_element_maps(case):
    # Two slices of the same parameter, in two layouts: their rectangles hold exactly their elements, a block's
    # rectangle exactly the block's, and the area of their union less the other's counts the set difference.
    spec, shape, old, a, src, new, b, dst = case
    src_full, dst_full, g_src, g_dst = _maps(case)
    width = math.prod(shape) // g_src.outer
    theirs, mine = rects_in_full(g_src, *src), rects_in_full(g_dst, *dst)
    held = set(src_full[src[0]:src[0] + src[1]].tolist())
    needed = set(dst_full[dst[0]:dst[0] + dst[1]].tolist())
    assert sorted(_cells(theirs, width)) == sorted(held)
    assert sorted(_cells(mine, width)) == sorted(needed)
    for blk in blocks(g_src, src, g_dst, dst):
        at = [r * g_dst.width + blk.dst_col + c for r in range(blk.row0, blk.row1) for c in range(blk.cols)]
        assert sorted(_cells([block_in_full(g_dst, blk)], width)) == sorted(int(dst_full[i]) for i in at)
    assert area(mine, theirs) == len(needed - held)
    assert area(intersection(mine, theirs)) == len(needed & held)
    assert area(mine + theirs + mine) == len(needed | held)
