"""A throwaway etcd cluster on loopback ports, for tests of the etcd store: each member an `etcd` process of its own,
its data in a temporary directory, stopped (or killed, as a lost member) one by one."""

from __future__ import annotations

import shutil
import signal
import socket
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path


def etcd_binary() -> str | None:
    """The `etcd` server on PATH (Debian's `etcd-server` package installs it), or None."""
    return shutil.which("etcd")


def _free_ports(n: int) -> list[int]:
    sockets = [socket.socket() for _ in range(n)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


class EtcdCluster:
    """`members` etcd processes forming one cluster; `address(job)` is the store address a job is given.
    `quota_bytes`: each member's space quota (etcd's `--quota-backend-bytes`; default 2 GiB)."""

    def __init__(self, members: int = 3, start_timeout_s: float = 30.0, quota_bytes: int | None = None):
        binary = etcd_binary()
        if binary is None:
            raise RuntimeError("no etcd on PATH: install the etcd server (Debian/Ubuntu: apt-get install etcd-server)")
        self.root = Path(tempfile.mkdtemp(prefix="ntp-etcd-"))
        ports = _free_ports(2 * members)
        self.client_ports, peer_ports = ports[:members], ports[members:]
        cluster = ",".join(f"m{i}=http://127.0.0.1:{p}" for i, p in enumerate(peer_ports))
        self.procs: list[subprocess.Popen | None] = []
        for i in range(members):
            client, peer = f"http://127.0.0.1:{self.client_ports[i]}", f"http://127.0.0.1:{peer_ports[i]}"
            log = open(self.root / f"m{i}.log", "w")
            self.procs.append(subprocess.Popen(
                [binary, "--name", f"m{i}", "--data-dir", str(self.root / f"m{i}"),
                 "--listen-client-urls", client, "--advertise-client-urls", client,
                 "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
                 "--initial-cluster", cluster, "--initial-cluster-state", "new",
                 "--initial-cluster-token", self.root.name, "--heartbeat-interval", "50",
                 "--election-timeout", "500",
                 *([f"--quota-backend-bytes={quota_bytes}"] if quota_bytes else [])],
                stdout=log, stderr=subprocess.STDOUT))
            log.close()
        deadline = time.monotonic() + start_timeout_s
        while not all(self.healthy(i) for i in range(members)):
            if time.monotonic() > deadline or any(p.poll() is not None for p in self.procs):
                logs = "\n".join((self.root / f"m{i}.log").read_text()[-1500:] for i in range(members))
                self.close()
                raise RuntimeError(f"the etcd cluster did not come up within {start_timeout_s}s:\n{logs}")
            time.sleep(0.1)

    def healthy(self, member: int) -> bool:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.client_ports[member]}/health", timeout=1.0) as r:
                return b'"true"' in r.read()
        except OSError:
            return False

    def address(self, job: str = "job") -> str:
        return "etcd://" + ",".join(f"127.0.0.1:{p}" for p in self.client_ports) + f"/{job}"

    def kill(self, member: int) -> None:
        """Lose a member as a crashed host loses it: SIGKILL, no goodbye to its peers."""
        proc = self.procs[member]
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=10)

    def close(self) -> None:
        for i in range(len(self.procs)):
            self.kill(i)
        shutil.rmtree(self.root, ignore_errors=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
