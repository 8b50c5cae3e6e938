"""Where each member sits in the configured (healthy) job, so that a job can grow back toward it. Pure logic.

A `Placement` remembers which configured replica each live replica is, and which TP slot of that replica's healthy
layout each of its members held. A degraded layout keeps every survivor's healthy heads (`ShardLayout.without_ranks`
moves only FFN columns and vocabulary rows a head taker gives away to even out work), so giving a joiner the
missing slot of the healthy layout moves the joiner's shard and those given units back: the survivors hold the rest.
Joiners complete degraded replicas first (fewest members missing first, then in replica order), then bring back
dropped replicas once enough joiners for `min_tp` are left.
"""

from __future__ import annotations

from dataclasses import dataclass

from ntp_ds.layout import ShardLayout, Topology


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
