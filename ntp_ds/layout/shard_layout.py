"""Shard layouts: which sharding units each tensor-parallel rank of one replica owns.

Pure logic, no torch. A layout is per replica; every replica may use a different one. Query heads, FFN columns and
vocabulary rows are each owned by exactly one rank; a rank also holds the KV heads its query heads read (GQA), so a
KV head can be replicated on several ranks.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Literal

from ntp_ds.layout import units as U
from ntp_ds.layout.balance import FINE_KINDS, deal_fine, deal_heads, work
from ntp_ds.layout.cost import UnitCost

KINDS = ("heads", "kv", "ffn", "vocab", "replicated")
OWNED_KINDS = ("heads", "ffn", "vocab")


class LayoutError(ValueError):
    """A layout or topology that cannot work; the message names the field and value at fault."""


@dataclass(frozen=True)
class ModelUnits:
    """How many units of each kind the unsharded model has, and what one costs (None: shapes unknown)."""

    heads: int
    kv_heads: int
    ffn: int
    vocab: int
    cost: UnitCost | None = None
    """FLOPs per token of one unit of each kind; degraded layouts balance it (without it they balance counts)."""

    def __post_init__(self):
        for name in ("heads", "kv_heads", "ffn", "vocab"):
            if getattr(self, name) < 1:
                raise LayoutError(f"{name}={getattr(self, name)} must be at least 1")
        if self.heads % self.kv_heads:
            raise LayoutError(f"heads={self.heads} must be a multiple of kv_heads={self.kv_heads}")

    @property
    def group(self) -> int:
        """Query heads per KV head."""
        return self.heads // self.kv_heads

    @property
    def counts(self) -> tuple[int, int, int, int]:
        """The unit counts alone: two ModelUnits of one model may carry different cost estimates."""
        return self.heads, self.kv_heads, self.ffn, self.vocab

    def count(self, kind: str) -> int:
        return {"heads": self.heads, "kv": self.kv_heads, "ffn": self.ffn, "vocab": self.vocab, "replicated": 1}[kind]


@dataclass(frozen=True)
class ParamSpec:
    """How one parameter tensor is sharded: by units of `kind` along tensor dim `dim`, `unit_size` rows each."""

    kind: str
    dim: int = 0
    unit_size: int = 1

    def __post_init__(self):
        if self.kind not in KINDS:
            raise LayoutError(f"kind={self.kind!r} must be one of {KINDS}")


@dataclass(frozen=True)
class ShardLayout:
    """Units owned by each TP rank of one replica; index i of each tuple is TP rank i."""

    units: ModelUnits
    heads: tuple[U.Ranges, ...]
    ffn: tuple[U.Ranges, ...]
    vocab: tuple[U.Ranges, ...]

    def __post_init__(self):
        if not (len(self.heads) == len(self.ffn) == len(self.vocab)) or not self.heads:
            raise LayoutError(
                f"heads, ffn and vocab must list the same number of ranks (at least 1); "
                f"got {len(self.heads)}, {len(self.ffn)}, {len(self.vocab)}")
        for kind in OWNED_KINDS:
            per_rank = getattr(self, kind)
            for rank, ranges in enumerate(per_rank):
                if U.count(ranges) == 0:
                    raise LayoutError(f"rank {rank} is left with zero {kind} units (tp={self.tp}); "
                                      f"every rank needs at least one of each kind")
            if not U.covers_exactly(per_rank, self.units.count(kind)):
                raise LayoutError(f"{kind} units must be owned exactly once over units 0..{self.units.count(kind) - 1}")

    def __hash__(self) -> int:
        """Hashed once (plans over R replicas key their dicts by layout; the fields are numbers, whose hashes are the
        same in every process, so a pickled layout carries a valid one)."""
        cached = self.__dict__.get("_hash")
        if cached is None:
            cached = self.__dict__["_hash"] = hash((self.units, self.heads, self.ffn, self.vocab))
        return cached

    @property
    def tp(self) -> int:
        return len(self.heads)

    @classmethod
    @functools.lru_cache(maxsize=64)  # frozen, so shared: a topology of R replicas builds R alike
    def balanced(cls, units: ModelUnits, tp: int) -> "ShardLayout":
        """Contiguous split of every kind, sizes differing by at most one (TP 3 over 8 heads: 3/3/2)."""
        if tp < 1:
            raise LayoutError(f"tp={tp} must be at least 1")
        if tp > units.heads:
            raise LayoutError(f"tp={tp} exceeds the query-head count num_attention_heads={units.heads}")
        for kind in ("ffn", "vocab"):
            if tp > units.count(kind):
                raise LayoutError(f"tp={tp} leaves rank {units.count(kind)} with zero {kind} units "
                                  f"(the model has {units.count(kind)})")
        return cls(units, *(tuple(U.split_even(units.count(k), tp)) for k in OWNED_KINDS))

    def owned(self, kind: str, rank: int) -> U.Ranges:
        """Units of `kind` that `rank` stores (its own, plus the KV heads it reads, or the whole replicated unit)."""
        if kind == "kv":
            g = self.units.group
            return U.normalize((a // g, (b - 1) // g + 1) for a, b in self.heads[rank])
        if kind == "replicated":
            return ((0, 1),)
        return getattr(self, kind)[rank]

    def holders(self, kind: str, unit: int) -> list[int]:
        return [r for r in range(self.tp) if U.intersect(self.owned(kind, r), ((unit, unit + 1),))]

    def shares_kv(self) -> bool:
        """Whether some KV head is held by more than one rank (its gradient must then be summed over them)."""
        return sum(U.count(self.owned("kv", r)) for r in range(self.tp)) > self.units.kv_heads

    def shard_shape(self, spec: ParamSpec, full_shape: tuple[int, ...], rank: int) -> tuple[int, ...]:
        if spec.kind == "replicated":
            return tuple(full_shape)
        shape = list(full_shape)
        shape[spec.dim] = U.count(self.owned(spec.kind, rank)) * spec.unit_size
        return tuple(shape)

    def without_ranks(self, lost: set[int] | frozenset[int],
                      balance: Literal["work", "count"] = "work") -> "ShardLayout":
        """Layout after losing `lost` ranks; survivors are renumbered 0..t'-1 in their old order.

        By "work" (the default when the units carry a cost) survivors keep their query heads and the lost ones go
        where they cost least (`layout.balance.deal_heads`); FFN columns and vocabulary rows then even out the work:
        the lost ones go to the survivors below the mean, and a survivor above it (it took a head) gives some of its
        own FFN columns away. By "count" (the old rule, kept for comparison) each kind's lost units go in contiguous
        runs to the survivors with the fewest, so every survivor keeps all its units and the taker of a head does
        its work on top.
        """
        survivors = [r for r in range(self.tp) if r not in lost]
        if not survivors:
            raise LayoutError(f"lost ranks {sorted(lost)} leave no survivor in a replica of tp={self.tp}")
        if balance not in ("work", "count"):
            raise LayoutError(f"balance={balance!r} must be 'work' or 'count'")
        if balance == "count" or self.units.cost is None:
            return self._count_balanced(lost, survivors)
        own = {k: [U.units_of(getattr(self, k)[r]) for r in survivors] for k in OWNED_KINDS}
        orphans = {k: [u for r in sorted(lost) if r < self.tp for u in U.units_of(getattr(self, k)[r])]
                   for k in OWNED_KINDS}
        cost, group = self.units.cost, self.units.group
        load = [work(own["heads"][i], {k: own[k][i] for k in FINE_KINDS}, group, cost) for i in range(len(survivors))]
        # The least the mean can be: the lost units spread with no KV head held anywhere it was not already.
        mean = (sum(load) + cost.heads * len(orphans["heads"])
                + sum(getattr(cost, k) * len(orphans[k]) for k in FINE_KINDS)) / len(survivors)
        heads = deal_heads(own["heads"], orphans["heads"], group, cost, [mean - w for w in load])
        fine = deal_fine(heads, own, orphans, group, cost)
        return ShardLayout(self.units, *(tuple(U.from_units(o) for o in per_rank)
                                         for per_rank in (heads, fine["ffn"], fine["vocab"])))

    def _count_balanced(self, lost, survivors: list[int]) -> "ShardLayout":
        """Hand each kind's lost units, in contiguous runs, to the survivors that hold the fewest of that kind."""
        new = {}
        for kind in OWNED_KINDS:
            per_rank = getattr(self, kind)
            owned = [list(U.units_of(per_rank[r])) for r in survivors]
            orphans = [u for r in sorted(lost) if r < self.tp for u in U.units_of(per_rank[r])]
            by_load = sorted(range(len(survivors)), key=lambda i: (len(owned[i]), i))
            targets = U.split_even(self.units.count(kind), len(survivors))
            for i, target in zip(by_load, targets):
                take = max(0, U.count(target) - len(owned[i]))
                owned[i] += orphans[:take]
                orphans = orphans[take:]
            owned[by_load[0]] += orphans
            new[kind] = tuple(U.from_units(o) for o in owned)
        return ShardLayout(self.units, new["heads"], new["ffn"], new["vocab"])
