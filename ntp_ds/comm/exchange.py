"""Point-to-point exchange of unit ranges between ranks of different layouts, one message per peer per call."""

from __future__ import annotations

from collections import defaultdict
from datetime import timedelta

import torch
import torch.distributed as dist

from ntp_ds.layout import ParamSpec, Topology, Transfer
from ntp_ds.layout import units as U
from ntp_ds.models.sharding import gather_units, packed_numel, scatter_units

GRAD_TAG, PARAM_TAG = 17, 29


class UnitExchange:
    """Moves this rank's part of a set of planned transfers, for all parameters whose kind a transfer names."""

    def __init__(self, transfers: tuple[Transfer, ...], rank: int, topology: Topology,
                 specs: dict[str, ParamSpec], timeout_s: float):
        self.rank, self.topology, self.specs = rank, topology, specs
        self.timeout = timedelta(seconds=timeout_s)
        self.outgoing: dict[int, list[tuple[str, U.Ranges]]] = defaultdict(list)
        self.incoming: dict[int, list[tuple[str, U.Ranges]]] = defaultdict(list)
        for t in transfers:
            side = self.outgoing[t.dst] if t.src == rank else self.incoming[t.src] if t.dst == rank else None
            if side is not None:
                side += [(name, t.units) for name, spec in specs.items() if spec.kind == t.kind]
        _, self.tp_rank = topology.locate(rank)
        self.layout = topology.layouts[topology.locate(rank)[0]]

    def send(self, tensors: dict[str, torch.Tensor], tag: int) -> list:
        """Start sending; return the pending works."""
        works = []
        for dst, items in sorted(self.outgoing.items()):
            buf = torch.cat([gather_units(tensors[n], self.specs[n], self.layout, self.tp_rank, u) for n, u in items])
            works.append(dist.isend(buf.contiguous(), dst, tag=tag))
        return works

    def receive_into(self, tensors: dict[str, torch.Tensor], tag: int) -> None:
        """Receive every incoming message and write its units into `tensors` (shaped like the local params)."""
        pending = []
        for src, items in sorted(self.incoming.items()):
            like = tensors[items[0][0]]
            n = sum(packed_numel(self.specs[name], tuple(tensors[name].shape), u) for name, u in items)
            buf = torch.empty(n, dtype=like.dtype, device=like.device)
            pending.append((dist.irecv(buf, src, tag=tag), buf, items))
        for work, buf, items in pending:
            self.wait([work])
            pos = 0
            for name, units in items:
                n = packed_numel(self.specs[name], tuple(tensors[name].shape), units)
                scatter_units(tensors[name], buf[pos:pos + n], self.specs[name], self.layout, self.tp_rank, units)
                pos += n

    def receiving(self) -> set[str]:
        return {name for items in self.incoming.values() for name, _ in items}

    def wait(self, works: list) -> None:
        for w in works:
            w.wait(self.timeout)
