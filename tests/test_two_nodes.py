"""Two nodes on one machine: two `ntp-ds launch` processes, node 0 hosting the store, node 1 joining with --store.

Node 1's workers are replica 1 (ranks 2 and 3). Rank 3 crashes at step 2 (replica 1 goes on at TP 1); later node 1
is lost whole after step 4 (its launcher killed with its worker, nobody left there to report the exit), well before
the last step: its worker stops itself (SIGSTOP) as step 5 begins, then the test kills the node, so the loss never
falls inside an optimizer step or while step 4's redundant copies travel (a whole replica lost there under ZeRO 1
loses state by design, and the recovery says `lossless: false`). Node 0's replica goes on alone; then a replacement
node (`ntp-ds launch --join`, two workers) brings replica 1 back at TP 2. The final weights must equal the
failure-free run's. Rank 0 runs slowed (a `slow` fault, which only waits) from step 5 on, so that the replacement's
workers start before the job ends.
"""

import os
import signal
import time

import pytest

from tests.helpers.cli import free_port, launch_node, run_events, train_clean
from tests.helpers.training import assert_same_final_weights, wait_for_lines

STEPS = 14
JOB = ["parallel.tp=2", "parallel.replicas=2", "parallel.timeout_s=20", f"train.steps={STEPS}",
       "train.global_batch=8", "train.micro_batch=2", "data.seq_len=16", "logging.progress=false"]


FAULTS = ("fault.faults=[{rank:3,step:2,phase:backward,kind:crash},{rank:0,step:5,phase:forward,kind:slow,factor:25},"
          "{rank:2,step:5,phase:forward,kind:hang}]")


def _launch(node: int | None, port: int, run_dir, log):
    """Node `node` of the two, or (None) a replacement node that joins the running job."""
    where = ["--join"] if node is None else ["--nnodes", "2", "--node-rank", str(node)]
    return launch_node([*where, "--store", f"127.0.0.1:{port}", "--nproc-per-node", "2", "--grace-s", "5",
                        "-m", "ntp_ds.train", *JOB, FAULTS, f"run_dir={run_dir}"], log)


@pytest.mark.long
def test_two_nodes_survive_a_worker_and_the_whole_second_node_and_a_replacement_node_joins(tmp_path):
    clean = train_clean(tmp_path / "clean", JOB, timeout=240)

    run_dir, port = tmp_path / "faulted", free_port()
    logs = [open(tmp_path / f"node{n}.log", "w") for n in (0, 1, 2)]
    node0 = _launch(0, port, run_dir, logs[0])
    time.sleep(1.0)  # node 0 hosts the store
    node1 = _launch(1, port, run_dir, logs[1])
    node2 = None
    try:
        deadline = time.monotonic() + 240
        wait_for_lines(tmp_path / "node1.log", ["injecting hang on rank 2 at step 5"], [node0, node1], deadline)
        os.killpg(node1.pid, signal.SIGKILL)  # the whole node: its launcher and its remaining (stopped) worker
        while len(run_events(run_dir, "recovery")) < 2 and time.monotonic() < deadline and node0.poll() is None:
            time.sleep(0.2)
        node2 = _launch(None, port, run_dir, logs[2])  # a replacement node joins the running job
        node0.wait(timeout=max(1.0, deadline - time.monotonic()))
        node2.wait(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        for proc in (node0, node1, node2):
            if proc is not None and proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        for log in logs:
            log.close()
    output = (tmp_path / "node0.log").read_text()
    assert node0.returncode == 0, output[-4000:]
    assert node2.returncode == 0, (tmp_path / "node2.log").read_text()[-4000:]
    recoveries = run_events(run_dir, "recovery")
    assert [e["degrees_after"] for e in recoveries] == [[2, 1], [2, 0]], recoveries
    assert all(e["lossless"] for e in recoveries)
    joins = run_events(run_dir, "join")  # the two workers are taken in together, or at two boundaries
    assert sorted(r for e in joins for r in e["joined"]) == [4, 5] and joins[-1]["degrees_after"] == [2, 2]
    assert all(e["lossless"] and e["bytes_moved"] == e["joiner_shard_bytes"] > 0 for e in joins)
    assert_same_final_weights(run_dir, clean)
