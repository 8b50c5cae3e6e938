"""Who is where in one generation of the job, and in the next one after a loss or a join. Pure logic.

A `Generation` is the one answer to "who is where": its members' launch ranks in global-rank order, their topology,
and their `Placement` in the configured (healthy) job. `after_loss` and `after_join` compute the next generation the
same way on every rank, from nothing but the current one and the ranks that left or arrive.

A `Placement` remembers which configured replica each live replica is, and which TP slot of that replica's healthy
layout each of its members held. A degraded layout keeps every survivor's healthy heads (`ShardLayout.without_ranks`
moves only FFN columns and vocabulary rows a head taker gives away to even out work), so giving a joiner the
missing slot of the healthy layout moves the joiner's shard and those given units back: the survivors hold the rest.
Joiners complete degraded replicas first (fewest members missing first, then in replica order), then bring back
dropped replicas once enough joiners for `min_tp` are left.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from ntp_ds.layout.domains import Racks, replica_domains
from ntp_ds.layout.plan import Topology
from ntp_ds.layout.shard_layout import ShardLayout


@dataclass(frozen=True)
class Generation:
    """One generation of the job: its members (launch ranks, in global-rank order), their topology and their
    places in the configured job."""

    number: int
    members: tuple[int, ...]
    topology: Topology | None
    """None only on a joiner before the hand-off (`unplaced`)."""
    placement: Placement | None
    racks: Racks | None = None
    """The racks the job's nodes sit in, when the launcher said: the topology is then placed in them
    (`Topology.domains`), here and in every generation after."""

    @classmethod
    def initial(cls, topology: Topology, members: Sequence[int] | None = None, number: int = 0,
                racks: Racks | None = None) -> Generation:
        """A job as launched (or as a joiner learns it): every replica at its configured layout."""
        members = tuple(range(topology.world_size)) if members is None else tuple(members)
        return cls(number, members, _placed(topology, members, racks), Placement.initial(topology), racks)

    @classmethod
    def unplaced(cls, number: int, members: Sequence[int]) -> Generation:
        """What a joiner knows of the generation it joins before the members tell it the rest: who is in it."""
        return cls(number, tuple(members), None, None)

    def after_loss(self, dead: Iterable[int], min_tp: int, number: int) -> Loss:
        """The generation `number` after `dead` (launch ranks) are lost: each hit replica keeps its survivors at a
        smaller layout, and the replicas left below `min_tp` are dropped."""
        hit = replica_membership(self.topology, dead, self.members)
        dropped = hit.below(min_tp)
        members = hit.ranks(dropped)
        after = None
        if members:
            after = Generation(number, members, _placed(hit.topology(dropped), members, self.racks),
                               self.placement.after_loss(hit.lost, dropped), self.racks)
        return Loss(after, dropped, tuple(r for r in hit.degraded if r not in dropped))

    def after_join(self, joiners: Sequence[int], min_tp: int, number: int) -> tuple[Generation, tuple[int, ...]]:
        """The generation `number` with `joiners` (launch ranks, in order) seated, and the joiners left without a
        seat. A replica nobody joins keeps its layout (a replica degraded twice may hold another split than its
        configured one less the missing slots)."""
        placement, members, unseated = self.placement.grow(self.members, tuple(joiners), min_tp)
        topology = _placed(placement.topology(self.placement, self.topology), members, self.racks)
        return Generation(number, members, topology, placement, self.racks), unseated


def _placed(topology: Topology, members: Sequence[int], racks: Racks | None) -> Topology:
    """`topology` placed in `racks` (its global rank g is launch rank `members[g]`); as it is without racks."""
    return topology if racks is None else topology.placed(replica_domains(topology, members, racks))


@dataclass(frozen=True)
class Loss:
    """What a loss leaves: the next generation (None: every replica fell below `min_tp`), the replicas dropped
    and the replicas rebuilt at a smaller degree (indices of the generation before)."""

    after: Generation | None
    dropped: tuple[int, ...]
    rebuilt: tuple[int, ...]


@dataclass(frozen=True)
class Placement:
    """Configured layouts, and for each live replica its configured index and the healthy slots of its members."""

    healthy: tuple[ShardLayout, ...]
    """The configured layout of every configured replica."""
    replicas: tuple[int, ...]
    """Configured index of each live replica, in topology order."""
    slots: tuple[tuple[int, ...], ...]
    """Per live replica, the healthy TP slot of each member, in TP-rank order (ascending)."""

    @classmethod
    def initial(cls, topology: Topology) -> Placement:
        return cls(topology.layouts, tuple(range(len(topology.layouts))),
                   tuple(tuple(range(lay.tp)) for lay in topology.layouts))

    def after_loss(self, lost: dict[int, frozenset[int]], dropped) -> Placement:
        """The placement after a recovery: `lost[r]` is the TP ranks live replica r lost (those that lost all are
        in `dropped` too), `dropped` the live replicas that leave."""
        dropped = set(dropped) | {r for r, gone in lost.items() if len(gone) == len(self.slots[r])}
        replicas, slots = [], []
        for r, (configured, members) in enumerate(zip(self.replicas, self.slots)):
            if r in dropped:
                continue
            replicas.append(configured)
            gone = lost.get(r)  # most replicas lost nothing: their slots are kept as they are
            slots.append(tuple(s for i, s in enumerate(members) if i not in gone) if gone else members)
        return Placement(self.healthy, tuple(replicas), tuple(slots))

    def missing(self) -> dict[int, tuple[int, ...]]:
        """Configured replica -> its healthy slots that no member holds (every slot of a dropped replica)."""
        live = dict(zip(self.replicas, self.slots))
        out = {}
        for configured, lay in enumerate(self.healthy):
            have = set(live.get(configured, ()))
            gap = tuple(s for s in range(lay.tp) if s not in have)
            if gap:
                out[configured] = gap
        return out

    def layout_of(self, configured: int, slots: tuple[int, ...]) -> ShardLayout:
        healthy = self.healthy[configured]
        gap = frozenset(range(healthy.tp)) - set(slots)
        return healthy.without_ranks(gap) if gap else healthy

    def grow(self, members: tuple[int, ...], joiners: tuple[int, ...], min_tp: int
             ) -> tuple[Placement, tuple[int, ...], tuple[int, ...]]:
        """Seat `joiners` (launch ranks, in order); return the new placement, the new members in global-rank order
        and the joiners left without a seat. `members` are the launch ranks of the current members in global-rank
        order."""
        live = dict(zip(self.replicas, self.slots))
        by_replica = {}
        pos = 0
        for configured, slots in zip(self.replicas, self.slots):
            by_replica[configured] = dict(zip(slots, members[pos:pos + len(slots)]))
            pos += len(slots)
        waiting = list(joiners)
        gaps = self.missing()
        degraded = sorted((c for c in gaps if c in live), key=lambda c: (len(gaps[c]), c))
        for configured in degraded:
            for slot in gaps[configured]:
                if not waiting:
                    break
                by_replica[configured][slot] = waiting.pop(0)
        for configured in sorted(c for c in gaps if c not in live):
            need = max(min_tp, 1)
            if len(waiting) < need:
                continue
            take = min(len(waiting), len(gaps[configured]))
            by_replica[configured] = {slot: waiting.pop(0) for slot in gaps[configured][:take]}
        replicas = tuple(sorted(by_replica))
        slots = tuple(tuple(sorted(by_replica[c])) for c in replicas)
        new_members = tuple(by_replica[c][s] for c, ss in zip(replicas, slots) for s in ss)
        return Placement(self.healthy, replicas, slots), new_members, tuple(waiting)

    def topology(self, before: Placement | None = None, current: Topology | None = None) -> Topology:
        """The layouts of the live replicas: a replica whose members did not change since `before` keeps its layout
        in `current` (a replica degraded twice may hold another split than `layout_of` would give it)."""
        kept = {}
        if before is not None and current is not None:
            kept = {(c, s): lay for c, s, lay in zip(before.replicas, before.slots, current.layouts)}
        return Topology(tuple(kept.get((c, s)) or self.layout_of(c, s) for c, s in zip(self.replicas, self.slots)))


@dataclass(frozen=True)
class ReplicaMembership:
    """Which TP ranks each replica lost, which replicas are gone, and each surviving replica's new layout."""

    lost: dict[int, frozenset[int]]
    """Replica -> TP ranks (in its old layout) it lost; only replicas that lost some appear."""
    gone: tuple[int, ...]
    """Replicas that lost every rank."""
    layouts: dict[int, ShardLayout]
    """Replica -> layout after the loss, for every replica not gone (unchanged for untouched ones)."""
    members: dict[int, tuple[int, ...]]
    """Replica -> launch ranks it keeps, in new TP-rank order, for every replica not gone."""

    @property
    def degraded(self) -> tuple[int, ...]:
        """Return the replicas that lost some ranks and keep at least one."""
        return tuple(r for r in sorted(self.lost) if r not in self.gone)

    def below(self, min_tp: int) -> tuple[int, ...]:
        """Return the surviving replicas whose new TP degree is below `min_tp`."""
        return tuple(r for r, lay in sorted(self.layouts.items()) if lay.tp < min_tp)

    def topology(self, drop: Iterable[int] = ()) -> Topology:
        """Return the topology of the surviving replicas, less `drop`, in their old order."""
        drop = set(drop)
        return Topology(tuple(lay for r, lay in sorted(self.layouts.items()) if r not in drop))

    def ranks(self, drop: Iterable[int] = ()) -> tuple[int, ...]:
        """Return the launch ranks of that topology in global-rank order (replica after replica)."""
        drop = set(drop)
        return tuple(m for r, ms in sorted(self.members.items()) if r not in drop for m in ms)


