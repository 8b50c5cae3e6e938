"""A node's ranks share their reads of the job's store (`NodeLocal.read`): one read per node, never a stale one."""

import threading
import time

import pytest
import torch.distributed as dist

from ntp_ds.control.membership import Membership
from ntp_ds.control.node_local import CLAIM_WAIT_S, NodeLocal
from ntp_ds.testing.liveness_load import CountingStore


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now

    def sleep(self, s):
        self.now += s


def _node(clock=None):
    clock = clock or Clock()
    return NodeLocal(dist.HashStore(), 4, clock=clock, sleep=clock.sleep), clock


def test_ranks_of_a_node_reading_within_the_age_share_one_read_and_an_older_copy_is_read_again():
    job = CountingStore(dist.HashStore())
    job.add("c", 5)
    node, clock = _node()
    assert node.read(job, ["c"], 0.1) == [b"5"]
    job.add("c", 1)  # (a change within the age is seen at the next read past it)
    clock.now += 0.05
    assert [node.read(job, ["c"], 0.1) for _ in range(3)] == [[b"5"]] * 3
    assert job.calls["multi_get"] == 1
    clock.now += 0.1
    assert node.read(job, ["c"], 0.1) == [b"6"]
    assert job.calls["multi_get"] == 2


def test_fixed_keys_are_kept_once_read_and_an_absence_only_for_the_age():
    job = CountingStore(dist.HashStore())
    node, clock = _node()
    assert node.read(job, ["e/1", "e/2"], 0.1, fixed=True, check=True) is None
    job.set("e/1", "a")
    job.set("e/2", "b")
    assert node.read(job, ["e/1", "e/2"], 0.1, fixed=True, check=True) is None  # absent, believed for the age
    clock.now += 0.2
    assert node.read(job, ["e/1", "e/2"], 0.1, fixed=True, check=True) == [b"a", b"b"]
    reads = job.calls["multi_get"]
    clock.now += 1000.0
    assert node.read(job, ["e/1", "e/2"], 0.1, fixed=True, check=True) == [b"a", b"b"]
    assert job.calls["multi_get"] == reads


def test_counters_are_created_by_the_first_read_and_checked_no_more_once_a_copy_shows_them():
    job = CountingStore(dist.HashStore())
    node, clock = _node()
    assert node.read(job, ["a", "b"], 0.05, create=True) == [b"0", b"0"]
    job.add("a", 3)
    clock.now += 0.1
    assert node.read(job, ["a", "b"], 0.05, create=True) == [b"3", b"0"]
    assert job.calls["check"] == 1 and job.calls["add"] == 3


def test_a_claimer_that_never_leaves_its_copy_costs_its_node_mates_the_claim_wait_then_they_read_themselves():
    job = dist.HashStore()
    job.set("k", "v")
    node, clock = _node()
    import hashlib

    name = "share/" + hashlib.blake2b(b"k", digest_size=12).hexdigest()
    node.store.add(f"{name}/claim/{int(clock.now / 0.1)}", 1)  # a node-mate claimed the read and died
    t0 = clock.now
    assert node.read(job, ["k"], 0.1) == [b"v"]
    assert CLAIM_WAIT_S <= clock.now - t0 <= CLAIM_WAIT_S + 0.01


def test_a_failed_node_store_makes_the_read_direct():
    class Gone:
        def __getattr__(self, name):
            def fail(*args):
                raise RuntimeError("connection reset")
            return fail

    job = dist.HashStore()
    job.set("k", "v")
    assert NodeLocal(Gone(), 4).read(job, ["k"], 0.1) == [b"v"]
    assert NodeLocal(Gone(), 4).read(job, ["x"], 0.1, check=True) is None


@pytest.mark.timeout(60)
def test_eight_processes_worth_of_threads_on_a_real_node_store_read_the_job_store_once():
    from ntp_ds.control.store import connect_store, host_store

    host, address = host_store(0, "127.0.0.1", 10.0)
    job = CountingStore(dist.HashStore())
    job.add("c", 7)
    start = threading.Barrier(8)
    got = []

    def rank():
        node = NodeLocal(connect_store(address, 10.0), 8)
        start.wait(timeout=30)
        got.append(node.read(job, ["c"], 1.0))  # (well within the age of each other, on any host)

    threads = [threading.Thread(target=rank) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert got == [[b"7"]] * 8
    # Two reads at most: a slot's boundary may fall between the eight (each slot has its claimer).
    assert job.calls["multi_get"] <= 2


def test_a_decision_awaited_through_the_node_costs_the_job_store_about_one_poll_per_node_not_per_rank():
    job = CountingStore(dist.HashStore())
    clock = Clock()
    local = dist.HashStore()
    ranks = range(8)
    node = NodeLocal(local, 8, clock=clock, sleep=clock.sleep)
    others = [Membership(job, r, range(16), settle_s=0.2, clock=clock, sleep=clock.sleep, node=node) for r in ranks]
    reporter = Membership(dist.HashStore(), 9, range(16))  # (a rank of another node: its own client)
    reporter.store = job
    waits = [m.decision_wait(0, 10.0) for m in others]
    job.calls.clear()
    for _ in range(5):  # nothing happens: each poll of the node's ranks is one read for all of them
        assert all(isinstance(w.poll(), float) for w in waits)
        clock.now += 0.3
    assert job.calls["multi_get"] <= 5 + 1 and job.calls["check"] <= 1
    reporter.report_failure(0, {15}, time.time(), "gone")
    clock.now += 0.3
    for _ in range(40):
        outcomes = [w.poll() for w in waits]
        if all(not isinstance(o, float) for o in outcomes):
            break
        clock.now += 0.05
    assert all(o.dead == {15} for o in outcomes)


def test_a_decision_committed_just_after_a_node_mates_look_reaches_the_node_within_the_age_not_the_settle_window():
    # Rank 1 looks at the decision (none yet) on its node's behalf; rank 9, elsewhere, commits it and moves the
    # events; rank 0 sees the events move and takes rank 1's look, which began before the commit. It must look
    # again once that look is too old to serve, not wait for the settle window (2.0 s here).
    job, clock, local = dist.HashStore(), Clock(), dist.HashStore()
    node = NodeLocal(local, 8, clock=clock, sleep=clock.sleep)
    members = range(16)
    waiter, looker = (Membership(job, r, members, settle_s=1.0, clock=clock, sleep=clock.sleep, node=node)
                      for r in (0, 1))
    other = Membership(job, 9, members, settle_s=1.0, clock=clock, sleep=clock.sleep)
    wait = waiter.decision_wait(0, 30.0)
    assert isinstance(wait.poll(), float)
    other.report_failure(0, {15}, time.time(), "gone")  # the report moves the events
    clock.now += 0.05
    age = 0.02
    assert looker.decision(0, age) is None  # a look on the node's behalf, before the commit
    other._commit(0, other.reports(0))  # the commit moves the events again
    started = clock.now
    for _ in range(200):
        outcome = wait.poll()
        if not isinstance(outcome, float):
            break
        clock.now += max(outcome, 0.001)
    assert not isinstance(outcome, float) and outcome.dead == {15}
    assert clock.now - started < 0.5, clock.now - started  # an age or so, not the settle window
