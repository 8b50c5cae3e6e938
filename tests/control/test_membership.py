"""Membership agreement: the pure decision, the replica mapping, and the store protocol under concurrency."""

from __future__ import annotations

import json
import multiprocessing as mp
import threading
import time

import pytest
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st

from ntp_ds.control.membership import (
    BarrierTimeout,
    BarrierWait,
    Evicted,
    FailureReport,
    Membership,
    MembershipChange,
    MembershipTimeout,
    SETTLE_EXTENSIONS,
    NodeLocal,
    StaleGeneration,
    barrier,
    decide,
    missing_ranks,
)
from ntp_ds.control.store import connect_store, host_store
from ntp_ds.layout import ModelUnits, Topology
from ntp_ds.layout.generation import replica_membership
from tests.helpers.clock import FakeClock

UNITS = ModelUnits(heads=8, kv_heads=4, ffn=16, vocab=32)


def run_threads(fn, n, timeout=10.0):
    """Run fn(i) on n threads started together; return results in order, failing on error or overrun."""
    out, errors, start = [None] * n, [], threading.Barrier(n)

    def body(i):
        try:
            start.wait(timeout)
            out[i] = fn(i)
        except BaseException as err:  # handed to the test thread
            errors.append(err)

    threads = [threading.Thread(target=body, args=(i,), daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    assert not any(t.is_alive() for t in threads), "a thread overran its bound"
    if errors:
        raise errors[0]
    return out


# -- pure ------------------------------------------------------------------------------------------------------

def test_decide_merges_reports_into_one_change():
    reports = [FailureReport(0, frozenset({3}), 100.5, "collective error", {3: 0.5}),
               FailureReport(1, frozenset({3, 5}), 101.0, "heartbeat timeout", {3: 1.5, 5: 2.0}),
               FailureReport(2, frozenset({9}), 100.0, "collective error")]  # 9 is not a member
    change = decide(4, range(8), reports)
    assert change.generation == 5
    assert change.dead == {3, 5}
    assert change.survivors == (0, 1, 2, 4, 6, 7)
    assert change.detected_at == ((3, 100.5), (5, 101.0))
    assert change.detection_s == pytest.approx(2.0)  # rank 3: the shorter silence (0.5 s); rank 5: 2.0 s
    assert change.reason == "collective error; heartbeat timeout"
    assert MembershipChange.decode(change.encode()) == change
    assert change.new_rank(4) == 3


def test_decide_rejects_reports_naming_no_member():
    with pytest.raises(ValueError, match="no current member"):
        decide(0, [0, 1], [FailureReport(0, frozenset({7}), 1.0, "x")])


def test_replica_membership_maps_dead_ranks_to_replicas():
    topo = Topology.from_degrees(UNITS, (4, 4, 2))  # ranks 0-3, 4-7, 8-9
    rm = replica_membership(topo, {1, 2, 8, 9})
    assert rm.lost == {0: frozenset({1, 2}), 2: frozenset({0, 1})}
    assert rm.gone == (2,)
    assert rm.degraded == (0,)
    assert rm.layouts[0] == topo.layouts[0].without_ranks({1, 2})
    assert rm.layouts[1] == topo.layouts[1]
    assert rm.members == {0: (0, 3), 1: (4, 5, 6, 7)}
    assert rm.below(3) == (0,)
    assert rm.topology().degrees == (2, 4)
    assert rm.ranks() == (0, 3, 4, 5, 6, 7)
    assert rm.topology(drop=[0]).degrees == (4,) and rm.ranks(drop=[0]) == (4, 5, 6, 7)


def test_replica_membership_after_an_earlier_change_uses_launch_ranks():
    topo = Topology.from_degrees(UNITS, (3, 4))
    members = (0, 1, 3, 4, 5, 6, 7)  # launch rank 2 died in an earlier generation
    rm = replica_membership(topo, {4}, members)
    assert rm.lost == {1: frozenset({0})}
    assert rm.members == {0: (0, 1, 3), 1: (5, 6, 7)}
    with pytest.raises(ValueError, match=r"dead ranks \[2\] are not members"):
        replica_membership(topo, {2}, members)
    with pytest.raises(ValueError, match="members lists 3 ranks"):
        replica_membership(topo, {0}, (0, 1, 3))


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 4), min_size=1, max_size=4), st.data())
def test_replica_membership_partitions_the_dead(degrees, data):
    topo = Topology.from_degrees(UNITS, degrees)
    dead = data.draw(st.frozensets(st.integers(0, topo.world_size - 1)))
    rm = replica_membership(topo, dead)
    lost_global = {topo.ranks_of(r)[i] for r, tps in rm.lost.items() for i in tps}
    assert lost_global == dead
    for r, t in enumerate(degrees):
        assert (r in rm.gone) == (len(rm.lost.get(r, ())) == t)
        if r not in rm.gone:
            assert rm.layouts[r].tp == t - len(rm.lost.get(r, ()))
            assert len(rm.members[r]) == rm.layouts[r].tp
    assert sorted(rm.ranks()) == sorted(set(range(topo.world_size)) - dead)


