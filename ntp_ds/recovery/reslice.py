"""Re-slice optimizer state for a new topology's anchors, from the fragments survivors hold (own or buddy copies).

A new anchor rank needs, for every parameter, the elements of its new fragment (its ZeRO partition of its new
local shard). They lie in the old anchors' fragments, in the old layout. Every rank plans only the moves it takes
part in: as a destination, the old fragments that overlap its own new fragments; as a server, the new fragments
that overlap the ones it serves. Overlaps are found by range arithmetic on the parameter's grid (`layout.regions`)
and a binary search over the fragments of one TP index, so planning grows with the rank's own shard and the
number of fragments it touches, never with the tensors' sizes. Where each fragment lies follows from the shapes and
DeepSpeed's flat order (`layout.zero`), checked on every rank against what it holds: the ranks gather only what
each can serve, not every rank's addresses.

What a destination installs is measured, not planned: a coverage mask over each new fragment records the elements
written, and every message carries an integer checksum of its payload that the receiver recomputes. An element no
survivor holds keeps the parameter's value with zero moments, and the recovery is reported as not lossless.
"""

from __future__ import annotations

import bisect
import hashlib
from collections import defaultdict
from dataclasses import dataclass

import torch

from ntp_ds.comm import wire
from ntp_ds.engine import fragments as S
from ntp_ds.layout import ShardLayout, Topology, plan_gradient_sync
from ntp_ds.layout import units as U
from ntp_ds.layout.regions import (Block, Grid, Rect, area, block_in_full, blocks, grid, intersection, rects_in_full,
                                   span_in)
from ntp_ds.layout.zero import FlatOrder, anchor_addresses, anchor_fragments
from ntp_ds.recovery.holdings import Listed, Planned


@dataclass(frozen=True)
class StateMove:
    """The elements `block` of owner `owner`'s fragment of `name` (held by new rank `src`) go to new rank `dst`."""

    src: int
    dst: int
    owner: int
    name: str
    block: Block
    step: int
    """The optimizer step the served copy holds."""


def unit_sources(old: ShardLayout, new: ShardLayout, tp_rank: int, kind: str) -> list[tuple[int, U.Ranges]]:
    """Which old TP index supplies which units of new TP index `tp_rank` (the same index first, then ascending);
    each unit from exactly one, so a unit held on several old ranks (KV heads, replicated tensors) moves once."""
    remaining, out = new.owned(kind, tp_rank), []
    for t in sorted(range(old.tp), key=lambda t: (t != tp_rank, t)):
        take = U.intersect(remaining, old.owned(kind, t))
        if take:
            out.append((t, take))
            remaining = U.subtract(remaining, take)
    return out


class _Table(dict):
    """A table whose entries are computed on first lookup."""

    def __init__(self, fill):
        super().__init__()
        self._fill = fill

    def __missing__(self, key):
        value = self[key] = self._fill(key)
        return value


