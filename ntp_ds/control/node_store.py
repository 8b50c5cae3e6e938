"""A node's own store: its workers' liveness stays on the node between failures.

At 100,000 ranks, every worker beating to the job's store and every watcher polling it costs the store about half a
million requests a second while nothing happens. `ntp-ds launch` therefore hosts a second, small store for its node
(on 127.0.0.1, `NTP_NODE_STORE`), and between failures:

- each worker beats there (`Heartbeat`'s `beats_to`): the launcher reads its workers' beats from it and publishes
  them as the node's one key in the job's store (`NodePublisher`);
- the recovery's barriers over the whole generation (the survivors' confirmation, the new generation's arrival,
  its end) are met there first, and reach the job's store once per node (`membership.BarrierWait`'s `node`);
- each watcher lists there the nodes whose keys it polls (`watching_key`), and the launcher copies those node keys
  and the exit and fence logs' counters from the job's store into one key of the node's (`NodeMirror`), one request
  per period for the whole node; a quiet watcher reads that copy (`LivenessReader`'s `mirror`);
- the launcher relays the job's alarms into it (`liveness_store.AlarmRelay`): one wait in the job's store per node,
  and the node's workers wait on the node's key (`Heartbeat`'s `alarms_from`).

And at a failure, the node's ranks share their reads of the job's store through it (`node_local.NodeLocal.read`):
the logs' new entries, the reports, the decision and its counters, the fast polls' node keys are read by one rank of
the node and taken from its copy by the others.

What the copy may hide, and what it does not: it is at most a period old, so a watcher reads the job's store itself
whenever something is news (an alarm, a peer silent for half the timeout, a new exit or fence), which is also when
a failure is being judged; the entries of the exit and fence logs are always read from the job's store. A copy that
has stopped moving (its launcher is gone) is not read at all, nor one that lacks a node the watcher wants: the job's
store is the truth, the copy an economy. A worker whose node store fails beats to the job's store from then on, and
its node key, no longer published, is read per rank by its watchers (`LivenessReader`).

With racks (`--rack-size K`, several racks), the launcher of each rack's first node also hosts a store for the rack
(`share_rack_store`; its address in the job's store, `NTP_RACK_STORE` to the workers): a node's side of a barrier
meets its rack's there, and reads of keys that never change are left there for the rack's other nodes
(`node_local`). It dies with its host's launcher; its rack's other nodes then meet the job's store node by node.

Under another launcher (`deepspeed`, `torchrun`) there is no node store: workers beat to the job's store and poll it.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from ntp_ds.control.keys import (EXITED_KEY, FENCE_KEY, NODE_MIRROR_KEY, WATCHERS, log_count_key, node_key,
                                 rack_store_key, watching_key)
from ntp_ds.control.node_local import NodeLocal
from ntp_ds.envs import NODE_SIZE_ENV, NODE_STORE_ENV, RACK_SIZE_ENV, RACK_STORE_ENV, WORLD_SIZE

PERIOD_S = 0.5
"""How often a launcher publishes its node's key and copies the keys its workers' watchers poll, until its workers
have said how often they beat (then: at their shortest beat interval, `NodeMirror.period_s`). Faster costs the
job's store more (two requests per node per period); slower delays what a watcher sees of a beat by more."""
STEADY_REQUESTS_PER_S = 25_000
"""What all the launchers together may ask of the job's store between failures. Each publishes its node's key and
copies its watchers' keys (two requests) once per period: past STEADY_REQUESTS_PER_S * PERIOD_S / 2 nodes (6,250,
50,000 GPUs of 8 per node) the period grows with the nodes, so the job's store's load between failures stays flat
and a beat takes longer to be seen (1 s at 100,000 GPUs; `launcher_period_s`)."""
NODE_CONNECT_TIMEOUT_S = 60.0
"""Bound on connecting to the node's store for the membership's barriers and acknowledgements (`node_local`): a
worker that cannot count its acknowledgement there cannot take part (its node-mates count it there)."""
NODE_STORE_TIMEOUT_S = 2.0
"""Bound on a call to the node's store: it lives on this machine, so a call that takes longer means its launcher
is gone or stuck (a worker then beats to the job's store). A call to the rack's store has the same bound."""
RACK_STORE_WAIT_S = 60.0
"""Longest a launcher waits for its rack's first node to publish the rack's store: past it, its workers meet the
job's store node by node (and their rack-mates, through the rack's store, learn so: `membership.BarrierWait`)."""


