"""Two nodes on one machine: two `ntp-ds launch` processes, node 0 hosting the store, node 1 joining with --store.

Node 1's workers are replica 1 (ranks 2 and 3). Rank 3 crashes at step 2 (replica 1 goes on at TP 1); later node 1
is lost whole after step 4 (its launcher killed with its worker, nobody left there to report the exit), well before
the last step. Node 0's replica goes on alone, and its final weights must equal the failure-free run's.
"""

import json
import os
import signal
import socket
import subprocess
import sys
import time

from safetensors.torch import load_file

from tests.test_cli import REPO, ntp_ds

STEPS = 12
JOB = ["parallel.tp=2", "parallel.replicas=2", "parallel.timeout_s=20", f"train.steps={STEPS}",
       "train.global_batch=8", "train.micro_batch=2", "data.seq_len=16", "logging.progress=false"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(node: int, port: int, run_dir, log) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(REPO), "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1",
           "WANDB_MODE": "offline"}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "NTP_RUN_DIR", "NTP_STORE"):
        env.pop(key, None)
    args = [sys.executable, "-m", "ntp_ds.cli", "launch", "--nnodes", "2", "--node-rank", str(node),
            "--store", f"127.0.0.1:{port}", "--nproc-per-node", "2", "--grace-s", "5", "-m", "ntp_ds.train", *JOB,
            "fault.faults=[{rank:3,step:2,phase:backward,kind:crash}]", f"run_dir={run_dir}"]
    return subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO, start_new_session=True)


def _steps_done(run_dir) -> int:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return 0
    steps = [json.loads(line).get("step", 0) for line in path.read_text().splitlines() if line.strip()]
    return max(steps, default=0)


def test_two_nodes_survive_a_worker_and_then_the_whole_second_node(tmp_path):
    clean = tmp_path / "clean"
    result = ntp_ds("train", *JOB, "fault=none", f"hydra.run.dir={clean}", timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]

    run_dir, port = tmp_path / "faulted", _free_port()
    logs = [open(tmp_path / f"node{n}.log", "w") for n in (0, 1)]
    node0 = _launch(0, port, run_dir, logs[0])
    time.sleep(1.0)  # node 0 hosts the store
    node1 = _launch(1, port, run_dir, logs[1])
    try:
        deadline = time.monotonic() + 240
        while _steps_done(run_dir) < 4 and time.monotonic() < deadline and node0.poll() is None:
            time.sleep(0.2)
        assert _steps_done(run_dir) >= 4, (tmp_path / "node0.log").read_text()[-3000:]
        os.killpg(node1.pid, signal.SIGKILL)  # the whole node: its launcher and its remaining worker
        node0.wait(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        for proc in (node0, node1):
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        for log in logs:
            log.close()
    output = (tmp_path / "node0.log").read_text()
    assert node0.returncode == 0, output[-4000:]
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    recoveries = [e for e in events if e["event"] == "recovery"]
    assert [e["degrees_after"] for e in recoveries] == [[2, 1], [2, 0]], recoveries
    assert all(e["lossless"] for e in recoveries)
    want = load_file(str(clean / "final" / "model.safetensors"))
    got = load_file(str(run_dir / "final" / "model.safetensors"))
    assert set(got) == set(want)
    for name, tensor in want.items():
        diff = (got[name] - tensor).abs().max().item()
        assert diff <= 1e-5, f"{name}: max abs difference {diff:.3g}"
