"""Host-memory copies come from one block per engine of exactly their size, page-locked by registering it with CUDA
(torch's caching host allocator rounds each pinned allocation up to a power of two and keeps it cached), and travel
with the next step's compute like copies kept on the device."""

import time

import pytest
import torch
import torch.distributed as dist

from ntp_ds.engine import copies as copies_module
from ntp_ds.engine.copies import StateCopies, host_block
from ntp_ds.testing.spawn import run_ranks

pytestmark = pytest.mark.timeout(300)


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


def test_a_buddy_keeps_its_owners_host_copies_in_one_block(monkeypatch):
    # Before: one allocation per buffer (a step label and each source tensor, per owner, twice with keep_previous).
    monkeypatch.setattr(copies_module, "_Rounds", lambda copies, outgoing: None)  # no transfer: no peers here
    copies = StateCopies(rank=2, buddies={0: (2,), 1: (2,)}, names=[], on_host=True, keep_previous=True)
    copies._layouts = {0: torch.tensor([1, 2, 30, 30]), 1: torch.tensor([1, 2, 50, 50])}  # (keys, sources, sizes)
    copies.start((), 0, torch.device("cpu"))
    buffers = [t for o in (0, 1) for t in copies._buffers[o] + copies._spare[o]]
    assert len(buffers) == 12 and len(_storages(buffers)) == 1
    assert [b.tensor.numel() for b in copies._blocks] == [2 * (2 + 30 + 30) + 2 * (2 + 50 + 50)], "exactly their size"


def _travel(rank, world):
    import ntp_ds.testing.nccl_model  # noqa: F401  (registers the backend)
    from ntp_ds.comm import groups

    dist.init_process_group("nccl_model", rank=rank, world_size=world)
    groups.start_generation(30.0)
    copies = StateCopies(rank, {0: (1,)}, names=[], on_host=True, chunk=100)
    state = [torch.arange(1000, dtype=torch.float32) * (rank + 1), torch.full((450,), 7.0)]
    copies.start((), 5, torch.device("cpu"), (state, {}) if rank == 0 else None)
    # The next step's micro-batches, each moving the copies on without waiting for them (`advance`).
    deadline, micro_batches = time.monotonic() + 30.0, 0
    while copies._in_flight[0].posted and time.monotonic() < deadline:
        copies.advance()
        time.sleep(0.01)
        micro_batches += 1
    left = len(copies._in_flight[0].posted)
    copies.finish()
    held = copies.held.get(0)
    dist.barrier()
    return {"left_for_finish": left, "micro_batches": micro_batches, "step": held and held.step,
            "copy": held and [b.clone() for b in copies._buffers[0][1:]]}


def test_host_copies_travel_during_the_next_steps_micro_batches():
    # Rank 0's state (15 pieces of at most 100 elements) to its buddy, rank 1, in host memory, under NCCL's rules.
    # Before: the rounds of host copies ran inside `finish`, at the step's end whatever `redundancy_overlap` said.
    # Now the first two set off at `start`, and every later one as the micro-batches' `advance` lands the round two
    # before it: nothing is left for `finish`, and the copy is whole.
    out = run_ranks(_travel, 2, timeout=120)
    assert [o["left_for_finish"] for o in out] == [0, 0], out
    assert out[1]["step"] == 5
    expected = [torch.arange(1000, dtype=torch.float32), torch.full((450,), 7.0)]
    assert all(torch.equal(a, b) for a, b in zip(out[1]["copy"], expected))
