"""A recovery keeps the groups of the replicas that lost nothing: their TP groups (and, under NCCL, the gloo twins)
carry on into the next generation, and only groups whose members left them with equally many operations posted are
kept. Judged by final state as every recovery test is: the weights equal the failure-free run's."""

import os
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from ntp_ds.testing.spawn import run_ranks
from tests.helpers.recovery import assert_equivalent, assert_lossless_and_minimal, events_of, fault, run

pytestmark = pytest.mark.timeout(300)

NCCL_RULES = os.environ.get("NTP_TEST_BACKEND") == "nccl_model"


@pytest.mark.parametrize("stage", [1, 2])
def test_replicas_that_lost_nothing_keep_their_tp_groups(stage):
    # 3 replicas at TP 2; rank 5 (replica 2) dies in the backward pass. Replicas 0 and 1 lose nothing: their TP
    # groups hold no dead rank, and their members stop together at the gradient sync with replica 2.
    results = run((2, 2, 2), stage, [fault(5, 3, "backward")])
    assert_equivalent(results)
    assert_lossless_and_minimal(results, (2, 2, 1))
    (copies,) = events_of(results)
    event = copies[0]
    print(f"communicators_created={event['communicators_created']} communicators_kept={event['communicators_kept']} "
          f"engines_rebuilt={event['engines_rebuilt']}")
    kept = {r: res["events"][0]["kept_here"] for r, res in results.items()}
    healthy = ["tp", "tp-control"] if NCCL_RULES else ["tp"]
    assert kept == {0: healthy, 1: healthy, 2: healthy, 3: healthy, 4: []}
    # Each kept group counted once (by its lowest member): replicas 0 and 1's.
    assert event["communicators_kept"] == 2 * len(healthy)
    # Replicas 0 and 1 keep their engines (their ZeRO partitions re-cut in place): only replica 2's survivor, now a
    # contributor at TP 1, builds one.
    assert event["engines_rebuilt"] == 1
    assert_keepers_receive_only_the_new_cut({r: res["events"][0] for r, res in results.items()}, (0, 1, 2, 3))
    assert_no_world_communicator(results)


def assert_keepers_receive_only_the_new_cut(events, keepers):
    """The ranks that kept their engines received no parameter, and of the optimizer state only what their new ZeRO
    partition holds and they did not: every element their old partition held and the new one needs was installed
    from themselves (measured per element in the re-slice, against the overlap of the two partitions' addresses)."""
    for rank, event in events.items():
        state = event["rank_state_elements"]
        print(f"rank {rank}: parameter bytes received {event['rank_bytes_received']}, optimizer elements {state}")
        if rank not in keepers:
            assert state["keepable"] is None  # it built a new engine
            continue
        assert event["rank_bytes_received"] == 0
        assert state["kept"] == state["keepable"] > 0
        assert state["kept"] + state["from_copies"] + state["received"] == state["wanted"]


def assert_no_world_communicator(results, largest=3):
    """Under NCCL's rules, no rank created a communicator larger than a DP family (a rank of each of the three
    replicas) or a TP group: the default group's world communicator was never created."""
    if not NCCL_RULES:
        return
    sizes = {r: res["communicators"] for r, res in results.items()}
    print("communicator sizes by rank:", {r: sorted(set(s)) for r, s in sizes.items()})
    assert all(s for s in sizes.values()), "a rank created no communicator"
    assert max(max(s) for s in sizes.values()) <= largest, sizes


@pytest.mark.parametrize("stage", [1, 2])
def test_and_keep_them_through_the_grow_back_that_follows(stage):
    from tests.helpers import grow

    # Rank 5 dies in step 2's backward pass; a worker (rank 6) joins and takes its place in replica 2 from step 4.
    results = grow.run((2, 2, 2), stage, [fault(5, 2, "backward")], joins=[6])
    assert set(results) == {0, 1, 2, 3, 4, 6}
    assert_equivalent(results, grow.STEPS)
    assert all(tuple(r["degrees"]) == (2, 2, 2) for r in results.values())
    healthy = ["tp", "tp-control"] if NCCL_RULES else ["tp"]
    for kind, event_of in (("recovery", lambda r: r["events"][0]), ("grow", lambda r: r["events"][-1])):
        events = {r: event_of(res) for r, res in results.items() if r != 6}
        assert all(("joined" in e) == (kind == "grow") for e in events.values())
        print(f"{kind}: communicators_created={events[0]['communicators_created']} "
              f"communicators_kept={events[0]['communicators_kept']} engines_rebuilt={events[0]['engines_rebuilt']}")
        assert {r: e["kept_here"] for r, e in events.items()} == {0: healthy, 1: healthy, 2: healthy, 3: healthy,
                                                                   4: []}
        assert events[0]["communicators_kept"] == 2 * len(healthy)
        # The anchors of replicas 0 and 1 keep their engines both times; at the grow, replica 2's survivor (an anchor
        # again, at TP 2) and the joiner build theirs.
        assert events[0]["engines_rebuilt"] == (1 if kind == "recovery" else 2)
        assert_keepers_receive_only_the_new_cut(events, (0, 1, 2, 3))
    assert_no_world_communicator(results)


