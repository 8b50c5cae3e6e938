"""Report: what a recovery or a grow moved, kept and lost, as the figures of its event.

The per-rank figures are measured where they happen (the wire's meter, the exchanges, the re-slice); `installed`
sums them over the new generation in one collective and lays out the event's fields.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ntp_ds.engine.fragments import fragment_addresses
from ntp_ds.layout import Topology
from ntp_ds.layout import units as U
from ntp_ds.layout.sharding import packed_numel

@dataclass
class RecoveryOutcome:
    """The engine a recovery or a grow installed, and its event."""

    engine: object
    event: dict = field(default_factory=dict)


TRAFFIC_KINDS = {"parameters": ("reshard", "param_sync"), "optimizer": ("reslice",),
                 "redundancy": ("copy_data", "copy_piece", "copy_layout"),
                 "objects": ("all_gather_object", "gather_object", "broadcast_object")}
"""How recovery's measured traffic is reported: call names of the wire layer by kind; the rest is "control"."""

SUMMED = ("bytes_moved", "kv_rereplicated_bytes", "optimizer_bytes_moved", "optimizer_bytes_restored", "whole",
          "rebalanced_bytes", "lost_optimizer_bytes", "engines_rebuilt", "communicators_created",
          "communicators_kept", "refused_param_buckets", "refused_copies", "refused_grads")
"""The figures `installed` sums over the new generation, in the order it takes them."""


def received_by_kind(traffic: dict[tuple[str, str], int]) -> dict[str, int]:
    """Bytes this rank received, per kind of traffic, from a reading of the wire's meter."""
    kind_of = {op: kind for kind, ops in TRAFFIC_KINDS.items() for op in ops}
    out = dict.fromkeys([*TRAFFIC_KINDS, "control"], 0)
    for (op, direction), n in traffic.items():
        if direction == "received":
            out[kind_of.get(op, "control")] += n
    return out


def installed(mine: dict, received: dict[str, int], sum_counts, members: int) -> dict:
    """The event's fields of an installation from this rank's figures (`mine`: every name of `SUMMED`) and its
    received traffic by kind, summed over the `members` of the new generation by `sum_counts`."""
    totals = [int(t) for t in sum_counts([mine[k] for k in SUMMED] + list(received.values()))]
    total = dict(zip(SUMMED, totals))
    return {"bytes_moved": total["bytes_moved"], "kv_rereplicated_bytes": total["kv_rereplicated_bytes"],
            "rebalanced_bytes": total["rebalanced_bytes"], "optimizer_bytes_moved": total["optimizer_bytes_moved"],
            "optimizer_bytes_restored": total["optimizer_bytes_restored"],
            "lost_optimizer_bytes": total["lost_optimizer_bytes"], "engines_rebuilt": total["engines_rebuilt"],
            "communicators_created": total["communicators_created"],
            "communicators_kept": total["communicators_kept"],
            "traffic_bytes": dict(zip(received, totals[len(SUMMED):])),
            "refused": {"param_buckets": total["refused_param_buckets"], "copies": total["refused_copies"],
                        "grads": total["refused_grads"]},
            "lossless": total["whole"] == members}


def keepable(snapshot, engine, rolled_back: bool) -> int:
    """Elements of a kept engine's new fragments that its old ones held (the same shard, so the same coordinates):
    what it installs from itself; none after a roll-back, which serves only the copies."""
    if rolled_back:
        return 0
    new = fragment_addresses(engine)
    return sum(max(0, min(old.start + old.numel, start + numel) - max(old.start, start))
               for name, old in snapshot.fragments.items() if name in new for start, numel in [new[name]])


def lost_shard_bytes(topology: Topology, members, gone, rebuilt, engine) -> int:
    """Parameter bytes the dead ranks of the rebuilt replicas held that no survivor of their replica holds (a unit
    two dead ranks shared, a GQA KV head, counts once)."""
    total = 0
    width = next(engine.module.parameters()).element_size()
    dead = {members.index(g) for g in gone}
    for replica in rebuilt:
        lay, ranks = topology.layouts[replica], topology.ranks_of(replica)
        for name, spec in engine.param_specs.items():
            lost = U.union(*(lay.owned(spec.kind, t) for t in range(lay.tp) if ranks[t] in dead))
            units = U.subtract(lost, U.union(*(lay.owned(spec.kind, t) for t in range(lay.tp) if ranks[t] not in dead)))
            if units:
                total += packed_numel(spec, engine.full_shapes[name], units) * width
    return total


def joiner_shard_bytes(topology: Topology, members, joiners, engine, width: int) -> int:
    """Parameter bytes of the joiners' new shards (each unit once per joiner), `width` bytes an element."""
    total = 0
    for rank in (members.index(j) for j in joiners):
        replica, tp = topology.locate(rank)
        lay = topology.layouts[replica]
        for name, spec in engine.param_specs.items():
            units = lay.owned(spec.kind, tp)
            if units:
                total += packed_numel(spec, engine.full_shapes[name], units) * width
    return total


def joined(joiners) -> str:
    """The reason of a grow's event."""
    return f"rank{'s' if len(joiners) > 1 else ''} {', '.join(map(str, joiners))} joined"
