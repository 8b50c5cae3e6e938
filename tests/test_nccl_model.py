"""The `nccl_model` backend: each NCCL rule it keeps, shown by a small program that breaks the rule. The program
passes under gloo, fails under nccl_model, and passes again with that one rule switched off."""

import os
import threading
import time

import pytest
import torch
import torch.distributed as dist

from ntp_ds.testing.spawn import run_ranks

pytestmark = pytest.mark.timeout(120)


def _program(rank, world, backend, off, body):
    if off:
        os.environ["NTP_NCCL_MODEL_OFF"] = off
    os.environ["NTP_NCCL_MODEL_DEADLOCK_S"] = "3"
    if backend == "nccl_model":
        import ntp_ds.testing.nccl_model  # noqa: F401  (registers the backend)
    dist.init_process_group(backend, rank=rank, world_size=world)
    try:
        return body(rank, world)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _run(body, backend, off="", world=2):
    return run_ranks(_program, world, backend, off, body, timeout=60)


def _fails(body, match, world=2, rule=""):
    """The body passes under gloo, fails under nccl_model with `match`, and passes with `rule` off."""
    _run(body, "gloo", world=world)
    with pytest.raises(RuntimeError, match=match):
        _run(body, "nccl_model", world=world)
    if rule:
        _run(body, "nccl_model", off=rule, world=world)


# -- the programs (module level: they travel to the ranks) --------------------------------------------------------
def pair_works_with_ops(rank, world):
    """Waits on the Work of its receive alone, pairing batch_isend_irecv's Works with its ops."""
    peer = 1 - rank
    got = torch.zeros(4)
    ops = [dist.P2POp(dist.isend, torch.full((4,), float(rank)), peer), dist.P2POp(dist.irecv, got, peer)]
    works = dict(zip(["send", "recv"], dist.batch_isend_irecv(ops)))
    works["recv"].wait()
    works["send"].wait()
    assert got.tolist() == [float(peer)] * 4, got


def read_before_wait(rank, world):
    """Reads an all-reduce's result before waiting on its Work."""
    t = torch.ones(8)
    work = dist.all_reduce(t, async_op=True)
    seen = t.clone()
    work.wait()
    assert not seen.isnan().any(), "read the poison: the result was not there yet"
    assert t.tolist() == [float(world)] * 8


def read_recv_before_wait(rank, world):
    """Reads a received buffer before waiting on the receive."""
    buf = torch.zeros(8)
    if rank == 0:
        dist.send(torch.arange(8.0), 1)
    else:
        work = dist.irecv(buf, 0)
        time.sleep(0.2)
        seen = buf.clone()
        work.wait()
        assert not seen.isnan().any(), "read the poison: the message had not arrived"


def overwrite_send_buffer(rank, world):
    """Reuses a send buffer before the send's Work completed."""
    buf = torch.arange(8.0)
    if rank == 0:
        work = dist.isend(buf, 1)
        buf.fill_(-1.0)
        work.wait()
    else:
        dist.recv(torch.zeros(8), 0)


def sends_before_receives(rank, world):
    """Posts each send before its receive, in separate calls, around a ring."""
    right, left = (rank + 1) % world, (rank - 1) % world
    got = torch.zeros(1024)
    send = dist.isend(torch.full((1024,), float(rank)), right)
    recv = dist.irecv(got, left)
    send.wait()
    recv.wait()
    assert got[0].item() == float(left)


def batch_first_on_a_subset(rank, world):
    """Starts a group of three with a batch between two of its ranks (NCCL: undefined)."""
    if rank == 2:
        return
    got = torch.zeros(4)
    for work in dist.batch_isend_irecv([dist.P2POp(dist.isend, torch.full((4,), float(rank)), 1 - rank),
                                        dist.P2POp(dist.irecv, got, 1 - rank)]):
        work.wait()
    assert got.tolist() == [float(1 - rank)] * 4


