"""Point-to-point exchange of unit ranges between ranks of different layouts, in buckets of bounded size.

A transfer plan (the gradient-sync plan, or recovery's unit moves) says which units of which kind go from rank to
rank. `UnitExchange` is one rank's side of it: the sender packs units out of its shards in its own layout, the
receiver unpacks them into its shards in its layout (the two may differ: recovery reads the old layout and writes
the new one). Items are ordered as backward produces gradients (parameters in reverse order) and cut into buckets
of at most `bucket_numel` elements per message, so both sides agree on every message without a header, a streaming
sender can send a bucket as soon as its gradients exist, and no buffer exceeds a bucket.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, replace

import torch

from ntp_ds.comm import wire
from ntp_ds.layout import ParamSpec, ShardLayout
from ntp_ds.layout import units as U
from ntp_ds.layout.sharding import gather_units, packed_numel, scatter_units


@dataclass(frozen=True)
class Bucket:
    """One message between this rank and `peer`: units of several parameters, packed in item order."""

    peer: int
    items: tuple[tuple[str, U.Ranges], ...]
    sizes: tuple[int, ...]

    @property
    def numel(self) -> int:
        return sum(self.sizes)

    @property
    def names(self) -> frozenset[str]:
        return frozenset(name for name, _ in self.items)


def plan_buckets(items_by_peer: dict[int, list[tuple[str, U.Ranges]]], specs: dict[str, ParamSpec],
                 full_shapes: dict[str, tuple[int, ...]], bucket_numel: int | None,
                 forward: bool = False) -> dict[int, list[Bucket]]:
    """Cut each peer's items into buckets (in reverse parameter order, as backward produces gradients, or in
    parameter order with `forward`, as the forward uses them; at most `bucket_numel` elements unless one item alone
    is larger); pure, so sender and receiver compute the same buckets."""
    names = list(specs) if forward else list(reversed(list(specs)))
    order = {name: i for i, name in enumerate(names)}
    out = {}
    for peer, items in items_by_peer.items():
        items = sorted(items, key=lambda it: (order[it[0]], it[1]))
        buckets, current, sizes = [], [], []
        for name, units in items:
            n = packed_numel(specs[name], full_shapes[name], units)
            if current and bucket_numel and sum(sizes) + n > bucket_numel:
                buckets.append(Bucket(peer, tuple(current), tuple(sizes)))
                current, sizes = [], []
            current.append((name, units))
            sizes.append(n)
        if current:
            buckets.append(Bucket(peer, tuple(current), tuple(sizes)))
        out[peer] = buckets
    return out


@dataclass(frozen=True)
class Side:
    """A rank's layout and TP index: how its local shards hold units."""

    layout: ShardLayout
    tp_rank: int


