"""Redundant in-memory copies of optimizer state: each anchor rank's fragments live on its buddies too.

After every optimizer step the owner posts, to each buddy, its step count and the flat tensors that hold its state
(`fragments.flat_sources`: the live ZeRO partitions, sent without a staging copy; they do not change before the
next optimizer step, which waits for the transfer). The buddy receives straight into the buffers of the copy it
keeps (sizes and fragment addresses are exchanged once per engine, as the copies travel), so a copy costs its
own bytes and nothing more. While a transfer is in flight the copy is marked incomplete; `finish` (before the next
optimizer step, or at a failure) completes it, and keeps it only once its arrival is proven (`wire.Exchange.proven`:
under NCCL a receive cut by an abort reports complete, its buffers part written). A copy whose transfer failed, or
whose arrival was not proven (`refused`), is dropped: its owner's state of the last step survives nowhere else, and
recovery says so (`lossless: false`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from ntp_ds.comm import wire
from ntp_ds.engine.fragments import Fragment

log = logging.getLogger(__name__)


@dataclass
class HeldCopy:
    """A copy of another rank's optimizer fragments, as of the end of optimizer step `step`."""

    owner: int
    step: int
    fragments: dict[str, Fragment]


class PinnedBlock:
    """A float32 host block of exactly `numel` elements, page-locked by registering it with CUDA where there is CUDA
    (torch's caching host allocator would round a pinned allocation up to a power of two and keep it cached: a
    33 GiB block would pin 64 GiB). Unregistered when dropped; a view that outlives it is plain host memory, as valid
    (a copy into it is then synchronous). Where registering fails, the block stays unpinned, as on a CPU."""

    def __init__(self, numel: int, pin: bool):
        self.tensor = torch.empty(numel, dtype=torch.float32)
        self._registered = None
        if pin and numel:
            ptr = self.tensor.data_ptr()
            error = torch.cuda.cudart().cudaHostRegister(ptr, numel * 4, 0)
            if int(error) == 0:
                self._registered = ptr
            else:
                log.warning("host copies stay in pageable memory: cudaHostRegister of %d bytes failed (%s)",
                            numel * 4, error)

    @property
    def pinned(self) -> bool:
        return self._registered is not None

    def __del__(self):
        if self._registered is not None:
            torch.cuda.cudart().cudaHostUnregister(self._registered)
            self._registered = None


def host_block(numels: dict[int, list[int]], copies: int,
               pin: bool) -> tuple[dict[int, list[list[torch.Tensor]]], PinnedBlock]:
    """`copies` sets of float32 host buffers of the given sizes per owner, all views of one block (`PinnedBlock`,
    page-locked with `pin`), and the block (keep it while the buffers are used for transfers)."""
    block = PinnedBlock(copies * sum(sum(ns) for ns in numels.values()), pin)
    out, at = {}, 0
    for o, ns in numels.items():
        out[o] = []
        for _ in range(copies):
            views = []
            for n in ns:
                views.append(block.tensor[at:at + n])
                at += n
            out[o].append(views)
    return out, block


def release_cached_host_memory() -> None:
    """Give the host memory torch's caching host allocator keeps of freed pinned blocks back to the system (a
    recovery's old engine and its snapshot held copies of another layout: their blocks would stay cached for
    good)."""
    if torch.cuda.is_available():
        torch.accelerator.empty_host_cache()