def rely_on_tags(rank, world):
    """Receives two messages of one batch in another order than they were sent, matched by tag."""
    if rank == 0:
        ops = [dist.P2POp(dist.isend, torch.tensor([1.0]), 1, tag=1),
               dist.P2POp(dist.isend, torch.tensor([2.0]), 1, tag=2)]
    else:
        a, b = torch.zeros(1), torch.zeros(1)
        ops = [dist.P2POp(dist.irecv, b, 0, tag=2), dist.P2POp(dist.irecv, a, 0, tag=1)]
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    if rank == 1:
        assert (a.item(), b.item()) == (1.0, 2.0), (a.item(), b.item())


def rely_on_wire_error(rank, world):
    """Expects a collective whose peer left to end with an error; aborts after 3 s only as a last resort."""
    dist.all_reduce(torch.zeros(1))  # the communicator, created at its first op with every member (`create`)
    if rank == 1:
        return "left"
    t = torch.ones(4)
    rescued = threading.Event()

    def last_resort():
        if not done.wait(3.0):
            rescued.set()
            dist.distributed_c10d._abort_process_group()

    done = threading.Event()
    threading.Thread(target=last_resort, daemon=True).start()
    try:
        dist.all_reduce(t)
    except RuntimeError as err:
        done.set()
        assert not rescued.is_set(), f"the op ended only when the group was aborted ({err}); output {t.tolist()}"
        return "peer failure seen"
    done.set()
    raise AssertionError(f"the all-reduce returned without its peer, without an error (ended by the abort: "
                         f"{rescued.is_set()})")


def work_behind_a_stopped_device(rank, world):
    """Rank 1's device stops (a kernel that never ends); the all-reduce it posts after that is expected to run."""
    from datetime import timedelta

    from ntp_ds.comm import device

    backend = dist.get_backend()
    if rank == 1 and backend != "gloo":  # (gloo's host computes: it has no device to stop)
        device.hang(backend)
    record = device.recorder(backend)
    event = record() if record is not None else None
    t = torch.ones(4)
    dist.all_reduce(t, async_op=True).wait(timedelta(seconds=2))
    assert t.tolist() == [float(world)] * 4
    assert event is None or event.query(), "an event recorded after the device stopped completed"


def first_op_while_a_member_is_away(rank, world):
    """Posts the first op of a new group (async) and expects the post to return while the other member is away."""
    group = dist.new_group([0, 1])  # (every member creates the group: its gloo transport connects here)
    t = torch.ones(4)
    if rank == 0:
        t0 = time.monotonic()
        work = dist.all_reduce(t, group=group, async_op=True)
        posted_s = time.monotonic() - t0
        assert posted_s < 2.0, f"the post took {posted_s:.1f} s"
        dist.barrier()  # (the default group's first op: its communicator is created here, by both)
        work.wait()
    else:
        time.sleep(5)  # away, longer than the model's deadlock bound (3 s)
        dist.barrier()
        dist.all_reduce(t, group=group)
    assert t.tolist() == [2.0] * 4


def sync_behind_a_stopped_device(rank, world):
    """Rank 1's device stops; a sync of its stream after that is expected to return."""
    from ntp_ds.comm import device

    backend = dist.get_backend()
    dist.barrier()
    if rank == 1 and backend != "gloo":  # (gloo's host computes: it has no device to stop)
        device.hang(backend)
    device.synchronize(backend)


def whole_device_sync_beside_a_pending_receive(rank, world):
    """Rank 0 syncs its whole device while a receive is pending on a communicator, and expects it to return at once."""
    from ntp_ds.comm import device

    dist.barrier()  # (the default group's communicator, created by both)
    buf = torch.zeros(4)
    if rank == 0:
        work = dist.irecv(buf, 1)
        t0 = time.monotonic()
        device.synchronize(dist.get_backend(), whole_device=True)
        waited_s = time.monotonic() - t0
        assert waited_s < 1.0, f"the sync waited {waited_s:.1f} s for the receive"
        work.wait()
        assert buf.tolist() == [1.0] * 4
    else:
        time.sleep(1.5)
        dist.send(torch.ones(4), 0)


