"""The etcd store: torch's store semantics on a 3-member etcd cluster, through the loss of a member; then jobs on it
(marker etcd, a stage of .ci/run): one loses an etcd member and then a worker, a two-node job loses the node whose
launcher started it. Both end with the failure-free run's weights.

The etcd server comes from the system's package (Debian/Ubuntu: `etcd-server`, which .ci/run installs)."""

import datetime
import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch.distributed as dist

from ntp_ds.control.address import parse_etcd_address
from ntp_ds.control.etcd_store import EtcdStore
from ntp_ds.control.store import connect_store
from ntp_ds.testing.etcd_cluster import EtcdCluster, etcd_binary
from tests.helpers.cli import REPO, ntp_ds, run_events, train_clean
from tests.helpers.training import assert_same_final_weights, wait_for_lines

pytestmark = pytest.mark.skipif(etcd_binary() is None, reason="no etcd server on PATH (apt-get install etcd-server)")


@pytest.fixture(scope="module")
def cluster():
    with EtcdCluster(3) as c:
        yield c


def test_store_semantics(cluster):
    s = connect_store(cluster.address("semantics"), timeout_s=10)
    s.set("a", b"x")
    assert s.get("a") == b"x" and s.check(["a"]) and not s.check(["a", "b"])
    assert s.add("n", 3) == 3 and s.add("n", -1) == 2 and s.get("n") == b"2"
    s.append("log", b"ab")
    s.append("log", "cd")
    assert s.get("log") == b"abcd"
    assert s.compare_set("c", "", "v1") == b"v1"  # absent and nothing expected: created
    assert s.compare_set("c", "v0", "v2") == b"v1"  # not what was expected: the value held
    assert s.compare_set("c", "v1", "v2") == b"v2"
    assert s.compare_set("absent", "q", "r") == b"q" and not s.check(["absent"])  # as torch's stores answer
    assert s.multi_get(["a", "n"]) == [b"x", b"2"]
    assert s.num_keys() == 4
    many = [f"m/{i}" for i in range(300)]  # more than one transaction's worth (TXN_OPS)
    calls, call = [], s._call
    s._call = lambda path, payload: calls.append(path) or call(path, payload)
    s.multi_set(many, [str(i) for i in range(300)])
    assert s.multi_get(["a", *many, "n"]) == [b"x", *(str(i).encode() for i in range(300)), b"2"]
    assert calls == ["/kv/txn"] * 6, "300 puts, then 302 reads, each in transactions of 128"
    del s._call
    s.multi_set(["m/0", "e"], ["again", ""])
    assert s.multi_get(["e", "m/0"]) == [b"", b"again"]
    late = threading.Thread(target=lambda: (time.sleep(0.3), s.clone().set("m/late", "1")))
    late.start()
    assert s.multi_get(["m/1", "m/late"]) == [b"1", b"1"]  # a missing key is waited for, as torch's stores do
    late.join(10)
    for key in [*many, "e", "m/late"]:
        s.delete_key(key)
    assert s.delete_key("a") and not s.delete_key("a") and not s.check(["a"])
    prefixed = dist.PrefixStore("gen/1", s)  # what a generation's process groups rendezvous on
    prefixed.set("k", "1")
    assert prefixed.get("k") == b"1" and s.check(["gen/1/k"])
    start = time.monotonic()
    with pytest.raises(dist.DistStoreError, match="timed out"):
        s.wait(["never"], datetime.timedelta(seconds=0.3))
    assert time.monotonic() - start < 5
    waiter = threading.Thread(target=lambda: s.clone().wait(["late"]))
    waiter.start()
    s.set("late", "1")
    waiter.join(10)
    assert not waiter.is_alive()


