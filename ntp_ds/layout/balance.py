"""Where a degraded replica's units go: the lost ranks' units dealt to the survivors so that each does equal work.

Pure logic, no torch. Units are plain lists of indices per survivor here; `ShardLayout.without_ranks` turns them
back into ranges. A query head is coarse (one costs as much as hundreds of FFN columns), so the heads are dealt
first and the fine units (FFN columns, then vocabulary rows) even out the rest: a survivor that takes a head takes
fewer of the lost FFN columns, and gives some of its own to the others when that is not enough.
"""

from __future__ import annotations

from ntp_ds.layout.cost import UnitCost

FINE_KINDS = ("ffn", "vocab")
"""Units that even out the work, in the order a survivor gives its own away (an FFN column moves more work per
byte than a vocabulary row)."""


def work(heads: list[int], fine: dict[str, list[int]], group: int, cost: UnitCost) -> float:
    """Work of a rank holding these query heads and fine units."""
    return attention_work(heads, group, cost) + sum(getattr(cost, k) * len(fine[k]) for k in FINE_KINDS)


def attention_work(heads: list[int], group: int, cost: UnitCost) -> float:
    """Work of a set of query heads and the KV heads they read (each KV head once)."""
    return cost.heads * len(heads) + cost.kv * len({h // group for h in heads})


def deal_heads(owned: list[list[int]], orphans: list[int], group: int, cost: UnitCost,
               room: list[float]) -> list[list[int]]:
    """Give each lost query head to a survivor, preferring those with `room` for it (work they can take before they
    pass the mean): among them the one it adds least to (one that already holds its KV head), else the one whose
    attention work stays lowest. So heads pack onto KV holders while that costs no unit of their own, and spread
    otherwise."""
    owned, room = [list(hs) for hs in owned], list(room)
    for head in orphans:
        def key(i):
            before = attention_work(owned[i], group, cost)
            after = attention_work(owned[i] + [head], group, cost)
            fits = after - before <= room[i]
            return not fits, after - before if fits else after, after, i
        taker = min(range(len(owned)), key=key)
        room[taker] -= attention_work(owned[taker] + [head], group, cost) - attention_work(owned[taker], group, cost)
        owned[taker].append(head)
    return [sorted(hs) for hs in owned]


def target_work(floor: list[float], total: float) -> float:
    """The work every survivor should end with: the mean, over the survivors whose minimum (`floor`: their heads and
    one unit of each fine kind) is below it; the others are pinned at their floor."""
    pinned: set[int] = set()
    while True:
        free = [i for i in range(len(floor)) if i not in pinned]
        target = (total - sum(floor[i] for i in pinned)) / len(free)
        over = {i for i in free if floor[i] > target}
        if not over:
            return target
        pinned |= over


def shed(own: dict[str, list[int]], excess: float, cost: UnitCost) -> dict[str, list[int]]:
    """The survivor's own fine units to give away for `excess` work: FFN columns (the highest first, the nearest
    count), vocabulary rows only once it is down to one FFN column; always keep one of each kind."""
    out = {}
    for kind in FINE_KINDS:
        keep = own[kind]
        n = min(len(keep) - 1, max(0, round(excess / getattr(cost, kind))))
        out[kind] = keep[len(keep) - n:] if n else []
        excess -= n * getattr(cost, kind)
        if n < len(keep) - 1:
            break
    return out


def split_by_weight(n: int, weights: list[float]) -> list[int]:
    """Split n units over parts in proportion to `weights` (largest remainder; equal parts when all weigh zero)."""
    if sum(weights) <= 0:
        weights = [1.0] * len(weights)
    quotas = [n * w / sum(weights) for w in weights]
    out = [int(q) for q in quotas]
    order = sorted(range(len(weights)), key=lambda i: (-(quotas[i] - out[i]), i))
    for i in order[: n - sum(out)]:
        out[i] += 1
    return out


def deal_fine(heads: list[list[int]], own: dict[str, list[list[int]]], orphans: dict[str, list[int]], group: int,
              cost: UnitCost) -> dict[str, list[list[int]]]:
    """Deal the lost FFN columns and vocabulary rows (and, where needed, survivors' own) so work evens out.

    A survivor above the target gives away its excess (`shed`); the pool of lost and given units then goes to the
    survivors below it in proportion to their shortfall, each kind in contiguous runs in rank order.
    """
    n = len(heads)
    load = [work(heads[i], {k: own[k][i] for k in FINE_KINDS}, group, cost) for i in range(n)]
    total = sum(load) + sum(getattr(cost, k) * len(orphans[k]) for k in FINE_KINDS)
    floor = [attention_work(heads[i], group, cost) + sum(getattr(cost, k) for k in FINE_KINDS) for i in range(n)]
    target = target_work(floor, total)
    kept = {k: [list(units) for units in own[k]] for k in FINE_KINDS}
    pool = {k: list(orphans[k]) for k in FINE_KINDS}
    for i in range(n):
        if load[i] <= target:
            continue
        given = shed({k: kept[k][i] for k in FINE_KINDS}, load[i] - target, cost)
        for kind, units in given.items():
            kept[kind][i] = kept[kind][i][: len(kept[kind][i]) - len(units)]
            pool[kind] += units
            load[i] -= getattr(cost, kind) * len(units)
    shortfall = [max(0.0, target - w) for w in load]
    out = {}
    for kind in FINE_KINDS:
        units = sorted(pool[kind])
        start = 0
        for i, take in enumerate(split_by_weight(len(units), shortfall)):
            kept[kind][i] = sorted(kept[kind][i] + units[start:start + take])
            start += take
        out[kind] = kept[kind]
    return out