def launcher_period_s(nodes: int, interval_s: float = PERIOD_S) -> float:
    """How often each launcher of a job of `nodes` nodes publishes and copies, its workers beating every
    `interval_s`: as often as they beat, but no launcher more often than the job's store's budget allows."""
    return max(interval_s, 2 * nodes / STEADY_REQUESTS_PER_S)


def launch_nodes(env: Mapping[str, str] = os.environ) -> int | None:
    """The launch's number of nodes (`WORLD_SIZE` / `NTP_NODE_SIZE`), or None where a launcher did not say."""
    size, world = env.get(NODE_SIZE_ENV, ""), env.get(WORLD_SIZE, "")
    if not (size.isdigit() and world.isdigit()) or int(size) < 1:
        return None
    return -(-int(world) // int(size))


def host_node_store():
    """Host this node's store (in the launcher, on 127.0.0.1 and a free port); return it and its HOST:PORT."""
    from ntp_ds.control.store import host_store

    return host_store(0, "127.0.0.1", NODE_STORE_TIMEOUT_S)


def share_rack_store(job_store, node_rank: int, rack_size: int, host: str):
    """The rack's store for launcher `node_rank`: hosted here on the rack's first node (listening on every interface,
    named by `host`) and its address published in the job's store; read from there by the rack's other launchers.
    Return (the store this process hosts or None, the address, or "" where it could not be had: the workers then
    claim their rack's arrivals as `nodes`, `_rack_level`)."""
    from datetime import timedelta

    from ntp_ds.control.store import host_store

    rack, key = node_rank // rack_size, rack_store_key(node_rank // rack_size)
    if node_rank % rack_size == 0:
        store, address = host_store(0, host, NODE_STORE_TIMEOUT_S)
        job_store.set(key, address)
        return store, address
    try:
        job_store.wait([key], timedelta(seconds=RACK_STORE_WAIT_S))
        return None, job_store.get(key).decode()
    except Exception as err:  # (its first node's launcher is late or gone)
        import logging

        logging.getLogger("ntp_ds.control.heartbeat").warning(
            "rack %d's store was not published within %g s (%s): node %d meets the job's store node by node", rack,
            RACK_STORE_WAIT_S, err, node_rank)
        return None, ""


def connect_node_store(env: Mapping[str, str] = os.environ):
    """A client of the node's store the launcher named in `NTP_NODE_STORE`, or None where there is none (another
    launcher) or it cannot be reached (then the job's store serves)."""
    address = env.get(NODE_STORE_ENV)
    if not address:
        return None
    from ntp_ds.control.store import connect_store

    try:
        return connect_store(address, NODE_STORE_TIMEOUT_S)
    except (ConnectionError, ValueError):
        return None


def node_local(env: Mapping[str, str] = os.environ) -> NodeLocal | None:
    """The node's store (a client of its own), the ranks per node and the launch's world size, for the barriers and
    acknowledgements met through it (`membership`); None without a node store or a node size (another launcher, a
    joiner). A node store named but out of reach is an error: the node's other workers count this one's
    acknowledgement there (`Membership`), so it cannot count it elsewhere."""
    size, world = env.get(NODE_SIZE_ENV), env.get(WORLD_SIZE, "")
    if not size or not size.isdigit() or int(size) < 1 or not env.get(NODE_STORE_ENV):
        return None
    from datetime import timedelta

    from ntp_ds.control.store import connect_store

    try:  # (a loaded machine may take seconds to answer a connection: the bound on its calls comes after)
        store = connect_store(env[NODE_STORE_ENV], NODE_CONNECT_TIMEOUT_S)
    except (ConnectionError, ValueError) as err:
        raise ConnectionError(f"{NODE_STORE_ENV}={env[NODE_STORE_ENV]}: this worker cannot reach its node's store "
                              f"(hosted by its launcher on this machine) within {NODE_CONNECT_TIMEOUT_S:g} s") from err
    store.set_timeout(timedelta(seconds=NODE_STORE_TIMEOUT_S))
    launched = int(world) if world.isdigit() else None
    return NodeLocal(store, int(size), launched, rack=_rack_level(env, int(size), launched))


class _Unreachable:
    """The rack's store a worker could not reach: every call fails (its level is marked failed from the start)."""

    def __getattr__(self, name):
        raise ConnectionError("this worker could not reach its rack's store")


def _rack_level(env: Mapping[str, str], size: int, launched: int | None) -> NodeLocal | None:
    """The rack's level of a worker whose launcher gave it its rack's store (`NTP_RACK_STORE`, with `NTP_RACK_SIZE`),
    or, where the launcher had none to give (an empty address) or it cannot be reached, a level marked failed, so
    that the worker's node still claims its rack's arrival as `nodes` (`membership.BarrierWait`) and its rack-mates
    need not wait for it in the rack's store; None where the launcher hosts no rack level."""
    from datetime import timedelta

    from ntp_ds.control.store import connect_store

    rack_size = env.get(RACK_SIZE_ENV, "")
    if RACK_STORE_ENV not in env or not rack_size.isdigit() or int(rack_size) < 2 or launched is None:
        return None
    address, store, err = env[RACK_STORE_ENV], None, None
    if address:
        try:
            store = connect_store(address, NODE_CONNECT_TIMEOUT_S)
            store.set_timeout(timedelta(seconds=NODE_STORE_TIMEOUT_S))
        except (ConnectionError, ValueError, RuntimeError) as e:
            store, err = None, e
    level = NodeLocal.for_rack(store if store is not None else _Unreachable(), size * int(rack_size), launched)
    if store is None:
        level.failed(err or ConnectionError(f"no {RACK_STORE_ENV} from the launcher"))
    return level


def list_watched(node_store, rank: int, nodes: Iterable[int], interval_s: float, watcher: str = "heartbeat") -> None:
    """Tell the launcher which nodes' keys a reader (`keys.WATCHERS`) of worker `rank` polls (it copies them into
    the node's store) and how often the worker beats (the launcher publishes and copies as often)."""
    node_store.set(watching_key(rank, watcher), json.dumps({"nodes": sorted(set(nodes)), "interval_s": interval_s}))


@dataclass(frozen=True)
class MirrorView:
    """The launcher's copy: a sequence number that rises with every copy, the raw node keys copied, and the exit
    and fence logs' counters as the job's store held them then."""

    seq: int
    nodes: dict[int, str]
    exits: int
    fences: int

    def encode(self) -> str:
        return json.dumps({"seq": self.seq, "nodes": {str(n): v for n, v in self.nodes.items()},
                           "counts": [self.exits, self.fences]}, separators=(",", ":"))

    @classmethod
    def decode(cls, raw: bytes | str) -> MirrorView:
        d = json.loads(raw)
        return cls(d["seq"], {int(n): v for n, v in d["nodes"].items()}, *d["counts"])


class NodeMirror:
    """A launcher's side of the copy: every `refresh` reads the nodes its workers watch (from the node's store), then
    those nodes' keys and the two log counters from the job's store in one request, and writes them as one key of
    the node's store (`NODE_MIRROR_KEY`)."""

    def __init__(self, job_store, node_store, ranks: Iterable[int], nodes: int = 1):
        self.job_store, self.node_store, self.ranks = job_store, node_store, tuple(ranks)
        self.nodes = nodes
        """The job's nodes: their number bounds the period from below (`launcher_period_s`)."""
        self.seq = 0
        self.period_s = launcher_period_s(nodes)
        """How often to publish and copy: the shortest beat interval of the node's workers, as they listed it, or
        the job's store's budget's period where that is longer."""
        self._present: set[str] = set()  # job-store keys seen to exist (node keys are never deleted)

    def watched(self) -> set[int]:
        """The nodes this node's workers watch now (and `period_s` from what they listed)."""
        keys = [watching_key(r, w) for r in self.ranks for w in WATCHERS]
        if self.node_store.check(keys):
            raws = self.node_store.multi_get(keys)
        else:  # a reader that has not listed its nodes yet
            raws = [self.node_store.get(k) for k in keys if self.node_store.check([k])]
        listed = [json.loads(raw) for raw in raws]
        if listed:
            self.period_s = launcher_period_s(self.nodes, min(entry["interval_s"] for entry in listed))
        return {n for entry in listed for n in entry["nodes"]}

    def refresh(self) -> MirrorView:
        """Copy once; return the copy."""
        counts = [log_count_key(EXITED_KEY), log_count_key(FENCE_KEY)]
        wanted = [node_key(n) for n in sorted(self.watched())]
        missing = [k for k in wanted + counts if k not in self._present]
        if missing and not self.job_store.check(missing):  # a node not published yet: left out of this copy
            self._present.update(k for k in missing if self.job_store.check([k]))
        else:
            self._present.update(missing)
        if not set(counts) <= self._present:  # created by `prepare_store`, before any worker starts
            raise RuntimeError("the job's store has no exit and fence log counters yet")
        keys = [k for k in wanted if k in self._present]
        values = self.job_store.multi_get(keys + counts)
        self.seq += 1
        view = MirrorView(self.seq, {int(k.rsplit("/", 1)[1]): v.decode() for k, v in zip(keys, values)},
                          int(values[-2]), int(values[-1]))
        self.node_store.set(NODE_MIRROR_KEY, view.encode())
        return view