def replica_membership(topology: Topology, dead: Iterable[int],
                       members: Sequence[int] | None = None) -> ReplicaMembership:
    """Map dead launch ranks onto `topology`'s replicas (pure).

    `members[i]` is the launch rank at global rank i of `topology` (default: the identity, as at launch).
    """
    members = tuple(range(topology.world_size)) if members is None else tuple(members)
    if len(members) != topology.world_size:
        raise ValueError(f"members lists {len(members)} ranks but the topology has {topology.world_size}")
    dead = frozenset(dead)
    if len(dead) <= 16:  # the usual few: one scan in C each, not a Python loop over the W members
        at = {m: members.index(m) for m in dead if m in members}
    else:
        at = {m: g for g, m in enumerate(members) if m in dead}
    unknown = sorted(dead - set(at))
    if unknown:
        raise ValueError(f"dead ranks {unknown} are not members {list(members)}")
    hit: dict[int, set[int]] = defaultdict(set)  # replica -> the TP indices it lost
    for g in at.values():
        replica, tp_rank = topology.locate(g)
        hit[replica].add(tp_rank)
    starts = topology._starts
    lost, gone, layouts, kept = {}, [], {}, {}
    for replica, layout in enumerate(topology.layouts):
        ranks = members[starts[replica]:starts[replica + 1]]
        if replica not in hit:  # most replicas: kept whole, no per-rank work
            layouts[replica], kept[replica] = layout, ranks
            continue
        tp_lost = lost[replica] = frozenset(hit[replica])
        if len(tp_lost) == layout.tp:
            gone.append(replica)
            continue
        layouts[replica] = layout.without_ranks(tp_lost)
        kept[replica] = tuple(m for m in ranks if m not in dead)
    return ReplicaMembership(lost, tuple(gone), layouts, kept)
