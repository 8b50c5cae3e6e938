"""Host-memory copies come from one block per engine of exactly their size, page-locked by registering it with CUDA
(torch's caching host allocator rounds each pinned allocation up to a power of two and keeps it cached)."""

import torch

from ntp_ds.engine.copies import StateCopies, host_block


def _storages(tensors):
    return {t.untyped_storage().data_ptr() for t in tensors}


def test_host_buffers_are_disjoint_views_of_one_block():
    out, block = host_block({3: [4, 100], 7: [4, 10, 20]}, copies=2, pin=False)
    assert not block.pinned
    flat = [t for bufs in out.values() for copy in bufs for t in copy]
    assert [t.numel() for t in out[3][0]] == [4, 100] and [t.numel() for t in out[7][1]] == [4, 10, 20]
    assert len(_storages(flat)) == 1
    spans = sorted((t.storage_offset(), t.storage_offset() + t.numel()) for t in flat)
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:])), "two buffers overlap"
    assert spans[-1][1] == flat[0].untyped_storage().nbytes() // 4, "the block is exactly the buffers' size"


def test_a_buddy_keeps_its_owners_host_copies_in_one_block():
    # Before: one allocation per buffer (a step label and each source tensor, per owner, twice with keep_previous).
    copies = StateCopies(rank=2, buddies={0: (2,), 1: (2,)}, names=[], on_host=True, keep_previous=True)
    copies._layouts = {0: torch.tensor([1, 2, 30, 30]), 1: torch.tensor([1, 2, 50, 50])}  # (keys, sources, sizes)
    copies.start((), 0, torch.device("cpu"))
    buffers = [t for o in (0, 1) for t in copies._buffers[o] + copies._spare[o]]
    assert len(buffers) == 12 and len(_storages(buffers)) == 1
    assert [b.tensor.numel() for b in copies._blocks] == [2 * (2 + 30 + 30) + 2 * (2 + 50 + 50)], "exactly their size"