def post_after_an_op_timed_out(rank, world):
    """Rank 0's receive outlives its group's timeout (1 s); its next post on the group is expected to return at once."""
    from datetime import timedelta

    os.environ["TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC"] = "500"  # (torch's default, 15 s, would sleep 60 s)
    group = dist.new_group([0, 1], timeout=timedelta(seconds=1))
    dist.all_reduce(torch.ones(1), group=group)  # (its communicator, created by both)
    buf = torch.zeros(4)
    if rank == 0:
        work = dist.irecv(buf, 1, group=group)
        time.sleep(1.5)
        t0 = time.monotonic()
        sent = dist.isend(torch.ones(4), 1, group=group)
        posted_s = time.monotonic() - t0
        assert posted_s < 1.0, f"the post took {posted_s:.1f} s"
        work.wait()
        sent.wait()
    else:
        time.sleep(1.8)
        dist.send(torch.ones(4), 0, group=group)
        dist.recv(buf, 0, group=group)
    assert buf.tolist() == [1.0] * 4


def first_op_of_a_non_blocking_group_while_a_member_is_away(rank, world):
    """Posts the first op of a group created non-blocking (the product's groups) while the other member is away
    longer than the non-blocking bound (1 s), and expects it to complete once the member arrives."""
    from datetime import timedelta

    from ntp_ds.comm.groups import creation_options

    os.environ["TORCH_NCCL_NONBLOCKING_TIMEOUT"] = "1"
    group = dist.new_group([0, 1], pg_options=creation_options(dist.get_backend(), timedelta(seconds=60)))
    t = torch.ones(4)
    if rank == 1:
        time.sleep(2)
    dist.all_reduce(t, group=group, async_op=True).wait(timedelta(seconds=3))
    assert t.tolist() == [2.0] * 4


# -- the tests -------------------------------------------------------------------------------------------------
def test_coalesce_one_work_per_batch():
    _fails(pair_works_with_ops, "KeyError: 'recv'", rule="coalesce")


def test_async_result_poisoned_until_waited():
    _fails(read_before_wait, "read the poison", rule="async")


def test_async_received_buffer_poisoned_until_waited():
    _fails(read_recv_before_wait, "read the poison", rule="async")


def test_async_send_buffer_must_not_change_in_flight():
    _fails(overwrite_send_buffer, "RuleViolation: .*send #0 to rank 1.* written before", rule="async")


def test_order_send_before_receive_deadlocks_and_is_reported():
    _fails(sends_before_receives, r"Deadlock: .*group rank \d has waited 3 s at op #0 \(send #0 to rank \d\).*rank \d: op #0: send #0 to rank \d",
           world=3, rule="order")


def test_first_op_a_batch_of_some_ranks_is_refused():
    # (With `first` off, `create` still catches it: rank 2 never reaches the communicator's creation.)
    _fails(batch_first_on_a_subset, "RuleViolation: .*first op of its communicator", world=3, rule="first,create")


def test_tags_ignored():
    _fails(rely_on_tags, r"\(2.0, 1.0\)", rule="tags")


def test_abort_no_op_ends_without_abort_and_the_abort_raises_nothing():
    _fails(rely_on_wire_error, r"returned without its peer, without an error \(ended by the abort: True\)",
           rule="abort")


def aborted_group(rank, world):
    """After an abort (torch 2.13's ProcessGroupNCCL): the pending op reports complete and its wait returns without
    an error, its output holds no reduced element (rank 1 never took part: some chunks keep the input, the rest the
    poison), and the group refuses later use."""
    import ntp_ds.testing.nccl_model as nm

    group = dist.new_group([0, 1])
    dist.all_reduce(torch.zeros(1), group=group)  # its communicator, created with both (`create`)
    t = torch.ones(4)
    if rank == 1:
        dist.barrier(group=dist.group.WORLD)
        return None
    work = dist.all_reduce(t, group=group, async_op=True)  # rank 1 never joins it
    assert not work.is_completed()
    group.abort()
    assert work.is_completed() and work.exception() is None
    assert work.wait() is True
    assert not (t == 2.0).any() and t.isnan().any() and (t == 1.0).any(), t
    with pytest.raises(nm.Aborted):
        dist.all_reduce(torch.ones(1), group=group)
    dist.barrier(group=dist.group.WORLD)
    return "ok"