class StateIndex:
    """Who holds which optimizer fragment after a failure, and which fragment each new anchor rank needs.

    `fragments[(old TP index, name)]`: (start, numel, owners) of each old anchor fragment someone can serve, by
    start; fragments of one old TP index are disjoint under ZeRO and identical without it, and identical ones are one
    entry, since any of their holders can serve them. `needs[(new TP index, name)]`: (start, numel, new rank) of
    each new anchor's fragment. `holdings.holders_of(owners)`: (server, step) of every copy of an owner's state
    (steps are ints; `holdings`: `holdings.Listed` or `holdings.Planned`).

    Built from the layouts (`from_layouts`: addresses follow from the shapes and the optimizer's flat order, and only
    the offers' steps were gathered; a TP index's entries are computed when first looked up), or from every rank's
    gathered addresses (`from_gathered`: where that rule was not confirmed on every rank).
    """

    def __init__(self, holdings: Listed | Planned | list[dict], old: Topology, new: Topology, specs, full_shapes):
        """`holdings`: who serves what (a list: `steps[server]` = {owner: step} of what each new rank serves)."""
        self.old, self.new, self.specs, self.full_shapes = old, new, specs, full_shapes
        self.old_layout = old.layouts[plan_gradient_sync(old).anchors[0]]
        self.new_layout = new.layouts[plan_gradient_sync(new).anchors[0]]
        self.holdings = Listed(holdings) if isinstance(holdings, list) else holdings
        self.step = self.holdings.step
        self.fragments: dict[tuple[int, str], list[tuple[int, int, tuple[int, ...]]]] = _Table(lambda key: [])
        self.needs: dict[tuple[int, str], list[tuple[int, int, int]]] = _Table(lambda key: [])
        self._sources: dict[tuple[int, str], list] = {}
        self._counted: dict[tuple[int, str], U.Ranges] = {}
        self._needed = _Table(self._fragments_needed)
        self.source = "gathered"
        """How the addresses were learnt: "layouts" or "gathered"."""

    @classmethod
    def from_gathered(cls, gathered: list[dict], old: Topology, new: Topology, specs, full_shapes) -> "StateIndex":
        """From every rank's offer (the owners whose fragments it can serve, with their steps and addresses) and need
        (its new fragments' addresses)."""
        index = cls(Listed([g["offer"]["steps"] for g in gathered]), old, new, specs, full_shapes)
        address: dict[tuple[int, str], tuple[int, int]] = {}
        for g in gathered:
            for owner, frags in g["offer"]["held"].items():
                for name, where in frags.items():
                    address[(int(owner), name)] = tuple(where)
        groups: dict[tuple[int, str, tuple[int, int]], list[int]] = defaultdict(list)
        for (owner, name), where in address.items():
            groups[(old.locate(owner)[1], name, where)].append(owner)
        for (tp, name, (start, numel)), owners in groups.items():
            index.fragments[(tp, name)].append((start, numel, tuple(sorted(owners))))
        for rank, g in enumerate(gathered):
            for name, (start, numel) in g["need"].items():
                index.needs[(new.locate(rank)[1], name)].append((start, numel, rank))
        for table in (index.fragments, index.needs):
            for entries in table.values():
                entries.sort()
        return index

    @classmethod
    def from_layouts(cls, holdings: Listed | Planned | list[dict], old: Topology, new: Topology, specs, full_shapes,
                     order: FlatOrder) -> "StateIndex":
        """From who serves what alone: every anchor's fragment follows from its TP index's shapes and `order`."""
        index = cls(holdings, old, new, specs, full_shapes)
        serves = index.holdings.serves
        columns = _Table(lambda key: anchor_fragments(order, old if key[0] else new, key[1], specs, full_shapes))

        def fragments(key):
            tp, name = key
            out = []
            for start, numel, owners in columns[(True, tp)].get(name, ()):
                held = tuple(o for o in owners if serves(o))
                if held:
                    out.append((start, numel, held))
            return out

        def needs(key):
            tp, name = key
            return sorted((start, numel, rank) for start, numel, ranks in columns[(False, tp)].get(name, ())
                          for rank in ranks)

        index.fragments, index.needs = _Table(fragments), _Table(needs)
        index.source = "layouts"
        return index

    def sources(self, tp_rank: int, kind: str) -> list[tuple[int, U.Ranges]]:
        key = (tp_rank, kind)
        if key not in self._sources:
            self._sources[key] = unit_sources(self.old_layout, self.new_layout, tp_rank, kind)
        return self._sources[key]

    def _fragments_needed(self, tp_rank: int) -> dict[int, dict[str, tuple[int, int]]]:
        out: dict[int, dict[str, tuple[int, int]]] = defaultdict(dict)
        for name in self.specs:
            for start, numel, rank in self.needs[(tp_rank, name)]:
                out[rank][name] = (start, numel)
        return out

    def needed(self, tp_rank: int, rank: int) -> dict[str, tuple[int, int]]:
        """{name: (start, numel)} of new rank `rank`'s fragments (it sits at new TP index `tp_rank`)."""
        return self._needed[tp_rank].get(rank, {})

    def counted_units(self, tp_rank: int, kind: str) -> U.Ranges:
        """Units of `kind` whose state new TP index `tp_rank` counts: those it holds and no lower index holds."""
        key = (tp_rank, kind)
        if key not in self._counted:
            lower = U.union(*(self.new_layout.owned(kind, t) for t in range(tp_rank)))
            self._counted[key] = U.subtract(self.new_layout.owned(kind, tp_rank), lower)
        return self._counted[key]

    def old_grid(self, name: str, tp: int) -> Grid:
        return grid(self.specs[name], self.full_shapes[name], self.old_layout, tp)

    def new_grid(self, name: str, tp: int, units: U.Ranges | None = None) -> Grid:
        return grid(self.specs[name], self.full_shapes[name], self.new_layout, tp, units)

    def pick(self, owners: tuple[int, ...], dst: int) -> tuple[int, int, int]:
        """(owner, server, step) serving `dst` one of `owners`' identical fragments: the freshest copy, then `dst`
        itself, then the lowest server."""
        holders = self.holdings.holders_of(owners)
        offers = [(owner, server, step) for owner in owners for server, step in holders[owner]]
        return min(offers, key=lambda o: (-o[2], o[1] != dst, o[1], o[0]))

    @staticmethod
    def overlapping(entries: list, lo: int, hi: int) -> list:
        """Entries (start, numel, ...) sorted by start whose range meets [lo, hi); disjoint or identical ranges."""
        if lo >= hi:
            return []
        i = bisect.bisect_right(entries, (lo,)) - 1
        while i > 0 and entries[i - 1][0] == entries[i][0]:
            i -= 1
        out = []
        for entry in entries[max(i, 0):]:
            if entry[0] >= hi:
                break
            if entry[0] + entry[1] > lo:
                out.append(entry)
        return out