# -- store protocol ----------------------------------------------------------------------------------------------

def test_one_report_becomes_the_decision_every_rank_reads():
    store = dist.HashStore()
    views = [Membership(store, r, range(4), settle_s=0.0, poll_s=0.001) for r in range(4)]
    assert not views[1].pending()
    assert views[0].report_failure(0, {2}, 10.0, "collective error", {2: 0.5})
    assert views[1].pending()
    changes = [v.await_decision(0, timeout_s=2.0) for v in views if v.rank != 2]
    assert len(set(changes)) == 1
    assert changes[0] == MembershipChange(1, frozenset({2}), (0, 1, 3), 0.5, "collective error", ((2, 10.0),))


def test_concurrent_proposers_commit_one_decision_threads():
    store = dist.HashStore()
    n = 8
    views = [Membership(store, r, range(n), settle_s=0.0, poll_s=0.001) for r in range(n)]

    def propose(i):  # no settle window: every proposer races compare_set with its own view of the reports
        views[i].report_failure(0, {i}, 1.0 + i, f"rank {i} saw itself fail")
        return views[i].await_decision(0, timeout_s=5.0)

    changes = run_threads(propose, n)
    assert len(set(changes)) == 1
    assert store.get("decision/0").decode() == changes[0].encode()


def test_settle_window_gathers_concurrent_reports():
    store = dist.HashStore()
    views = [Membership(store, r, range(6), settle_s=0.3, poll_s=0.005) for r in range(6)]

    def propose(i):
        if i < 3:
            views[i].report_failure(0, {i + 3}, 1.0, "collective error")
        return views[i].await_decision(0, timeout_s=5.0)

    changes = run_threads(propose, 6)
    assert len(set(changes)) == 1
    assert changes[0].dead == {3, 4, 5} and changes[0].survivors == (0, 1, 2)


def test_the_decision_does_not_wait_out_the_settle_window_once_every_live_member_reported():
    # A 30 s settle window: every member but the dead one reports at once, so nobody is left to add a death.
    store = dist.HashStore()
    views = [Membership(store, r, range(4), settle_s=30.0, poll_s=0.005) for r in range(4)]
    t0 = time.monotonic()

    def propose(i):
        views[i].report_failure(0, {3}, 1.0, "collective error")
        return views[i].await_decision(0, timeout_s=60.0)

    changes = run_threads(propose, 3)
    assert len(set(changes)) == 1 and changes[0].dead == {3}
    assert time.monotonic() - t0 < 5.0
    # One member silent: the window runs (here 0.3 s) before the union is committed.
    store = dist.HashStore()
    views = [Membership(store, r, range(4), settle_s=0.3, poll_s=0.005) for r in range(4)]
    t0 = time.monotonic()
    views[0].report_failure(0, {3}, 1.0, "collective error")
    assert views[0].await_decision(0, timeout_s=5.0).dead == {3}
    assert time.monotonic() - t0 >= 0.3


def test_reports_of_new_deaths_start_the_settle_window_again_up_to_a_bound():
    # Eight members, settle window 1 s, nobody else acknowledging: the deaths of one moment whose verdicts come
    # 0.8 s apart (a loaded host) join one decision; a stream of them is cut off SETTLE_EXTENSIONS windows on.
    def run(report_at: dict[float, int]) -> tuple[MembershipChange, float]:
        store, clock = dist.HashStore(), FakeClock(100.0)
        views = [Membership(store, r, range(8), settle_s=1.0, poll_s=0.05, clock=clock) for r in range(8)]
        wait = views[0].decision_wait(0, timeout_s=60.0)
        while True:
            for t in [t for t in report_at if t <= clock.now]:
                dead = report_at.pop(t)
                views[7 - dead].report_failure(0, {dead}, t, f"rank {dead} silent")
            outcome = wait.poll()
            if isinstance(outcome, MembershipChange):
                return outcome, clock.now
            clock.now += min(outcome, 0.05) or 0.05

    change, at = run({100.0: 7, 100.8: 6, 101.6: 5})  # each within a window of the last: one decision
    assert change.dead == {5, 6, 7} and 102.6 <= at < 102.8, (change.dead, at)
    change, at = run({100.0: 7, 101.5: 6})  # a report more than a window after the last: the next decision's
    assert change.dead == {7} and 101.0 <= at < 101.2, (change.dead, at)
    change, at = run({100.0 + 0.8 * i: 7 - i for i in range(6)})  # a stream: cut off after 1 + 2 windows
    assert at < 100.0 + 1.0 + SETTLE_EXTENSIONS + 0.2 and change.dead == {7, 6, 5, 4}, (change.dead, at)