def test_counters_stay_exact_under_contention_and_through_a_lost_member(cluster):
    address = cluster.address("contention")
    stores = [EtcdStore(address, timeout_s=20) for _ in range(4)]
    seen: list[int] = []

    def count(store):
        for _ in range(25):
            seen.append(store.add("n", 1))
            store.append("log", b".")

    threads = [threading.Thread(target=count, args=(s,)) for s in stores]
    for t in threads:
        t.start()
    time.sleep(0.05)
    with EtcdCluster(3) as spare:  # the member the clients talk to is lost mid-count; a cluster of our own
        address = spare.address("lost")
        survivors = [EtcdStore(address, timeout_s=20) for _ in range(3)]
        for s in survivors:
            s.add("n", 1)
        spare.kill(0)  # every client reached member 0 first
        for i, s in enumerate(survivors):
            assert s.add("n", 1) == 4 + i
            s.append("log", str(i))
        assert survivors[0].get("log") == b"012" and survivors[1].get("n") == b"6"
    for t in threads:
        t.join(60)
    assert sorted(seen) == list(range(1, 101))  # each add once, each answer distinct
    assert stores[0].get("log") == b"." * 100


def test_a_counter_read_is_one_read_and_an_absent_counter_is_created(cluster):
    s = connect_store(cluster.address("counter-read"), timeout_s=10)
    assert s.add("c", 0) == 0 and s.check(["c"])  # created, as torch's stores create it
    s.add("c", 5)
    calls, call = [], s._call
    s._call = lambda path, payload: calls.append(path) or call(path, payload)
    assert s.add("c", 0) == 5 and calls == ["/kv/range"]  # no transaction: readers never retry each other out
    del s._call


def test_a_generation_s_keys_are_forgotten_by_prefix_and_the_others_kept(cluster):
    from ntp_ds.control.keys import barrier_key, decision_key, membership_key
    from ntp_ds.control.store import forget_generation, generation_store

    s = connect_store(cluster.address("forget"), timeout_s=10)
    for g in (3, 4, 13):
        s.set(decision_key(g), "d")
        s.add(membership_key(g, "acks"), 1)
        s.set(barrier_key(g, "done", (0, 1)) + "/count", "2")
        generation_store(s, g).set("store_based_barrier", "1")
    s.set("heartbeat/0", "1")
    assert forget_generation(s, 3) == 4
    assert not s.check([decision_key(3)]) and not s.check([membership_key(3, "acks")])
    assert s.check([decision_key(4), decision_key(13), membership_key(13, "acks"), "heartbeat/0"])
    assert s.num_keys() == 9  # generations 4 and 13 (4 keys each) and the beat


def _revisions(store, n: int, value: bytes, compact_every: int | None) -> None:
    for i in range(n):
        store.set("history", value)
        if compact_every is not None:
            store.compact_if_due(compact_every)


def test_compaction_keeps_a_small_quota_from_filling_and_without_it_the_quota_fills(tmp_path):
    from ntp_ds.control.etcd_store import EtcdRefused

    quota = 16 << 20
    value = os.urandom(128 << 10)  # 200 writes: 25 MB of history, over the quota
    with EtcdCluster(1, quota_bytes=quota) as small:
        s = connect_store(small.address("compacted"), timeout_s=10)
        _revisions(s, 200, value, compact_every=20)
        assert s.get("history") == value
        status = s._call("/maintenance/status", {})
        assert int(status["dbSize"]) < quota, status
    with EtcdCluster(1, quota_bytes=quota) as small:
        s = connect_store(small.address("uncompacted"), timeout_s=10)
        with pytest.raises(EtcdRefused, match="NOSPACE") as refused:
            _revisions(s, 200, value, compact_every=None)
        assert refused.value.code == 8


def test_one_client_compacts_per_period_whoever_asks(cluster):
    a, b = connect_store(cluster.address("compact-once"), 10), connect_store(cluster.address("compact-once"), 10)
    a.set("x", "1")
    first = a.compact_if_due(every=1)
    assert first is not None and b.compact_if_due(every=1000) is None  # due for nobody else until 1000 more
    for i in range(5):
        b.set("x", str(i))
    assert b.compact_if_due(every=5) is not None and a.compact_if_due(every=5) is None
    assert a.get("x") == b"4"  # compaction keeps every key's current value


