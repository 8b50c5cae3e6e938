"""Failure domains: the racks a job's nodes sit in, and where copies and watchers go so that a rack lost whole (its
power, its top-of-rack switch) takes no state and no watcher with it. Pure logic.

A rack is `rack_size` contiguous nodes of `node_size` ranks: launch rank r lives in rack r // node_size // rack_size
(the launcher says both: `launcher.rack_size`, `NTP_RACK_SIZE`). A topology placed in racks (`Topology.domains`)
knows, for each replica, the racks its ranks live in. Two replicas are *apart* when they share no rack.

- Copies of an anchor's optimizer state (`plan_buddies`) go to replicas apart from it: the smallest shifts along the
  replica order that put every anchor's copy apart from it (a rack of m replicas: the copy goes m replicas on), so
  every replica still holds as many copies as it keeps; where no such shift exists (racks of different sizes), each
  anchor takes the nearest replica apart from it, and only where none is apart, the nearest.
- Watchers (`domain_neighbours`): the replicas are put on a ring that interleaves the racks (`interleaved_ring`),
  and each rank watches the ranks of its two ring neighbours at its own TP index (modulo the smaller degree of the
  two). Neighbours on that ring lie in other racks whenever no rack holds more than half the replicas, so every
  rank of a lost rack is watched from outside it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import islice

SHIFT_TRIES = 64
"""How many shifts along the replica order are tried for one that puts every copy apart (a rack's replicas: a few)."""


@dataclass(frozen=True)
class Racks:
    """`rack_size` contiguous nodes of `node_size` ranks each form a rack."""

    node_size: int
    rack_size: int

    def __post_init__(self):
        for name in ("node_size", "rack_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be at least 1")

    def of(self, launch_rank: int) -> int:
        """The rack launch rank `launch_rank` lives in."""
        return launch_rank // self.node_size // self.rack_size


def replica_domains(topology, members: Sequence[int], racks: Racks | None) -> tuple[frozenset[int], ...] | None:
    """For each replica of `topology` (whose global rank g is launch rank `members[g]`), the racks its ranks live
    in; None without racks."""
    if racks is None:
        return None
    return tuple(frozenset(racks.of(members[g]) for g in topology.rank_range(r)) for r in range(len(topology.layouts)))


def _apart(domains, a: int, b: int) -> bool:
    return domains[a].isdisjoint(domains[b])


def copy_targets(order: Sequence[int], anchors: int, copies: int,
                 domains: Sequence[frozenset[int]] | None) -> list[list[int]]:
    """For each of the first `anchors` replicas of `order` (the anchors, then the contributors), the `copies`
    replicas of `order` that keep copies of its state (see the module's docstring). Without domains, or with
    every replica in one rack: the next ones along `order`."""
    n = len(order)
    if domains is None or len({d for r in order for d in domains[r]}) < 2:
        return [[order[(i + k) % n] for k in range(1, copies + 1)] for i in range(anchors)]
    uniform: list[int] = []
    for s in range(1, min(n, SHIFT_TRIES + 1)):
        if all(_apart(domains, order[i], order[(i + s) % n]) for i in range(anchors)):
            uniform.append(s)
            if len(uniform) == copies:
                break
    out = []
    for i in range(anchors):
        shifts = list(uniform)
        if len(shifts) < copies:  # the nearest replicas apart, then the nearest of any rack (scanned lazily: the
            # nearest replica apart lies past the anchor's own rack, a few replicas on)
            apart = (s for s in range(1, n) if s not in shifts and _apart(domains, order[i], order[(i + s) % n]))
            shifts += islice(apart, copies - len(shifts))
            shifts += islice((s for s in range(1, n) if s not in shifts), copies - len(shifts))
        out.append([order[(i + s) % n] for s in shifts])
    return out


def ring_neighbours(ranks: list[int], rank: int) -> set[int]:
    """The ranks before and after `rank` in `ranks`, taken as a ring (none in a group of one): whom a member of a
    large group watches, so that every member is watched by two whatever the group's size."""
    if len(ranks) < 2:
        return set()
    i = ranks.index(rank)
    return {ranks[i - 1], ranks[(i + 1) % len(ranks)]} - {rank}


def _deal(by_domain: dict[int, list[int]]) -> tuple[int, ...]:
    """A ring of the items of every domain that puts items of one domain next to each other only where one domain
    holds more than half of them: the domains' items, the largest domain's first, are dealt to every other place of
    the ring, then to the places between."""
    dealt = [r for _, rs in sorted(by_domain.items(), key=lambda kv: (-len(kv[1]), kv[0])) for r in rs]
    n = len(dealt)
    ring = [0] * n
    places = list(range(0, n, 2)) + list(range(1, n, 2))
    for place, r in zip(places, dealt):
        ring[place] = r
    return tuple(ring)


def interleaved_ring(topology) -> tuple[int, ...]:
    """The live replicas (degree at least 1) of a placed topology in the watchers' ring order (`_deal`: replicas of
    one rack next to each other only where one rack holds more than half of them). A replica spanning racks counts
    in its first."""
    by_rack: dict[int, list[int]] = {}
    for r, d in enumerate(topology.degrees):
        if d > 0:
            by_rack.setdefault(min(topology.domains[r], default=-1), []).append(r)
    return _deal(by_rack)


def failure_domain(racks: Racks | None, node_size: int | None) -> Callable[[int], int] | None:
    """A launch rank's failure domain: its rack where the launcher placed nodes in racks, else its node where the
    launcher said how many ranks a node runs, else none (None)."""
    if racks is not None:
        return racks.of
    if node_size:
        return lambda r: r // node_size
    return None


def spread_neighbours(members: Sequence[int], rank: int, domain_of: Callable[[int], int] | None) -> set[int]:
    """The two members `rank` watches while no engine names its peers (a new generation's rendezvous and build):
    its neighbours on a ring of `members` that interleaves their domains (`domain_of`: a launch rank's rack, or its
    node; `_deal`), so that a rack or a node lost whole is watched from outside it, not only at the two ends of its
    run of ranks. Without `domain_of`: its neighbours in `members` taken as a ring. Symmetric: every member is
    watched by its two neighbours."""
    if domain_of is None:
        return ring_neighbours(list(members), rank)
    ring, where = _spread_ring(tuple(members), domain_of)
    if len(ring) < 2:
        return set()
    i = where[rank]
    return {ring[i - 1], ring[(i + 1) % len(ring)]} - {rank}


@functools.lru_cache(maxsize=2)
def _spread_ring(members: tuple[int, ...], domain_of: Callable[[int], int]) -> tuple[tuple[int, ...], dict[int, int]]:
    """The ring `spread_neighbours` walks, and each member's place on it: built once per generation (a rank asks at
    its rendezvous and again until its engine is built; a harness playing many ranks asks once per member)."""
    by_domain: dict[int, list[int]] = {}
    for r, d in zip(members, map(domain_of, members)):
        by_domain.setdefault(d, []).append(r)
    ring = _deal(by_domain)
    return ring, {r: i for i, r in enumerate(ring)}


def domain_neighbours(topology, rank: int) -> set[int]:
    """The ranks global rank `rank` watches so that a rack lost whole is seen from outside it: of its replica's two
    neighbours on the interleaved ring (`interleaved_ring`), the ranks at its TP index modulo the smaller of the two
    degrees. The relation is symmetric. Empty for a topology not placed in racks."""
    if topology.domains is None:
        return set()
    cached = topology.__dict__.get("_domain_ring")
    if cached is None:  # frozen: cached in the instance's dict, as cached_property does
        order = interleaved_ring(topology)
        cached = topology.__dict__["_domain_ring"] = order, {r: i for i, r in enumerate(order)}
    order, where = cached
    replica, tp = topology.locate(rank)
    if len(order) < 2 or replica not in where:
        return set()
    i, degrees = where[replica], topology.degrees
    out = set()
    for other in {order[i - 1], order[(i + 1) % len(order)]} - {replica}:
        common = min(degrees[replica], degrees[other])
        out.update(g for u, g in enumerate(topology.rank_range(other)) if u % common == tp % common)
    return out
