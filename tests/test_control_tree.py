"""The generation's control tree: the per-step votes and sums cross groups of at most `control_fanout` ranks, as many
levels as log_fanout(world), and give every rank the world's reduction, through a death between the votes too."""

import math

import pytest
import torch
import torch.distributed as dist

from ntp_ds.comm.groups import control_tree
from ntp_ds.testing.spawn import run_ranks
from tests.helpers.recovery import assert_equivalent, assert_lossless_and_minimal, events_of, fault, run

pytestmark = pytest.mark.timeout(240)


def _reduce_along(world: int, fanout: int, values: list[float]) -> list[float]:
    """What each rank holds after `wire.control_all_reduce` (a sum), groups taken as the ranks list them: each group
    reduces once all its members hold their own subtree's sum, then each group below the top hands its leader's
    result to its members."""
    trees = {r: control_tree(r, world, fanout) for r in range(world)}
    groups = {}  # (level, members) -> top
    for r, tree in trees.items():
        for level, (members, top) in enumerate(tree):
            assert r in members
            assert groups.setdefault((level, members), top) == top, "members disagree on whether it is the top"
    held = list(values)
    for level, members in sorted(groups):  # lowest level first
        total = sum(held[m] for m in members)
        for m in members:
            held[m] = total
    for level, members in sorted(groups, reverse=True):  # highest first
        if not groups[(level, members)]:
            for m in members:
                held[m] = held[members[0]]
    return held


@pytest.mark.parametrize("world", [1, 2, 3, 5, 8, 9, 31, 64, 100, 1000])
@pytest.mark.parametrize("fanout", [2, 3, 8, 32])
def test_every_rank_ends_with_the_world_sum_through_small_groups(world, fanout):
    values = [float(2 ** (r % 20)) for r in range(world)]
    assert _reduce_along(world, fanout, values) == [sum(values)] * world
    levels = math.ceil(math.log(world, fanout) - 1e-9) if world > 1 else 0
    for r in range(world):
        tree = control_tree(r, world, fanout)
        assert len(tree) <= levels
        assert all(1 <= len(members) <= fanout for members, _ in tree)
        assert all(members[0] == r for members, _ in tree[:-1]), "a rank leads every group below its highest"
        for level, (members, _) in enumerate(tree):  # every member builds as many groups before this one
            assert all(control_tree(m, world, fanout)[level][0] == members for m in members)
    if world > 1:
        assert len(control_tree(0, world, fanout)) == levels and control_tree(0, world, fanout)[-1][1]


def test_at_100k_ranks_a_rank_belongs_to_at_most_four_groups_of_32():
    world = 100_000
    assert max(len(control_tree(r, world, 32)) for r in range(0, world, 7)) == 4
    assert len(control_tree(0, world, 32)) == 4
    assert len(control_tree(99_999, world, 32)) == 1
    with pytest.raises(ValueError, match="control_fanout=1"):
        control_tree(0, 4, 1)


def tree_reductions(rank, world, backend, fanout):
    import os

    from ntp_ds.comm import groups, wire

    if backend == "nccl_model":
        import ntp_ds.testing.nccl_model  # noqa: F401  (registers the backend)
    os.environ["MASTER_ADDR"] = os.environ.get("MASTER_ADDR", "127.0.0.1")
    dist.init_process_group(backend, rank=rank, world_size=world)
    try:
        groups.start_generation(30.0, fanout)
        with wire.recording() as calls:
            sums = wire.sum_counts([float(rank), 1.0])
            everyone = wire.vote(True)
            one_says_no = wire.vote(rank != world - 1)
            highest = wire.control_all_reduce(torch.tensor([float(rank)]), "max", "max").item()
            gathered = wire.all_gather_object({"rank": rank, "payload": "x" * rank})
            told = wire.broadcast_object(f"from {rank}" if rank == world - 2 else None, world - 2)
            wire.barrier()
        return {"sums": sums, "everyone": everyone, "one_says_no": one_says_no, "highest": highest,
                "gathered": gathered, "told": told,
                "group_sizes": sorted({len(c.group_ranks) for c in calls}), "calls": len(calls)}
    finally:
        from ntp_ds.comm import wire

        wire.teardown()


@pytest.mark.parametrize("backend", ["gloo", "nccl_model"])
def test_votes_sums_gathers_and_barriers_over_a_three_level_tree_agree_on_every_rank(backend):
    world = 7  # fanout 2: groups {0,1} {2,3} {4,5}, {0,2} {4,6}, {0,4} on top
    results = run_ranks(tree_reductions, world, backend, 2, timeout=120)
    for rank, res in enumerate(results):
        assert res["sums"] == [float(sum(range(world))), float(world)]
        assert res["everyone"] is True and res["one_says_no"] is False
        assert res["highest"] == world - 1
        assert res["gathered"] == [{"rank": r, "payload": "x" * r} for r in range(world)]
        assert res["told"] == f"from {world - 2}"
        assert res["group_sizes"] == [2], "a control collective ran on a group larger than the fanout"
    # Rank 0 reduces and passes the result down at each of its three levels; rank 6 only takes part in {4, 6}.
    assert results[0]["calls"] > results[6]["calls"] > 0


