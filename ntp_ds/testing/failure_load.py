"""Every rank of a large job through a failure (or many), against a store served by a process of its own.

A job of W ranks (TP `tp` per replica, one replica per node of `tp` ranks, racks of `rack_nodes` nodes) is played by a
few processes, each owning a share of the nodes. No rank is sampled and no key is written in advance: every rank runs
the product's own control-plane code, on event loops (two threads per share, as `liveness_load` runs them) and one
thread per rank blocked in the store for alarms, each with store clients of its own:

- steady state: each rank's `Heartbeat` beats and polls its real peers (its TP group, its data-parallel ring
  neighbours, its buddies and the ranks it owns copies of, and its neighbours on the ring that interleaves the racks:
  the peers `NTPEngine.watched_peers` names in that topology), each node's launcher publishes its node key
  (`NodePublisher`) and copies the keys its watchers poll into its node's store (`NodeMirror`, with the fence
  requests its launcher reads), each launcher relays the job's alarms into its node's store (`AlarmRelay`), and each
  rank's alarm thread (`Heartbeat._await_alarms`) waits for them there. A node's own store (`control.node_store`:
  the beats, the copy, the relayed alarms, the shared reads and the node's side of barriers and acknowledgements)
  is a store in the harness process, as it is a store on the node: its requests are not the job store's and are
  not counted; so is a rack's store (`RackStore`, `rack_level`: the rack's side of barriers and acknowledgements,
  the reads of keys that never change), hosted by the launcher of the rack's first node and gone with it;
- the failure (scenario `gpu`: one rank killed, its launcher marks the exit; `node`: a node's ranks and its launcher
  gone; `rack`: a rack's; `one_percent`: 1% of the ranks killed one by one at random times within `spread_s`, their
  launchers marking the exits): the victims stop beating, and the watchers' verdicts go the way `Watch.peers_dead`
  sends them (a fence request, the early report to the membership);
- every survivor notices at its first verdict (its collectives would fail then: the wire is told) and runs the store
  path of `Recovery._attempt` through the product's poll objects: the detection (`Detection`), the agreement
  (`Agreement`: report, decision, watched confirm), the new generation's arrival (`Detector.arrival`), the done
  barrier (`Detector.ending`) and, on the first member, `forget_generation`; then it trains again in the new
  generation, watching its new engine's peers (`watch_sets`, `Generations`), until the next death. A victim runs
  all of this too until it dies.

Not run here: the departures and `keep`'s drains (a few keys per group a rank holds), the new world's process group
and groups (their store rendezvous), and the hand-off's object collectives (they go over the communicators, not the
store). The groups the new generation builds from scratch, and their members, are counted from the product's own
group rule (`wanted_groups`, as `keep` compares) instead of created.

Every request a client makes is counted (by call, with the bytes sent and received); the store server's own CPU time
is read from /proc. Per failure: everything served from the failure to the last rank through its last done barrier
(the beats and polls that go on meanwhile included), and the steady state's rates measured before it, stated apart;
the times to the decision and to the last rank through are counted from the last death.
"""

from __future__ import annotations

import gc
import heapq
import multiprocessing as mp
import random
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

from ntp_ds.control.heartbeat import WATCHES_PER_BEAT, Heartbeat, next_pause
from ntp_ds.control.liveness import LivenessMonitor
from ntp_ds.control.liveness_store import (NODE_PUBLISH_S, AlarmRelay, JobLog, LivenessReader, NodePublisher,
                                           prepare_store, record_exit, request_fence, stale_after_s)
from ntp_ds.control.keys import FENCE_KEY
from ntp_ds.control.node_store import NodeMirror, launcher_period_s
from ntp_ds.control.membership import Membership, MembershipChange
from ntp_ds.control.node_local import NodeLocal
from ntp_ds.control.store import connect_store, forget_generation
from ntp_ds.recovery.watch import another_suspect
from ntp_ds.testing.local_store import LocalStore
from ntp_ds.testing.spawn import start_with_pipes

SCENARIOS = ("gpu", "node", "rack", "one_percent")
MAX_ATTEMPTS = 10
"""Attempts of one rank's recovery before the harness counts it failed (the product's bound is the world size)."""
SETUP_S = 600.0
"""Bound on a harness process's set-up (its ranks' store clients and alarm threads)."""