class StateCopies:
    """Send this rank's optimizer state to its buddies and keep the copies other ranks send here."""

    def __init__(self, rank: int, buddies: dict[int, tuple[int, ...]], names: list[str], on_host: bool = False,
                 chunk: int | None = None, keep_previous: bool = False):
        """`on_host`: keep the copies in host memory (pinned under CUDA), filled through two device staging buffers
        of at most `chunk` elements each, so the copies cost no device memory beyond those. `keep_previous`: two
        buffers per copy, so the copy of the step before stays whole while the next one arrives."""
        self.on_host, self.chunk, self.keep_previous = on_host, chunk, keep_previous
        self.targets = buddies.get(rank, ())
        self.owners = sorted(o for o, bs in buddies.items() if rank in bs)
        self.names = sorted(names)
        self.held: dict[int, HeldCopy] = {}
        """The complete copies, by owner."""
        self.previous: dict[int, HeldCopy] = {}
        """With `keep_previous`: the copies of the step before the newest, whole, by owner."""
        self._spare: dict[int, list[torch.Tensor]] = {}
        self._layouts: dict[int, torch.Tensor] | None = None
        self._buffers: dict[int, list[torch.Tensor]] = {}
        self._blocks: list[PinnedBlock] = []  # the host blocks the buffers are views of
        self._in_flight: tuple[wire.Exchange, list] | None = None
        self.refused: list[int] = []
        """Owners whose copy arrived by a wait that returned but was not proven to have arrived (cut by an abort)."""

    def peers(self) -> set[int]:
        return set(self.targets) | set(self.owners)

    def held_bytes(self) -> int:
        """Bytes of the copies this rank keeps for its owners (complete or being refreshed; both buffers of each with
        `keep_previous`)."""
        return sum(b.numel() * b.element_size() for bufs in [*self._buffers.values(), *self._spare.values()]
                   for b in bufs)

    def start(self, keys: tuple[str, ...], step: int, device,
              sources: tuple[list[torch.Tensor], dict] | None = None) -> None:
        """Post this step's copies among owners and buddies (data on `device`); do not wait for them.

        `sources`: this rank's `flat_sources` (owners only)."""
        self.finish()
        outgoing = []
        if self.targets:
            tensors, index = sources
            outgoing = [torch.tensor(_encode_step(step), dtype=torch.float32, device=device)]
            outgoing += [t.detach().reshape(-1).to(device) for t in tensors]
        if self._layouts is None:
            self._exchange_layouts(keys, sources, device)
        new = {o: [_STEP_WIDTH] + lay[2:2 + int(lay[1])].tolist() for o, lay in self._layouts.items()
               if o not in self._buffers}
        if new and self.on_host:  # one block of exactly their size for every owner's buffers
            copies, block = host_block(new, 2 if self.keep_previous else 1, pin=torch.cuda.is_available())
            self._blocks.append(block)
            self._buffers.update((o, bufs[0]) for o, bufs in copies.items())
            if self.keep_previous:
                self._spare.update((o, bufs[1]) for o, bufs in copies.items())
        elif new:
            for o, numels in new.items():
                self._buffers[o] = [torch.empty(n, dtype=torch.float32, device=device) for n in numels]
                if self.keep_previous:
                    self._spare[o] = [torch.empty(n, dtype=torch.float32, device=device) for n in numels]
        for o in self._layouts:
            if self.keep_previous and o in self.held:  # the whole copy stays; the next arrives in the other buffers
                self.previous[o] = self.held[o]
                self._buffers[o], self._spare[o] = self._spare[o], self._buffers[o]
            self.held.pop(o, None)  # being overwritten: incomplete until `finish`
        self._device = device
        if not self.on_host:
            sends = {t: outgoing for t in self.targets}
            self._in_flight = (wire.exchange(sends, dict(self._buffers), op="copy_data", lane="copies"), outgoing)
            return
        # Host copies travel piece by piece (`_Rounds`): their first rounds set off now, the others as the rounds
        # before them land (`advance`, or `finish`).
        self._in_flight = (_Rounds(self, outgoing), outgoing)

    def advance(self) -> None:
        """Move host copies in flight on without waiting: land the rounds seen complete and post the next ones (call
        between the next step's micro-batches, so that the copies travel with its compute)."""
        if self._in_flight is not None and self.on_host:
            self._in_flight[0].advance()

    def finish(self, salvage: bool = False) -> None:
        """Complete the copies in flight; raise if a transfer failed (the copies it was writing are dropped, the
        others are kept). `salvage`: at a failure, keep whatever arrives from live owners."""
        if self._in_flight is None:
            return
        pending, outgoing = self._in_flight
        self._in_flight = None
        if self.on_host:
            pending.finish(salvage)
            return
        lost, arrived = [], []
        for o in self._buffers:
            try:
                pending.wait_received(o, heed_failure=not salvage)
            except RuntimeError as err:  # its owner (or the link to it) failed mid-transfer (coalesced: the batch)
                if not salvage and wire.verdict():
                    # A wait that ends at a verdict says nothing of the transfer (it may have completed long since):
                    # the snapshot's salvage takes the copies, by their proofs.
                    self._in_flight = (pending, outgoing)
                    raise
                lost.append(err)
                continue
            arrived.append(o)
        if arrived and not salvage:
            wire.settle_device()  # a wait only orders the stream: the device runs the receives before they are proven
        for o in arrived:
            if not pending.proven(o):
                self.refused.append(o)
                lost.append(wire.PeerFailure(f"the copy of rank {o}'s state was cut before it arrived"))
                continue
            self.held[o] = self._view(o, self._buffers[o])
        if not salvage:
            try:
                pending.wait()  # this rank's own sends: a buddy that failed keeps no copy, nothing is lost here
            except RuntimeError as err:
                lost.append(err)
        if lost:
            raise lost[0]

    def _pieces(self, numels: list[int]) -> list[tuple[int, int, int]]:
        """(buffer, lo, hi) of every message of a host-copy transfer, at most `chunk` elements each."""
        step = self.chunk or max(numels + [1])
        return [(i, lo, min(lo + step, n)) for i, n in enumerate(numels) for lo in range(0, n, step)]

    def _exchange_layouts(self, keys, sources, device) -> None:
        """Tell each buddy, once per engine, the sizes of this rank's sources and where each fragment lies: int64
        headers on the data device, over the group the copies travel on (the buffers stay referenced until the
        exchange completes), read back to the host."""
        layout = None
        if self.targets:
            tensors, index = sources
            layout = [len(keys), len(tensors)] + [t.numel() for t in tensors]
            for name in self.names:
                layout += list(index.get(name, (-1, 0, 0, 0)))
            layout = torch.tensor(layout, dtype=torch.int64, device=device)
        heads = {t: layout[:2] for t in self.targets}
        sizes = {o: torch.empty(2, dtype=torch.int64, device=device) for o in self.owners}
        wire.exchange(heads, sizes, op="copy_layout", lane="copies").wait_proven("the copies' layouts")
        layouts = {o: torch.empty(2 + int(n[1]) + 4 * len(self.names), dtype=torch.int64, device=device)
                   for o, n in sizes.items()}
        wire.exchange({t: layout for t in self.targets}, layouts, op="copy_layout",
                      lane="copies").wait_proven("the copies' layouts")
        self._layouts = {o: lay.cpu() for o, lay in layouts.items()}

    def _view(self, owner: int, bufs: list[torch.Tensor]) -> HeldCopy:
        lay = self._layouts[owner]
        n_keys, n_sources = int(lay[0]), int(lay[1])
        step = _decode_step(bufs[0].tolist())
        keys = ["fp32"] + [f"key{i}" for i in range(n_keys)]
        frags, pos = {}, 2 + n_sources
        for i, name in enumerate(self.names):
            index, offset, start, numel = (int(v) for v in lay[pos + 4 * i:pos + 4 * i + 4])
            if index < 0 or numel == 0:
                continue
            frags[name] = Fragment(start, numel, {k: bufs[1 + index + j][offset:offset + numel]
                                                  for j, k in enumerate(keys)})
        return HeldCopy(owner, step, frags)


