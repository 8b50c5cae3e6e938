"""Failure domains: copies of a replica's state and its watchers go to other racks, so a rack lost whole loses no
state and is seen from outside it (pure logic; the rack-loss run is `test_rack_loss.py`)."""

from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ntp_ds.engine.config import ConfigError, env_racks
from ntp_ds.layout import ModelUnits, ShardLayout, Topology, plan_buddies, plan_gradient_sync
from ntp_ds.comm.groups import ring_neighbours
from ntp_ds.layout.domains import (Racks, copy_targets, domain_neighbours, failure_domain, replica_domains,
                                    spread_neighbours)
from ntp_ds.layout.generation import Generation

UNITS = ModelUnits(4, 2, 16, 16)


def _placed(degrees, racks: Racks) -> Topology:
    return Generation.initial(Topology.from_degrees(UNITS, degrees), racks=racks).topology


def test_a_rack_of_two_replicas_sends_each_copy_two_replicas_on_and_every_replica_holds_one():
    # nodes of 2 ranks, racks of 2 nodes, TP 2: replica r is node r, racks {0, 1}, {2, 3}, {4, 5}
    topo = _placed([2] * 6, Racks(node_size=2, rack_size=2))
    assert topo.domains == tuple(frozenset({r // 2}) for r in range(6))
    buddies = plan_buddies(topo, plan_gradient_sync(topo), 1, 1)
    assert buddies == {r: ((r + 4) % 12,) for r in range(12)}  # same TP index, two replicas on
    unplaced = Topology.from_degrees(UNITS, [2] * 6)
    assert plan_buddies(unplaced, plan_gradient_sync(unplaced), 1, 1) == {r: ((r + 2) % 12,) for r in range(12)}


@given(st.lists(st.sampled_from([4, 4, 2, 1]), min_size=2, max_size=14), st.integers(1, 3), st.integers(1, 4),
       st.integers(1, 3))
@settings(max_examples=200, deadline=None)
def test_copies_go_apart_from_their_anchor_wherever_some_replica_is(degrees, node_size, rack_size, copies):
    racks = Racks(node_size, rack_size)
    topo = _placed(degrees, racks)
    plan = plan_gradient_sync(topo)
    order = list(plan.anchors) + sorted(plan.anchor_of)
    copies = min(copies, len(order) - 1)
    targets = copy_targets(order, len(plan.anchors), copies, topo.domains)
    for a, others in zip(plan.anchors, targets):
        assert len(others) == len(set(others)) == copies and a not in others
        apart = [r for r in order if topo.domains[r].isdisjoint(topo.domains[a])]
        assert sum(r in apart for r in others) == min(copies, len(apart)), (a, others, apart)
    # every anchor rank has its copies, at the same TP index modulo the holder's degree
    buddies = plan_buddies(topo, plan, 1, copies)
    assert set(buddies) == {g for a in plan.anchors for g in topo.rank_range(a)}


def test_where_racks_are_alike_every_replica_keeps_as_many_copies_as_it_gives():
    topo = _placed([2] * 12, Racks(2, 3))  # 4 racks of 3 replicas
    plan = plan_gradient_sync(topo)
    targets = copy_targets(list(plan.anchors), len(plan.anchors), 2, topo.domains)
    held = Counter(r for others in targets for r in others)
    assert set(held.values()) == {2} and len(held) == 12
    assert all(topo.domains[a].isdisjoint(topo.domains[r]) for a, others in enumerate(targets) for r in others)


@given(st.lists(st.sampled_from([4, 2, 2, 1]), min_size=2, max_size=16), st.integers(1, 2), st.integers(1, 3))
@settings(max_examples=200, deadline=None)
def test_watchers_are_mutual_and_a_rack_lost_whole_is_watched_from_outside(degrees, node_size, rack_size):
    racks = Racks(node_size, rack_size)
    topo = _placed(degrees, racks)
    watched = {g: domain_neighbours(topo, g) for g in range(topo.world_size)}
    for g, peers in watched.items():
        assert g not in peers and all(g in watched[p] for p in peers)  # mutual
    rack_of = {g: racks.of(g) for g in range(topo.world_size)}
    replicas_in = Counter(min(d) for d in topo.domains)
    if max(replicas_in.values()) * 2 > len(degrees):
        return  # one rack holds more than half the replicas: some of its replicas neighbour each other
    for rack in set(rack_of.values()):
        lost = {g for g, r in rack_of.items() if r == rack}
        for g in lost:
            replica = topo.locate(g)[0]
            if topo.domains[replica] == frozenset({rack}):  # (a replica spanning racks is seen by its own)
                assert watched[g] - lost, (g, rack, watched[g])


@given(st.sets(st.integers(0, 95), min_size=2, max_size=96), st.integers(1, 4), st.integers(1, 3))
@settings(max_examples=200, deadline=None)
def test_the_rendezvous_watchers_are_mutual_and_see_a_rack_lost_whole_from_outside(members, node_size, rack_size):
    # Any members left (a generation after losses), in any racks: every member is watched by two (mutual), and
    # unless one rack holds more than half the members, each member's watchers live outside its rack. The plain
    # ring (no domains) puts a rack's ranks next to each other: only the two ends of its run are seen from outside.
    members = sorted(members)
    racks = Racks(node_size, rack_size)
    domain_of = failure_domain(racks, node_size)
    watched = {m: spread_neighbours(members, m, domain_of) for m in members}
    for m, peers in watched.items():
        assert m not in peers and peers <= set(members) and all(m in watched[p] for p in peers)
        assert len(peers) == min(2, len(members) - 1)
    per_rack = Counter(racks.of(m) for m in members)
    if max(per_rack.values()) * 2 <= len(members):
        for m, peers in watched.items():
            assert all(racks.of(p) != racks.of(m) for p in peers), (m, peers)
    assert spread_neighbours(members, members[0], None) == ring_neighbours(members, members[0])


def test_the_failure_domain_is_the_rack_else_the_node_else_none():
    assert failure_domain(Racks(8, 4), 8)(40) == 1 and failure_domain(None, 8)(40) == 5
    assert failure_domain(None, None) is None


def test_a_generation_after_a_rack_loss_stays_placed_and_plans_copies_across_the_racks_left():
    racks = Racks(2, 2)
    before = Generation.initial(Topology.from_degrees(UNITS, [2] * 6), racks=racks)
    after = before.after_loss({4, 5, 6, 7}, min_tp=1, number=1).after  # rack 1 (replicas 2 and 3) lost whole
    assert after.members == (0, 1, 2, 3, 8, 9, 10, 11) and after.racks == racks
    assert after.topology.domains == (frozenset({0}), frozenset({0}), frozenset({2}), frozenset({2}))
    buddies = plan_buddies(after.topology, plan_gradient_sync(after.topology), 1, 1)
    assert all(racks.of(after.members[g]) != racks.of(after.members[b]) for g, (b,) in buddies.items())
    joined, _ = after.after_join((12, 13), min_tp=1, number=2)  # a replacement node: a rack of its own
    assert joined.topology.domains is not None and joined.racks == racks


def test_a_100k_rank_job_in_racks_of_eight_replicas_plans_its_copies_and_watchers_in_linear_time():
    # 12,500 replicas x TP 8, nodes of 8, racks of 8 nodes. No clock is read: it runs in about a second, and an
    # O(R^2) plan would not end within the suite's timeout.
    units = ModelUnits(64, 8, 28672, 128256)
    topo = Generation.initial(Topology((ShardLayout.balanced(units, 8),) * 12_500), racks=Racks(8, 8)).topology
    buddies = plan_buddies(topo, plan_gradient_sync(topo), 1, 1)
    assert buddies[0] == (64,) and buddies[99_999] == (63,)  # 8 replicas (one rack) on, cyclically
    # the ring deals replicas 0..6249 to its even places and 6250..12499 to its odd ones: replica 0 sits between
    # replicas 12499 and 6250, both in other racks
    assert domain_neighbours(topo, 0) == {12_499 * 8, 6250 * 8}


def test_replica_domains_without_racks_is_none_and_a_replica_across_racks_names_both():
    topo = Topology.from_degrees(UNITS, [4, 2])
    assert replica_domains(topo, range(6), None) is None
    assert replica_domains(topo, range(6), Racks(2, 1)) == (frozenset({0, 1}), frozenset({2}))


@pytest.mark.parametrize("env, message", [
    ({"NTP_RACK_SIZE": "0", "NTP_NODE_SIZE": "2"}, "NTP_RACK_SIZE='0' must be a positive number"),
    ({"NTP_RACK_SIZE": "two", "NTP_NODE_SIZE": "2"}, "NTP_RACK_SIZE='two'"),
    ({"NTP_RACK_SIZE": "2"}, "needs the ranks per node: NTP_NODE_SIZE"),
])
def test_a_bad_rack_size_is_refused_naming_the_variable(env, message):
    with pytest.raises(ConfigError, match=message):
        env_racks(env)


def test_racks_come_from_the_launcher_or_from_torchrun_s_node_size():
    assert env_racks({}) is None
    assert env_racks({"NTP_RACK_SIZE": "4", "NTP_NODE_SIZE": "8"}) == Racks(8, 4)
    assert env_racks({"NTP_RACK_SIZE": "4", "LOCAL_WORLD_SIZE": "8"}) == Racks(8, 4)


def test_the_launcher_passes_the_rack_size_and_refuses_a_bad_one():
    from ntp_ds.supervise.launch import LaunchError, parse_args, worker_env

    spec = parse_args(["--nproc-per-node", "2", "--rack-size", "3", "-m", "ntp_ds.train"])
    env = worker_env(spec, 1, "127.0.0.1:1", ("127.0.0.1", 2), base={"DS_ACCELERATOR": "cpu"})
    assert env["NTP_RACK_SIZE"] == "3" and env_racks(env) == Racks(2, 3)
    with pytest.raises(LaunchError, match="--rack-size=0"):
        parse_args(["--rack-size", "0", "-m", "ntp_ds.train"])


def test_a_bad_launcher_rack_size_is_refused_naming_the_key():
    from ntp_ds.run.config import RunConfig

    cfg = RunConfig.from_dict({"parallel": {"tp": 2, "replicas": 2}, "launcher": {"rack_size": 0}})
    with pytest.raises(ConfigError, match="launcher.rack_size"):
        cfg.validate()
