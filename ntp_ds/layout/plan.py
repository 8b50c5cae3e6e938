"""Topologies and the plans computed from them: unit transfers between layouts and cross-replica gradient sync.

Pure logic, no torch. Global ranks are numbered replica after replica: replica 0 holds ranks 0..t0-1, and so on.
"""

from __future__ import annotations

import math
from bisect import bisect_right
from collections import defaultdict
from dataclasses import dataclass, field, replace
from functools import cached_property
from itertools import accumulate

from ntp_ds.layout import units as U
from ntp_ds.layout.domains import copy_targets
from ntp_ds.layout.shard_layout import KINDS, OWNED_KINDS, LayoutError, ShardLayout


@dataclass(frozen=True)
class Topology:
    """The layout of every data-parallel replica; replica r's TP degree is `layouts[r].tp`."""

    layouts: tuple[ShardLayout, ...]
    domains: tuple[frozenset[int], ...] | None = field(default=None, compare=False)
    """The failure domains (racks) each replica's ranks live in, when the launcher said (`layout.domains`): copies
    of a replica's state and its watchers are then placed in other racks. None: unknown (one rack for all). Not part
    of a topology's identity: two generations of the same layouts are the same topology wherever they run."""

    def __post_init__(self):
        if not self.layouts:
            raise LayoutError("replicas=0: a topology needs at least one replica")
        if self.domains is not None and len(self.domains) != len(self.layouts):
            raise LayoutError(f"domains name {len(self.domains)} replicas, the topology has {len(self.layouts)}")
        first = self.layouts[0].units
        if any(lay.units is not first and lay.units != first for lay in self.layouts):
            raise LayoutError("all replicas must shard the same model (their ModelUnits differ)")

    @classmethod
    def from_degrees(cls, units, degrees) -> "Topology":
        return cls(tuple(ShardLayout.balanced(units, t) for t in degrees))

    def placed(self, domains: tuple[frozenset[int], ...] | None) -> "Topology":
        """This topology with its replicas' failure domains (None: unknown)."""
        return replace(self, domains=domains)

    # Computed once per topology (the dataclass is frozen, the caches write the instance's dict): every lookup below
    # is O(1) or O(log R), so plans over R replicas cost O(R), not O(R^2).
    @cached_property
    def degrees(self) -> tuple[int, ...]:
        return tuple(lay.tp for lay in self.layouts)

    @cached_property
    def _starts(self) -> tuple[int, ...]:
        """First global rank of each replica, and the world size last."""
        return (0, *accumulate(self.degrees))

    @property
    def world_size(self) -> int:
        return self._starts[-1]

    def ranks_of(self, replica: int) -> list[int]:
        return list(self.rank_range(replica))

    def rank_range(self, replica: int) -> range:
        """The global ranks of `replica`, as a range (no list built)."""
        return range(self._starts[replica], self._starts[replica + 1])

    def locate(self, rank: int) -> tuple[int, int]:
        """Return (replica, tp_rank) of a global rank."""
        if not 0 <= rank < self.world_size:
            raise LayoutError(f"rank={rank} is outside the world of size {self.world_size}")
        replica = bisect_right(self._starts, rank) - 1
        return replica, rank - self._starts[replica]

    def layout_classes(self) -> list[tuple[int, ...]]:
        """Replicas grouped by identical layout, in order of first appearance."""
        groups: dict[ShardLayout, list[int]] = {}
        for r, lay in enumerate(self.layouts):
            groups.setdefault(lay, []).append(r)
        return [tuple(g) for g in groups.values()]


@dataclass(frozen=True)
class Transfer:
    """Move the units `units` of `kind` from global rank `src` to global rank `dst`."""

    src: int
    dst: int
    kind: str
    units: U.Ranges


def plan_transfer(src: ShardLayout, src_ranks: list[int], dst: ShardLayout, dst_ranks: list[int],
                  kinds=KINDS) -> list[Transfer]:
    """Plan how every destination rank receives each unit it holds, each exactly once, from the source layout.

    Owned kinds have one source; for a unit held on several source ranks (KV heads, replicated tensors) the least
    loaded holder is chosen, preferring the one at the same TP index, so the load spreads over the source ranks.
    """
    moves: dict[tuple[int, int, str], list[tuple[int, int]]] = defaultdict(list)
    load = [0] * src.tp
    for d in range(dst.tp):
        for kind in kinds:
            needed = dst.owned(kind, d)
            if kind in OWNED_KINDS:
                for s in range(src.tp):
                    moves[(s, d, kind)] += U.intersect(needed, src.owned(kind, s))
                continue
            for u in U.units_of(needed):
                holders = src.holders(kind, u)
                s = min(holders, key=lambda h: (load[h], h != d, h))
                load[s] += 1
                moves[(s, d, kind)].append((u, u + 1))
    return [Transfer(src_ranks[s], dst_ranks[d], kind, U.normalize(rs)) for (s, d, kind), rs in sorted(moves.items())
            if rs]