def test_abort_completes_pending_ops_without_error_and_refuses_use():
    assert _run(aborted_group, "nccl_model")[0] == "ok"


def abort_mid_message(rank, world):
    """Rank 0 receives from ranks 1 and 2 in one batch; rank 1's message left, rank 2's never does; rank 0 aborts.
    (The `order` rule is off, so the transfers start as they are posted and rank 1's is under way at the abort.)"""
    import ntp_ds.testing.nccl_model as nm

    store = dist.distributed_c10d._get_default_store()
    dist.barrier()
    if rank == 1:
        dist.send(torch.arange(16.0), 0)
    if rank != 0:
        store.wait(["aborted"])
        return None
    got1, got2 = torch.zeros(16), torch.zeros(16)
    (work,) = dist.batch_isend_irecv([dist.P2POp(dist.irecv, got1, 1), dist.P2POp(dist.irecv, got2, 2)])
    time.sleep(0.5)  # rank 1's message is in
    dist.group.WORLD.abort()
    store.set("aborted", "1")
    assert work.is_completed() and work.wait() is True  # no error: a cut op looks like a finished one
    chunks = got1.chunk(nm.CHANNELS)
    assert [c.tolist() for c in chunks[::2]] == [[0.0, 1.0, 2.0, 3.0], [8.0, 9.0, 10.0, 11.0]], got1  # arrived
    assert all(c.isnan().all() for c in chunks[1::2]), got1  # the rest holds what the memory held
    assert got2.isnan().all(), got2
    return "ok"


def test_abort_cuts_a_message_in_flight_into_some_chunks_and_old_bytes():
    assert run_ranks(_program, 3, "nccl_model", "order", abort_mid_message, timeout=60)[0] == "ok"


def proofs_of_arrival(rank, world):
    """wire's proofs: an exchange seen complete before the abort (never asked about until after it: the abort looks
    at what is in flight first) is proven; one cut by the abort is not, though its wait returns without error."""
    from ntp_ds.comm import wire

    store = dist.distributed_c10d._get_default_store()
    wire.configure(30.0, None)
    wire.all_reduce(torch.zeros(1), None)  # the group's first op: a collective (NCCL's rule)
    side = dist.new_group([0, 2])  # where the cut exchange runs (an op entered on the first group would look at it)
    if rank != 1:
        dist.all_reduce(torch.zeros(1), group=side)  # its communicator, created with both (`create`)
    if rank == 2:
        store.wait(["aborted"])
        return None
    peer = 1 - rank
    got = torch.zeros(8)
    done = wire.exchange({peer: torch.full((8,), float(rank))}, {peer: got})
    done.wait()
    if rank == 1:
        store.wait(["aborted"])
        return None
    waiting = torch.zeros(8)
    cut = wire.exchange({}, {2: waiting}, group=side)  # rank 2 never sends
    time.sleep(0.3)
    wire.abort_all()
    store.set("aborted", "1")
    cut.wait_received(2, heed_failure=False)  # returns: the cut op reports complete
    assert waiting.isnan().all()
    return [done.proven(), done.proven(peer), cut.proven(), cut.proven(2), got.tolist()]


