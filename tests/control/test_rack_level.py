"""The level above the node (`NodeLocal.rack`): a barrier reaches the job's store once per rack, and keeps counting
every rank once when a rack's store dies; reads of keys that never change are shared by the rack's nodes."""

import pytest
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st

from ntp_ds.control.membership import BarrierTimeout, BarrierWait
from ntp_ds.control.node_local import NodeLocal
from ntp_ds.testing.liveness_load import CountingStore


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


class Dying:
    """A rack's store whose host goes away after `calls` calls: every call from then on raises. With `lost`, the call
    that meets the end is carried out and its answer lost (the host died after doing it)."""

    def __init__(self, store, calls: int | None, lost: bool = False):
        self._store, self.left, self.lost = store, calls, lost

    def __getattr__(self, name):
        method = getattr(self._store, name)

        def call(*args):
            if self.left is not None:
                if self.left <= 0:
                    raise ConnectionError("the rack's store is gone")
                self.left -= 1
                if self.left == 0 and self.lost:
                    method(*args)
                    raise ConnectionError("the rack's store went away before answering")
            return method(*args)
        return call


class Writes:
    """The job's store, recording per key the number of writes (`add` of a non-zero amount, `set`)."""

    def __init__(self, store):
        self._store, self.writes = store, {}

    def __getattr__(self, name):
        return getattr(self._store, name)

    def add(self, key, amount):
        if amount:
            self.writes[key] = self.writes.get(key, 0) + 1
        return self._store.add(key, amount)

    def set(self, key, value):
        self.writes[key] = self.writes.get(key, 0) + 1
        return self._store.set(key, value)