def plan_incoming(index: StateIndex, me: int) -> tuple[list[StateMove], list[tuple[int, int]]]:
    """The moves that fill rank `me`'s new fragments, and the (name index, elements) its fragments need in all."""
    moves, wanted = [], []
    tp = index.new.locate(me)[1]
    for i, (name, spec) in enumerate(index.specs.items()):
        need = index.needed(tp, me).get(name)
        if need is None:
            continue
        wanted.append((i, need[1]))
        for old_tp, units in index.sources(tp, spec.kind):
            mine, theirs = index.new_grid(name, tp, units), index.old_grid(name, old_tp)
            found = index.overlapping(index.fragments[(old_tp, name)], *span_in(mine, need, theirs))
            for start, numel, owners in found:
                owner, server, step = index.pick(owners, me)
                moves += [StateMove(server, me, owner, name, b, step)
                          for b in blocks(theirs, (start, numel), mine, need)]
    return moves, wanted


def plan_outgoing(index: StateIndex, me: int, served: dict[int, dict[str, tuple[int, int]]]) -> list[StateMove]:
    """The moves rank `me` sends to other ranks from the fragments it serves (`served[owner][name]`: address)."""
    moves = []
    for owner, frags in served.items():
        old_tp = index.old.locate(owner)[1]
        for name, (start, numel) in frags.items():
            group = next(e[2] for e in index.fragments[(old_tp, name)] if e[0] == start and owner in e[2])
            theirs = index.old_grid(name, old_tp)
            for tp in range(index.new_layout.tp):
                for source_tp, units in index.sources(tp, index.specs[name].kind):
                    if source_tp != old_tp:
                        continue
                    mine = index.new_grid(name, tp, units)
                    for nstart, nnumel, dst in index.overlapping(index.needs[(tp, name)],
                                                                 *span_in(theirs, (start, numel), mine)):
                        chosen_owner, server, step = index.pick(group, dst)
                        if dst == me or (chosen_owner, server) != (owner, me):
                            continue
                        moves += [StateMove(me, dst, owner, name, b, step)
                                  for b in blocks(theirs, (start, numel), mine, (nstart, nnumel))]
    return moves