@pytest.mark.parametrize("sweep", [True, False])
def test_only_ops_seen_complete_before_the_abort_are_proven(sweep, monkeypatch):
    if not sweep:  # the rule's negative: an abort that does not first look at the ops in flight
        monkeypatch.setenv("NTP_TEST_NO_SWEEP", "1")
    out = run_ranks(_program, 3, "nccl_model", "", _proofs_maybe_without_sweep, timeout=60)[0]
    assert out == ([True, True, False, False, [1.0] * 8] if sweep else [False, False, False, False, [1.0] * 8]), out


def _proofs_maybe_without_sweep(rank, world):
    if os.environ.get("NTP_TEST_NO_SWEEP"):
        from ntp_ds.comm import ledger
        ledger._observe = lambda groups: None
    return proofs_of_arrival(rank, world)


def abort_racing_a_post(rank, world):
    """An abort that lands while the training thread posts an op (between its check and its registration): the op
    is refused, as a real aborted communicator refuses it, not left pending for a wait that never returns."""
    import ntp_ds.testing.nccl_model as nm

    group = dist.new_group([0, 1])
    dist.all_reduce(torch.zeros(1), group=group)  # its communicator, created with both (`create`)
    if rank == 1:
        dist.barrier(group=dist.group.WORLD)
        return None
    real = nm.ModelWork.__init__

    def abort_meanwhile(work, *args, **kwargs):  # the moment between the post's first check and its registration
        real(work, *args, **kwargs)
        group.abort()

    nm.ModelWork.__init__ = abort_meanwhile
    try:
        with pytest.raises(nm.Aborted):
            dist.all_reduce(torch.ones(4), group=group, async_op=True)
    finally:
        nm.ModelWork.__init__ = real
    dist.barrier(group=dist.group.WORLD)
    return "refused"


def test_an_abort_racing_a_post_refuses_the_op():
    assert _run(abort_racing_a_post, "nccl_model")[0] == "refused"


def collectives(rank, world):
    """Every collective DeepSpeed and the package use gives gloo's answer once waited."""
    out = {}
    t = torch.full((4,), float(rank + 1))
    dist.all_reduce(t)
    out["all_reduce"] = t.tolist()
    flat = torch.zeros(4 * world)
    flat[4 * rank:4 * rank + 4] = rank + 1.0
    dist.all_gather_into_tensor(flat, flat[4 * rank:4 * rank + 4])  # in place, as ZeRO gathers its partitions
    out["all_gather_in_place"] = flat.tolist()
    parts = [torch.zeros(2) for _ in range(world)]
    dist.all_gather(parts, torch.full((2,), float(rank)))
    out["all_gather"] = [p.tolist() for p in parts]
    shard = torch.zeros(3)
    dist.reduce_scatter_tensor(shard, torch.arange(3.0 * world) + rank)
    out["reduce_scatter"] = shard.tolist()
    b = torch.full((3,), float(rank))
    dist.broadcast(b, src=1)
    out["broadcast"] = b.tolist()
    a2a = torch.zeros(world)
    dist.all_to_all_single(a2a, torch.arange(float(world)) + 10 * rank)
    out["all_to_all"] = a2a.tolist()
    x, y = torch.ones(2), torch.full((3,), 2.0)
    dist.all_reduce_coalesced([x, y])
    out["coalesced"] = [x.tolist(), y.tolist()]
    dist.barrier()
    objs = [None] * world
    dist.all_gather_object(objs, {"rank": rank})
    out["objects"] = objs
    return out


@pytest.mark.long  # (about 10 s: .ci/run's long stage; the README suite stays under 10 min)
def test_create_a_communicator_is_created_at_the_first_op_by_all_members_blocking_the_post():
    _fails(first_op_while_a_member_is_away, r"Deadlock: .*group rank 0 has waited 3 s in the creation of its "
           r"communicator at its first op \(allreduce\) for group rank\(s\) \[1\]", rule="create")


def test_create_a_non_blocking_communicator_is_waited_for_at_most_its_bound_then_raises():
    _fails(first_op_of_a_non_blocking_group_while_a_member_is_away,
           r"DistBackendError: NCCL timeout in: nccl_model: the non-blocking communicator of group rank 0 was not "
           r"ready within TORCH_NCCL_NONBLOCKING_TIMEOUT=1 s at its first op \(allreduce\): group rank\(s\) \[1\]",
           rule="create")


