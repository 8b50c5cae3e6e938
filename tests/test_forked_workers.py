"""Forked workers (`ntp_ds.supervise.forked`): a worker forked from the launcher starts as a fresh interpreter would
(its own environment, default signal handlers, no inherited descriptors, the thread count it asks for), ends as one
(exit status, exit handlers run) and is handled as `subprocess.Popen` is (poll, signals, kill).

The end-to-end runs of `ntp-ds train` (tests/test_train_run.py and the others) fork their workers: forking is
the default of `launcher.fork`.
"""

import atexit
import json
import os
import signal
import socket
import sys
import time
from pathlib import Path

import pytest
import torch

from ntp_ds.supervise.forked import can_fork, fork_worker
from ntp_ds.supervise.launch import LaunchSpec

pytestmark = pytest.mark.skipif(not can_fork(), reason="workers are forked on Linux machines without CUDA only")


def main(args: list[str]) -> int:
    """The worker of these tests: write what it sees to ARGS[0], then do ARGS[1]."""
    out, action, fd = Path(args[0]), args[1], int(args[2])
    try:
        os.fstat(fd)
        fd_open = True
    except OSError:
        fd_open = False
    report = {"env": dict(os.environ), "argv": sys.argv, "fd_open": fd_open, "threads": torch.get_num_threads(),
              "sigint_default": signal.getsignal(signal.SIGINT) is signal.default_int_handler,
              "sigterm_default": signal.getsignal(signal.SIGTERM) == signal.SIG_DFL}
    atexit.register(lambda: out.with_suffix(".atexit").write_text("ran"))
    out.write_text(json.dumps(report))
    if action == "sleep":
        time.sleep(60)  # until the test signals it; bounded all the same
    elif action == "raise":
        raise RuntimeError("a worker's unhandled error")
    elif action == "sys.exit":
        sys.exit(5)
    return 3 if action == "return3" else 0


def _fork(tmp_path: Path, action: str, env: dict | None = None, fd: int = 0):
    out = tmp_path / f"{action}.json"
    env = env or {"RANK": "0"}
    return fork_worker([sys.executable, "-u", "-m", __name__, str(out), action, str(fd)], env), out


def _wait(worker, timeout_s: float = 20.0) -> int:
    deadline = time.monotonic() + timeout_s
    while worker.poll() is None:
        if time.monotonic() > deadline:
            worker.kill()
            pytest.fail(f"forked worker {worker.pid} still running after {timeout_s} s")
        time.sleep(0.02)
    return worker.returncode


def test_a_forked_worker_starts_as_a_fresh_process(tmp_path):
    assert torch.get_num_threads() != 3
    listening = socket.socket()  # as the launcher's store
    listening.bind(("127.0.0.1", 0))
    listening.listen()
    fd = listening.fileno()
    previous = signal.signal(signal.SIGTERM, lambda *_: None)  # as the launcher's stop handler
    env = {"RANK": "2", "WORLD_SIZE": "4", "OMP_NUM_THREADS": "3", "PATH": os.environ.get("PATH", "")}
    try:
        worker, out = _fork(tmp_path, "return3", env, fd)
    finally:
        signal.signal(signal.SIGTERM, previous)
        listening.close()
    assert _wait(worker) == 3
    report = json.loads(out.read_text())
    assert report["env"] == env
    assert report["argv"] == [__name__, str(out), "return3", str(fd)]
    assert report["threads"] == 3
    assert report["sigint_default"] and report["sigterm_default"]
    assert report["fd_open"] is False
    assert out.with_suffix(".atexit").read_text() == "ran"


@pytest.mark.parametrize("action, code", [("return0", 0), ("sys.exit", 5), ("raise", 1)])
def test_a_forked_worker_exits_with_the_status_of_its_main(tmp_path, capfd, action, code):
    worker, out = _fork(tmp_path, action)
    assert _wait(worker) == code
    assert out.with_suffix(".atexit").read_text() == "ran"
    err = capfd.readouterr().err
    assert ("RuntimeError: a worker's unhandled error" in err) == (action == "raise")


def test_a_forked_worker_is_signalled_and_killed_as_a_popen(tmp_path):
    for signum in (signal.SIGTERM, signal.SIGKILL):
        worker, out = _fork(tmp_path, "sleep")
        deadline = time.monotonic() + 20
        while not out.is_file() and time.monotonic() < deadline:
            time.sleep(0.02)
        assert worker.poll() is None
        worker.kill() if signum == signal.SIGKILL else worker.send_signal(signum)
        assert _wait(worker) == -signum
        worker.send_signal(signal.SIGTERM)  # already reaped: nothing to signal, no error
        assert worker.poll() == -signum


def test_only_a_module_command_is_forked():
    with pytest.raises(ValueError, match="python -m MODULE ARGS"):
        fork_worker([sys.executable, "-u", "script.py"], {})
    assert LaunchSpec(["python", "x.py"]).fork is False  # `ntp-ds launch` starts fresh interpreters