class UnitExchange:
    """This rank's part of planned unit transfers (objects with src, dst, kind, units and optionally name), for the
    parameter a transfer names or else every parameter of its kind."""

    def __init__(self, transfers, rank: int, specs: dict[str, ParamSpec], full_shapes: dict[str, tuple[int, ...]],
                 send_side: Side, recv_side: Side, bucket_numel: int | None = None, forward: bool = False):
        self.rank, self.specs, self.full_shapes = rank, specs, full_shapes
        self.send_side, self.recv_side = send_side, recv_side
        outgoing, incoming = defaultdict(list), defaultdict(list)
        for t in transfers:
            side = outgoing[t.dst] if t.src == rank else incoming[t.src] if t.dst == rank else None
            if side is not None and t.src != t.dst:
                # A transfer that names one parameter moves only that one; otherwise every parameter of its kind.
                names = [t.name] if getattr(t, "name", None) else [n for n, sp in specs.items() if sp.kind == t.kind]
                side += [(name, t.units) for name in names]
        self.outgoing = plan_buckets(dict(outgoing), specs, full_shapes, bucket_numel, forward)
        self.incoming = plan_buckets(dict(incoming), specs, full_shapes, bucket_numel, forward)

    def peers(self) -> set[int]:
        return set(self.outgoing) | set(self.incoming)

    def receive_buffer(self, bucket: Bucket, tensors: dict[str, torch.Tensor], dtype=None, device=None):
        """An empty buffer for one incoming bucket, shaped by its elements, typed and placed like `tensors`."""
        like = tensors[bucket.items[0][0]]
        return torch.empty(bucket.numel, dtype=dtype or like.dtype, device=device or like.device)

    # -- packing -------------------------------------------------------------------------------------------------
    def pack(self, bucket: Bucket, tensors: dict[str, torch.Tensor], dtype=None) -> torch.Tensor:
        """One bucket's units out of `tensors` (this rank's shards in its send layout), as one flat buffer."""
        side = self.send_side
        parts = [gather_units(tensors[name], self.specs[name], side.layout, side.tp_rank, units)
                 for name, units in bucket.items]
        buf = torch.cat(parts) if len(parts) > 1 else parts[0]
        return buf if dtype is None else buf.to(dtype)

    def unpack(self, bucket: Bucket, buf: torch.Tensor, tensors: dict[str, torch.Tensor], add: bool = False,
               only: str | None = None) -> None:
        """Write (or add) a received bucket's units into `tensors` (this rank's shards in its receive layout)."""
        side, pos = self.recv_side, 0
        for (name, units), n in zip(bucket.items, bucket.sizes):
            if only is None or name == only:
                piece = buf[pos:pos + n]
                target = tensors[name]
                if add:
                    scratch = torch.zeros_like(target)
                    scatter_units(scratch, piece, self.specs[name], side.layout, side.tp_rank, units)
                    target.add_(scratch)
                else:
                    scatter_units(target, piece, self.specs[name], side.layout, side.tp_rank, units)
            pos += n

    # -- whole exchanges -------------------------------------------------------------------------------------------
    def run(self, send: dict[str, torch.Tensor] | None, receive: dict[str, torch.Tensor] | None,
            dtype=None, device=None, op: str = "exchange", proofs: list | None = None, group=None) -> int:
        """Send every outgoing bucket out of `send` and receive every incoming one into `receive`, bucket round by
        bucket round (each round posts both directions together); return the bytes received.

        What arrives must be proven to have arrived (`wire.Exchange.proven`) before it is kept: with `proofs`, the
        rounds' exchanges are appended to it for the caller to check later; without, this waits for the device and
        raises `PeerFailure` if a transfer was cut. `group`: the group every transfer runs on (default: each peer's
        route, `wire.set_routes`)."""
        rounds = max([len(b) for b in self.outgoing.values()] + [len(b) for b in self.incoming.values()] + [0])
        received, pending = 0, []
        for k in range(rounds):
            sends = {p: self.pack(bs[k], send, dtype) for p, bs in self.outgoing.items() if k < len(bs)}
            recvs = {p: self.receive_buffer(bs[k], receive, dtype, device)
                     for p, bs in self.incoming.items() if k < len(bs)}
            pending.append(wire.exchange(sends, recvs, group=group, op=op))
            pending[-1].wait()
            for p, buf in recvs.items():
                self.unpack(self.incoming[p][k], buf, receive)
                received += buf.numel() * buf.element_size()
        if proofs is not None:
            proofs += pending
        elif self.incoming:
            wire.require_arrived(pending, op)
        return received


def bucket_index(buckets_by_peer: dict[int, list[Bucket]]) -> dict[str, list[tuple[int, int]]]:
    """(peer, bucket index) of every bucket holding each parameter (one per peer: an item is never split)."""
    index: dict[str, list[tuple[int, int]]] = defaultdict(list)
    for peer, buckets in buckets_by_peer.items():
        for k, bucket in enumerate(buckets):
            for name in bucket.names:
                index[name].append((peer, k))
    return dict(index)


def same_layout(transfers, rank: int, topology, specs, full_shapes, bucket_numel=None,
                forward: bool = False) -> UnitExchange:
    """A UnitExchange between ranks that keep their layout (steady-state gradient and parameter sync)."""
    replica, tp_rank = topology.locate(rank)
    side = Side(topology.layouts[replica], tp_rank)
    return UnitExchange(transfers, rank, specs, full_shapes, side, side, bucket_numel, forward)


@torch.no_grad()
def assemble_whole(moves, writer: dict[str, int], me: int, ranks: list[int], specs: dict[str, ParamSpec],
                   full_shapes: dict[str, tuple[int, ...]], side: Side, params: dict[str, torch.Tensor],
                   bucket_numel: int | None, device, op: str, group=None) -> dict[str, torch.Tensor]:
    """The whole tensors (fp32) that holder `me` writes (`layout.plan_whole_tensors`: `writer`, and `moves` between
    holders, `ranks[i]` being holder i's global rank): the units it holds copied in, the rest received from the
    holders that have them, over `group` (default: the routes). `side`: how `params`, this holder's shards, hold
    units."""
    whole = Side(ShardLayout.balanced(side.layout.units, 1), 0)
    full = {n: torch.empty(full_shapes[n], dtype=torch.float32, device=device) for n, w in writer.items() if w == me}
    for m in moves:
        if m.src == me and m.dst == me:
            buf = gather_units(params[m.name], specs[m.name], side.layout, side.tp_rank, m.units)
            scatter_units(full[m.name], buf.float(), specs[m.name], whole.layout, 0, m.units)
    moves = [replace(m, src=ranks[m.src], dst=ranks[m.dst]) for m in moves]
    UnitExchange(moves, ranks[me], specs, full_shapes, side, whole, bucket_numel).run(
        params, full, dtype=torch.float32, device=device, op=op, group=group)
    return full
