"""Where ZeRO 1/2 keeps each parameter's optimizer state: pure arithmetic on one TP index's parameter sizes.

The anchors at one TP index hold shards of the same shapes, and DeepSpeed lays them out alike on each: every
parameter group flattened in order, each parameter but the group's last padded to `param_alignment` elements, the
group padded to a multiple of 2 x dp, then cut into dp equal contiguous partitions, partition p on the anchor of
data-parallel index p. From that rule any rank can say which elements of which parameter any anchor holds, from
shapes alone, so recovery gathers no addresses (a gather that would grow with the world size on every rank).
The engine reads the rule's inputs off DeepSpeed (`engine.fragments.flat_order`) and recovery checks the rule
against the fragments each rank really holds before trusting it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from ntp_ds.layout.plan import Topology, plan_gradient_sync

START_ALIGNMENT = 2
"""DeepSpeed's `nccl_start_alignment_factor`: a group's flat buffer is padded to a multiple of this times dp."""


@dataclass(frozen=True)
class FlatOrder:
    """How an optimizer lays a TP index's parameters out: the parameter groups in flat order and the padding."""

    groups: tuple[tuple[str, ...], ...]
    """Parameter names of each optimizer parameter group, in the order of its flat buffer."""
    param_alignment: int = 1
    """Elements every parameter but a group's last is padded to (DeepSpeed's `parameter_alignment`)."""
    partitioned: bool = True
    """False without ZeRO: every anchor holds every parameter whole."""
    round_robin: bool = False
    """DeepSpeed's `round_robin_gradients`: `groups` keep the parameters' own order, and each group is flattened in
    round-robin order over the dp partitions instead (parameters 0, dp, 2 dp, ..., then 1, dp + 1, ...), an order
    that changes with dp."""

    def fragments(self, numels: Mapping[str, int], dp: int) -> dict[str, list[tuple[int, int, int | None]]]:
        """Per parameter: (start in the parameter, numel, data-parallel index) of each anchor's fragment, by start.
        Unpartitioned, one fragment per parameter with index None: every anchor holds the same one."""
        out: dict[str, list[tuple[int, int, int | None]]] = {}
        for names, offsets, size in self._flat(numels, dp):
            if size is None:
                out.update({n: [(0, numels[n], None)] if numels[n] else [] for n in names})
                continue
            for name, lo in zip(names, offsets):
                hi = lo + numels[name]
                out[name] = [(max(lo, p * size) - lo, min(hi, (p + 1) * size) - max(lo, p * size), p)
                             for p in range(lo // size if size else 0, min(dp, -(-hi // size)) if size else 0)
                             if max(lo, p * size) < min(hi, (p + 1) * size)]
        return out

    def addresses(self, numels: Mapping[str, int], dp: int, index: int) -> dict[str, tuple[int, int]]:
        """(start, numel) of the fragment of every parameter the anchor of data-parallel index `index` holds: its
        partition met with each parameter's span, without listing the other dp - 1 anchors' fragments."""
        out = {}
        for names, offsets, size in self._flat(numels, dp):
            for name, lo in zip(names, offsets):
                if size is None:
                    if numels[name]:
                        out[name] = (0, numels[name])
                    continue
                start, end = max(lo, index * size), min(lo + numels[name], (index + 1) * size)
                if start < end:
                    out[name] = (start - lo, end - start)
        return out

    def _flat(self, numels: Mapping[str, int], dp: int):
        """Per parameter group: its names in flat order, each one's offset in the flat buffer, and the partition size
        (None without ZeRO)."""
        for names in self.groups:
            if not self.partitioned:
                yield names, [0] * len(names), None
                continue
            if self.round_robin:
                names = tuple(n for j in range(dp) for n in names[j::dp])
            offsets, end = [], 0
            for i, name in enumerate(names):
                offsets.append(end)
                end += numels[name]
                if i < len(names) - 1:
                    end += -end % self.param_alignment
            align = START_ALIGNMENT * dp
            yield names, offsets, -(-end // align) * align // dp


def column_numels(topology: Topology, tp: int, specs, full_shapes) -> dict[str, int]:
    """Elements of every parameter's shard at TP index `tp` of the topology's anchors."""
    layout = topology.layouts[plan_gradient_sync(topology).anchors[0]]
    return {name: math.prod(layout.shard_shape(specs[name], full_shapes[name], tp)) for name in specs}


def anchor_fragments(order: FlatOrder, topology: Topology, tp: int, specs,
                     full_shapes) -> dict[str, list[tuple[int, int, tuple[int, ...]]]]:
    """Per parameter: (start, numel, global ranks holding it) of each fragment of the anchors at TP index `tp`."""
    plan = plan_gradient_sync(topology)
    ranks = [topology.ranks_of(a)[tp] for a in plan.anchors]
    frags = order.fragments(column_numels(topology, tp, specs, full_shapes), len(ranks))
    return {name: [(start, numel, tuple(ranks) if p is None else (ranks[p],)) for start, numel, p in entries]
            for name, entries in frags.items()}


def anchor_addresses(order: FlatOrder, topology: Topology, rank: int, specs, full_shapes) -> dict[str, tuple[int, int]]:
    """(start, numel) of every fragment anchor `rank` holds."""
    plan = plan_gradient_sync(topology)
    replica, tp = topology.locate(rank)
    return order.addresses(column_numels(topology, tp, specs, full_shapes), len(plan.anchors),
                           plan.anchors.index(replica))