def count_lost_state(index: StateIndex, me: int, dead: set[int],
                     installed: dict[str, list[Rect]]) -> tuple[int, int]:
    """The elements of lost optimizer state (per tensor) that rank `me` counts, and how many of them it installed from
    a dead owner's copy (`installed[name]`: the rectangles it wrote from dead owners' copies).

    Lost: held in a fragment of a dead owner and in none of a live owner (of the offered fragments, compared in the
    parameter's unsharded coordinates), so an element a survivor also holds is not lost, whichever holder served it.
    Each element counts at one rank, the one whose new fragment holds it at the lowest new TP index holding its unit
    (the lowest such rank where anchors hold identical fragments), so the sums over ranks count each element once
    however many ranks installed it. Range arithmetic on the old fragments meeting this rank's own fragments."""
    lost = restored = 0
    if not dead:
        return lost, restored
    tp = index.new.locate(me)[1]
    for name, need in index.needed(tp, me).items():
        spec = index.specs[name]
        units = index.counted_units(tp, spec.kind)
        if not units or any(r < me for s, n, r in index.needs[(tp, name)] if (s, n) == need):
            continue
        counted = rects_in_full(index.new_grid(name, tp, units), *need)
        held_dead, held_live = [], []
        for old_tp in sorted(range(index.old_layout.tp), key=lambda t: (t != tp, t)):
            shared = U.intersect(units, index.old_layout.owned(spec.kind, old_tp))
            if not shared:
                continue
            mine, theirs = index.new_grid(name, tp, shared), index.old_grid(name, old_tp)
            for start, numel, owners in index.overlapping(index.fragments[(old_tp, name)],
                                                          *span_in(mine, need, theirs)):
                (held_live if set(owners) - dead else held_dead).extend(rects_in_full(theirs, start, numel))
            if not area(counted, held_live):  # a live owner holds every counted element: nothing here is lost
                break
        lost += area(intersection(held_dead, counted), held_live)
        restored += area(intersection(installed.get(name, []), counted), held_live)
    return lost, restored


def _order(index: StateIndex, moves: list[StateMove]) -> list[StateMove]:
    """One order both ends of every pair compute alike."""
    position = {name: i for i, name in enumerate(index.specs)}
    return sorted(moves, key=lambda m: (m.src, m.dst, m.owner, position[m.name], m.block.row0, m.block.src_col,
                                        m.block.dst_col))


def _region(t: torch.Tensor, start: int, width: int, block: Block, col: int) -> torch.Tensor:
    """The rows x columns view of `block` in a flat fragment `t` that begins at local element `start`."""
    offset = t.storage_offset() + block.row0 * width + col - start
    return t.as_strided((block.row1 - block.row0, block.cols), (width, 1), offset)


def _message_numel(payload: int) -> int:
    """Elements of a message carrying `payload` float32 elements: the payload padded to whole 64-bit words, then the
    checksum's two words."""
    return payload + payload % 2 + 2


def _checksum(payload: torch.Tensor) -> torch.Tensor:
    """An exact checksum of a float32 payload of even length, as two float32 words: the sum of its 64-bit words
    modulo 2**64 (integer addition wraps, so every reduction order gives the same bits; no converted copy)."""
    return payload.view(torch.int64).sum().reshape(1).view(torch.float32)


def seal(message: torch.Tensor) -> torch.Tensor:
    """Write the checksum of `message`'s payload into its last two words; return it."""
    message[-2:] = _checksum(message[:-2])
    return message


def intact(message: torch.Tensor) -> bool:
    """Whether `message`'s payload matches the checksum it carries, compared as bits (a checksum word may read as a
    float NaN, which equals nothing)."""
    return torch.equal(_checksum(message[:-2]).view(torch.int32), message[-2:].view(torch.int32))


