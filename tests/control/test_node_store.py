"""A node's own store: beats stay on the node, quiet watchers read the launcher's copy, and the job's store is the
truth whenever the copy cannot be trusted."""

from __future__ import annotations

import json
import threading
import time
from collections import Counter

import torch.distributed as dist

from ntp_ds.control.heartbeat import Heartbeat
from ntp_ds.control.keys import NODE_MIRROR_KEY, heartbeat_key, node_key, watching_key
from ntp_ds.control.liveness import Beat, LivenessMonitor
from ntp_ds.control.liveness_store import LivenessReader, NodePublisher, mark_exited, prepare_store, request_fence
from ntp_ds.control.node_store import MirrorView, NodeMirror, connect_node_store, host_node_store
from ntp_ds.control.store import host_store
from ntp_ds.envs import NODE_STORE_ENV
from tests.helpers.clock import FakeClock


class Counting:
    """A store that counts the requests made to it."""

    def __init__(self, store):
        self.store, self.calls = store, Counter()

    def __getattr__(self, name):
        attr = getattr(self.store, name)

        def counted(*args, **kwargs):
            self.calls[name] += 1
            return attr(*args, **kwargs)

        return counted


def _job(nodes: int = 3, size: int = 2):
    """A job store with `nodes` nodes of `size` ranks each, each node with its own store, its workers' beats in it
    and its key published; returns (job store, node stores, publishers)."""
    job = dist.HashStore()
    prepare_store(job)
    locals_ = [dist.HashStore() for _ in range(nodes)]
    publishers = [NodePublisher(job, n, range(n * size, (n + 1) * size), beats_from=locals_[n]) for n in range(nodes)]
    for n, local in enumerate(locals_):
        for r in range(n * size, (n + 1) * size):
            local.set(heartbeat_key(r), Beat(1, 100.0).encode())
        publishers[n].publish()
    return job, locals_, publishers


def test_a_node_key_is_published_from_the_beats_in_the_nodes_own_store():
    job, locals_, publishers = _job()
    assert not job.check([heartbeat_key(0)])  # no worker beat to the job's store
    locals_[0].set(heartbeat_key(1), Beat(7, 101.0).encode())
    published = publishers[0].publish()
    assert published.beats[1].counter == 7
    assert json.loads(job.get(node_key(0)))["beats"]["1"][0] == 7


def test_a_worker_that_beats_to_the_job_store_is_published_from_there():
    # A heartbeat built without the node's store (a user's own, or a worker started before it): its launcher reads
    # its beats where they are.
    job, locals_, publishers = _job()
    job.set(heartbeat_key(6), Beat(9, 102.0).encode())
    publisher = NodePublisher(job, 3, [6, 7], beats_from=dist.HashStore())
    assert publisher.publish().beats == {6: Beat(9, 102.0)}


def test_a_quiet_read_takes_the_copy_and_costs_the_job_store_nothing():
    job, locals_, publishers = _job()
    counted = Counting(job)
    reader = LivenessReader(counted, 2, mirror=locals_[0])
    reader.want(0, [2, 3, 4], 0.5)  # rank 0 watches nodes 1 and 2
    assert json.loads(locals_[0].get(watching_key(0, "heartbeat"))) == {"nodes": [1, 2], "interval_s": 0.5}
    copy = NodeMirror(job, locals_[0], [0, 1]).refresh()
    assert sorted(copy.nodes) == [1, 2] and copy.seq == 1
    view = reader.read([2, 3, 4], direct=False)
    assert sorted(view.beats) == [2, 3, 4]
    assert sum(counted.calls.values()) == 0
    reader.read([2, 3, 4])  # a direct read (news, or a recovery's) goes to the job's store
    assert counted.calls["multi_get"] == 1


def test_the_copy_is_not_trusted_when_it_stops_moving_or_lacks_a_node():
    job, locals_, publishers = _job()
    clock = FakeClock()
    counted = Counting(job)
    reader = LivenessReader(counted, 2, mirror=locals_[0], clock=clock)
    reader.want(0, [2], 0.5)
    mirror = NodeMirror(job, locals_[0], [0, 1])
    mirror.refresh()
    reader.read([2], direct=False)
    assert sum(counted.calls.values()) == 0
    # A node the copy does not hold yet (the watch set just grew): the job's store, until the next copy has it.
    view = reader.read([2, 4], direct=False)
    assert sorted(view.beats) == [2, 4] and counted.calls["multi_get"] == 1
    reader.want(0, [2, 4], 0.5)
    mirror.refresh()
    reader.read([2, 4], direct=False)
    assert counted.calls["multi_get"] == 1
    # The launcher stops copying (gone, or stuck): past stale_s the job's store serves.
    clock.now += reader.stale_s + 0.1
    reader.read([2, 4], direct=False)
    assert counted.calls["multi_get"] == 2


def test_a_copy_older_than_a_key_read_before_never_moves_a_beat_backwards():
    job, locals_, publishers = _job()
    clock = FakeClock()
    reader = LivenessReader(job, 2, mirror=locals_[0], clock=clock)
    reader.want(0, [2], 0.5)
    mirror = NodeMirror(job, locals_[0], [0, 1])
    mirror.refresh()  # copies node 1 with beat 1
    locals_[1].set(heartbeat_key(2), Beat(2, 101.0).encode())
    publishers[1].publish()
    monitor = LivenessMonitor([2], heartbeat_timeout_s=3.0, clock=clock)
    monitor.observe(reader.read([2]).beats)  # direct: beat 2
    clock.now += 1.0
    monitor.observe(reader.read([2], direct=False).beats)  # the older copy: beat 1 would look like a new beat
    assert reader.read([2], direct=False).beats[2].counter == 2
    assert monitor.silent_for(2) == 1.0