@given(st.sets(st.integers(0, 300), min_size=1, max_size=120), st.sets(st.integers(0, 300), max_size=8))
@settings(max_examples=60, deadline=None)
def test_a_decision_survives_its_encoding_and_grows_with_the_gaps_not_the_members(survivors, dead):
    survivors = tuple(sorted(survivors - dead))
    if not survivors:
        return
    change = MembershipChange(3, frozenset(dead), survivors, 0.5, "why", tuple((r, 1.0) for r in sorted(dead)))
    assert MembershipChange.decode(change.encode()) == change
    gaps = sum(1 for a, b in zip(survivors, survivors[1:]) if b != a + 1)
    assert len(json.loads(change.encode())["survivor_runs"]) == gaps + 1  # whatever the number of ranks


@given(st.sets(st.integers(0, 300), min_size=2, max_size=120), st.lists(st.sets(st.integers(0, 310), max_size=6),
                                                                            min_size=1, max_size=4))
@settings(max_examples=80, deadline=None)
def test_decide_removes_exactly_the_reported_members(members, named):
    # decide works by bisection on the sorted members (they are W long): it must agree with the plain set rule.
    members = sorted(members)
    reports = [FailureReport(i, frozenset(ranks), 1.0, "x") for i, ranks in enumerate(named)]
    dead = set().union(*named) & set(members)
    if not dead or dead == set(members):
        return
    change = decide(0, members, reports)
    assert change.dead == dead and change.survivors == tuple(sorted(set(members) - dead))


@pytest.mark.parametrize("survivors, dead", [((0, 2, 1), ()), ((0, 1, 1), ()), ((0, 1, 2), (1,))])
def test_a_change_with_unsorted_repeated_or_dead_survivors_is_refused(survivors, dead):
    with pytest.raises(ValueError, match="sorted and distinct|both dead and surviving"):
        MembershipChange(1, frozenset(dead), survivors, 0.0, "x")


def test_a_death_every_survivor_sees_is_reported_once_and_acknowledged_by_all():
    # 16 survivors all see rank 16 die: one report entry (the first claimant's), 16 acknowledgements; the decision
    # needs no settle window, and each rank read one report, not sixteen.
    store = dist.HashStore()
    views = [Membership(store, r, range(17), settle_s=30.0, poll_s=0.002) for r in range(16)]
    start = time.monotonic()
    changes = run_threads(lambda i: (views[i].report_failure(0, {16}, 1.0 + i, f"seen by {i}", {16: 0.1 * i}),
                                     views[i].await_decision(0, timeout_s=20.0))[1], 16)
    assert time.monotonic() - start < 10.0
    assert len(set(changes)) == 1 and changes[0].dead == {16} and changes[0].survivors == tuple(range(16))
    assert store.add("membership/0/reports/count", 0) == 1 and store.get("membership/0/acks/done") == b"1"
    assert all(len(v.reports(0)) == 1 for v in views)
    # a second report of a death already claimed adds no entry, and acknowledges once
    store = dist.HashStore()
    a, b = (Membership(store, r, range(4), settle_s=0.0) for r in (0, 1))
    assert a.report_failure(0, {3}, 1.0, "x") and b.report_failure(0, {3}, 1.0, "y")
    assert a.report_failure(0, {3}, 2.0, "x")
    assert store.add("membership/0/reports/count", 0) == 1 and not store.check(["membership/0/acks/done"])
    assert sorted(r for r in range(4) if store.check([f"membership/0/acks/{r}"])) == [0, 1, 3]  # 3: by its claimant
    assert b.report_failure(0, {2, 3}, 3.0, "z") and [sorted(r.ranks) for r in b.reports(0)] == [[3], [2]]


