"""Regions of a parameter as range arithmetic: where a slice of one rank's flat shard lies in the unsharded tensor.

Pure logic, no torch. A tensor of shape (..., D, ...) sharded along dim `d` is seen as a matrix of `outer` rows
(the product of the dims before `d`) by `D * inner` columns (`inner`: the product of the dims after it). A rank's
local shard is the same rows with only its units' columns, in unit order, so the mapping between local and full
coordinates is a short list of column runs, one per contiguous range of owned units. A contiguous slice of the
flat local shard (a ZeRO fragment) is at most three rectangles of that matrix.

Matching two slices (an old owner's fragment against a new rank's fragment, in different layouts) therefore costs
a few rectangle intersections per parameter, never an element map: memory and time do not grow with the tensor.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ntp_ds.layout import units as U
from ntp_ds.layout.shard_layout import ParamSpec, ShardLayout


@dataclass(frozen=True)
class Grid:
    """How one rank's flat local shard of a parameter maps to the unsharded tensor, as a matrix."""

    outer: int
    width: int
    """Local elements per row."""
    runs: tuple[tuple[int, int, int], ...]
    """(local column, full column, columns) for each contiguous range of owned units, in local order."""

    @property
    def numel(self) -> int:
        return self.outer * self.width


def grid(spec: ParamSpec, full_shape: tuple[int, ...], layout: ShardLayout, tp_rank: int,
         units: U.Ranges | None = None) -> Grid:
    """The grid of `tp_rank`'s shard; with `units`, only the runs of those units (a subset of its own) are kept."""
    if spec.kind == "replicated":
        numel = math.prod(full_shape)
        runs = ((0, 0, numel),) if units is None or units else ()
        return Grid(1, numel, runs)
    outer = math.prod(full_shape[:spec.dim])
    per_unit = math.prod(full_shape[spec.dim + 1:]) * spec.unit_size
    owned = layout.owned(spec.kind, tp_rank)
    keep = owned if units is None else U.intersect(owned, U.normalize(units))
    runs, local = [], 0
    for a, b in owned:
        for x, y in U.intersect(((a, b),), keep):
            runs.append((local + (x - a) * per_unit, x * per_unit, (y - x) * per_unit))
        local += (b - a) * per_unit
    return Grid(outer, local, tuple(runs))


def rectangles(start: int, numel: int, width: int) -> list[tuple[int, int, int, int]]:
    """Cut flat elements [start, start + numel) of a matrix `width` wide into (row0, row1, col0, col1) pieces."""
    if numel <= 0:
        return []
    stop = start + numel
    (r0, c0), (r1, c1) = divmod(start, width), divmod(stop, width)
    if r0 == r1:
        return [(r0, r0 + 1, c0, c1)]
    out = []
    if c0:
        out.append((r0, r0 + 1, c0, width))
        r0 += 1
    if r1 > r0:
        out.append((r0, r1, 0, width))
    if c1:
        out.append((r1, r1 + 1, 0, c1))
    return out


def _in_full(g: Grid, start: int, numel: int) -> list[tuple[int, int, int, int, int]]:
    """(row0, row1, full col0, full col1, local col0) pieces of flat local slice [start, start + numel)."""
    out = []
    for r0, r1, c0, c1 in rectangles(start, numel, g.width):
        for local, full, n in g.runs:
            a, b = max(c0, local), min(c1, local + n)
            if a < b:
                out.append((r0, r1, full + a - local, full + b - local, a))
    return out


@dataclass(frozen=True)
class Block:
    """Rows [row0, row1) x `cols` columns, at local column `src_col` of the source and `dst_col` of the destination."""

    row0: int
    row1: int
    src_col: int
    dst_col: int
    cols: int

    @property
    def numel(self) -> int:
        return (self.row1 - self.row0) * self.cols


def blocks(src: Grid, src_slice: tuple[int, int], dst: Grid, dst_slice: tuple[int, int]) -> list[Block]:
    """Where the elements of `src`'s flat slice (start, numel) that `dst`'s slice also holds lie in each shard."""
    out = []
    theirs = _in_full(dst, *dst_slice)
    for s0, s1, sf0, sf1, sl in _in_full(src, *src_slice):
        for d0, d1, df0, df1, dl in theirs:
            r0, r1, f0, f1 = max(s0, d0), min(s1, d1), max(sf0, df0), min(sf1, df1)
            if r0 < r1 and f0 < f1:
                out.append(Block(r0, r1, sl + f0 - sf0, dl + f0 - df0, f1 - f0))
    return out


def span_in(src: Grid, src_slice: tuple[int, int], other: Grid) -> tuple[int, int]:
    """The smallest flat range [lo, hi) of `other`'s shard holding every element of `src`'s slice it holds."""
    lo, hi = other.numel, 0
    for r0, r1, f0, f1, _ in _in_full(src, *src_slice):
        for local, full, n in other.runs:
            a, b = max(f0, full), min(f1, full + n)
            if a < b:
                lo = min(lo, r0 * other.width + local + a - full)
                hi = max(hi, (r1 - 1) * other.width + local + b - full)
    return (lo, hi) if lo < hi else (0, 0)


Rect = tuple[int, int, int, int]
"""(row0, row1, full col0, full col1): a rectangle of the unsharded matrix, the same in every layout."""


def rects_in_full(g: Grid, start: int, numel: int) -> list[Rect]:
    """The rectangles of the unsharded matrix that flat local slice [start, start + numel) of `g` holds."""
    return [piece[:4] for piece in _in_full(g, start, numel)]


def block_in_full(g: Grid, block: Block) -> Rect:
    """The rectangle of the unsharded matrix that `block` covers in `g`, the destination's grid (a block lies within
    one run of owned columns)."""
    for local, full, n in g.runs:
        if local <= block.dst_col < local + n:
            col = full + block.dst_col - local
            return block.row0, block.row1, col, col + block.cols
    raise ValueError(f"block {block} lies in no run of owned columns {g.runs}")


def intersection(a: list[Rect], b: list[Rect]) -> list[Rect]:
    """The pairwise overlaps of two rectangle lists."""
    out = []
    for r0, r1, c0, c1 in a:
        for s0, s1, d0, d1 in b:
            rows, cols = (max(r0, s0), min(r1, s1)), (max(c0, d0), min(c1, d1))
            if rows[0] < rows[1] and cols[0] < cols[1]:
                out.append((*rows, *cols))
    return out


def area(rects: list[Rect], minus: list[Rect] = ()) -> int:
    """Elements in the union of `rects` and in no rectangle of `minus`: per band of rows between two rectangle edges,
    column range arithmetic (time grows with the rectangles, never with the elements)."""
    edges = sorted({r for rect in (*rects, *minus) for r in rect[:2]})
    total = 0
    for y0, y1 in zip(edges, edges[1:]):
        inside = U.normalize((c0, c1) for r0, r1, c0, c1 in rects if r0 <= y0 and y1 <= r1)
        if inside:
            out = U.normalize((c0, c1) for r0, r1, c0, c1 in minus if r0 <= y0 and y1 <= r1)
            total += (y1 - y0) * U.count(U.subtract(inside, out))
    return total