@dataclass(frozen=True)
class FailureSpec:
    world: int
    scenario: str = "gpu"
    tp: int = 8
    rack_nodes: int = 4
    processes: int = 4
    shares: int = 2
    """Event-loop pairs per process."""
    interval_s: float = 0.5
    heartbeat_timeout_s: float = 3.0
    steady_s: float = 4.5
    """Steady state before the failure: its rates are measured over the part after `warm_s`, a whole number of the
    launchers' periods (each launcher's requests come once a period: a window of 2.5 periods would count 2 or 3)."""
    warm_s: float = 1.5
    """The start of the steady state left out of its rates: every watcher's first polls (fast, to the job's store,
    and each reader's one-time existence checks) are the job's start, not its steady state."""
    timeout_s: float = 120.0
    seed: int = 0
    spread_s: float = 60.0
    """`one_percent`: the deaths come at random times within this many seconds of the first."""
    deaths: int | None = None
    """`one_percent`: how many ranks die (None: 1% of the world, at least one)."""
    rack_level: bool = True
    """Each rack has a store of its own (`ntp-ds launch` with `launcher.rack_size`: the launcher of the rack's first
    node hosts it), where a node's side of a barrier meets its rack's (`NodeLocal.rack`); False: nodes alone."""
    period_nodes: int | None = None
    """The launchers publish and copy at the period of a job of this many nodes (`node_store.launcher_period_s`),
    and watchers bypass a node key as its readers would (`stale_after_s`): None, this job's own. `scale.py` plays
    the period a 100,000-rank job keeps, whose figures it extrapolates."""

    def __post_init__(self):
        if self.scenario not in SCENARIOS:
            raise ValueError(f"scenario={self.scenario!r} must be one of {', '.join(SCENARIOS)}")
        nodes = self.world // self.tp
        periods = (self.steady_s - self.warm_s) / self.launcher_period_s
        if abs(periods - round(periods)) > 1e-6 or round(periods) < 1:
            raise ValueError(f"steady_s={self.steady_s} - warm_s={self.warm_s} must be a whole number of the "
                             f"launchers' periods ({self.launcher_period_s:g} s)")
        if self.deaths is not None and not 0 < self.deaths < self.world:
            raise ValueError(f"deaths={self.deaths} must be between 1 and world - 1 = {self.world - 1}")
        if self.spread_s < 0:
            raise ValueError(f"spread_s={self.spread_s} must not be negative")
        if self.world % self.tp or nodes < 3 * self.rack_nodes:
            raise ValueError(f"world={self.world} must be a multiple of tp={self.tp} with at least three racks of "
                             f"{self.rack_nodes} nodes")

    @property
    def nodes(self) -> int:
        return self.world // self.tp

    @property
    def racks(self):
        """The job's racks: nodes of `tp` ranks, `rack_nodes` nodes each (`layout.domains.Racks`)."""
        from ntp_ds.layout.domains import Racks

        return Racks(self.tp, self.rack_nodes)

    @property
    def played_nodes(self) -> int:
        """The number of nodes whose launchers' period the job plays (`period_nodes`, or its own)."""
        return self.period_nodes or self.nodes

    @property
    def launcher_period_s(self) -> float:
        return launcher_period_s(self.played_nodes, self.interval_s)

    def victims(self) -> tuple[int, ...]:
        """The ranks the failure takes: rank 3 of the middle node, that node, its rack, or 1% of the ranks (drawn
        with the spec's seed)."""
        return tuple(sorted(self.deaths_at()))

    def deaths_at(self) -> dict[int, float]:
        """Each victim, with the seconds from the failure to its death (0 for all but `one_percent`, whose first
        death is the failure and the rest come at random times within `spread_s`). Drawn once (do not change it)."""
        return self._deaths

    @cached_property
    def _deaths(self) -> dict[int, float]:
        if self.scenario != "one_percent":
            return dict.fromkeys(self._struck(), 0.0)
        rng = random.Random(self.seed)
        ranks = rng.sample(range(self.world), self.deaths or max(1, self.world // 100))
        return {r: (0.0 if i == 0 else rng.uniform(0.0, self.spread_s)) for i, r in enumerate(ranks)}

    @property
    def max_attempts(self) -> int:
        """The harness's bound on one recovery's attempts: `MAX_ATTEMPTS`, and one more for each death that may come
        during it (`one_percent`)."""
        return MAX_ATTEMPTS + (len(self.deaths_at()) if self.scenario == "one_percent" else 0)

    @property
    def last_death_s(self) -> float:
        return max(self.deaths_at().values())

    def _struck(self) -> tuple[int, ...]:
        node = self.nodes // 2
        if self.scenario == "gpu":
            return (node * self.tp + 3,)
        if self.scenario == "node":
            return tuple(range(node * self.tp, (node + 1) * self.tp))
        first = node // self.rack_nodes * self.rack_nodes
        return tuple(range(first * self.tp, (first + self.rack_nodes) * self.tp))

    def dead_launchers(self) -> tuple[int, ...]:
        """Nodes whose launcher goes with the failure (none for GPUs: their launchers mark the exits)."""
        if self.scenario in ("gpu", "one_percent"):
            return ()
        return tuple(sorted({r // self.tp for r in self.victims()}))


def job_generation(spec: FailureSpec):
    """The job as launched: one replica of TP `tp` per node, placed in racks of `rack_nodes` nodes."""
    from ntp_ds.layout import Topology
    from ntp_ds.layout.generation import Generation
    from ntp_ds.testing.shapes import llama_70b

    topology = Topology.from_degrees(llama_70b().units(), (spec.tp,) * spec.nodes)
    return Generation.initial(topology, racks=spec.racks)


def job_topology(spec: FailureSpec):
    """The job's placed topology as launched."""
    return job_generation(spec).topology


def watch_sets(topology) -> dict[int, set[int]]:
    """`NTPEngine.watched_peers` of every global rank of a placed topology, from the product's plans: its TP group,
    its two ring neighbours in its data-parallel group (an anchor's), the ranks its gradient and parameter transfers
    join it to (a contributor's and its anchor's: `SyncPlan`), its buddies and the owners whose copies it keeps
    (`plan_buddies`, ZeRO 1 with one copy), and its neighbours on the ring that interleaves the racks."""
    from ntp_ds.comm.groups import ring_neighbours
    from ntp_ds.layout import plan_buddies, plan_gradient_sync
    from ntp_ds.layout.domains import domain_neighbours

    plan = plan_gradient_sync(topology)
    peers = {g: set(topology.ranks_of(topology.locate(g)[0])) for g in range(topology.world_size)}
    width = topology.degrees[plan.anchors[0]]
    for t in range(width):  # each anchor TP index's data-parallel group: its ring
        dp = [topology.ranks_of(a)[t] for a in plan.anchors]
        for g in dp:
            peers[g] |= ring_neighbours(dp, g)
    for transfer in (*plan.grad_transfers, *plan.param_transfers):
        peers[transfer.src].add(transfer.dst)
        peers[transfer.dst].add(transfer.src)
    for owner, holders in plan_buddies(topology, plan, 1, 1).items():
        peers[owner].update(holders)
        for h in holders:
            peers[h].add(owner)
    for g, mine in peers.items():
        mine |= domain_neighbours(topology, g)
        mine.discard(g)
    return peers


class Generations:
    """The job's generations as its decisions make them (the same in every harness process), and each member's
    watched peers in launch ranks: whom a rank watches once it trains again in a generation (`Watch.watch_engine`).
    Only the newest two are kept."""

    def __init__(self, first):
        self._lock = threading.Lock()
        self._generations = {first.number: first}
        self._changes: dict[int, object] = {}
        self._peers: dict[int, tuple[frozenset, dict]] = {}
        self.first_peers = self._launch_peers(first)

    def record(self, change) -> None:
        """A decision a rank read (every rank reads each of its generation's decisions in order)."""
        with self._lock:
            self._changes.setdefault(change.generation, change)

    def peers(self, change) -> tuple[frozenset, dict]:
        """(the members, each member's watched peers) of `change`'s generation."""
        with self._lock:
            number = change.generation
            if number not in self._peers:
                newest = max(self._generations)
                for n in range(newest + 1, number + 1):
                    if n not in self._changes:
                        raise KeyError(f"generation {n}'s decision was never recorded (recorded: "
                                       f"{sorted(self._changes)}, asked for generation {number})")
                    loss = self._generations[n - 1].after_loss(self._changes[n].dead, 1, n)
                    self._generations[n] = loss.after
                self._peers[number] = (frozenset(self._generations[number].members),
                                       self._launch_peers(self._generations[number]))
                for old in [n for n in self._generations if n < number - 1]:
                    del self._generations[old]
                for old in [n for n in self._peers if n < number - 1]:
                    del self._peers[old]
            return self._peers[number]

    @staticmethod
    def _launch_peers(generation) -> dict[int, list[int]]:
        members = generation.members
        return {members[g]: sorted(members[p] for p in peers) for g, peers in watch_sets(generation.topology).items()}


class MeteredClient:
    """A store client that counts its calls by name and the bytes it sends and receives (one per thread: no lock)."""

    def __init__(self, store):
        self._store, self.calls, self.sent, self.received = store, Counter(), 0, 0
        self.largest = 0
        self.largest_call = ""
        """The call that returned the most bytes, with its first argument (a key)."""
        self.tag = "watch"
        """What the client's owner is doing (a phase of the failure path): requests are also counted by it."""
        self.tags: Counter = Counter()

    def clone(self) -> MeteredClient:
        return MeteredClient(self._store.clone())

    def __getattr__(self, name):
        method = getattr(self._store, name)

        def counted(*args, **kwargs):
            self.calls[name] += 1
            self.tags[self.tag] += 1
            self.sent += _nbytes(args)
            out = method(*args, **kwargs)
            n = _nbytes(out)
            self.received += n
            if n > self.largest:
                self.largest, self.largest_call = n, f"{name}({str(args[0])[:80] if args else ''})"
            return out
        return counted


def _nbytes(value) -> int:
    if isinstance(value, (bytes, bytearray, str)):
        return len(value)
    if isinstance(value, (list, tuple)):
        return sum(_nbytes(v) for v in value)
    if isinstance(value, (int, float, bool)):
        return 8
    return 0


# -- the store server ----------------------------------------------------------------------------------------------
def _serve(conn, timeout_s: float) -> None:
    from ntp_ds.control.store import host_store

    store, address = host_store(timeout_s=timeout_s)
    prepare_store(store)
    conn.send(address)
    conn.recv()  # until the parent is done
    del store


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of process `pid` so far (/proc, clock ticks)."""
    import os

    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


# -- one process's share of the job --------------------------------------------------------------------------------
@dataclass
class RankPath:
    """One survivor's failure path: when it noticed, the poll object it is in, when it got through each phase."""

    noticed: float | None = None
    phase: str = "train"
    poll: object = None
    decided: float | None = None
    done: float | None = None
    error: str | None = None
    change: object = None
    attempts: int = 1
    recoveries: list = field(default_factory=list)
    """Each recovery it got through: (noticed, decided, done, attempts, generation)."""
    evicted: str | None = None
    """Why the committed decision declared it dead (a false verdict: it leaves the job, as `Recovery` makes it)."""


class RackStore:
    """A rack's store in a harness process (a `LocalStore`, as a node's), hosted by the launcher of the rack's first
    node: once that launcher is gone (`dies_at`), every call fails at once, as a client of a killed process's server
    is answered (its connection reset)."""

    def __init__(self):
        self._store, self.dies_at = LocalStore(), float("inf")

    def __getattr__(self, name):
        if time.monotonic() >= self.dies_at:
            raise ConnectionError("the rack's store is gone with its launcher")
        return getattr(self._store, name)


class _Share:
    def __init__(self, spec: FailureSpec, address: str, nodes: list[int], generations: Generations,
                 rack_stores: dict[int, RackStore] | None = None):
        self.spec, self.nodes, self.generations = spec, nodes, generations
        self.max_attempts, self.last_death_s = spec.max_attempts, spec.last_death_s
        deaths = spec.deaths_at()
        self.victims = set(deaths)
        self.beat_store = MeteredClient(connect_store(address, 60.0))
        self.watch_store = MeteredClient(connect_store(address, 60.0))
        self.beat_store.tag = "launcher"  # (the beats go to the node's store: this client is its launchers')
        self.ranks = [n * spec.tp + i for n in nodes for i in range(spec.tp)]
        from ntp_ds.layout.domains import failure_domain

        self.domain_of = failure_domain(spec.racks, spec.tp)  # (as `Recovery`'s)
        # Each node's own store (`ntp-ds launch` hosts it on the node): its requests never reach the job's store.
        # (`LocalStore`: HashStore's answers, without its wake of every waiter at every write.)
        self.node_stores = {n: LocalStore() for n in nodes}
        self.publishers = {n: NodePublisher(self.beat_store, n, range(n * spec.tp, (n + 1) * spec.tp),
                                            beats_from=self.node_stores[n]) for n in nodes}
        self.mirrors = {n: NodeMirror(self.beat_store, self.node_stores[n], range(n * spec.tp, (n + 1) * spec.tp),
                                      nodes=spec.played_nodes) for n in nodes}
        stale_s = stale_after_s(spec.played_nodes)
        self.fence_logs = {n: JobLog(self.beat_store, FENCE_KEY) for n in nodes}
        settle_s = spec.heartbeat_timeout_s / 2 + spec.interval_s
        members = tuple(range(spec.world))  # one tuple and one set for every rank (a rank's own copies, W long each,
        everyone = frozenset(members)       # would make the harness's memory grow with W squared)
        self.beaters, self.heartbeats, self.memberships, self.detectors = {}, {}, {}, {}
        self.paths = {r: RankPath() for r in self.ranks}  # (a victim runs its path too, until it dies)
        self.survivors = [r for r in self.ranks if r not in self.victims]
        self.dies_in = {r: deaths[r] for r in self.ranks if r in deaths}
        self.dies_at: dict[int, float] = {}
        """Each of the share's victims' time of death (set when the run starts)."""
        self.settled: set[int] = set()
        """Survivors through a generation without any victim (or failed): the share is finished once all are."""
        self.errors: list[str] = []
        self.retries: list[str] = []
        """Why ranks tried again: the first few, and the first of each new attempt number."""
        self.retried: set[int] = set()
        self.held: dict[int, float] = {}
        """Rank (node, for its launcher's key) -> the longest the harness's own loop held back two of its beats
        (publications) in a row: past the heartbeat timeout, the harness, not the product, made it look silent."""
        self._last_sent: dict[int, float] = {}
        self.alarm_clients: list[MeteredClient] = []
        self.relays: dict[int, AlarmRelay] = {}
        self.wake: set[int] = set()
        self._wake_lock = threading.Lock()
        from ntp_ds.recovery.detect import Detector

        for rank in self.ranks:
            local = self.node_stores[rank // spec.tp]
            self.beaters[rank] = Heartbeat(self.beat_store, rank, spec.interval_s, beats_to=local)
            reader = LivenessReader(self.watch_store, spec.tp, mirror=local, stale_s=stale_s)
            monitor = LivenessMonitor((), spec.heartbeat_timeout_s)
            hb = Heartbeat(self.watch_store, rank, spec.interval_s, monitor=monitor, reader=reader,
                           on_dead=lambda ranks, wall, r=rank: self._dead(r, ranks, wall), alarms_from=local)
            hb.watch(generations.first_peers[rank])
            hb._members = everyone
            self.heartbeats[rank] = hb
            rack = None
            if rack_stores is not None:  # (each rank's own view of its rack's store, as each process has)
                rack = NodeLocal.for_rack(rack_stores[rank // spec.tp // spec.rack_nodes], spec.tp * spec.rack_nodes,
                                          spec.world)
            # (as `Recovery`: barriers and acks meet in the node store, and the rack's)
            node = NodeLocal(local, spec.tp, spec.world, rack=rack)
            self.memberships[rank] = Membership(self.watch_store, rank, members, settle_s=settle_s, node=node)
            self.detectors[rank] = Detector(LivenessReader(self.watch_store, spec.tp, mirror=local, stale_s=stale_s),
                                            heartbeat_timeout_s=spec.heartbeat_timeout_s,
                                            heartbeat_interval_s=spec.interval_s,
                                            first_beat_timeout_s=spec.heartbeat_timeout_s,
                                            collective_timeout_s=spec.timeout_s / 4, node=node,
                                            domain_of=self.domain_of)

    # The verdict's way (`Watch.peers_dead`, `Watch._report`): fence, report while training, notice.
    def _dead(self, rank: int, ranks: frozenset[int], wall: float) -> None:
        path = self.paths.get(rank)
        if path is None or self._gone(rank):
            return
        from ntp_ds.recovery.detect import Among

        members = Among(self.memberships[rank].members)
        ranks = frozenset(r for r in ranks if r in members)  # (as `Watch.peers_dead`: a generation left is not news)
        if not ranks:
            return
        hb = self.heartbeats[rank]
        self.watch_store.tag = "verdict"
        judged = hb.monitor.dead() | hb.monitor.hung()  # (as `Watch.peers_dead`: the rest is fenced already)
        request_fence(self.watch_store, [r for r in ranks if r in judged], f"declared dead by rank {rank}")
        self.detectors[rank].declared.update((r, f"rank {r} declared dead by a peer") for r in ranks)
        if path.phase == "train":
            monitor = hb.monitor
            if not another_suspect(monitor, ranks, self.detectors[rank].declared):
                m = self.memberships[rank]
                m.report_failure(m.generation, ranks, wall, "declared dead",
                                 {r: monitor.silent_for(r) for r in ranks if r in monitor.ranks}, ranks - judged)
            path.noticed, path.phase = time.monotonic(), "notice"
        self.watch_store.tag = "watch"

    def _sent(self, who: int, now: float) -> None:
        """`who` (a rank, or -1 - node for a node's key) was sent at `now`: keep the longest gap (`held`)."""
        last = self._last_sent.get(who)
        self._last_sent[who] = now
        if last is not None and now - last > self.held.get(who, 0.0):
            self.held[who] = now - last

    def held_back_s(self, rank: int) -> float:
        """The longest the harness held back `rank`'s beats or its node's key (see `held`)."""
        return max(self.held.get(rank, 0.0), self.held.get(-1 - rank // self.spec.tp, 0.0))

    def _gone(self, rank: int) -> bool:
        """Whether `rank` has died by now."""
        return time.monotonic() >= self.dies_at.get(rank, float("inf"))

    def _alarmed(self, rank: int) -> None:
        with self._wake_lock:
            self.wake.add(rank)

    def setup(self) -> None:
        for b in self.beaters.values():
            b.beat()
        for p in self.publishers.values():
            p.publish()

    def start_alarms(self, address: str) -> list[threading.Thread]:
        # Connected 32 at a time: now and then a connection waits 5 s on this machine's resolver
        # (`control.store._ipv4_listener`), which one after the other would make the set-up take minutes.
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(32) as pool:
            clients = list(pool.map(lambda _: MeteredClient(connect_store(address, 60.0)), self.heartbeats))
            relay_clients = list(pool.map(lambda _: MeteredClient(connect_store(address, 60.0)), self.nodes))
        for client in clients + relay_clients:
            client.tag = "alarm"
        # Each node's launcher relays the alarms into its node's store (`AlarmRelay`), where its ranks wait.
        fastest = self.spec.interval_s / WATCHES_PER_BEAT
        for n, client in zip(self.nodes, relay_clients):
            relay = AlarmRelay(client, self.node_stores[n], n * self.spec.tp, pause_s=lambda: fastest).start()
            self.relays[n] = relay
            self.alarm_clients += [client, relay._waiter]
            relay._waiter.tag = "alarm"
        threads = []
        for (rank, hb), client in zip(self.heartbeats.items(), clients):
            self.alarm_clients.append(client)
            hb.on_alarm.append(lambda r=rank: self._alarmed(r))
            t = threading.Thread(target=hb._await_alarms, args=(client,), daemon=True, name=f"alarm-{rank}")
            t.start()
            threads.append(t)
        return threads

    def run(self, loop: str, start: float, fail_at: float, end: float) -> None:
        try:
            self._run(loop, start, fail_at, end)
        except Exception as err:  # reported by the process: a share that stopped early fails the case
            self.errors.append(f"{loop}: {type(err).__name__}: {err}")

    def _run(self, loop: str, start: float, fail_at: float, end: float) -> None:
        spec = self.spec
        self.dies_at = {r: fail_at + s for r, s in self.dies_in.items()}
        rng = random.Random(spec.seed + self.nodes[0] * 7 + (loop == "watches"))
        fastest = spec.interval_s / WATCHES_PER_BEAT
        queue, seq = [], 0

        def push(due, kind, who):
            nonlocal seq
            seq += 1
            heapq.heappush(queue, (due, seq, kind, who))

        dead_nodes = set(spec.dead_launchers())
        if loop == "beats":
            for r in self.ranks:
                push(start + rng.uniform(0, spec.interval_s), "beat", r)
            for n in self.nodes:
                push(start + rng.uniform(0, NODE_PUBLISH_S), "publish", n)
                push(start + rng.uniform(0, spec.interval_s), "mirror", n)
            for r, at in sorted(self.dies_in.items()):  # the launcher of a killed GPU marks its exit
                if r // spec.tp not in dead_nodes:
                    push(fail_at + at + 0.05, "exit", r)
        else:
            for r in self.paths:
                push(start + rng.uniform(0, spec.interval_s), "watch", (r, 0))
            push(start, "wake", -1)
        pause = {r: fastest for r in self.ranks}
        chain = dict.fromkeys(self.ranks, 0)  # each rank's current chain of polls: an alarm starts a new one
        while queue:
            due, _, kind, who = heapq.heappop(queue)
            if due >= end or self._finished(loop, fail_at):
                return
            now = time.monotonic()
            if due > now:
                time.sleep(due - now)
            failed = time.monotonic() >= fail_at
            if kind == "beat":
                if self._gone(who):
                    continue
                self.beaters[who].beat()
                self._sent(who, time.monotonic())
                push(due + spec.interval_s, "beat", who)
            elif kind == "publish":
                if failed and who in dead_nodes:
                    continue
                self.publishers[who].publish()
                self._sent(-1 - who, time.monotonic())  # (a node's key: -1 - node, apart from the ranks)
                push(due + self.mirrors[who].period_s, "publish", who)  # (as often as its workers beat)
            elif kind == "mirror":  # the launcher's copy, and the fence requests it reads with it
                if failed and who in dead_nodes:
                    self.relays[who]._stop.set()  # (its relay is gone with it: it relays no alarm from now on)
                    continue
                self.fence_logs[who].catch_up(self.mirrors[who].refresh().fences)
                push(due + self.mirrors[who].period_s, "mirror", who)
            elif kind == "exit":
                record_exit(self.beat_store, who, "exit code -9")
            elif kind == "wake":  # alarms heard since: their ranks poll now
                with self._wake_lock:
                    woken, self.wake = self.wake, set()
                for r in woken:
                    # its next poll comes now, in place of the one due (one watching thread)
                    if r in self.paths and not self._gone(r):
                        pause[r] = fastest
                        chain[r] += 1
                        push(time.monotonic(), "watch", (r, chain[r]))
                push(time.monotonic() + 0.01, "wake", -1)
            elif kind == "watch":
                who, link = who
                path = self.paths[who]
                if path.error or link != chain[who] or self._gone(who):  # (a poll an alarm brought forward)
                    continue
                news = self.heartbeats[who].poll_peers(direct=pause[who] == fastest)  # (as `Heartbeat._run`)
                pause[who] = next_pause(pause[who], news, fastest, spec.interval_s)
                push(time.monotonic() + pause[who], "watch", (who, link))
                if path.phase == "notice":
                    path.phase = "detect"
                    push(time.monotonic(), "path", who)
            elif not self._gone(who):
                self.watch_store.tag = self.paths[who].phase
                wait_s = self._step(who)
                self.watch_store.tag = "watch"
                if wait_s is not None:
                    push(time.monotonic() + wait_s, "path", who)

    def _finished(self, loop: str, fail_at: float) -> bool:
        """Past the last death, once every survivor of the share is through to a generation without the victims (or
        failed): its beats stop too."""
        return (time.monotonic() > fail_at + self.last_death_s + 0.2
                and len(self.settled) == len(self.survivors))

    def _step(self, rank: int) -> float | None:
        """One poll of `rank`'s failure path; the pause before the next, or None at its end."""
        from ntp_ds.recovery.detect import Agreement, Detection

        path, d, m = self.paths[rank], self.detectors[rank], self.memberships[rank]
        try:
            if path.phase == "detect":
                if path.poll is None:
                    seen = self.heartbeats[rank].watch([])  # as `Recovery._attempt`: a retry keeps the last monitor
                    if seen.ranks:
                        d.monitor = seen
                    path.poll = Detection(d, m, RuntimeError("peer failed"))
                pause = path.poll.poll()
                if pause is not None:
                    return pause
                dead, reason = path.poll.result
                request_fence(self.watch_store, (fence := d.to_fence()), fence)
                silent = self.heartbeats[rank].silences()
                path.phase, path.poll = "agree", Agreement(d, m, dead, reason, silent)
            if path.phase == "agree":
                pause = path.poll.poll()
                if path.poll.change is not None and path.decided is None:  # (the attempt's decision)
                    path.decided = time.monotonic()
                    self.generations.record(path.poll.change)  # (before its confirm, which a death may end)
                if pause is not None:
                    return pause
                path.change = change = path.poll.change
                path.phase, path.poll = "arrive", d.arrival(self.watch_store, rank, change.generation,
                                                            change.survivors)
            if path.phase == "arrive":
                pause = path.poll.poll()
                if pause is not None:
                    return pause
                change = path.change
                from ntp_ds.layout.domains import spread_neighbours

                hb = self.heartbeats[rank]  # `Watch.watch_ring`: the ring neighbours, and every member's fences
                hb.watch(sorted(spread_neighbours(change.survivors, rank, self.domain_of)))
                hb._members = frozenset(change.survivors)
                path.phase = "regroup"  # (`Recovery._install`: the done barrier, watched)
                path.poll = d.ending(self.watch_store, rank, change.generation, change.survivors, self.spec.timeout_s)
            if path.phase == "regroup":
                pause = path.poll.poll()
                if pause is not None:
                    return pause
                change = path.change
                if change.survivors[0] == rank and change.generation >= 2:
                    forget_generation(self.watch_store, change.generation - 2)
                # Training again, in the new generation: the new engine's peers watched (`Watch.watch_engine`).
                path.recoveries.append((path.noticed, path.decided, time.monotonic(), path.attempts,
                                        change.generation))
                members, peers = self.generations.peers(change)
                hb = self.heartbeats[rank]
                hb.watch(peers[rank])
                hb._members = members
                path.phase, path.poll, path.change, path.noticed, path.decided, path.attempts = (
                    "train", None, None, None, None, 1)
                if not any(v in members for v in self.victims):
                    self.settled.add(rank)
            return None
        except Exception as err:
            from ntp_ds.control.membership import BarrierTimeout, Evicted
            from ntp_ds.recovery.errors import failed_on_the_way

            if isinstance(getattr(path.poll, "change", None), MembershipChange):  # adopted, then its confirm failed
                self.generations.record(path.poll.change)
            if isinstance(err, Evicted):  # it leaves the job: its process ends, so its beats stop
                path.evicted = str(err)[:300]
                self.heartbeats[rank]._stop.set()
                self.settled.add(rank)
                return None
            if not failed_on_the_way(err) or path.attempts >= self.max_attempts:
                path.error = f"{path.phase}: {type(err).__name__}: {str(err)[:300]}"
                if rank not in self.victims:
                    self.settled.add(rank)
                return None
            # `Recovery._recover_from`: another attempt; who never came to a barrier is dead, and fenced.
            if isinstance(err, BarrierTimeout) and err.missing:
                request_fence(self.watch_store, d.missed(err), f"{err} (seen by rank {rank})")
            path.attempts += 1
            if len(self.retries) < 3 or path.attempts > max(self.retried, default=1):
                self.retried.add(path.attempts)
                self.retries.append(f"rank {rank}, attempt {path.attempts} after {path.phase}: {str(err)[:200]}")
            path.phase, path.poll, path.change, path.decided = "detect", None, None, None
            return 0.0


# -- a process of the harness --------------------------------------------------------------------------------------
def _process(spec: FailureSpec, address: str, nodes: list[int], conn) -> None:
    generations = Generations(job_generation(spec))
    racks = {n // spec.rack_nodes: RackStore() for n in nodes} if spec.rack_level else None
    shares = [_Share(spec, address, nodes[i::spec.shares], generations, racks)
              for i in range(spec.shares) if nodes[i::spec.shares]]
    for s in shares:
        s.setup()
    alarms = [t for s in shares for t in s.start_alarms(address)]
    gc.collect()
    gc.freeze()
    conn.send("ready")
    start, fail_at, end = conn.recv()
    for n in spec.dead_launchers():  # a rack's store goes with the launcher of its first node
        if racks is not None and n % spec.rack_nodes == 0 and n // spec.rack_nodes in racks:
            racks[n // spec.rack_nodes].dies_at = fail_at
    for s in shares:
        for c in (s.beat_store, s.watch_store, *s.alarm_clients):
            c.calls.clear()
            c.tags.clear()
            c.sent = c.received = c.largest = 0
    threads = [threading.Thread(target=s.run, args=(loop, start, fail_at, end), daemon=True)
               for s in shares for loop in ("beats", "watches")]
    for t in threads:
        t.start()
    time.sleep(max(0.0, start + spec.warm_s - time.monotonic()))
    warm = _counts(shares)
    time.sleep(max(0.0, fail_at - time.monotonic()))
    steady = _counts(shares)
    for t in threads:
        t.join(max(0.0, end - time.monotonic()) + 5.0)
    total = _counts(shares)
    paths = {r: (s.paths[r].recoveries, s.paths[r].error, r in s.settled, s.paths[r].evicted) for s in shares
             for r in s.survivors}
    held = {r: s.held_back_s(r) for s in shares for r in s.survivors if s.paths[r].evicted}
    for s in shares:
        for hb in s.heartbeats.values():
            hb._stop.set()
    conn.send({"warm": warm, "steady": steady, "total": total, "paths": paths, "held": held,
               "errors": [e for s in shares for e in s.errors], "alarm_threads": len(alarms),
               "retries": [e for s in shares for e in s.retries]})
    conn.close()


def _counts(shares) -> dict:
    calls, tags, sent, received, largest, largest_call = Counter(), Counter(), 0, 0, 0, ""
    for s in shares:
        for c in (s.beat_store, s.watch_store, *s.alarm_clients):
            calls.update(c.calls)
            tags.update(c.tags)
            sent, received = sent + c.sent, received + c.received
            if c.largest > largest:
                largest, largest_call = c.largest, c.largest_call
    return {"calls": dict(calls), "tags": dict(tags), "sent": sent, "received": received, "largest": largest,
            "largest_call": largest_call, "at": time.monotonic()}


@dataclass
class FailureResult:
    spec: FailureSpec
    steady_req_per_s: float
    steady_bytes_per_s: float
    failure_req: float
    failure_bytes: float
    failure_calls: dict
    failure_phases: dict
    """The same requests by what their rank was doing: its watch's polls (`watch`), a verdict's fence and report
    (`verdict`), the recovery's phases (`detect`, `agree`, `arrive`, `regroup`), the launchers (`launcher`: node
    keys, copies, exits, fence reads), the alarm threads (`alarm`)."""
    server_busy_s: float
    """The store server's CPU seconds from the failure until every harness process had finished."""
    window_s: float
    """From the failure to the last survivor through its last done barrier (or to the end of the run)."""
    steady_busy_s_per_s: float
    """The store server's CPU seconds per second in the steady state before."""
    decision_s: float | None
    """From the last death to the last survivor's last decision."""
    done_s: float | None
    """From the last death to the last survivor through its last done barrier (None: none got through)."""
    survivors: int
    """The ranks that were to get through: those not killed, less those the decisions evicted."""
    through: int
    """Survivors through to a generation without any victim."""
    evicted: list = field(default_factory=list)
    """Ranks a decision declared dead that had not died (a false verdict), with why: they left the job."""
    starved: list = field(default_factory=list)
    """Those of `evicted` whose beats or node key the harness's own loop held back past the heartbeat timeout (two
    sent that far apart): the store rightly saw them silent; the harness, not the product, is to blame."""
    errors: list = field(default_factory=list)
    largest_value: int = 0
    largest_call: str = ""
    """The request that returned `largest_value` (its call and key)."""
    attempts: int = 1
    """The most attempts any survivor's recovery took (each recovery counted apart)."""
    generations: int = 0
    """The newest generation a survivor got through to: the decisions the deaths took."""
    recoveries: int = 0
    """The most recoveries any survivor went through."""
    retries: list = field(default_factory=list)
    """Why ranks tried again (a few per harness process)."""
    steady_phases: dict = field(default_factory=dict)
    """The steady state's requests per second by who made them (the tags of `failure_phases`)."""
    bootstrapped_groups: int = 0
    bootstrapped_members: int = 0


def run_failure(spec: FailureSpec) -> FailureResult:
    """Run the job through the scenario's failure; return what the store served and how long the survivors took."""
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    server = ctx.Process(target=_serve, args=(child, spec.timeout_s), daemon=True)
    server.start()
    if not parent.poll(60.0):
        raise TimeoutError("the store server did not start within 60 s")
    address = parent.recv()
    # Racks are dealt to the processes whole (a rack's store is one process's), a rack's nodes then to its shares.
    racks = list(range(-(-spec.nodes // spec.rack_nodes)))
    dealt = [[n for k in racks[p::spec.processes] for n in range(k * spec.rack_nodes,
                                                                  min(spec.nodes, (k + 1) * spec.rack_nodes))]
             for p in range(spec.processes)]
    procs = []
    try:
        pipes, procs = start_with_pipes(_process, [(spec, address, dealt[p]) for p in range(spec.processes)],
                                        SETUP_S, "a harness process")
        start = time.monotonic() + 0.5
        fail_at = start + spec.steady_s
        end = fail_at + spec.last_death_s + spec.timeout_s
        for a in pipes:
            a.send((start, fail_at, end))
        time.sleep(max(0.0, start + spec.warm_s - time.monotonic()))
        cpu_start = cpu_seconds(server.pid)
        time.sleep(max(0.0, fail_at - time.monotonic()))
        cpu_fail = cpu_seconds(server.pid)
        outs = []
        for a in pipes:
            if not a.poll(spec.last_death_s + spec.timeout_s + 30.0):
                raise TimeoutError("a harness process did not finish within its bound")
            outs.append(a.recv())
        cpu_end = cpu_seconds(server.pid)
    finally:
        for proc in procs:
            proc.join(5.0)
            if proc.is_alive():
                proc.kill()
        parent.send("stop")
        server.join(5.0)
        if server.is_alive():
            server.kill()
    return _result(spec, outs, start, fail_at, cpu_start, cpu_fail, cpu_end)


def _result(spec, outs, start, fail_at, cpu_start, cpu_fail, cpu_end) -> FailureResult:
    steady_n = sum(sum(o["steady"]["calls"].values()) for o in outs)
    steady_b = sum(o["steady"]["sent"] + o["steady"]["received"] for o in outs)
    warm_n = sum(sum(o["warm"]["calls"].values()) for o in outs)
    warm_b = sum(o["warm"]["sent"] + o["warm"]["received"] for o in outs)
    steady_s = spec.steady_s - spec.warm_s
    paths = {r: p for o in outs for r, p in o["paths"].items()}
    evicted = {r: why for r, (_, _, _, why) in paths.items() if why}
    held = {r: t for o in outs for r, t in o.get("held", {}).items()}
    through = [r for r, (_, error, settled, why) in paths.items() if settled and not error and not why]
    recoveries = [rec for recs, _, _, _ in paths.values() for rec in recs]
    # From the last death: the last recovery of each survivor through (the only one, but for `one_percent`).
    last_death = fail_at + spec.last_death_s
    done = [paths[r][0][-1][2] for r in through]
    decided = [paths[r][0][-1][1] for r in through if paths[r][0][-1][1] is not None]
    last = max(done) if len(through) == len(paths) - len(evicted) else max(o["total"]["at"] for o in outs)
    window = last - fail_at
    calls, tags, steady_tags = Counter(), Counter(), Counter()
    for o in outs:
        steady_tags.update(o["steady"]["tags"])
        steady_tags.subtract(o["warm"]["tags"])
        calls.update(o["total"]["calls"])
        calls.subtract(o["steady"]["calls"])
        tags.update(o["total"]["tags"])
        tags.subtract(o["steady"]["tags"])
    total_n = sum(sum(o["total"]["calls"].values()) for o in outs) - steady_n
    total_b = sum(o["total"]["sent"] + o["total"]["received"] for o in outs) - steady_b
    groups, members = bootstraps(spec)
    # Everything served from the failure to the last rank through: the steady state's own traffic over that time is
    # not subtracted (a recovering rank polls its peers less, so the difference would understate), and stated apart.
    return FailureResult(spec=spec, steady_req_per_s=(steady_n - warm_n) / steady_s,
                         steady_bytes_per_s=(steady_b - warm_b) / steady_s,
                         failure_req=total_n, failure_bytes=total_b, failure_calls=dict(calls),
                         failure_phases={k: v for k, v in tags.items() if v},
                         server_busy_s=cpu_end - cpu_fail, window_s=window,
                         steady_busy_s_per_s=(cpu_fail - cpu_start) / steady_s,
                         decision_s=(max(decided) - last_death) if decided else None,
                         done_s=(max(done) - last_death) if done else None,
                         survivors=len(paths) - len(evicted), through=len(through),
                         evicted=[f"rank {r}: {why}" for r, why in sorted(evicted.items())],
                         starved=[f"rank {r}: held back {held[r]:.2f} s" for r in sorted(evicted)
                                  if held.get(r, 0.0) > spec.heartbeat_timeout_s],
                         errors=[e for o in outs for e in o["errors"]] + [f"rank {r}: {p[1]}" for r, p in
                                                                        paths.items() if p[1]],
                         largest_value=max(o["total"]["largest"] for o in outs),
                         largest_call=max(outs, key=lambda o: o["total"]["largest"])["total"]["largest_call"],
                         attempts=max((rec[3] for rec in recoveries), default=1),
                         generations=max((rec[4] for rec in recoveries), default=0),
                         recoveries=max((len(p[0]) for p in paths.values()), default=0),
                         bootstrapped_groups=groups, bootstrapped_members=members,
                         retries=[e for o in outs for e in o.get("retries", ())],
                         steady_phases={k: round(v / steady_s, 1) for k, v in steady_tags.items() if v})


def bootstraps(spec: FailureSpec) -> tuple[int, int]:
    """Communicators the new generation creates from scratch, and their members in all: every group of the new
    topology (`wanted_groups`, for every rank) that no group of the old one matches in role and launch ranks (what
    `keep` could carry)."""
    from ntp_ds.comm.groups import wanted_groups
    from ntp_ds.layout import plan_gradient_sync
    from ntp_ds.layout.generation import Generation

    old_topology = job_topology(spec)
    before = Generation.initial(old_topology, racks=spec.racks)
    after = before.after_loss(set(spec.victims()), 1, 1).after
    old_sync, new_sync = plan_gradient_sync(before.topology), plan_gradient_sync(after.topology)
    old = {(role, tuple(before.members[r] for r in ranks)) for g in range(spec.world)
           for role, ranks in wanted_groups(before.topology, old_sync, g, twins=False)}
    new = {(role, tuple(after.members[r] for r in ranks)) for g in range(len(after.members))
           for role, ranks in wanted_groups(after.topology, new_sync, g, twins=False)}
    fresh = [ranks for key in new - old for ranks in [key[1]] if len(ranks) > 1]
    return len(fresh), sum(len(r) for r in fresh)