def test_a_death_read_in_a_report_already_is_not_claimed_again():
    # Rank 0 reports rank 3; ranks 1 and 2 have read that report (during their detection) before they report the
    # same death: they only acknowledge, and rank 3's claim key has one writer, not one per survivor.
    store = _Writers(dist.HashStore())
    views = [Membership(store, r, range(4), settle_s=30.0) for r in range(3)]
    store.rank = 0
    assert views[0].report_failure(0, {3}, 1.0, "seen by 0")
    for r in (1, 2):
        store.rank = r
        assert [sorted(x.ranks) for x in views[r].reports(0)] == [[3]]
        assert views[r].report_failure(0, {3}, 2.0, f"seen by {r}")
    assert store.writers["membership/0/dead/3"] == {0}
    assert store.get("membership/0/acks/done") == b"1"  # every live member acknowledged, 3 by its claimant
    assert views[2].await_decision(0, 5.0).dead == {3}
    # A death known only from the fence log is acknowledged, not claimed (its fencer claims it).
    store = _Writers(dist.HashStore())
    a, b = (Membership(store, r, range(4), settle_s=30.0) for r in (0, 1))
    store.rank = 1
    assert b.report_failure(0, {3}, 1.0, "fenced by 0", fenced={3})
    assert "membership/0/dead/3" not in store.writers and store.check(["membership/0/acks/1"])
    store.rank = 0
    assert a.report_failure(0, {3}, 1.0, "seen by 0")
    assert store.writers["membership/0/dead/3"] == {0} and [sorted(x.ranks) for x in a.reports(0)] == [[3]]


def test_one_rank_commits_and_the_others_read_its_decision():
    # 64 members, rank 63 dies, every survivor sees it: one claims it and files the report; the acknowledgements
    # complete the moment the last survivor acknowledges (its claimant acknowledged for the dead), and the decision
    # key is written by that last one alone (it was written by every survivor whose settle window ran out).
    store = _Writers(dist.HashStore())
    views = [Membership(store, r, range(64), settle_s=30.0, poll_s=0.002) for r in range(63)]

    def agree(i):
        store.rank = i
        views[i].report_failure(0, {63}, 1.0, "exit code -9")
        return views[i].await_decision(0, timeout_s=20.0)

    start = time.monotonic()
    changes = run_threads(agree, 63)
    assert time.monotonic() - start < 10.0  # not the 30 s settle window: everyone had acknowledged
    assert len(set(changes)) == 1 and changes[0].dead == {63}
    assert len(store.compare_sets) == 1 and store.compare_sets == store.writers["membership/0/acks/done"]


def test_the_others_commit_when_the_reporter_never_does():
    # The reporter files its report and dies before committing: the others commit after twice the settle window.
    store = dist.HashStore()
    reporter, *others = (Membership(store, r, range(4), settle_s=0.05, poll_s=0.002) for r in range(3))
    reporter.report_failure(0, {3}, 1.0, "exit code -9")
    changes = run_threads(lambda i: (others[i].report_failure(0, {3}, 1.0, "x"),
                                     others[i].await_decision(0, timeout_s=5.0))[1], 2)
    assert changes[0] == changes[1] and changes[0].dead == {3}


def _propose_in_process(address, rank, n, results):
    store = connect_store(address, 10.0)
    view = Membership(store, rank, range(n), settle_s=0.0, poll_s=0.002)
    barrier(store, "start", rank, range(n), 20.0, poll_s=0.002)  # race the proposals against each other
    view.report_failure(0, {rank}, float(rank), "self report")
    results.put((rank, view.await_decision(0, timeout_s=20.0).encode()))


def test_concurrent_proposers_commit_one_decision_processes():
    store, address = host_store(timeout_s=20.0)
    n, ctx = 3, mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_propose_in_process, args=(address, r, n, results), daemon=True) for r in range(n)]
    for p in procs:
        p.start()
    try:
        got = dict(results.get(timeout=30.0) for _ in range(n))
    finally:
        for p in procs:
            p.join(5.0)
            if p.is_alive():
                p.kill()
    assert len(set(got.values())) == 1
    assert got[0] == store.get("decision/0").decode()


def test_stale_generation_is_ignored():
    store = dist.HashStore()
    a, b = (Membership(store, r, range(3), settle_s=0.0, poll_s=0.001) for r in (0, 1))
    a.report_failure(0, {2}, 1.0, "x")
    change = a.await_decision(0, 1.0)
    assert run_threads(lambda i: (a, b)[i].confirm(change, 2.0), 2) == [True, True]
    assert a.generation == b.generation == 1
    assert a.report_failure(0, {1}, 2.0, "late") is False
    assert not store.check(["membership/1/reports/count"])
    assert a.confirm(change, 1.0) is False  # an old decision changes nothing
    assert a.members == (0, 1)
    with pytest.raises(StaleGeneration):
        a.await_decision(0, 1.0)
    with pytest.raises(ValueError, match="ahead"):
        a.report_failure(2, {1}, 2.0, "x")