def test_device_an_op_posted_after_the_device_stopped_never_starts():
    _fails(work_behind_a_stopped_device, "did not complete", rule="device")


def test_sync_a_stream_sync_never_returns_once_the_device_stopped():
    _fails(sync_behind_a_stopped_device, r"deadlock: a device sync has waited 3 s behind a kernel that never ends",
           rule="sync")


def test_sync_a_sync_of_the_whole_device_waits_for_a_kernel_running_on_a_communicator():
    _fails(whole_device_sync_beside_a_pending_receive, r"the sync waited 1\.\d s for the receive", rule="sync")


@pytest.mark.long  # (about 10 s: .ci/run's long stage; the README suite stays under 10 min)
def test_watchdog_a_post_after_an_op_timed_out_waits_for_the_watchdogs_sleep():
    _fails(post_after_an_op_timed_out, r"the post took 1\.\d s", rule="watchdog")


def test_collectives_agree_with_gloo():
    assert _run(collectives, "nccl_model") == _run(collectives, "gloo")


# -- the package's own wire on the backend ----------------------------------------------------------------------
def receive_from_one_peer(rank, world):
    """wire.exchange's receives from one peer are complete once `wait_received(peer)` returns (defect: with NCCL's
    one Work per batch, the per-op pairing waited on nothing and the buffer still held the poison)."""
    from ntp_ds.comm import wire

    wire.configure(30.0, None)
    wire.all_reduce(torch.zeros(1), None)  # the group's first op: a collective (NCCL's rule)
    peer = 1 - rank
    got = [torch.zeros(16), torch.zeros(4)]
    pending = wire.exchange({peer: [torch.full((16,), float(rank)), torch.full((4,), float(rank))]}, {peer: got})
    pending.wait_received(peer)
    assert all(not g.isnan().any() for g in got), "read the poison: wait_received waited on nothing"
    pending.wait()
    return [g.tolist() for g in got]


def test_wire_exchange_waits_on_the_coalesced_batch():
    assert _run(receive_from_one_peer, "nccl_model") == _run(receive_from_one_peer, "gloo")


def copies_in_flight_beside_the_data(rank, world):
    """Rank 0's state copy to rank 1 is in flight (rank 1 posts its receive only later) while the pair exchanges a
    parameter bucket: with the copies' lane (2 replicas x TP 1, twin families) the bucket does not queue behind the
    copy and each lands where it should; without it (NTP_TEST_NO_LANE) both share one communicator and its stream,
    where the bucket waits behind the copy for good."""
    from datetime import timedelta

    from ntp_ds.comm import groups, wire
    from ntp_ds.layout import Topology, plan_gradient_sync
    from tests.helpers.training import tiny_config

    groups.start_generation(30.0)
    topology = Topology.from_degrees(tiny_config().units(), (1, 1))
    lane = not os.environ.get("NTP_TEST_NO_LANE")
    built = groups.build_exchange_families(topology, plan_gradient_sync(topology), rank, timedelta(seconds=30), lane)
    peer, copy, bucket = 1 - rank, torch.zeros(8), torch.zeros(8)
    if rank == 0:
        copying = wire.exchange({peer: torch.full((8,), 7.0)}, {}, op="copy_data", lane="copies")
    data = wire.exchange({peer: torch.full((8,), float(rank))}, {peer: bucket}, op="param_bucket")
    data.wait_proven("the bucket")
    if rank == 1:
        wire.exchange({}, {peer: copy}, op="copy_data", lane="copies").wait_proven("the copy")
    else:
        copying.wait()
    return sorted(groups.role_of(g) for g in built), bucket.tolist(), copy.tolist()


