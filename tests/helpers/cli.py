"""Running the `ntp-ds` command and other commands in their own session, killed whole at a timeout."""

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def run(args: list[str], timeout: float, env: dict | None = None, cwd=None) -> subprocess.CompletedProcess:
    """Run a command in its own session; on timeout kill the whole group (launcher and workers) and fail."""
    full_env = {**os.environ, "PYTHONPATH": str(REPO), "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1",
                "WANDB_MODE": "offline", **(env or {})}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "NTP_RUN_DIR", "NTP_STORE"):
        if key not in (env or {}):
            full_env.pop(key, None)
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=full_env,
                            cwd=cwd or REPO, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"{' '.join(args)} did not finish in {timeout}s\nstdout:\n{out}\nstderr:\n{err}")
    return subprocess.CompletedProcess(args, proc.returncode, out, err)


def ntp_ds(*args: str, timeout: float = 60, env: dict | None = None) -> subprocess.CompletedProcess:
    return run([sys.executable, "-m", "ntp_ds.cli", *args], timeout, env)


def train_clean(run_dir, job: list[str], timeout: float = 240):
    """The failure-free reference of `job` (`ntp-ds train JOB fault=none`) in RUN_DIR; fail if it does not finish."""
    result = ntp_ds("train", *job, "fault=none", f"hydra.run.dir={run_dir}", timeout=timeout)
    assert result.returncode == 0, result.stderr[-3000:]
    return run_dir


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_node(args: list[str], log, env: dict | None = None) -> subprocess.Popen:
    """Start `ntp-ds launch ARGS` (one node of a job) in its own session, its output to `log`: a test kills the
    node whole (its launcher and its workers) with `os.killpg`."""
    full_env = {**os.environ, "PYTHONPATH": str(REPO), "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1",
                "WANDB_MODE": "offline", **(env or {})}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "NTP_RUN_DIR", "NTP_STORE", "NTP_RACK_SIZE"):
        full_env.pop(key, None)
    return subprocess.Popen([sys.executable, "-m", "ntp_ds.cli", "launch", *args], stdout=log,
                            stderr=subprocess.STDOUT, env=full_env, cwd=REPO, start_new_session=True)


def run_events(run_dir, kind: str) -> list[dict]:
    """The events of `kind` a run has written so far to RUN_DIR/events.jsonl."""
    path = Path(run_dir) / "events.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    return [e for e in map(json.loads, filter(None, lines)) if e["event"] == kind]