def _keep_after(rank, world, case):
    from ntp_ds.comm import groups, wire
    from ntp_ds.control.store import connect_from_env
    from ntp_ds.layout import Topology, plan_gradient_sync
    from ntp_ds.recovery.keep import keep
    from ntp_ds.testing import nccl_model
    from tests.helpers.training import tiny_config

    dist.init_process_group("nccl_model" if case == "device-stopped" else "gloo", rank=rank, world_size=world)
    groups.start_generation(30.0)
    topology = Topology.from_degrees(tiny_config().units(), (2,))
    built = groups.build_groups(topology, plan_gradient_sync(topology), rank, 30.0)
    wire.all_reduce(torch.ones(1), built.tp_group)
    pending = None
    if case == "one-op-unmatched" and rank == 0:  # an operation its peer never posts (a member cut off mid-collective)
        pending = dist.all_reduce(torch.ones(1), group=built.tp_group, async_op=True)
    if case == "left-with-fewer":  # rank 0 posts an operation rank 1 never will, and rank 1 leaves for the recovery
        from ntp_ds.recovery.keep import depart, departed

        store = connect_from_env(30.0)
        wire.on_departure(lambda group: departed(store, 3, group))
        if rank == 0:
            pending = dist.all_reduce(torch.ones(1), group=built.tp_group, async_op=True)
            wire._enter(pending, built.tp_group)
        depart(store, 3)
    if case == "device-stopped":  # both post a second operation; rank 1's device stops before it runs its kernel
        if rank == 1:
            nccl_model.hang_device()
        # Posted as `wire.all_reduce` posts it, whose wait on a GPU only orders the stream: the host goes on (the
        # model's host is its stream, and would wait there).
        pending = dist.all_reduce(torch.ones(1), group=built.tp_group, async_op=True)
        wire._enter(pending, built.tp_group)
    candidates = groups.keepable(dist.distributed_c10d._world.pg_map)
    wire.teardown(keep=candidates)
    t0 = time.monotonic()
    kept = keep(connect_from_env(30.0), rank, candidates, (0, 1), (0, 1), topology, plan_gradient_sync(topology),
                1, 5.0)
    decided_s = time.monotonic() - t0
    held = [groups.role_of(g) for g in kept]
    left = len(dist.distributed_c10d._world.pg_map)
    del pending
    return {"kept": held, "registered": left, "decided_s": decided_s}


@pytest.mark.parametrize("case", ["drained", "one-op-unmatched", "left-with-fewer", "device-stopped"])
def test_a_group_is_kept_only_if_its_members_posted_equally_many_operations_all_complete(case):
    # "device-stopped": the members posted equally many operations, but the last never runs (under NCCL's rules a
    # member's device stopped behind it). Before: kept, its kernel carried into the next generation.
    # "left-with-fewer": rank 0's last operation is one its peer, gone to the recovery, never posts: rank 0 stops
    # looking for its completion at the departure record (on gloo nothing aborts the group), not at the timeout.
    results = run_ranks(_keep_after, 2, case, timeout=120, store=True)
    kept = [sorted(results[r]["kept"]) for r in (0, 1)]
    # Both members decide alike on the TP group; a group not kept is closed (out of torch's registry). Each rank's
    # data-parallel group is itself alone (one replica): nothing to check, kept.
    # Under NCCL's rules the TP group has a gloo twin for the control reductions, on which nothing was left running.
    expected = {"drained": ["dp", "tp"], "one-op-unmatched": ["dp"], "left-with-fewer": ["dp"],
                "device-stopped": ["dp", "tp-control"]}[case]
    assert kept == [expected, expected]
    assert [results[r]["registered"] for r in (0, 1)] == [len(expected)] * 2
    # A look bounded by the timeout (5 s), ended at once where nothing is left running.
    assert all(results[r]["decided_s"] < (8.0 if case == "device-stopped" else 3.0) for r in (0, 1)), results