@dataclass(frozen=True)
class SyncPlan:
    """Cross-replica gradient synchronisation.

    Replicas with the most common layout form the anchor class: their ranks at the same TP index make one
    data-parallel group in which DeepSpeed reduces gradients and runs its (ZeRO-partitioned) optimizer. Every other
    replica is a contributor, paired with one anchor replica: it sends its gradients to that anchor before the
    anchor's reduction and receives the updated parameters after the anchor's step. Anchors not paired with a
    contributor exchange nothing beyond their own data-parallel reduction.
    """

    anchors: tuple[int, ...]
    anchor_of: dict[int, int]
    grad_transfers: tuple[Transfer, ...]
    param_transfers: tuple[Transfer, ...]

    def is_anchor(self, replica: int) -> bool:
        return replica in self._anchor_set

    @cached_property
    def _anchor_set(self) -> frozenset[int]:
        return frozenset(self.anchors)  # a lookup in the tuple is O(replicas): 12,500 of them at 100K ranks

    def contributors_of(self, anchor: int) -> list[int]:
        return sorted(c for c, a in self.anchor_of.items() if a == anchor)


def plan_gradient_sync(topology: Topology) -> SyncPlan:
    """The topology's gradient-sync plan (see `SyncPlan`), planned once per topology: a recovery asks for it from
    many places, and at 100K ranks each plan costs a tenth of a second."""
    plan = topology.__dict__.get("_sync_plan")  # frozen: cached in the instance's dict, as cached_property does
    if plan is None:
        plan = topology.__dict__["_sync_plan"] = _plan_gradient_sync(topology)
    return plan


def _plan_gradient_sync(topology: Topology) -> SyncPlan:
    classes = topology.layout_classes()
    anchor_class = min(classes, key=lambda c: (-len(c), -topology.degrees[c[0]], c[0]))
    anchors = set(anchor_class)
    contributors = [r for r in range(len(topology.layouts)) if r not in anchors]
    anchor_of = {c: anchor_class[i % len(anchor_class)] for i, c in enumerate(contributors)}
    grads, params = [], []
    for c, a in anchor_of.items():
        lc, la = topology.layouts[c], topology.layouts[a]
        rc, ra = topology.ranks_of(c), topology.ranks_of(a)
        grads += plan_transfer(lc, rc, la, ra)
        params += plan_transfer(la, ra, lc, rc)
    return SyncPlan(tuple(anchor_class), anchor_of, tuple(grads), tuple(params))


def plan_buddies(topology: Topology, plan: SyncPlan, zero_stage: int, copies: int) -> dict[int, tuple[int, ...]]:
    """For every anchor rank, the ranks of other replicas that keep a copy of its optimizer fragments.

    Without ZeRO and with two or more anchors every anchor already holds the full state of its TP index, so no copy
    is kept. Otherwise copy number k of anchor replica a goes to the k-th next replica (anchors first, then
    contributors), at the same TP index where that replica is wide enough; in a topology placed in racks, to the
    k-th such replica in another rack (`layout.domains.copy_targets`). Planned once per topology and settings
    (cached in the frozen topology's dict): a recovery asks for it from several places.
    """
    key = ("_buddies", plan.anchors, zero_stage, copies)
    if key not in topology.__dict__:
        topology.__dict__[key] = _plan_buddies(topology, plan, zero_stage, copies)
    return topology.__dict__[key]


def _plan_buddies(topology: Topology, plan: SyncPlan, zero_stage: int, copies: int) -> dict[int, tuple[int, ...]]:
    if copies <= 0 or (zero_stage == 0 and len(plan.anchors) >= 2):
        return {}
    order = list(plan.anchors) + sorted(plan.anchor_of)
    copies = min(copies, len(order) - 1)
    starts, degrees = topology._starts, topology.degrees
    out = {}
    targets = copy_targets(order, len(plan.anchors), copies, topology.domains)
    for a, others in zip(plan.anchors, targets):  # the anchors lead `order`, so anchor i sits at position i
        for tp_rank, rank in enumerate(topology.ranks_of(a)):
            out[rank] = tuple(starts[r] + tp_rank % degrees[r] for r in others)
    return out


@dataclass(frozen=True)
class TensorMove:
    """Units `units` of parameter `name` (of `kind`) go from holder `src` to the holder `dst` that writes it."""

    src: int
    dst: int
    kind: str
    units: U.Ranges
    name: str


def plan_whole_tensors(old: Topology, holders: list[int], specs,
                       full_shapes) -> tuple[dict[str, int], list[TensorMove]]:
    """Who writes each whole tensor of a sharded HF directory (the final weights, the last good state), and the units
    each writer fetches.

    `holders[i]` is holder i's global rank in `old`. Tensors go to holders by size, largest first to the least
    loaded, so each writes about 1/n of the model and none holds it whole; a writer takes the units it holds itself,
    then the rest from the lowest holder holding them. Raises LookupError naming the first tensor some of whose
    units no holder holds.
    """
    writer, load = {}, [0] * len(holders)
    for name in sorted(specs, key=lambda n: (-math.prod(full_shapes[n]), n)):
        writer[name] = min(range(len(holders)), key=lambda i: (load[i], i))
        load[writer[name]] += math.prod(full_shapes[name])
    places = [old.locate(h) for h in holders]
    moves = []
    for name, spec in specs.items():
        w = writer[name]
        missing = ((0, old.layouts[0].units.count(spec.kind)),)
        for i in sorted(range(len(holders)), key=lambda i: (i != w, i)):
            replica, tp_rank = places[i]
            piece = U.intersect(missing, old.layouts[replica].owned(spec.kind, tp_rank))
            if piece:
                moves.append(TensorMove(i, w, spec.kind, piece, name))
                missing = U.subtract(missing, piece)
        if missing:
            raise LookupError(f"the holders no longer hold all of {name}")
    return writer, moves