def _watch_metrics(cluster) -> tuple[int, int]:
    """(watch streams, watchers) open on the cluster's members, from their metrics."""
    import urllib.request

    streams = watchers = 0
    for port in cluster.client_ports:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as answer:
            for line in answer.read().decode().splitlines():
                name, _, value = line.partition(" ")
                streams += int(float(value)) if name == "etcd_debugging_mvcc_watch_stream_total" else 0
                watchers += int(float(value)) if name == "etcd_debugging_mvcc_watcher_total" else 0
    return streams, watchers


@pytest.mark.parametrize("transport, streams", [("grpc", 1), ("http", 20)])
def test_a_process_s_waits_share_one_watch_stream_over_grpc(transport, streams):
    """20 waits of one process, each on a client of its own (as a rank's heartbeat, alarm thread and training
    thread each hold one): over gRPC one watch stream carries all 20 watchers; over the HTTP gateway each wait opens
    a stream of its own."""
    with EtcdCluster(1) as small:
        first = EtcdStore(small.address("streams"), 20, transport)
        clients = [first.clone() for _ in range(20)]
        threads = [threading.Thread(target=c.wait, args=([f"k/{i}"],)) for i, c in enumerate(clients)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 10
        while _watch_metrics(small)[1] < 20 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _watch_metrics(small) == (streams, 20)
        first.multi_set([f"k/{i}" for i in range(20)], ["1"] * 20)
        for t in threads:
            t.join(10)
        assert not any(t.is_alive() for t in threads)  # every wait woke


def test_bad_addresses_name_what_is_wrong(tmp_path):
    for address, words in [("etcd://", "names no etcd member"), ("etcd://h", "has no port"),
                           ("etcd://h:1,h:x", "member 'h:x'"), ("etcd://h:1/a b", "job name")]:
        with pytest.raises(ValueError, match=words):
            parse_etcd_address(address)
    assert parse_etcd_address("etcd://a:1,b:2/run7") == ([("a", 1), ("b", 2)], "run7")
    result = ntp_ds("train", "recipe=cpu_demo", "launcher.store=etcd://h:1,h:x", f"hydra.run.dir={tmp_path}")
    assert result.returncode == 2 and "launcher.store" in result.stderr and "member 'h:x'" in result.stderr


def test_a_used_job_path_is_refused(cluster, tmp_path):
    address = cluster.address("used")
    connect_store(address, 10).set("leftover", "1")
    result = ntp_ds("launch", "--store", address, "-m", "json.tool", "--help", timeout=60)
    assert result.returncode != 0 and "already holds 1 keys of an earlier job" in result.stderr


# -- jobs on etcd ----------------------------------------------------------------------------------------------------
STEPS = 12
JOB = ["parallel.tp=2", "parallel.replicas=2", "parallel.timeout_s=20", f"train.steps={STEPS}",
       "train.global_batch=8", "train.micro_batch=2", "data.seq_len=16", "logging.progress=false",
       "logging.wandb.mode=disabled"]


@pytest.fixture(scope="module")
def clean(tmp_path_factory):
    return train_clean(tmp_path_factory.mktemp("etcd") / "clean", JOB)


def _env() -> dict:
    env = {**os.environ, "PYTHONPATH": str(REPO), "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1",
           "WANDB_MODE": "disabled"}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "NTP_RUN_DIR", "NTP_STORE"):
        env.pop(key, None)
    return env


def _steps_done(run_dir) -> int:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return 0
    return max((json.loads(x).get("step", 0) for x in path.read_text().splitlines() if x.strip()), default=0)


def _wait_for_step(run_dir, step: int, procs, deadline: float, log) -> None:
    while _steps_done(run_dir) < step and time.monotonic() < deadline and all(p.poll() is None for p in procs):
        time.sleep(0.1)
    assert _steps_done(run_dir) >= step, log.read_text()[-4000:]


