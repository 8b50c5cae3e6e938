"""Running the `ntp-ds` command and other commands in their own session, killed whole at a timeout."""

import os
import signal
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
