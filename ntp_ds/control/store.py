"""The coordination store: a TCPStore hosted outside every training rank, and the clients that reach it.

`torch.distributed` hosts its store inside rank 0 by default, so losing rank 0 loses the store. The launcher hosts
it instead (`host_store`), and every worker connects as a client (`connect_store`) to the address it passes in
`NTP_STORE=HOST:PORT`. Each generation of process groups rendezvouses under a key prefix of its own
(`generation_store`), so a regroup never reads a key left by the groups it replaces.

A TCPStore client serialises its operations: a blocking `wait` on one client delays every other call on it. A thread
that must not be delayed (the heartbeat) gets a client of its own.
"""

from __future__ import annotations

import datetime
import logging
import os
import socket
import threading
import time

import torch.distributed as dist

from ntp_ds.control.address import format_address, is_etcd_address, parse_address
from ntp_ds.control.keys import PING_KEY, generation_keys, process_group_prefix
from ntp_ds.envs import MASTER_ADDR, MASTER_PORT, RANK, STORE_ENV

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 60.0
"""Default bound on connecting and on any blocking store call."""


def _timedelta(timeout_s: float) -> datetime.timedelta:
    if not timeout_s > 0:
        raise ValueError(f"timeout_s={timeout_s} must be positive")
    return datetime.timedelta(seconds=timeout_s)


def connect_store(address: str, timeout_s: float = DEFAULT_TIMEOUT_S, *, forks: bool = False) -> dist.Store:
    """Connect a client to the store at `address` (`HOST:PORT`, a TCPStore, or `etcd://HOST:PORT[,...][/JOB]`, an
    etcd cluster: `control.etcd_store`); every blocking call on it is bounded by `timeout_s`. `forks`: this process
    forks workers (a launcher), so an etcd client speaks HTTP to the gateway, not gRPC (`EtcdStore`).

    Raise ValueError for a malformed address and ConnectionError when nothing answers within `timeout_s`.
    """
    if is_etcd_address(address):
        return _connect_etcd(address, timeout_s, "http" if forks else "grpc")
    host, port = parse_address(address)
    deadline = time.monotonic() + timeout_s
    _await_listener(host, port, address, timeout_s)
    # The client's handshake does not honour its timeout against a peer that accepts and never answers (a port
    # that is not a store): run it aside and give up at the deadline.
    outcome: list = []

    def handshake():
        try:
            outcome.append(dist.TCPStore(host, port, is_master=False, timeout=_timedelta(timeout_s),
                                         wait_for_workers=False))
        except (dist.DistError, RuntimeError) as err:
            outcome.append(err)

    thread = threading.Thread(target=handshake, name="ntp-store-connect", daemon=True)
    thread.start()
    thread.join(max(0.05, deadline - time.monotonic()))
    if not outcome:
        raise ConnectionError(f"{address} accepts connections but did not answer as a store within {timeout_s}s "
                              f"(is it the job's store?)")
    if isinstance(outcome[0], BaseException):
        raise ConnectionError(f"cannot reach the store at {address} within {timeout_s}s: {outcome[0]}") from outcome[0]
    return outcome[0]


def _connect_etcd(address: str, timeout_s: float, transport: str) -> dist.Store:
    from ntp_ds.control.etcd_store import EtcdStore

    store = EtcdStore(address, timeout_s, transport)
    try:
        store.check([PING_KEY])  # one read through the cluster: some member answers, and it has a leader
    except dist.DistStoreError as e:
        raise ConnectionError(f"cannot reach the etcd cluster at {address} within {timeout_s}s: {e}") from None
    return store


def _await_listener(host: str, port: int, address: str, timeout_s: float) -> None:
    """Wait until something accepts connections at host:port, so an absent store fails quietly and on time."""
    deadline = time.monotonic() + timeout_s
    while True:
        left = deadline - time.monotonic()
        try:
            socket.create_connection((host, port), timeout=max(0.05, min(1.0, left))).close()
            return
        except OSError as err:
            if left <= 0.1:
                raise ConnectionError(f"cannot reach the store at {address} within {timeout_s}s: {err}") from None
            time.sleep(0.1)


def connect_from_env(timeout_s: float = DEFAULT_TIMEOUT_S, env=os.environ) -> dist.Store:
    """Connect to the store whose address the launcher put in `NTP_STORE`."""
    address = env.get(STORE_ENV)
    if not address:
        raise ValueError(f"{STORE_ENV} is not set; the launcher passes the store address as {STORE_ENV}=HOST:PORT")
    return connect_store(address, timeout_s)