@torch.no_grad()
def move_state(engine, index: StateIndex, held: dict, keys: tuple[str, ...], dead: set[int] = frozenset()) -> dict:
    """Run this rank's moves (one pairwise exchange on the data device) and install what arrives into this new
    anchor's live optimizer state; return measured figures: bytes sent and received, elements covered (and of those,
    how many this rank `kept` from its own old fragments, took `from_copies` it keeps, or `received`), checksum
    agreement, freshness; and this rank's share of the lost state's bytes and of those installed from the copies of
    `dead` owners (`count_lost_state`: summed over the ranks, each element counts once)."""
    me = engine.ntp_groups.rank
    device = wire.device_of()
    served = {owner: {n: (f.start, f.numel) for n, f in frags.items()} for owner, (_, frags) in held.items()}
    incoming, wanted = plan_incoming(index, me) if engine.is_anchor else ([], [])
    outgoing = plan_outgoing(index, me, served)
    width = 1 + len(keys)

    def tensors_of(frag) -> list[torch.Tensor]:
        return [frag.tensors[S.MASTER]] + [frag.tensors.get(k, frag.tensors.get(f"key{i}")) for i, k in enumerate(keys)]

    def served_regions(m: StateMove) -> list[torch.Tensor]:
        """Views of the block of move `m` in each optimizer tensor of the fragment it is served from."""
        frag = held[m.owner][1][m.name]
        g = index.old_grid(m.name, index.old.locate(m.owner)[1])
        return [_region(t, frag.start, g.width, m.block, m.block.src_col) for t in tensors_of(frag)]

    def pack(items: list[StateMove]) -> torch.Tensor:
        """One message: every block's regions copied once, straight into place, then the checksum."""
        message = torch.empty(_message_numel(sum(m.block.numel for m in items) * width), device=device)
        pos = 0
        for m in items:
            rows, n = m.block.row1 - m.block.row0, m.block.numel
            for region in served_regions(m):
                message[pos:pos + n].view(rows, m.block.cols).copy_(region)
                pos += n
        message[pos:-2] = 0  # the padding word's half
        return seal(message)

    by_dst: dict[int, list[StateMove]] = defaultdict(list)
    for m in _order(index, outgoing):
        by_dst[m.dst].append(m)
    by_src: dict[int, list[StateMove]] = defaultdict(list)
    for m in _order(index, incoming):
        by_src[m.src].append(m)
    sends = {dst: pack(items) for dst, items in by_dst.items()}
    recvs = {src: torch.empty(_message_numel(sum(m.block.numel for m in items) * width), device=device)
             for src, items in by_src.items() if src != me}
    wire.exchange(sends, recvs, op="reslice").wait_proven("the re-slice of optimizer state")

    figures = {"bytes_sent": sum(t.numel() * t.element_size() for t in sends.values()),
               "bytes_received": sum(t.numel() * t.element_size() for t in recvs.values()),
               "checksums_ok": True, "covered": 0, "wanted": sum(n for _, n in wanted), "fresh": True,
               "restored_bytes": 0, "lost_bytes": 0, "kept": 0, "from_copies": 0, "received": 0,
               "state_index": index.source}
    if not engine.is_anchor:
        return figures
    S.reset_state(engine, index.step, keys)
    targets = S.local_fragments(engine, keys)
    masks = {name: torch.zeros(targets[name].numel, dtype=torch.bool) for name in targets}
    from_dead: dict[str, list[Rect]] = defaultdict(list)
    my_tp = index.new.locate(me)[1]
    for src, items in by_src.items():
        if src != me:
            payload = recvs[src][:-2]
            figures["checksums_ok"] &= intact(recvs[src])
        pos = 0
        for m in items:
            target = targets[m.name]
            g = index.new_grid(m.name, my_tp)
            rows, n = m.block.row1 - m.block.row0, m.block.numel
            if src == me:  # what this rank keeps or serves itself goes region to region, with no message
                pieces = served_regions(m)
            else:
                pieces = [payload[pos + i * n:pos + (i + 1) * n].view(rows, m.block.cols) for i in range(width)]
                pos += n * width
            for t, piece in zip([target.tensors[S.MASTER]] + [target.tensors[k] for k in keys], pieces):
                _region(t, target.start, g.width, m.block, m.block.dst_col).copy_(piece)
            _region(masks[m.name], target.start, g.width, m.block, m.block.dst_col).fill_(True)
            # Elements by where they came from: this rank's own old fragment, a copy it keeps, another rank.
            figures["kept" if src == me and m.owner == me else "from_copies" if src == me else "received"] += n
            if m.owner in dead:
                from_dead[m.name].append(block_in_full(g, m.block))
            figures["fresh"] &= m.step == index.step
    figures["covered"] = int(sum(int(mask.sum()) for mask in masks.values()))
    lost, restored = count_lost_state(index, me, dead, from_dead)
    figures["lost_bytes"], figures["restored_bytes"] = lost * width * 4, restored * width * 4
    return figures