@pytest.mark.long  # .ci/run: on gloo in the long stage, and in the nccl_model stage
def test_the_tree_root_dying_between_the_votes_is_recovered_equal_to_the_failure_free_run():
    # Fanout 2 over 6 ranks: three levels, rank 0 at the top of each. It dies inside DeepSpeed's optimizer step of
    # step 3, between the ready and commit votes, so every survivor's commit vote is abandoned mid-tree; the step is
    # rolled back and run again, and the new generation (5 ranks) votes over a tree of its own.
    results = run((2, 2, 2), 1, [fault(0, 3, "in_optimizer")], redundancy=2, control_fanout=2)
    assert 0 not in results
    assert_equivalent(results)
    assert_lossless_and_minimal(results, (1, 2, 2))
    assert all(e["rolled_back"] for copies in events_of(results) for e in copies)


def groups_under_a_bound_default_group(rank, world):
    from ntp_ds.comm import groups, wire
    from ntp_ds.layout import Topology, plan_gradient_sync
    from tests.helpers.training import tiny_config

    dist.init_process_group("gloo", rank=rank, world_size=world)
    default = dist.distributed_c10d._get_default_group()
    default.bound_device_id = torch.device("cpu", 0)  # as DeepSpeed's init_distributed binds the GPU under CUDA
    try:
        groups.start_generation(30.0, 2)
        topology = Topology.from_degrees(tiny_config().units(), (2, 1))
        built = groups.build_groups(topology, plan_gradient_sync(topology), rank, 30.0)
        summed = wire.all_reduce(torch.ones(1), built.tp_group).item()
        return {"vote": wire.vote(True), "tp_sum": summed, "bound": str(default.bound_device_id)}
    finally:
        wire.teardown()


def test_groups_are_built_among_their_members_when_the_default_group_is_bound_to_a_device():
    # Bound, torch builds every later group as a split of the default group's communicator, which all ranks must
    # join: groups built by their members alone would wait forever under NCCL (here, on CPU, torch refuses at once).
    results = run_ranks(groups_under_a_bound_default_group, 3, timeout=120)
    assert [r["tp_sum"] for r in results] == [2.0, 2.0, 1.0]
    assert all(r["vote"] is True and r["bound"] == "cpu:0" for r in results)


def groups_after_unequal_histories(rank, world):
    from datetime import timedelta

    from ntp_ds.comm import groups, wire

    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        timeout = timedelta(seconds=30)
        # Rank 0 holds two more groups than the others (as a rank that kept groups a peer did not, or an older member
        # beside a joiner); torch's own members-only groups would then be named apart on rank 0.
        extra = [groups.named_group(f"only-mine/{i}", [0], timeout) for i in range(2)] if rank == 0 else []
        pair = groups.named_group("pair", [0, 1], timeout)
        every = groups.named_group("every", range(world), timeout)
        pair_sum = wire.all_reduce(torch.ones(1), pair).item() if pair is not None else None
        return {"pair": pair_sum, "every": wire.all_reduce(torch.ones(1), every).item(), "extra": len(extra),
                "ranks": dist.get_process_group_ranks(every), "group_rank": dist.get_rank(every)}
    finally:
        wire.teardown()


def test_named_groups_meet_whatever_groups_each_member_already_holds():
    results = run_ranks(groups_after_unequal_histories, 3, timeout=120)
    assert [r["pair"] for r in results] == [2.0, 2.0, None]  # rank 2 is no member, and waited for nobody
    assert [r["every"] for r in results] == [3.0, 3.0, 3.0]
    assert [r["extra"] for r in results] == [2, 0, 0]
    assert all(r["ranks"] == [0, 1, 2] for r in results) and [r["group_rank"] for r in results] == [0, 1, 2]


def join_after_a_peer_that_shares_no_group_with_it(rank, world, backend):
    """Fanout 2 over 3 ranks: tree groups {0, 1} and {0, 2}. Rank 2 joins the generation only once rank 1 has joined
    it, which rank 1 can do only if joining connected it to nobody outside its own groups (the default group
    connecting every pair would hold rank 1 until rank 2 came)."""
    import os
    from datetime import timedelta

    from ntp_ds.comm import wire
    from ntp_ds.control.store import connect_from_env
    from ntp_ds.engine.config import NTPConfig
    from ntp_ds.engine.initialize import join_world

    os.environ["NTP_TEST_BACKEND"] = backend
    if backend == "nccl_model":
        import ntp_ds.testing.nccl_model  # noqa: F401  (registers the backend)
    store = connect_from_env(30.0)
    if rank == 2:
        store.wait(["joined/1"], timedelta(seconds=20))  # raises if rank 1 could not join without rank 2
    join_world(NTPConfig(tp=1, replicas=world, control_fanout=2), store, 0, rank, world)
    if rank == 1:
        store.set("joined/1", "1")
    try:
        total = wire.sum_counts([1.0])  # along the tree: every rank took part
    finally:
        wire.teardown()
    return total


def test_a_rank_joins_a_generation_without_connecting_to_ranks_outside_its_groups():
    # gloo: a generation's default group larger than one control group connects nobody. (Under NCCL it is created
    # unbound and never carries an op: tests/test_kept_groups.py reads the communicators each rank created.)
    results = run_ranks(join_after_a_peer_that_shares_no_group_with_it, 3, "gloo", timeout=90, store=True)
    assert results == {0: [3.0], 1: [3.0], 2: [3.0]}