def host_store(port: int = 0, host: str = "127.0.0.1",
               timeout_s: float = DEFAULT_TIMEOUT_S) -> tuple[dist.TCPStore, str]:
    """Host a store in this process (the launcher, never a training rank); return it and its HOST:PORT.

    `port=0` takes a free ephemeral port. `host` is the name workers use to reach this machine; the store listens on
    every interface: every IPv4 one where `host` has IPv4 addresses only (see `_ipv4_listener`), else every one.
    """
    if not 0 <= port <= 65535:
        raise ValueError(f"port={port} must lie in 0..65535 (0 picks a free port)")
    listener = _ipv4_listener(host, port)
    if listener is None:
        store = dist.TCPStore(host, port, is_master=True, timeout=_timedelta(timeout_s), wait_for_workers=False)
    else:
        store = dist.TCPStore(host, listener.getsockname()[1], is_master=True, timeout=_timedelta(timeout_s),
                              wait_for_workers=False, master_listen_fd=listener.detach())
    return store, format_address(host, store.port)


def _ipv4_listener(host: str, port: int) -> socket.socket | None:
    """A listening IPv4 socket on every interface at `port`, for a `host` with IPv4 addresses only (else None).

    The TCPStore server names every client it accepts for its log with a reverse lookup (`getnameinfo`), inside its
    one event-loop thread. On its own dual-stack socket a client on an IPv4 address arrives as an IPv4-mapped IPv6
    address, which no hosts file lists, so every connection asks DNS, and a DNS that drops a query holds the whole
    store for the resolver's timeout: every rank's beats and waits with it (seen here: 5 s about every 25
    connections). Accepted on an IPv4 socket, a client on this machine is the hosts file's `localhost`."""
    try:
        families = {info[0] for info in socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)}
    except socket.gaierror:
        return None
    if families != {socket.AF_INET}:
        return None
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("0.0.0.0", port))
        listener.listen(socket.SOMAXCONN)
    except OSError:
        listener.close()
        raise
    return listener


def generation_store(store: dist.Store, generation: int) -> dist.PrefixStore:
    """Return a view of `store` whose keys are private to process groups of `generation`."""
    if isinstance(generation, bool) or not isinstance(generation, int) or generation < 0:
        raise ValueError(f"generation={generation!r} must be a non-negative integer")
    return dist.PrefixStore(process_group_prefix(generation), store)


def forget_generation(store: dist.Store, generation: int) -> int:
    """Delete the keys of `generation` (`keys.generation_keys`), which nobody reads once two newer generations
    exist; return how many went. A store that deletes by prefix (etcd: one request per prefix) loses them all; a
    TCPStore, which deletes named keys only, loses the decision and the join plan and keeps the rest (its keys live
    in the launcher's memory, where a generation's cost the job's age multiplies)."""
    prefixes, exact = generation_keys(generation)
    gone = sum(bool(store.delete_key(k)) for k in exact)
    if hasattr(store, "delete_prefix"):
        gone += sum(store.delete_prefix(p) for p in prefixes)
    return gone


def job_store(timeout_s: float, env=os.environ) -> tuple[dist.Store | None, bool]:
    """Return (store, hosted here) for a training rank: the launcher's store (NTP_STORE), else one that rank 0 hosts
    for the job, else (None, False) where there is no address to host it at.

    `ntp-ds launch` (and `ntp-ds train`) host the store outside every rank. Under another launcher (deepspeed,
    torchrun) rank 0 hosts it at MASTER_ADDR:MASTER_PORT+1, so recovery works there too, as long as rank 0 lives.
    """
    if env.get(STORE_ENV):
        return connect_from_env(timeout_s, env), False
    if not (env.get(MASTER_ADDR) and env.get(MASTER_PORT)):
        return None, False
    host, port = env[MASTER_ADDR], int(env[MASTER_PORT]) + 1
    if int(env.get(RANK, "0")) == 0:
        store, _ = host_store(port, host, timeout_s)
        log.info("no %s from the launcher: rank 0 hosts the job's store at %s (losing rank 0 ends the job)",
                 STORE_ENV, format_address(host, port))
        return store, True
    return connect_store(format_address(host, port), timeout_s), False