def test_a_rank_keeps_the_decisions_of_two_generations_not_of_every_one():
    # 50 generations (grown memberships, as joins commit them): what a rank keeps does not grow with the job's age.
    store = dist.HashStore()
    m = Membership(store, 0, range(4), settle_s=0.0, poll_s=0.001)
    for g in range(50):
        change = MembershipChange(g + 1, frozenset(), tuple(range(4 + g + 1)), 0.0, f"rank {4 + g} joined")
        assert m.commit(change) == change
        m.adopt(change)
    assert m.generation == 50 and sorted(m._decided) == [49]
    m.report_failure(50, {3}, 1.0, "x")
    change = m.await_decision(50, 1.0)
    assert sorted(m._decided) == [49, 50] and sorted(m._read) == [50]
    m.adopt(change)
    assert sorted(m._decided) == [50] and sorted(m._read) == [50]
    with pytest.raises(StaleGeneration):
        m.decision(49)


def test_report_after_decision_is_ignored_and_must_be_repeated():
    store = dist.HashStore()
    v = Membership(store, 0, range(4), settle_s=0.0, poll_s=0.001)
    v.report_failure(0, {3}, 1.0, "x")
    change = v.await_decision(0, 1.0)
    assert v.report_failure(0, {2}, 1.5, "y") is False
    assert change.dead == {3}
    assert v.report_failure(0, {3}, 1.0, "x") is False  # still generation 0 locally, but decided


def test_barrier_excludes_dead_ranks():
    store = dist.HashStore()
    v = [Membership(store, r, range(4), settle_s=0.0, poll_s=0.001) for r in range(4)]
    v[0].report_failure(0, {1}, 1.0, "heartbeat timeout")
    change = v[0].await_decision(0, 1.0)
    # rank 1 is dead and never calls confirm; the survivors pass anyway
    assert run_threads(lambda i: v[[0, 2, 3][i]].confirm(change, 3.0), 3) == [True] * 3
    assert all(x.generation == 1 and x.members == (0, 2, 3) for x in (v[0], v[2], v[3]))


def test_barrier_times_out_naming_missing_survivor():
    store = dist.HashStore()
    v = [Membership(store, r, range(3), settle_s=0.0, poll_s=0.001) for r in range(3)]
    v[1].report_failure(0, {0}, 1.0, "crash")
    change = v[1].await_decision(0, 1.0)
    t0 = time.monotonic()
    with pytest.raises(BarrierTimeout) as err:
        v[1].confirm(change, 0.3)
    assert 0.3 <= time.monotonic() - t0 < 2.0
    assert err.value.missing == {2}
    assert v[1].generation == 1  # adopted: rank 2 is reported in generation 1
    assert v[1].report_failure(1, err.value.missing, 2.0, "missed the barrier")


def test_barrier_counts_a_repeated_arrival_once():
    store = dist.HashStore()
    with pytest.raises(BarrierTimeout):
        barrier(store, "b", 0, [0, 1], 0.05, poll_s=0.001)
    with pytest.raises(BarrierTimeout):
        barrier(store, "b", 0, [0, 1], 0.05, poll_s=0.001)
    barrier(store, "b", 1, [0, 1], 0.5, poll_s=0.001)


class _Writers:
    """A store client that records, per key, which ranks wrote it (`add` of a non-zero amount, `set`), and which
    ranks proposed a decision (`compare_set` on `decision/...`); `rank` is the calling thread's."""

    def __init__(self, store):
        self._store, self.writers, self.compare_sets, self._local = store, {}, set(), threading.local()

    @property
    def rank(self):
        return getattr(self._local, "rank", None)

    @rank.setter
    def rank(self, value):
        self._local.rank = value

    def add(self, key, amount):
        if amount:
            self.writers.setdefault(key, set()).add(self.rank)
        return self._store.add(key, amount)

    def set(self, key, value):
        self.writers.setdefault(key, set()).add(self.rank)
        return self._store.set(key, value)

    def compare_set(self, key, expected, desired):
        if key.startswith("decision/") and (expected, desired) != ("\0", "\0"):  # (not a read: `present_values`)
            self.compare_sets.add(self.rank)
        return self._store.compare_set(key, expected, desired)

    def __getattr__(self, name):
        return getattr(self._store, name)