def exchange_outside_every_family(rank, world):
    """One replica at TP 2: each rank is its family's only member, so no family joins the two, and their exchange
    runs on a group of the pair, built at its first use (started by a collective, as NCCL's first-op rule asks)."""
    from datetime import timedelta

    from ntp_ds.comm import groups, wire
    from ntp_ds.layout import Topology, plan_gradient_sync
    from tests.helpers.training import tiny_config

    groups.start_generation(30.0)
    topology = Topology.from_degrees(tiny_config().units(), (2,))
    assert groups.build_exchange_families(topology, plan_gradient_sync(topology), rank, timedelta(seconds=30)) == []
    peer = 1 - rank
    got = torch.zeros(8)
    wire.exchange({peer: torch.full((8,), float(rank))}, {peer: got}).wait()
    wire.exchange({peer: torch.full((8,), float(rank + 10))}, {peer: got}).wait()  # the same pair group again
    pairs = [g for g in dist.distributed_c10d._world.pg_map if groups.role_of(g) == "pair"]
    return got.tolist(), [dist.get_process_group_ranks(g) for g in pairs]


def test_state_copies_in_flight_never_hold_a_parameter_bucket_behind_them(monkeypatch):
    out = _run(copies_in_flight_beside_the_data, "nccl_model")
    assert out[0] == (["family", "family-copies"], [1.0] * 8, [0.0] * 8)
    assert out[1] == (["family", "family-copies"], [0.0] * 8, [7.0] * 8)
    # One communicator for both: its stream holds the bucket behind the copy, whose receive rank 1 posts only after
    # the bucket (messages between a pair match in posting order there: the lane is what frees the two orders).
    monkeypatch.setenv("NTP_TEST_NO_LANE", "1")
    with pytest.raises(RuntimeError, match=r"Deadlock: .*group rank 1 has waited 3 s at op #1 \(batch of send #0 "
                                           r"to rank 0, recv #0 from rank 0\).*rank 0: op #1: batch of send #0"):
        _run(copies_in_flight_beside_the_data, "nccl_model")


@pytest.mark.parametrize("backend", ["gloo", "nccl_model"])
def test_an_exchange_between_ranks_of_no_common_family_runs_on_a_group_of_the_pair(backend):
    assert _run(exchange_outside_every_family, backend) == [([11.0] * 8, [[0, 1]]), ([10.0] * 8, [[0, 1]])]


def initialize_on_a_callers_group(rank, world, handling):
    """A user's script built the default group itself (as torchrun or deepspeed launcher users do), with
    TORCH_NCCL_ASYNC_ERROR_HANDLING as given (None: unset), then asks ntp_ds for an engine."""
    import ntp_ds
    from ntp_ds.engine.config import ConfigError
    from tests.helpers.training import deepspeed_config, full_model, tiny_config

    os.environ.pop("TORCH_NCCL_ASYNC_ERROR_HANDLING", None)
    if handling is not None:
        os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] = handling
    import ntp_ds.testing.nccl_model  # noqa: F401  (registers the backend)

    dist.init_process_group("nccl_model", rank=rank, world_size=world)
    try:
        engine = ntp_ds.initialize(model=full_model(tiny_config()), config=deepspeed_config("sgd", 0, 4, 2),
                                   ntp={"tp": 1, "replicas": 2})
    except ConfigError as err:
        return str(err)
    return f"engine on {engine.ntp_groups.topology.degrees}"


def test_a_callers_nccl_group_without_async_error_handling_0_is_refused():
    # Defect: a group the user's launcher built never got TORCH_NCCL_ASYNC_ERROR_HANDLING=0, so NCCL's watchdog
    # would have torn every survivor down at the first failure.
    refused = run_ranks(initialize_on_a_callers_group, 2, None, timeout=90)
    assert all(msg.startswith("TORCH_NCCL_ASYNC_ERROR_HANDLING=(unset)") for msg in refused), refused
    accepted = run_ranks(initialize_on_a_callers_group, 2, "0", timeout=90)
    assert accepted == ["engine on (1, 1)"] * 2, accepted