def _healthy_tp_group(rank, world, backend):
    """A TP group of ranks 0 and 1 with one operation posted (its communicator created by both), departures read
    from the store for recovery generation 7; (group, store)."""
    from ntp_ds.comm import groups, wire
    from ntp_ds.control.store import connect_from_env
    from ntp_ds.recovery.keep import departed

    if backend == "nccl_model":
        import ntp_ds.testing.nccl_model  # noqa: F401  (registers the backend)
    dist.init_process_group(backend, rank=rank, world_size=world)
    groups.start_generation(30.0)
    tp = groups.named_group("tp/0", [0, 1], timedelta(seconds=30), role="tp")
    store = connect_from_env(30.0)
    wire.on_departure(lambda group: departed(store, 7, group))
    wire.all_reduce(torch.ones(1), tp)
    return tp, store


def _departures(rank, world):
    from ntp_ds.comm import waits, wire
    from ntp_ds.recovery.keep import depart, departed

    tp, store = _healthy_tp_group(rank, world, "gloo")
    seen = {"before": departed(store, 7, tp)}
    store.set(f"rank{rank}-read", "1")
    if rank == 1:  # leaves first, with one operation posted on the group
        store.wait(["rank0-read"])
        depart(store, 7)
        store.set("rank1-left", "1")
        store.wait(["rank0-left"])
    else:
        store.wait(["rank1-left"])
        seen["level"] = waits._departed(tp)  # as many operations as the leaver: nothing of this rank's is unmatched
        pending = dist.all_reduce(torch.ones(1), group=tp, async_op=True)  # one the leaver never posts
        seen["ahead"] = waits._departed(tp)
        depart(store, 7)  # leaves with two: the members did not stop together
        store.set("rank0-left", "1")
    seen["after"] = departed(store, 7, tp)
    seen["released"] = waits._departed(tp)
    wire.discard([tp])
    if rank == 0:
        del pending
    return seen


def test_a_departure_releases_only_a_peer_that_posted_more_than_the_leaver():
    # A healthy replica's TP group: rank 1 leaves it for the recovery after one operation. Rank 0, level with it, has
    # nothing to give up; once it posts an operation rank 1 never will, its wait is lost. Leaving with another count
    # than rank 1's marks the group -1, which releases every member.
    seen = run_ranks(_departures, 2, timeout=120, store=True)
    assert seen[0]["before"] is None and seen[1]["before"] is None
    assert seen[0]["level"] is False and seen[0]["ahead"] is True
    assert seen[0]["after"] == seen[1]["after"] == -1
    assert seen[0]["released"] is True and seen[1]["released"] is True


def _ran_ahead(rank, world):
    from ntp_ds.comm import wire
    from ntp_ds.recovery.keep import depart

    tp, store = _healthy_tp_group(rank, world, "nccl_model")
    if rank == 1:  # leaves the group for a recovery with one operation posted on it
        depart(store, 7)
        store.set("rank1-left", "1")
        store.wait(["rank0-done"])
        return {}
    store.wait(["rank1-left"])
    # Rank 0's host ran ahead of its device (as on a GPU, where a wait only orders the stream) past an operation
    # rank 1 will never match; then a verdict on another replica spares the group, and the training thread arrives.
    pending = dist.all_reduce(torch.ones(1), group=tp, async_op=True)
    wire.peer_failed("rank 9 declared dead (test)", suspects=[9])
    handed = wire.arrive()
    t0 = time.monotonic()
    try:  # what the snapshot's device sync would wait on, behind the operation's kernel
        pending.wait(timedelta(seconds=10))
        outcome = "ended"
    except RuntimeError as err:
        outcome = str(err)
    seen = {"handed": tp in handed, "outcome": outcome, "waited_s": time.monotonic() - t0,
            "aborted": tp in wire._state.aborted_groups}
    # The groups still handed over (the control tree's, which nobody left early) are looked at once a second.
    looks = []
    check = wire._state.departed
    wire.on_departure(lambda group: looks.append(group) or check(group))
    time.sleep(2.5)
    seen["watched"], seen["looks"] = len(wire._state.handed), len(looks)
    seen["kept"] = wire.stop_watching([tp]) == [tp]
    store.set("rank0-done", "1")
    return seen


def test_a_group_handed_to_the_recovery_is_aborted_once_a_member_left_it_with_fewer_operations():
    # Rank 1 left the (healthy) group with one operation posted; rank 0 posted a second and ran ahead of it. The
    # group is spared by a verdict on another replica and handed to the recovery at the arrival. Before: nothing
    # watched it any more, and the wait behind that operation (on a GPU: the snapshot's device sync) never ended.
    # Now the departures are watched until the recovery decides what it keeps: the group is aborted, the wait ends.
    seen = run_ranks(_ran_ahead, 2, timeout=120, store=True)[0]
    assert seen["handed"] and seen["outcome"] == "ended", seen
    assert seen["waited_s"] < 2.0 and seen["aborted"] and not seen["kept"], seen
    assert seen["watched"] >= 1 and seen["looks"] <= 3 * seen["watched"], seen