def reslice(engine, snapshot, copies: dict, dead: set[int] = frozenset(), own: bool = True, *,
            old_rank_of: dict[int, int], buddies: dict[int, tuple[int, ...]]) -> dict:
    """Give every new anchor rank the optimizer state of its new fragments; return this rank's measured figures.
    `copies`: the buddy copies this rank serves, by owner. `dead`: old global ranks that died, whose state comes from
    copies. `own=False` (a roll-back): this rank's live fragments may be partly updated, so only the copies it keeps
    are served. `old_rank_of`: new rank -> old global rank of the survivors; `buddies`: the old topology's buddy plan.

    No rank receives every rank's offer. One max-reduction gives the newest step served, whether the layout rule
    held on every rank (each checks it against the fragments it really holds, old and new, and the copies it keeps),
    whether the ranks' flat orders agree, and the lowest rank with optimizer keys; one collect then carries the
    keys, the optimizer's flat order from the lowest new anchor (the addresses follow from the layouts), and the
    offers of the ranks that serve other than the buddy plan says (`holdings.Planned`). If the rule failed on some
    rank, or the flat orders differ, every rank gathers the full addresses instead (`StateIndex.from_gathered`)."""
    held = {}  # owner old global rank -> (step, {name: Fragment}) this rank can serve
    if snapshot.fragments and own:
        held[snapshot.rank] = (snapshot.optimizer_step, snapshot.fragments)
    for owner, copy in copies.items():
        held[owner] = (copy.step, copy.fragments)
    steps = {int(o): int(step) for o, (step, _) in held.items()}  # plain ints: the index reads them as they come
    new_order = S.flat_order(engine) if engine.is_anchor else None
    old_topology, new_topology = snapshot.topology, engine.ntp_groups.topology
    me = engine.ntp_groups.rank
    first_anchor = new_topology.ranks_of(plan_gradient_sync(new_topology).anchors[0])[0]
    ok, orders = _rule_holds(engine, snapshot, held, new_order)
    digests = [int(d[:15], 16) for d in orders]
    none = wire.LOWEST
    newest, broken, high, low, keyed = wire.reduce_ints(
        [Planned.newest(steps), int(not ok), max(digests, default=none), max((-d for d in digests), default=none),
         -me if snapshot.keys else none], "max", "reslice_facts")
    args = (old_topology, new_topology, engine.param_specs, engine.full_shapes)
    if broken or high == none or high != -low:
        offer = {"steps": steps,
                 "held": {o: {n: (f.start, f.numel) for n, f in frags.items()} for o, (_, frags) in held.items()}}
        need = S.fragment_addresses(engine) if engine.is_anchor else {}
        gathered = wire.all_gather_object({"offer": offer, "need": need, "keys": snapshot.keys})
        keys = next((tuple(g["keys"]) for g in gathered if g["keys"]), ())
        index = StateIndex.from_gathered(gathered, *args)
        return move_state(engine, index, held, keys, set(dead))
    old_sync = plan_gradient_sync(old_topology)
    holdings = Planned(max(newest, 0), old_rank_of, lambda r: old_sync.is_anchor(old_topology.locate(r)[0]), buddies,
                       own)
    said = {**({"steps": steps} if steps != holdings.expected(me) else {}),
            **({"keys": snapshot.keys} if me == -keyed else {}), **({"order": new_order} if me == first_anchor else {})}
    told = wire.collect(said or None)
    holdings.tell({r: t["steps"] for r, t in told.items() if "steps" in t})
    keys = tuple(told[-keyed]["keys"]) if keyed != none else ()
    index = StateIndex.from_layouts(holdings, *args, told[first_anchor]["order"])
    return move_state(engine, index, held, keys, set(dead))


def _digest(order: FlatOrder) -> str:
    return hashlib.sha256(repr(order).encode()).hexdigest()


def _rule_holds(engine, snapshot, held: dict, new_order: FlatOrder | None) -> tuple[bool, list[str]]:
    """Whether the layout rule gives the addresses of every fragment this rank holds or will hold (its old
    fragments and the copies it keeps, under the old engine's flat order; its new fragments under the new one), and
    the digests of the flat orders it saw."""
    specs, shapes = engine.param_specs, engine.full_shapes
    old_order = snapshot.order if snapshot.fragments else None
    orders = [o for o in (old_order, new_order) if o is not None]
    check_old = old_order or new_order
    try:
        if snapshot.fragments and old_order is None:
            return False, []
        if check_old is not None:
            for owner, (_, frags) in held.items():
                rule = anchor_addresses(check_old, snapshot.topology, owner, specs, shapes)
                if rule != {n: (f.start, f.numel) for n, f in frags.items()}:
                    return False, []
        if engine.is_anchor and (new_order is None or S.fragment_addresses(engine) != anchor_addresses(
                new_order, engine.ntp_groups.topology, engine.ntp_groups.rank, specs, shapes)):
            return False, []
    except KeyError:  # a parameter of the flat order without a sharding spec
        return False, []
    return True, [_digest(o) for o in orders]