def _stop(*procs) -> None:
    for proc in procs:
        if proc is not None and proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@pytest.mark.etcd
def test_a_job_loses_an_etcd_member_then_a_worker(clean, tmp_path):
    """Member 0 (the one every client reaches first) is killed after step 3; rank 3 crashes at step 6, so the
    recovery runs on the two members left."""
    run_dir, log_path = tmp_path / "faulted", tmp_path / "job.log"
    with EtcdCluster(3) as etcd, open(log_path, "w") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "ntp_ds.cli", "train", *JOB, f"launcher.store={etcd.address('lose-member')}",
             "fault.faults=[{rank:3,step:6,phase:backward,kind:crash}]", f"hydra.run.dir={run_dir}"],
            stdout=log, stderr=subprocess.STDOUT, env=_env(), cwd=REPO, start_new_session=True)
        try:
            deadline = time.monotonic() + 240
            _wait_for_step(run_dir, 3, [proc], deadline, log_path)
            etcd.kill(0)
            proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        finally:
            _stop(proc)
    assert proc.returncode == 0, log_path.read_text()[-4000:]
    recoveries = run_events(run_dir, "recovery")
    assert [e["degrees_after"] for e in recoveries] == [[2, 1]] and recoveries[0]["lossless"], recoveries
    assert _steps_done(run_dir) == STEPS
    assert_same_final_weights(run_dir, clean)


@pytest.mark.etcd
def test_a_two_node_job_on_etcd_loses_the_node_that_started_it(clean, tmp_path):
    """Node 0 (ranks 0 and 1, replica 0, and the launcher that started the job) is lost whole after step 4; node 1's
    replica finishes the job alone and writes the records and the weights.

    The node goes at a known point: its two workers stop themselves (SIGSTOP) as step 5 begins, then the test kills
    the node. A kill at a random instant could fall inside an optimizer step or while step 4's redundant copies
    travel, where the loss of a whole replica under ZeRO 1 with two replicas loses state by design (the recovery
    then says `lossless: false`; docs/usage.md)."""
    run_dir = tmp_path / "faulted"
    logs = [tmp_path / f"node{n}.log" for n in (0, 1)]
    stops = "fault.faults=[" + ",".join(f"{{rank:{r},step:5,phase:forward,kind:hang}}" for r in (0, 1)) + "]"
    with EtcdCluster(3) as etcd:
        address = etcd.address("two-nodes")
        procs = []
        for node, path in enumerate(logs):
            with open(path, "w") as log:
                procs.append(subprocess.Popen(
                    [sys.executable, "-m", "ntp_ds.cli", "launch", "--nnodes", "2", "--node-rank", str(node),
                     "--store", address, "--nproc-per-node", "2", "--grace-s", "5", "-m", "ntp_ds.train", *JOB,
                     stops, f"run_dir={run_dir}"],
                    stdout=log, stderr=subprocess.STDOUT, env=_env(), cwd=REPO, start_new_session=True))
        try:
            deadline = time.monotonic() + 240
            wait_for_lines(logs[0], [f"injecting hang on rank {r} at step 5" for r in (0, 1)], procs, deadline)
            os.killpg(procs[0].pid, signal.SIGKILL)  # the whole node: its launcher and both (stopped) workers
            procs[1].wait(timeout=max(1.0, deadline - time.monotonic()))
        finally:
            _stop(*procs)
    assert procs[1].returncode == 0, logs[1].read_text()[-4000:]
    recoveries = run_events(run_dir, "recovery")
    assert [e["degrees_after"] for e in recoveries] == [[2, 0]] and recoveries[0]["lossless"], recoveries
    assert recoveries[0]["dead"] == [0, 1]  # replica 0 dropped: replica 1 is listed first now
    assert _steps_done(run_dir) == STEPS
    assert_same_final_weights(run_dir, clean)