class _Rounds:
    """A host-copy transfer: this rank's pieces to its buddies and its owners' into their host buffers, in rounds.
    Round j carries every pair's j-th piece, both directions posted together (NCCL would deadlock a ring of buddies
    whose sends go first), through two device staging buffers per owner: rounds j and j + 1 are in flight, and
    round j + 2 sets off once round j has landed in the host buffers."""

    def __init__(self, copies: StateCopies, outgoing: list[torch.Tensor]):
        self.copies, self.outgoing = copies, outgoing
        self.out_pieces = copies._pieces([t.numel() for t in outgoing]) if copies.targets else []
        self.in_pieces = {o: copies._pieces([b.numel() for b in bufs]) for o, bufs in copies._buffers.items()}
        self.rounds = max([len(self.out_pieces)] + [len(ps) for ps in self.in_pieces.values()])
        self.staging = {o: [torch.empty(max(hi - lo for _, lo, hi in ps), dtype=torch.float32, device=copies._device)
                            for _ in range(2)] for o, ps in self.in_pieces.items() if ps}
        self.posted: list[tuple[int, wire.Exchange, dict]] = []
        self.rounds_of: dict[int, list[wire.Exchange]] = {o: [] for o in self.in_pieces}
        for j in range(min(2, self.rounds)):
            self._post(j)

    def _post(self, j: int) -> None:
        sends = {}
        if j < len(self.out_pieces):
            i, lo, hi = self.out_pieces[j]
            sends = {t: self.outgoing[i][lo:hi] for t in self.copies.targets}
        recvs = {}
        for o, ps in self.in_pieces.items():
            if j < len(ps):
                _, lo, hi = ps[j]
                recvs[o] = self.staging[o][j % 2][:hi - lo]
        self.posted.append((j, wire.exchange(sends, recvs, op="copy_piece", lane="copies"), recvs))

    def _land(self, j: int, pending: wire.Exchange, recvs: dict) -> None:
        """Copy round j's pieces (waited) into the host buffers and post round j + 2 into the staging buffers they
        leave (its receives are ordered after the copies)."""
        for o, view in recvs.items():
            self.rounds_of[o].append(pending)
            i, lo, hi = self.in_pieces[o][j]
            self.copies._buffers[o][i][lo:hi].copy_(view, non_blocking=True)
        if j + 2 < self.rounds:
            self._post(j + 2)

    def advance(self) -> None:
        """Land the rounds seen complete, oldest first, without waiting for one that is not."""
        while self.posted and not wire.verdict() and self.posted[0][1].proven():
            j, pending, recvs = self.posted.pop(0)
            pending.wait()  # complete: orders this stream after it, and returns at once
            self._land(j, pending, recvs)

    def finish(self, salvage: bool) -> None:
        """Complete the rounds still in flight; keep each owner's copy whose every round is proven to have arrived.
        Raise if a round failed (the owners it was writing are dropped, the owners already complete are kept)."""
        try:
            while self.posted:
                j, pending, recvs = self.posted.pop(0)
                if salvage:  # at a failure: what live owners send still arrives
                    for o in recvs:
                        pending.wait_received(o, heed_failure=False)
                else:
                    pending.wait()
                self._land(j, pending, recvs)
        except RuntimeError:  # round j did not arrive: the owners still receiving are dropped
            self._keep([o for o, ps in self.in_pieces.items() if len(ps) <= j])
            raise
        self._keep(list(self.copies._buffers))

    def _keep(self, owners) -> None:
        wire.settle_device()  # the host buffers were filled by non-blocking copies from the device
        copies = self.copies
        for o in owners:
            if all(e.proven(o) for e in self.rounds_of[o]):
                copies.held[o] = copies._view(o, copies._buffers[o])
            else:
                copies.refused.append(o)


_STEP_WIDTH = 2
"""fp32 elements that carry the step count at the head of a transfer (each exact below 2**24)."""


def _encode_step(step: int) -> list[float]:
    return [float(step // 2**20), float(step % 2**20)]


def _decode_step(values: list[float]) -> int:
    return int(values[0]) * 2**20 + int(values[1])