@given(st.integers(1, 1500), st.data())
@settings(max_examples=25, deadline=None)
def test_a_barrier_of_many_ranks_ends_when_the_last_arrives_and_no_key_has_more_than_32_writers(n, data):
    ranks = sorted(data.draw(st.sets(st.integers(0, 3 * n), min_size=n, max_size=n)))
    order = data.draw(st.permutations(ranks))
    store = _Writers(dist.HashStore())
    waits = []
    for rank in order:
        assert not waits or waits[0].poll() is not None  # not over before the last arrival
        store.rank = rank
        waits.append(BarrierWait(store, "b", rank, ranks, 60.0))
    assert all(w.poll() is None for w in waits)
    assert max(len(w) for w in store.writers.values()) <= 32
    # each rank writes its mark and its leaf; each counter below the root climbs once, filled; the root's filler
    # sets the end: about 2 + 1/31 writes per rank
    climbs, width = 1, n
    while width > 32:
        width = -(-width // 32)
        climbs += width
    assert sum(len(w) for w in store.writers.values()) == 2 * n + climbs


def test_a_barrier_that_runs_out_names_exactly_the_ranks_that_never_came():
    ranks = list(range(100))
    store, clock = dist.HashStore(), FakeClock()
    waits = [BarrierWait(store, "b", r, ranks, 5.0, clock=clock) for r in ranks if r not in (7, 64, 99)]
    assert waits[0].poll() is not None
    clock.now += 5.0
    with pytest.raises(BarrierTimeout) as err:
        waits[0].poll()
    assert err.value.missing == {7, 64, 99}


@given(st.integers(1, 3000), st.sets(st.integers(0, 2999), max_size=6), st.sampled_from([2, 4, 32]))
@settings(max_examples=40, deadline=None)
def test_a_timed_out_barrier_finds_its_missing_ranks_down_the_counters_in_requests_that_grow_with_them(n, gone, fanout):
    # Every rank of a barrier that times out names the missing ranks: exactly those that never came, in requests
    # bounded by the missing times the fanout and the tree's depth, not by the barrier's ranks.
    ranks = list(range(0, 2 * n, 2))  # (ranks need not be 0..n-1)
    missing = {ranks[i] for i in gone if i < n}
    store = dist.HashStore()
    for r in ranks:
        if r not in missing:
            BarrierWait(store, "b", r, ranks, 60.0, fanout=fanout)
    counted = _Requests(store)
    assert missing_ranks(counted, "b", ranks, fanout) == missing
    depth = 1
    while fanout ** depth < n:
        depth += 1
    assert counted.n <= 1 + len(missing) * (fanout * depth + fanout), (counted.n, n, len(missing))


class _Requests:
    """A store client that counts its requests."""

    def __init__(self, store):
        self._store, self.n = store, 0

    def __getattr__(self, name):
        method = getattr(self._store, name)

        def counted(*args, **kwargs):
            self.n += 1
            return method(*args, **kwargs)
        return counted


@given(st.integers(2, 8), st.integers(3, 300), st.data())
@settings(max_examples=25, deadline=None)
def test_a_barrier_met_through_node_stores_ends_with_its_last_arrival_at_a_few_job_requests_per_node(size, n, data):
    # Ranks on nodes of `size` (some dead: not in the barrier), each node with its own store; a joiner outside the
    # node numbering arrives alone. The barrier ends exactly at the last arrival, every counter has at most 32
    # writers, the job's store sees about two writes per node, and only one rank per node polls it.
    ranks = sorted(data.draw(st.sets(st.integers(0, 2 * n), min_size=n, max_size=n)))
    joiner = 10 * n + size * 100
    everyone = ranks + [joiner]
    order = data.draw(st.permutations(everyone))
    job = _Writers(dist.HashStore())
    counted = _Requests(job)
    nodes = {r // size: NodeLocal(dist.HashStore(), size) for r in ranks}
    waits = {}
    for rank in order:
        assert not waits or all(w.poll() is not None for w in waits.values())
        job.rank = rank
        waits[rank] = BarrierWait(counted, "b", rank, everyone, 60.0,
                                  node=None if rank == joiner else nodes[rank // size])
    for w in waits.values():  # a closer copies the end into its node's store as it sees it
        w.poll()
    assert all(w.poll() is None for w in waits.values())
    assert max(len(w) for w in job.writers.values()) <= 32
    writes = sum(len(w) for w in job.writers.values())
    assert writes <= 4 * (len(nodes) + 1) + len(everyone) // 31 + 2
    assert sum(w.closer for w in waits.values()) == len(nodes) + 1  # one per node, and the joiner


def test_a_node_barrier_counts_a_repeated_arrival_once_and_names_only_the_missing_of_an_incomplete_node():
    ranks = list(range(8))  # nodes of 4: ranks 0-3 and 4-7
    job, clock = dist.HashStore(), FakeClock()
    nodes = [NodeLocal(dist.HashStore(), 4) for _ in range(2)]
    ranks = list(range(8)) + [20]  # and a joiner, without a node store
    waits = [BarrierWait(job, "b", r, ranks, 10.0, clock=clock, node=nodes[r // 4] if r < 8 else None)
             for r in ranks if r != 6]
    again = BarrierWait(job, "b", 5, ranks, 10.0, clock=clock, node=nodes[1])  # counted once
    assert nodes[1].store.add("b/count", 0) == 3 and not again.closer
    assert all(w.poll() is not None for w in waits)
    clock.now += 5.0  # half the bound, a slow barrier: the waiting ranks mark themselves in the job's store
    assert all(w.poll() is not None for w in waits)
    clock.now += 5.0
    for w in (waits[0], waits[-1]):  # a node's rank, and the joiner, who knows nothing of nodes
        with pytest.raises(BarrierTimeout) as err:
            w.poll()
        assert err.value.missing == {6}  # not its whole node
    # rank 6 comes late: its node completes, and the end reaches every rank
    late = BarrierWait(job, "b", 6, ranks, 10.0, clock=clock, node=nodes[1])
    assert late.closer and late.poll() is None
    assert all(w.poll() is None for w in waits[4:])
    assert all(w.poll() is None for w in waits)


def test_await_decision_is_bounded_without_reports():
    v = Membership(dist.HashStore(), 0, range(2), poll_s=0.01)
    t0 = time.monotonic()
    with pytest.raises(MembershipTimeout, match="generation 0"):
        v.await_decision(0, 0.2)
    assert time.monotonic() - t0 < 1.5


def test_evicted_rank_learns_it_must_leave():
    store = dist.HashStore()
    alive, hung = Membership(store, 0, range(2), settle_s=0.0), Membership(store, 1, range(2))
    alive.report_failure(0, {1}, 1.0, "heartbeat timeout")
    change = hung.await_decision(0, 1.0)  # the hung rank wakes up and reads the decision
    with pytest.raises(Evicted, match="rank 1 was declared dead"):
        hung.confirm(change, 1.0)


def test_confirm_rejects_an_uncommitted_change():
    store = dist.HashStore()
    v = Membership(store, 0, range(3))
    forged = MembershipChange(1, frozenset({2}), (0, 1), 0.0, "forged")
    with pytest.raises(ValueError, match="not the committed decision"):
        v.confirm(forged, 1.0)
    with pytest.raises(ValueError, match="skips"):
        v.confirm(MembershipChange(3, frozenset({2}), (0, 1), 0.0, "x"), 1.0)


def test_a_waiter_reads_each_report_once_and_a_counted_entry_not_yet_written_later():
    class Counting:
        def __init__(self):
            self.store, self.gets = dist.HashStore(), []

        def __getattr__(self, name):
            return getattr(self.store, name)

        def get(self, key):
            self.gets.append(key)
            return self.store.get(key)

        def multi_get(self, keys):
            self.gets += keys
            return self.store.multi_get(keys)

        def compare_set(self, key, expected, desired):  # (a read of one key that may not exist)
            if key.startswith("membership/0/reports/") and key.rsplit("/", 1)[1].isdigit():  # (an entry's fetch)
                self.gets.append(key)
            return self.store.compare_set(key, expected, desired)

    store = Counting()
    reporters = [Membership(store, r, range(8)) for r in range(4)]
    watcher = Membership(store, 7, range(8))
    for m, dead in zip(reporters[:3], (5, 6, 4)):
        m.report_failure(0, {dead}, 1.0, "no heartbeat")
    assert [r.reporter for r in watcher.reports(0)] == [0, 1, 2]
    assert watcher.reports(0) == watcher.reports(0) and len(store.gets) == 3, "nothing new: nothing fetched again"
    store.store.add("membership/0/reports/count", 1)  # a reporter between counting its entry and writing it
    assert len(watcher.reports(0)) == 3
    store.store.set("membership/0/reports/4", FailureReport(3, frozenset({5}), 1.0, "silent", {}).encode())
    store.gets.clear()
    assert [r.reporter for r in watcher.reports(0)] == [0, 1, 2, 3]
    assert store.gets == ["membership/0/reports/4"], "only the new entry is fetched"


def _listening_families(port: int) -> set[str]:
    """Which of /proc/net/tcp (IPv4) and /proc/net/tcp6 list a socket listening on `port` (state 0A)."""
    found = set()
    for table in ("tcp", "tcp6"):
        with open(f"/proc/net/{table}") as f:
            for line in f.readlines()[1:]:
                fields = line.split()
                if int(fields[1].rsplit(":", 1)[1], 16) == port and fields[3] == "0A":
                    found.add(table)
    return found


def test_a_store_hosted_on_an_ipv4_address_listens_on_ipv4_and_serves_its_clients():
    # The TCPStore server names each client by a reverse lookup in its event loop; on a dual-stack socket a local
    # client is an IPv4-mapped address no hosts file lists, so each connection asked DNS (store.py, `_ipv4_listener`).
    store, address = host_store(0, "127.0.0.1", timeout_s=10.0)
    assert _listening_families(store.port) == {"tcp"}
    clients = [connect_store(address, 10.0) for _ in range(3)]
    clients[0].set("k", "v")
    assert [c.get("k") for c in clients] == [b"v"] * 3
    assert clients[2].add("n", 2) == 2 and store.add("n", 0) == 2


@given(st.integers(2, 4), st.integers(2, 6), st.integers(0, 3), st.data())
@settings(max_examples=300, deadline=None)
def test_acknowledgements_through_node_stores_end_exactly_when_every_member_is_accounted_for(size, nodes, joiners,
                                                                                            data):
    # Launch ranks on `nodes` nodes of `size` (each with its own store), and joiners on none. Some die (whole nodes
    # among them, joiners too), each claimed by a live rank; one live rank is also falsely claimed and acknowledges
    # itself as well. Every live rank reports (the dead it knows of, claimed or already fenced) in a random order,
    # and every rank reads the reports filed so far: the acknowledgements end exactly at the call that completes
    # them (every claim made, every live rank not claimed acknowledged), no counter of their tree is ever counted
    # past its size, and with nodes alone no rank's own acknowledgement reaches the job's store.
    from ntp_ds.control.node_local import NodeLocal

    world = size * nodes
    members = list(range(world)) + list(range(world, world + joiners))
    dead = sorted(data.draw(st.sets(st.sampled_from(members), min_size=1, max_size=len(members) - 1)))
    live = [r for r in members if r not in dead]
    falsely = data.draw(st.sampled_from([None] + live)) if len(live) > 1 else None
    claimed = dead + ([falsely] if falsely is not None else [])
    claimant = {d: data.draw(st.sampled_from([r for r in live if r != d])) for d in claimed}
    job = _Writers(dist.HashStore())
    locals_ = {n: dist.HashStore() for n in range(nodes)}
    views = {r: Membership(job, r, members, settle_s=60.0,
                           node=NodeLocal(locals_[r // size], size, world) if r < world else None) for r in live}
    order = data.draw(st.permutations(live))
    acks = "membership/0/acks"
    for i, rank in enumerate(order):
        job.rank = rank
        mine = {d for d, c in claimant.items() if c == rank}
        views[rank].report_failure(0, mine or set(claimed), 1.0, "x", fenced=set() if mine else set(claimed))
        # every view reads the reports filed so far (as its decision wait would) and closes what it can
        for r in order[:i + 1]:
            job.rank = r
            views[r].reports(0)
            if views[r]._close_nodes(0):  # (as its decision wait does: the last acknowledgement commits)
                views[r]._commit(0, views[r].reports(0))
        done = job._store.check([f"{acks}/done"])
        called = set(order[:i + 1])  # (a falsely claimed rank is acknowledged by its claimant: its own is not due)
        due = all(r in called for r in live if r != falsely) and all(claimant[d] in called for d in claimed)
        assert done == due, f"acknowledgements ended={done} after {i + 1} of {len(order)} calls"
    leaves = [k for k in job.writers if k.startswith(f"{acks}/c/0/")]
    for k in leaves:
        index = int(k.rsplit("/", 1)[1])
        assert int(job._store.add(k, 0)) <= min(32, len(members) - 32 * index)
    by_node = joiners == 0
    assert any(k.startswith(f"{acks}/node/") for k in job.writers) == by_node  # (a joiner: rank by rank)
    if by_node:  # no rank's own acknowledgement reached the job's store
        assert not any(k.startswith(f"{acks}/") and k.rsplit("/", 1)[1].isdigit() and "/c/" not in k
                       and "/node/" not in k for k in job.writers)
    assert views[order[0]].decision(0).dead == frozenset(claimed)  # (committed by the last acknowledgement)