def _levels(world, size, rack_nodes, rack_stores, node_stores):
    """Each rank's own view of its node's and rack's stores (a process's: it learns of a failed store alone)."""
    def level(rank):
        rack = NodeLocal.for_rack(rack_stores[rank // size // rack_nodes], size * rack_nodes, world)
        return NodeLocal(node_stores[rank // size], size, world, rack=rack)
    return level


def _run(order, ranks, level, job, clock, rounds=6):
    """Arrive in `order`, everyone polling after each arrival; return the waits. Asserts the end comes exactly after
    the last arrival (within a few rounds of polls: a rack that falls back arrives node by node as it polls)."""
    waits = {}
    for i, rank in enumerate(order):
        waits[rank] = BarrierWait(job, "b", rank, ranks, 60.0, clock=clock, node=level(rank))
        for w in waits.values():
            w.poll()
        if i < len(order) - 1:
            assert not job.check(["b/done"]), f"ended after {i + 1} of {len(order)} arrivals"
    for _ in range(rounds):
        if all([w.poll() is None for w in waits.values()]):  # (every wait polls: each copies the end down)
            return waits
    raise AssertionError("the barrier did not end after every rank arrived")


def _no_double_count(job, n):
    leaves = [k for k in job.writes if k.startswith("b/c/0/")]
    for k in leaves:
        index = int(k.rsplit("/", 1)[1])
        assert int(job.add(k, 0)) <= min(32, n - 32 * index), k


@given(st.integers(1, 4), st.integers(2, 3), st.integers(3, 7), st.data())
@settings(max_examples=100, deadline=None)
def test_a_barrier_through_racks_ends_at_its_last_arrival_and_counts_each_rank_once_when_rack_stores_die(
        size, rack_nodes, racks, data):
    # Ranks on nodes of `size`, racks of `rack_nodes` nodes, some ranks dead (not in the barrier). Each rack's store
    # may die after a drawn number of calls (some with the last call done and its answer lost). Whatever the order
    # and the deaths, the barrier ends exactly after its last arrival, and no leaf counter is counted past its size.
    world = size * rack_nodes * racks
    ranks = sorted(data.draw(st.sets(st.integers(0, world - 1), min_size=2, max_size=world)))
    fates = data.draw(st.lists(st.tuples(st.one_of(st.none(), st.integers(0, 3 * size * rack_nodes)), st.booleans()),
                               min_size=racks, max_size=racks))
    rack_stores = {k: Dying(dist.HashStore(), calls, lost) for k, (calls, lost) in enumerate(fates)}
    node_stores = {n: dist.HashStore() for n in range(world // size)}
    job = Writes(dist.HashStore())
    order = data.draw(st.permutations(ranks))
    _run(order, ranks, _levels(world, size, rack_nodes, rack_stores, node_stores), job, FakeClock())
    _no_double_count(job, len(ranks))


@given(st.integers(2, 4), st.integers(2, 4), st.integers(3, 12), st.data())
@settings(max_examples=50, deadline=None)
def test_with_racks_the_job_s_store_sees_a_few_writes_per_rack_and_one_poller_per_rack(size, rack_nodes, racks, data):
    world = size * rack_nodes * racks
    ranks = list(range(world))
    rack_stores = {k: dist.HashStore() for k in range(racks)}
    node_stores = {n: dist.HashStore() for n in range(world // size)}
    job = Writes(dist.HashStore())
    waits = _run(data.draw(st.permutations(ranks)), ranks, _levels(world, size, rack_nodes, rack_stores, node_stores),
                 job, FakeClock())
    assert sum(w.closer for w in waits.values()) == racks  # (the ranks that poll the job's store)
    # per rack: its claim and one add per leaf counter its span falls in (two at most), plus the tree above, the end
    assert sum(job.writes.values()) <= 3 * racks + world // 31 + 2
    _no_double_count(job, world)


def test_a_rack_closer_that_lost_the_claim_to_a_failed_rack_mate_makes_every_node_arrive_on_its_own():
    # Racks of two nodes of two ranks. Node 1's closer cannot reach the rack's store: it claims `nodes` and arrives
    # for its node. Node 0's closer then completes nothing in the rack's store (node 1 never counted there), so the
    # barrier ends through the nodes, with every rank counted once.
    world, ranks = 8, list(range(8))
    rack_stores = {0: dist.HashStore(), 1: dist.HashStore()}
    node_stores = {n: dist.HashStore() for n in range(4)}
    job, clock = Writes(dist.HashStore()), FakeClock()
    base = _levels(world, 2, 2, rack_stores, node_stores)

    def level(rank):
        node = base(rank)
        if rank in (2, 3):  # node 1's ranks find the rack's store gone
            node.rack.failed(ConnectionError("gone"))
            assert not node.rack.usable
        return node

    waits = _run([0, 2, 3, 4, 5, 6, 7, 1], ranks, level, job, clock)
    assert job.get("b/rack/0") == b"nodes" and job.get("b/rack/1") == b"rack"
    assert job.check(["b/node/0", "b/node/1"])
    _no_double_count(job, world)
    assert waits[1].closer and waits[3].closer  # both of rack 0's nodes poll the job's store: it fell back


def test_a_rack_store_dying_after_its_closer_counted_the_rack_leaves_no_rank_uncounted_or_counted_twice():
    # The rack's closer claims `rack` and counts the rack; the rack's store dies before it copies the end there.
    # The other node's closer, polling the rack's store, fails over: `rack` stands, so it polls the job's store.
    world, ranks = 12, list(range(12))
    dying = Dying(dist.HashStore(), None)
    rack_stores = {0: dying, 1: dist.HashStore(), 2: dist.HashStore()}
    node_stores = {n: dist.HashStore() for n in range(6)}
    job, clock = Writes(dist.HashStore()), FakeClock()
    level = _levels(world, 2, 2, rack_stores, node_stores)
    waits = {r: BarrierWait(job, "b", r, ranks, 60.0, clock=clock, node=level(r)) for r in ranks}
    assert job.get("b/rack/0") == b"rack"
    dying.left = 0
    for _ in range(3):
        done = [w.poll() is None for w in waits.values()]
    assert all(done)
    _no_double_count(job, world)


def test_a_slow_barrier_s_rack_waiters_poll_the_job_s_store_and_a_timeout_names_the_missing_rank():
    # Rank 5 never comes: rack 1's count never completes. At half the bound every waiting rank marks itself and the
    # rack's node closers turn to the job's store; at the bound, every rank names rank 5 alone.
    world, ranks = 8, list(range(8))
    level = _levels(world, 2, 2, {0: dist.HashStore(), 1: dist.HashStore()}, {n: dist.HashStore() for n in range(4)})
    job, clock = Writes(dist.HashStore()), FakeClock()
    waits = [BarrierWait(job, "b", r, ranks, 10.0, clock=clock, node=level(r)) for r in ranks if r != 5]
    assert all(w.poll() is not None for w in waits)
    clock.now = 5.0
    assert all(w.poll() is not None for w in waits)
    assert waits[6].closer  # (rank 6 closed node 3 and waited on rack 1's store: now the job's)
    clock.now = 10.0
    for w in waits:
        with pytest.raises(BarrierTimeout) as err:
            w.poll()
        assert err.value.missing == {5}


def test_a_last_rack_of_fewer_nodes_counts_only_its_launch_ranks_and_joiners_arrive_alone():
    # Three nodes of two ranks in racks of two nodes: rack 1 is node 2 alone, and the joiners (ranks 6 and 7, on no
    # node) follow it. Rack 1 completes with node 2's two ranks, and the barrier ends at its last arrival, whatever
    # the order, with no one left waiting for half its bound.
    world, ranks = 6, list(range(8))
    for order in ([0, 1, 2, 3, 4, 5, 6, 7], [6, 4, 0, 7, 1, 5, 2, 3], [7, 6, 5, 4, 3, 2, 1, 0]):
        level = _levels(world, 2, 2, {0: dist.HashStore(), 1: dist.HashStore()},
                        {n: dist.HashStore() for n in range(3)})
        job = Writes(dist.HashStore())
        _run(order, ranks, lambda r: level(r) if r < world else None, job, FakeClock())
        assert job.get("b/rack/1") == b"rack"
        _no_double_count(job, len(ranks))


def test_reads_of_keys_that_never_change_are_shared_by_a_rack_and_an_absence_is_not():
    job = CountingStore(dist.HashStore())
    rack_store, clock = dist.HashStore(), FakeClock()  # (the nodes' clocks, and the wall clock of the rack's slots)
    nodes = [NodeLocal(dist.HashStore(), 4, 16, clock=clock,
                       rack=NodeLocal(rack_store, 16, 16, clock=clock, present_only=True)) for _ in range(4)]
    keys = ["e/1", "e/2"]
    assert [n.read(job, keys, 0.05, fixed=True, check=True) for n in nodes] == [None] * 4
    assert job.calls["check"] == 4  # an absence: each node asks itself (no clock is shared across the rack)
    job.set("e/1", "a")
    job.set("e/2", "b")
    clock.now += 0.1  # (a node believes an absence it read for the age)
    assert [n.read(job, keys, 0.05, fixed=True, check=True) for n in nodes] == [[b"a", b"b"]] * 4
    assert job.calls["multi_get"] == 1  # present: read once for the rack
    # a counter (not fixed) is read by each node itself, never through the rack
    job.add("c", 3)
    assert [n.read(job, ["c"], 0.05) for n in nodes] == [[b"3"]] * 4  # (each node's first read of it)
    assert job.calls["multi_get"] == 5


def test_a_rack_store_that_fails_makes_the_node_read_the_job_s_store_and_is_not_asked_again():
    job = CountingStore(dist.HashStore())
    job.set("k", "v")
    dying = Dying(dist.HashStore(), 0)
    rack = NodeLocal(dying, 16, 16, present_only=True)
    node = NodeLocal(dist.HashStore(), 4, 16, rack=rack)
    assert node.read(job, ["k"], 0.05, fixed=True, check=True) == [b"v"]
    assert not rack.usable
    other = NodeLocal(dist.HashStore(), 4, 16, rack=rack)
    dying.left = None  # (were it asked again, it would answer: it is not)
    assert other.read(job, ["k"], 0.05, fixed=True, check=True) == [b"v"]
    assert not dying.check(["share/" + "x"])  # (nothing was written there)


@given(st.integers(1, 3), st.integers(2, 3), st.integers(3, 5), st.booleans(), st.data())
@settings(max_examples=100, deadline=None)
def test_acknowledgements_through_racks_end_exactly_when_every_member_is_accounted_for(size, rack_nodes, racks, dying,
                                                                                       data):
    # As test_membership's test of the acknowledgements through node stores, with racks of `rack_nodes` nodes, each
    # with its store: some ranks die (whole nodes and whole racks among them), each claimed by a live rank, one live
    # rank also falsely claimed. Every live rank reports in a random order and every rank reads the reports filed so
    # far. With every rack's store alive, the acknowledgements end exactly at the call that completes them; with some
    # dying (`dying`), never before it, and once every rank has looked again; no counter is ever counted past its size.
    from ntp_ds.control.membership import Membership

    world = size * rack_nodes * racks
    members = list(range(world))
    dead = sorted(data.draw(st.sets(st.sampled_from(members), min_size=1, max_size=world - 1)))
    live = [r for r in members if r not in dead]
    falsely = data.draw(st.sampled_from([None] + live)) if len(live) > 1 else None
    claimed = dead + ([falsely] if falsely is not None else [])
    claimant = {d: data.draw(st.sampled_from([r for r in live if r != d])) for d in claimed}
    fates = [(data.draw(st.one_of(st.none(), st.integers(0, 4 * size * rack_nodes))), data.draw(st.booleans()))
             if dying else (None, False) for _ in range(racks)]
    rack_stores = {k: Dying(dist.HashStore(), calls, lost) for k, (calls, lost) in enumerate(fates)}
    node_stores = {n: dist.HashStore() for n in range(world // size)}
    level = _levels(world, size, rack_nodes, rack_stores, node_stores)
    job = Writes(dist.HashStore())
    views = {r: Membership(job, r, members, settle_s=60.0, node=level(r)) for r in live}
    order = data.draw(st.permutations(live))
    acks = "membership/0/acks"
    for i, rank in enumerate(order):
        mine = {d for d, c in claimant.items() if c == rank}
        views[rank].report_failure(0, mine or set(claimed), 1.0, "x", fenced=set() if mine else set(claimed))
        for r in order[:i + 1]:
            views[r].reports(0)
            if views[r]._close_nodes(0):
                views[r]._commit(0, views[r].reports(0))
        done = job.check([f"{acks}/done"])
        called = set(order[:i + 1])
        due = all(r in called for r in live if r != falsely) and all(claimant[d] in called for d in claimed)
        if not dying or not due:
            assert done == due, f"acknowledgements ended={done} after {i + 1} of {len(order)} calls"
    for _ in range(2):  # (a rack that went node by node: its ranks learn so when they look again)
        for r in order:
            views[r]._close_nodes(0)
    assert job.check([f"{acks}/done"])
    for k in [k for k in job.writes if k.startswith(f"{acks}/c/0/")]:
        index = int(k.rsplit("/", 1)[1])
        assert int(job.add(k, 0)) <= min(32, world - 32 * index), k
    if not dying:  # no rank's own acknowledgement, nor a node's of a rack that had a live rank, reached the job
        assert not any(k.startswith(f"{acks}/node/") and int(k.rsplit("/", 1)[1]) * size // (size * rack_nodes)
                       in {r // (size * rack_nodes) for r in live if r != falsely} for k in job.writes), job.writes