CYCLES = 25
"""Crash-and-repair cycles of the 50-generation job: each crash and each join starts a generation."""
LONG_STEPS = 4 * CYCLES + 24
LONG_JOB = [*(j for j in JOB if not j.startswith("train.steps")), f"train.steps={LONG_STEPS}"]


def _keys_under(store, prefix: str) -> list[str]:
    """The keys of the job under `prefix` (one range read, keys only)."""
    import base64

    start = store._key(prefix)
    end = start[:-1] + bytes([start[-1] + 1])
    answer = store._call("/kv/range", {"key": base64.b64encode(start).decode(),
                                       "range_end": base64.b64encode(end).decode(), "keys_only": True})
    return [base64.b64decode(kv["key"])[len(store._prefix):].decode() for kv in answer.get("kvs", [])]


@pytest.mark.etcd
def test_a_job_runs_through_50_generations_on_a_64_mb_quota_and_keeps_the_last_two(tmp_path):
    """25 times over, the worker at TP rank 1 of replica 1 crashes in a backward pass and is repaired (a fresh launch
    rank joins in its place): 50 generations, on a 3-member cluster whose space quota is 64 MB, the job compacting
    every 500 revisions. The faults are sent to the running job through the store (a schedule cannot name the
    replacements' launch ranks): crash launch rank 3 + i at step 4i + 2, repair it from step 4i + 4."""
    from ntp_ds.control.etcd_store import COMPACTION_KEY
    from ntp_ds.control.faults import REPAIR_PHASE, Fault, send_fault

    clean = train_clean(tmp_path / "clean", LONG_JOB, timeout=600)
    run_dir, log_path = tmp_path / "faulted", tmp_path / "job.log"
    with EtcdCluster(3, quota_bytes=64 << 20) as etcd, open(log_path, "w") as log:
        address = etcd.address("fifty")
        proc = subprocess.Popen(
            [sys.executable, "-m", "ntp_ds.cli", "train", *LONG_JOB, f"launcher.store={address}",
             f"hydra.run.dir={run_dir}", "fault=none"],
            stdout=log, stderr=subprocess.STDOUT, env={**_env(), "NTP_ETCD_COMPACT_EVERY": "500"}, cwd=REPO,
            start_new_session=True)
        try:
            deadline = time.monotonic() + 900
            _wait_for_step(run_dir, 1, [proc], deadline, log_path)
            store = connect_store(address, 30)
            for i in range(CYCLES):
                send_fault(store, Fault(3 + i, 4 * i + 2, "backward", "crash"))
                send_fault(store, Fault(3 + i, 4 * i + 4, REPAIR_PHASE, "repair"))
            proc.wait(timeout=max(1.0, deadline - time.monotonic()))
            compacted_to = int(store.get(COMPACTION_KEY.decode()))
            revision = int(store._call("/kv/range", {"key": "AA=="})["header"]["revision"])
            groups = {int(k.split("/")[1]) for k in _keys_under(store, "pg/")}
            agreements = {int(k.split("/")[1]) for k in _keys_under(store, "membership/")}
        finally:
            _stop(proc)
    assert proc.returncode == 0, log_path.read_text()[-4000:]
    recoveries, joins = run_events(run_dir, "recovery"), run_events(run_dir, "join")
    assert len(recoveries) == CYCLES and len(joins) == CYCLES, (len(recoveries), len(joins))
    assert all(e["lossless"] for e in recoveries + joins)
    last = max(e["generation"] for e in recoveries + joins)
    assert last == 2 * CYCLES
    assert groups <= {last - 1, last} and agreements <= {last - 1, last}, (groups, agreements)
    assert 0 < compacted_to and revision - compacted_to < 5000, (compacted_to, revision)  # compacted all along
    assert _steps_done(run_dir) == LONG_STEPS
    assert_same_final_weights(run_dir, clean)