def test_exit_and_fence_entries_come_from_the_job_store_when_the_copy_counts_them():
    job, locals_, publishers = _job()
    reader = LivenessReader(job, 2, mirror=locals_[0])
    reader.want(0, [2], 0.5)
    mirror = NodeMirror(job, locals_[0], [0, 1])
    mark_exited(job, 3, "exit code -9")
    request_fence(job, [5], "declared dead by rank 4")
    copy = mirror.refresh()
    assert (copy.exits, copy.fences) == (1, 1)
    view = reader.read([2], direct=False)
    assert view.exited == {3: "exit code -9"} and view.fences == {5: "declared dead by rank 4"}


def test_a_heartbeat_beats_to_its_node_store_and_to_the_job_store_when_that_fails():
    job = dist.HashStore()

    class Broken:
        def set(self, *args):
            raise RuntimeError("connection reset by peer")

    local = dist.HashStore()
    hb = Heartbeat(job, 4, 0.5, beats_to=local)
    hb.beat()
    assert local.check([heartbeat_key(4)]) and not job.check([heartbeat_key(4)])
    hb.beats_to = Broken()
    hb.beat()
    assert Beat.decode(job.get(heartbeat_key(4))).counter == 2


def test_a_watching_heartbeat_lists_its_nodes_and_polls_the_copy_when_quiet():
    job, locals_, publishers = _job()
    counted = Counting(job)
    monitor = LivenessMonitor((), 3.0)
    hb = Heartbeat(counted, 0, 0.5, monitor=monitor, on_dead=lambda *a: None,
                   reader=LivenessReader(counted, 2, mirror=locals_[0]), beats_to=locals_[0])
    hb.watch([2, 4])
    assert json.loads(locals_[0].get(watching_key(0, "heartbeat"))) == {"nodes": [1, 2], "interval_s": 0.5}
    NodeMirror(job, locals_[0], [0, 1]).refresh()
    counted.calls.clear()
    hb.poll_peers(direct=False)
    hb.beat()
    assert sum(counted.calls.values()) == 0
    hb.poll_peers()
    assert sum(counted.calls.values()) > 0


def test_node_store_over_tcp_and_its_absence():
    store, address = host_node_store()
    client = connect_node_store({NODE_STORE_ENV: address})
    client.set("k", "v")
    assert store.get("k") == b"v"
    assert connect_node_store({}) is None
    job, job_address = host_store()
    prepare_store(job)
    # A launcher copying while its workers list their nodes from their own clients, concurrently.
    mirror = NodeMirror(job, store, [0, 1])
    threads = [threading.Thread(target=lambda r=r: LivenessReader(job, 2, mirror=connect_node_store(
        {NODE_STORE_ENV: address})).want(r, [2, 3], 0.2 + r)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10.0)
    job.set(node_key(1), '{"seq":1,"beats":{},"exited":{}}')
    copy = MirrorView.decode(store.get(NODE_MIRROR_KEY)) if store.check([NODE_MIRROR_KEY]) else None
    assert copy is None
    deadline = time.monotonic() + 10.0
    while mirror.watched() != {1} and time.monotonic() < deadline:
        time.sleep(0.01)
    assert mirror.refresh().nodes == {1: '{"seq":1,"beats":{},"exited":{}}'}
    assert mirror.period_s == 0.2  # the node's shortest beat interval


def test_past_the_job_stores_budget_the_launchers_publish_less_often_and_readers_wait_longer():
    from ntp_ds.control.liveness_store import NODE_STALE_S
    from ntp_ds.control.node_store import STEADY_REQUESTS_PER_S, launcher_period_s

    # Up to the budget the launchers keep their workers' beat; past it, two requests per node per period fill it.
    assert launcher_period_s(6_250, 0.5) == 0.5 and launcher_period_s(128, 0.2) == 0.2
    assert launcher_period_s(12_500, 0.5) == 1.0 and launcher_period_s(25_000, 0.5) == 2.0
    for nodes in (10_000, 12_500, 40_000):
        assert 2 * nodes / launcher_period_s(nodes, 0.5) <= STEADY_REQUESTS_PER_S * (1 + 1e-9)
    job, local = dist.HashStore(), dist.HashStore()
    prepare_store(job)
    big = NodeMirror(job, local, range(8), nodes=12_500)
    assert big.period_s == 1.0
    local.set(watching_key(0, "heartbeat"), json.dumps({"nodes": [1], "interval_s": 0.25}))
    big.watched()
    assert big.period_s == 1.0  # a faster beat does not make the launchers exceed the budget
    small = NodeMirror(job, local, range(8), nodes=4)
    assert small.period_s == 0.5  # (before its workers list their beat: PERIOD_S)
    small.watched()
    assert small.period_s == 0.25
    # A reader started by a launcher of a big job bypasses a node key only after two of its launchers' periods.
    env = {"NTP_NODE_SIZE": "8", "WORLD_SIZE": "100000"}
    assert LivenessReader.from_env(job, env).stale_s == 2.0
    assert LivenessReader.from_env(job, {"NTP_NODE_SIZE": "8", "WORLD_SIZE": "1024"}).stale_s == NODE_STALE_S
    # A watcher suspects a peer after 2.5 such periods (a copy may show a node's key unchanged twice), a small
    # job's after half the timeout as before.
    from ntp_ds.control.heartbeat import suspect_after_s

    assert suspect_after_s(3.0, LivenessReader.from_env(job, env)) == 2.5
    assert suspect_after_s(3.0, LivenessReader.from_env(job, {"NTP_NODE_SIZE": "8", "WORLD_SIZE": "1024"})) == 1.5
    assert suspect_after_s(1.0, LivenessReader(job)) == 0.5
