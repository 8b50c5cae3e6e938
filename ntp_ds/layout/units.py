"""Unit ranges: the sets of sharding units (heads, FFN columns, vocabulary rows) a rank owns.

A set of units is stored as a sorted tuple of disjoint, non-adjacent half-open ranges, so that uneven and
non-contiguous ownership stays small to describe even for 100k vocabulary rows.
"""

from __future__ import annotations

from typing import Iterable

import numpy as np
import numpy.ma  # noqa: F401 (np.unique imports it on its first call, which would be inside a recovery's critical path)

Ranges = tuple[tuple[int, int], ...]


def normalize(ranges: Iterable[tuple[int, int]]) -> Ranges:
    """Sort, drop empty ranges and merge overlapping or adjacent ones."""
    out: list[list[int]] = []
    for start, stop in sorted((int(a), int(b)) for a, b in ranges if b > a):
        if out and start <= out[-1][1]:
            out[-1][1] = max(out[-1][1], stop)
        else:
            out.append([start, stop])
    return tuple((a, b) for a, b in out)


def from_units(units: Iterable[int]) -> Ranges:
    """Build ranges from individual unit indices, repeats allowed (one sort in C and vectorised run breaks: a
    vocabulary's 128K rows, or a member list of 100K ranks, take milliseconds)."""
    u = np.unique(np.fromiter(units, dtype=np.int64))
    if not u.size:
        return ()
    breaks = np.flatnonzero(np.diff(u) != 1) + 1  # where a run starts, after the first
    starts = np.concatenate((u[:1], u[breaks]))
    stops = np.concatenate((u[breaks - 1], u[-1:])) + 1
    return tuple(zip(starts.tolist(), stops.tolist()))


def count(ranges: Ranges) -> int:
    return sum(b - a for a, b in ranges)


def units_of(ranges: Ranges) -> list[int]:
    return [u for a, b in ranges for u in range(a, b)]


def intersect(x: Ranges, y: Ranges) -> Ranges:
    """Return the units present in both range sets."""
    out, i, j = [], 0, 0
    while i < len(x) and j < len(y):
        start, stop = max(x[i][0], y[j][0]), min(x[i][1], y[j][1])
        if start < stop:
            out.append((start, stop))
        if x[i][1] < y[j][1]:
            i += 1
        else:
            j += 1
    return tuple(out)


def subtract(x: Ranges, y: Ranges) -> Ranges:
    """Return the units of x that are not in y (range arithmetic: time linear in the number of ranges)."""
    x, y = normalize(x), normalize(y)
    out, j = [], 0
    for start, stop in x:
        while j < len(y) and y[j][1] <= start:
            j += 1
        k, cursor = j, start
        while k < len(y) and y[k][0] < stop:
            if y[k][0] > cursor:
                out.append((cursor, y[k][0]))
            cursor = max(cursor, y[k][1])
            k += 1
        if cursor < stop:
            out.append((cursor, stop))
    return tuple(out)


def union(*sets: Ranges) -> Ranges:
    """Return the units present in any of the range sets."""
    return normalize(r for ranges in sets for r in ranges)


def covers_exactly(per_rank: Iterable[Ranges], n: int) -> bool:
    """Whether the range sets are disjoint and together cover units 0..n-1 (without listing units)."""
    spans = sorted(r for ranges in per_rank for r in ranges if r[1] > r[0])
    cursor = 0
    for start, stop in spans:
        if start != cursor:
            return False
        cursor = stop
    return cursor == n


def local_offsets(owned: Ranges, wanted: Ranges) -> list[tuple[int, int]]:
    """Map `wanted` (a subset of `owned`) to half-open offsets in the rank's local, unit-ordered storage.

    A rank stores its units in increasing unit order, so unit u sits at the number of owned units below u.
    """
    out, base = [], 0
    for a, b in owned:
        for start, stop in intersect(((a, b),), wanted):
            out.append((base + start - a, base + stop - a))
        base += b - a
    if sum(b - a for a, b in out) != count(wanted):
        raise ValueError(f"units {wanted} are not all within owned units {owned}")
    return out


def split_even(n: int, parts: int) -> list[Ranges]:
    """Split units 0..n-1 into `parts` contiguous ranges whose sizes differ by at most one (larger first)."""
    base, extra = divmod(n, parts)
    out, start = [], 0
    for p in range(parts):
        size = base + (1 if p < extra else 0)
        out.append(normalize([(start, start + size)]))
        start += size
    return out
