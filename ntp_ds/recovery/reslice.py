"""Re-slice optimizer state for a new topology's anchors, from the fragments survivors hold (own or buddy copies).

A new anchor rank needs, for every parameter, the elements of its new fragment (its ZeRO partition of its new
local shard). When the anchors keep their layout those elements sit at the same local offsets in the old anchors'
fragments at the same TP index, so contiguous ranges are moved. When the anchors' layout changes (failures in two
replicas), elements are matched through their index in the unsharded tensor. A needed element that no survivor
holds falls back to the parameter's value with zero moments, and the recovery is reported as not lossless.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ntp_ds.comm import wire
from ntp_ds.engine import fragments as S
from ntp_ds.layout import ShardLayout, Topology, plan_gradient_sync
from ntp_ds.layout.sharding import shard_tensor


@dataclass(frozen=True)
class StateMove:
    """Elements `src_sel` of owner `owner`'s fragment (offsets in its old local shard), served by new rank `src`,
    land at `dst_sel` (offsets in new rank `dst`'s new local shard). A selection is a (lo, hi) range or an index
    tensor."""

    src: int
    dst: int
    owner: int
    name: str
    src_sel: object
    dst_sel: object

    def count(self) -> int:
        sel = self.dst_sel
        return sel[1] - sel[0] if isinstance(sel, tuple) else int(sel.numel())


def _take(t: torch.Tensor, sel, base: int) -> torch.Tensor:
    flat = t.reshape(-1)
    return flat[sel[0] - base:sel[1] - base] if isinstance(sel, tuple) else flat[sel - base]


def _local_to_full(spec, full_shape, layout: ShardLayout, tp: int) -> torch.Tensor:
    """Index in the unsharded tensor of every element of a local shard, in local flat order."""
    return shard_tensor(torch.arange(math.prod(full_shape)).view(full_shape), spec, layout, tp).reshape(-1)


def plan_state_moves(gathered: list[dict], old: Topology, new: Topology, specs, full_shapes,
                     step: int) -> tuple[list, bool]:
    """Every StateMove the new anchors need, and whether every needed element has a source as of `step`."""
    offers: dict[int, list[int]] = {}
    for server, g in enumerate(gathered):
        for owner in g["offer"]["held"]:
            offers.setdefault(int(owner), []).append(server)
    old_anchors = plan_gradient_sync(old).anchors
    new_anchors = plan_gradient_sync(new).anchors
    old_layout, new_layout = old.layouts[old_anchors[0]], new.layouts[new_anchors[0]]
    same = old_layout == new_layout
    moves, lossless = [], True
    for dst, g in enumerate(gathered):
        _, tp = new.locate(dst)
        for name, (start, numel) in g["need"].items():
            covered = 0
            if same:
                owners = [old.ranks_of(a)[tp] for a in old_anchors]
            else:
                owners = [r for a in old_anchors for r in old.ranks_of(a)]
                need_full = _local_to_full(specs[name], full_shapes[name], new_layout, tp)[start:start + numel]
            for owner in owners:
                # The freshest copy first (the owner's own state when it lives), then this rank's own, then the lowest.
                servers = sorted(offers.get(owner, []),
                                 key=lambda s: (-gathered[s]["offer"]["steps"][owner], s != dst, s))
                frag = gathered[servers[0]]["offer"]["held"][owner].get(name) if servers else None
                if not frag:
                    continue
                # A copy older than the last step (its refresh was cut by the failure) cannot restore it exactly.
                lossless &= gathered[servers[0]]["offer"]["steps"][owner] == step
                ostart, onumel = frag
                if same:
                    lo, hi = max(start, ostart), min(start + numel, ostart + onumel)
                    if lo < hi:
                        moves.append(StateMove(servers[0], dst, owner, name, (lo, hi), (lo, hi)))
                        covered += hi - lo
                    continue
                _, old_tp = old.locate(owner)
                have = _local_to_full(specs[name], full_shapes[name], old_layout, old_tp)[ostart:ostart + onumel]
                where = torch.full((math.prod(full_shapes[name]),), -1, dtype=torch.long)
                where[have] = torch.arange(ostart, ostart + onumel)
                pos = where[need_full]
                hit = (pos >= 0).nonzero().reshape(-1)
                if hit.numel():
                    moves.append(StateMove(servers[0], dst, owner, name, pos[hit], hit + start))
                    covered += hit.numel()
            lossless &= covered >= numel
    return moves, lossless


def move_state(engine, moves: list[StateMove], held: dict, keys: tuple[str, ...], step: int) -> int:
    """Run this rank's part of `moves` (one pairwise exchange, on the data device) and install the result into a
    new anchor; return bytes received."""
    me = engine.ntp_groups.rank
    device = wire.device_of()
    width = 1 + len(keys)

    def pack(items) -> torch.Tensor:
        parts = []
        for m in items:
            frag = held[m.owner][1][m.name]
            tensors = [frag.tensors["fp32"]] + [frag.tensors.get(k, frag.tensors.get(f"key{i}"))
                                                 for i, k in enumerate(keys)]
            parts += [_take(t, m.src_sel, frag.start).to(device, torch.float32) for t in tensors]
        return torch.cat(parts)

    sends = {dst: pack([m for m in moves if m.src == me and m.dst == dst])
             for dst in sorted({m.dst for m in moves if m.src == me and m.dst != me})}
    incoming = {src: [m for m in moves if m.src == src and m.dst == me] for src in sorted({m.src for m in moves
                                                                                           if m.dst == me})}
    recvs = {src: torch.empty(sum(m.count() for m in items) * width, device=device)
             for src, items in incoming.items() if src != me}
    wire.exchange(sends, recvs, op="reslice").wait()
    values = {}
    if engine.is_anchor:
        for name, p in engine.module.named_parameters():
            base = p.detach().float().reshape(-1).clone()
            values[name] = {"fp32": base, **{k: torch.zeros_like(base) for k in keys}}
    received = sum(b.numel() * b.element_size() for b in recvs.values())
    for src, items in incoming.items():
        buf = recvs[src] if src != me else pack(items)
        pos = 0
        for m in items:
            n = m.count()
            for k in ("fp32",) + tuple(keys):
                target = values[m.name][k]
                if isinstance(m.dst_sel, tuple):
                    target[m.dst_sel[0]:m.dst_sel[1]] = buf[pos:pos + n]
                else:
                    target[m.dst_sel.to(target.device)] = buf[pos:pos + n]
                pos += n
    if engine.is_anchor:
        shaped = {n: {k: v.view_as(p) for k, v in values[n].items()} for n, p in engine.module.named_parameters()}
        S.install_state(engine, shaped, step, tuple(keys))
    return received


def reslice(engine, snapshot) -> tuple[int, bool]:
    """Give every new anchor rank the optimizer state of its new fragments; return (bytes received, lossless)."""
    held = {}  # owner old global rank -> (step, {name: Fragment}) this rank can serve
    if snapshot.fragments:
        held[snapshot.rank] = (snapshot.optimizer_step, snapshot.fragments)
    for owner, copy in snapshot.held.items():
        held[owner] = (copy.step, copy.fragments)
    offer = {"keys": snapshot.keys, "steps": {o: step for o, (step, _) in held.items()},
             "held": {o: {n: (f.start, f.numel) for n, f in frags.items()} for o, (_, frags) in held.items()}}
    need = S.fragment_addresses(engine) if engine.is_anchor else {}
    gathered = wire.all_gather_object({"offer": offer, "need": need})
    keys = next((g["offer"]["keys"] for g in gathered if g["offer"]["keys"]), ())
    step = max((s for g in gathered for s in g["offer"]["steps"].values()), default=0)
    moves, lossless = plan_state_moves(gathered, snapshot.topology, engine.ntp_groups.topology,
                                       engine.param_specs, engine.full_shapes, step)
    # Before the first optimizer step the fallback (the parameter, zero moments) is the exact state: nothing is lost.
    return move_state(engine, moves, held, keys, step), lossless or snapshot.global_steps == 0
