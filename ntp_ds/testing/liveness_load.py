"""Load the control plane as a large job would: thousands of simulated workers on hundreds of simulated nodes.

One TCPStore, a few shares of the nodes. In each share every simulated worker beats and watches its peers through the
real `Heartbeat` (its beat, its per-node `LivenessReader`, its backoff), and every simulated node's launcher
publishes through the real `NodePublisher`, each on its own schedule. A share runs two event loops instead of one OS
thread per worker, each on its own store client, as a real job's beats and watches run on threads of their own: one
for the beats and the launchers' publications, one for the watches and the agreement. What matters is the load the
store sees and the verdicts the watchers reach, not the thread count. Every call on the store is counted.

All workers are healthy except one, which stops beating at `hang_at_s` (a SIGSTOP as the store sees it): its peers
must declare it dead after the heartbeat timeout, and nobody else may be declared dead. Each peer that finds it
reports it (`Membership.report_failure`); every other worker learns of the report at its next step boundary
(`pending()`, once per `step_s`), waits for the decision through the real `DecisionWait` and confirms it at the
survivors' barrier (`Membership.confirm_wait`), so the agreement's load lands on the store while the beats go on:
the worst moment.
"""

from __future__ import annotations

import gc
import heapq
import random
import threading
import time
import types
from collections import Counter
from dataclasses import dataclass, field

from ntp_ds.control.heartbeat import WATCHES_PER_BEAT, Heartbeat, next_pause
from ntp_ds.control.liveness import LivenessMonitor
from ntp_ds.control.liveness_store import NODE_PUBLISH_S, LivenessReader, NodePublisher, prepare_store
from ntp_ds.control.membership import BarrierWait, DecisionWait, Membership, MembershipChange
from ntp_ds.control.store import connect_store, host_store


@dataclass(frozen=True)
class LoadSpec:
    """The simulated job and how long to run it."""

    nodes: int = 512
    workers_per_node: int = 8
    interval_s: float = 0.5
    """Beat interval of every worker (the recovery manager's default)."""
    heartbeat_timeout_s: float = 3.0
    duration_s: float = 10.0
    threads: int = 4
    """Shares of the simulated nodes; each runs two threads (beats, watches), each with its own store connection."""
    processes: int = 1
    """Processes the threads are spread over (real workers are processes: one interpreter driving thousands of
    them falls behind their beats on a small machine)."""
    hang_at_s: float | None = 2.0
    """When the one hung worker (the last rank of node 0) stops beating; None: every worker stays healthy."""
    per_node: bool = True
    """Watchers read node keys (False: one key per peer, as without a launcher)."""
    step_s: float = 1.0
    """How often a worker checks for a reported failure (`Membership.pending`, at its step boundary)."""
    settle_s: float = 0.3
    """The membership settle window (the recovery manager's default)."""
    seed: int = 0

    def __post_init__(self):
        for name in ("nodes", "workers_per_node", "threads", "processes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be at least 1")
        if not 0 < self.interval_s < self.heartbeat_timeout_s:
            raise ValueError(f"interval_s={self.interval_s} must lie in (0, heartbeat_timeout_s="
                             f"{self.heartbeat_timeout_s})")

    @property
    def world_size(self) -> int:
        return self.nodes * self.workers_per_node

    @property
    def hung_rank(self) -> int | None:
        return None if self.hang_at_s is None else self.workers_per_node - 1


def peers_of(rank: int, nodes: int, workers_per_node: int) -> list[int]:
    """Whom a worker watches: the other workers of its node (its TP group) and the workers of the same local rank on
    the neighbouring nodes and the opposite node (its data-parallel neighbours and its buddy). Symmetric."""
    node, local = divmod(rank, workers_per_node)
    same_node = {node * workers_per_node + i for i in range(workers_per_node)}
    others = {((node + d) % nodes) * workers_per_node + local for d in (-1, 1, nodes // 2)}
    return sorted((same_node | others) - {rank})


@dataclass
class LoadResult:
    spec: LoadSpec
    seconds: float
    ops: Counter
    false_deaths: int
    """(watcher, rank) verdicts naming a healthy rank dead."""
    hung_found_by: int
    """Peers of the hung worker that declared it dead."""
    hung_watchers: int
    detection_s: list[float] = field(default_factory=list)
    """Per peer of the hung worker: seconds from its last beat to its peer declaring it dead."""
    detection_lag_s: list[float] = field(default_factory=list)
    """Per entry of `detection_s`: how late the harness ran that peer's polls (behind their schedule), the two
    latest of those from the hung worker's last beat to the verdict added up: the poll that saw the last beat and
    the one that declared the silence both delay the verdict."""
    worst_beat_lag_s: float = 0.0
    """Longest delay of a scheduled beat behind its time (the harness falling behind shows here)."""
    worst_watch_lag_s: float = 0.0
    """Longest delay of a scheduled poll of the peers behind its time (on the watching threads)."""
    starved: int = 0
    """Healthy workers the harness itself kept from beating for longer than the timeout (two of their beats sent
    further apart): a verdict against such a worker is right, the store saw it silent, and is not a false death."""
    ops_per_second: list[int] = field(default_factory=list)
    """Store calls in each whole second of the run."""
    decisions: dict[str, int] = field(default_factory=dict)
    """Encoded committed change -> how many workers hold it (one key when they all agree)."""
    agreement_s: float | None = None
    """From the first failure report to the last worker holding the decision."""
    confirmed: int = 0
    """Workers through the survivors' confirm barrier."""
    confirm_s: float | None = None
    """From the first failure report to the last worker through the confirm barrier."""

    @property
    def peak_ops_per_s(self) -> int:
        return max(self.ops_per_second, default=0)

    @property
    def decided(self) -> int:
        return sum(self.decisions.values())

    @property
    def ops_per_s(self) -> float:
        return sum(self.ops.values()) / self.seconds

    def line(self) -> str:
        found = f"{self.hung_found_by}/{self.hung_watchers}"
        detect = f"{max(self.detection_s):.2f}" if self.detection_s else "-"
        late = f"{max(self.detection_lag_s):.2f}" if self.detection_lag_s else "-"
        mix = " ".join(f"{name}={n / self.seconds:.0f}" for name, n in sorted(self.ops.items()))
        agree = f"{self.agreement_s:.2f}" if self.agreement_s is not None else "-"
        confirm = f"{self.confirm_s:.2f}" if self.confirm_s is not None else "-"
        return (f"workers={self.spec.world_size} nodes={self.spec.nodes} per_node={self.spec.per_node} "
                f"store_ops_per_s={self.ops_per_s:.0f} peak_ops_per_s={self.peak_ops_per_s} "
                f"false_deaths={self.false_deaths} starved={self.starved} hung_found_by={found} "
                f"worst_detection_s={detect} (polls late by up to {late} s) "
                f"decided={self.decided} decisions={len(self.decisions)} agreement_s={agree} "
                f"confirmed={self.confirmed} confirm_s={confirm} "
                f"worst_beat_lag_s={self.worst_beat_lag_s:.2f} worst_watch_lag_s={self.worst_watch_lag_s:.2f} "
                f"({mix} per s)")


class CountingStore:
    """A store client that counts its calls by name, and by whole second since `start` when that is set (one
    counter per thread: no lock)."""

    def __init__(self, store):
        self._store, self.calls, self.per_second = store, Counter(), Counter()
        self.start: float | None = None

    def __getattr__(self, name):
        method = getattr(self._store, name)

        def counted(*args, **kwargs):
            self.calls[name] += 1
            if self.start is not None:
                self.per_second[int(time.monotonic() - self.start)] += 1
            return method(*args, **kwargs)
        return counted


def run_load(spec: LoadSpec) -> LoadResult:
    """Run the simulated job against one store for `spec.duration_s`; return the store's load and the verdicts."""
    host, address = host_store(timeout_s=30.0)
    prepare_store(host)
    shares = [list(range(t, spec.nodes, spec.threads)) for t in range(spec.threads)]
    if spec.processes == 1:
        sims = _run_shares(spec, address, shares, None)
    else:
        from ntp_ds.testing.spawn import start_with_pipes

        pipes, procs = start_with_pipes(_run_shares, [(spec, address, shares[p::spec.processes])
                                                      for p in range(spec.processes)], 60.0, "a load process")
        start = time.monotonic() + 0.2
        for conn in pipes:
            conn.send(start)
        sims = []
        for conn, proc in zip(pipes, procs):
            if not conn.poll(spec.duration_s + 40.0):
                raise TimeoutError(f"load process {proc.pid} did not finish within {spec.duration_s + 40.0}s")
            sims += conn.recv()
            proc.join(5.0)
    errors = [e for sim in sims for e in sim.errors]
    if errors:
        raise RuntimeError(f"{len(errors)} store calls failed; first: {errors[0]!r}")
    ops = sum((c.calls for sim in sims for c in sim.clients), Counter())
    deaths = [(w, r, t) for sim in sims for w, r, t in sim.deaths]
    hung = spec.hung_rank
    starved = {r for sim in sims for r, gap in sim.beat_gap.items() if r != hung and gap > spec.heartbeat_timeout_s}
    false_deaths = sum(1 for _, r, _ in deaths if r != hung and r not in starved)
    hung_peers = set(peers_of(hung, spec.nodes, spec.workers_per_node)) if hung is not None else set()
    found = {w: t for w, r, t in deaths if r == hung}
    last_beat = max((sim.hung_last_beat for sim in sims if sim.hung_last_beat is not None), default=None)
    detection = [t - last_beat for t in found.values()] if last_beat is not None else []
    polls = {w: p for sim in sims for w, p in sim.hung_watcher_polls.items()}
    detection_lag = [sum(sorted(late for wall, late in polls[w] if last_beat <= wall <= t)[-2:])
                     for w, t in found.items()] if last_beat is not None else []
    per_second = sum((c.per_second for sim in sims for c in sim.clients), Counter())
    decisions = Counter(change.encode() for sim in sims for change in sim.decided.values())
    reported = [sim.first_report for sim in sims if sim.first_report is not None]
    decided_at = [t for sim in sims for t in sim.decided_at.values()]
    agreement = max(decided_at) - min(reported) if reported and decided_at else None
    confirmed_at = [t for sim in sims for t in sim.confirmed_at.values()]
    confirm = max(confirmed_at) - min(reported) if reported and confirmed_at else None
    return LoadResult(spec=spec, seconds=spec.duration_s, ops=ops, false_deaths=false_deaths,
                      hung_found_by=len(found.keys() & hung_peers), hung_watchers=len(hung_peers),
                      detection_s=detection, detection_lag_s=detection_lag,
                      worst_beat_lag_s=max(sim.worst_lag for sim in sims),
                      worst_watch_lag_s=max(sim.worst_watch_lag for sim in sims), starved=len(starved),
                      ops_per_second=[per_second[s] for s in range(int(spec.duration_s))], decisions=dict(decisions),
                      agreement_s=agreement, confirmed=len(confirmed_at), confirm_s=confirm)


def _run_shares(spec: LoadSpec, address: str, shares: list[list[int]], conn) -> list:
    """Set up and run some shares, one thread each; with `conn` (a child process) wait for the common start time
    and send back what each share saw, else return the shares themselves."""
    sims = [_Share(spec, connect_store(address, 30.0), connect_store(address, 30.0), nodes) for nodes in shares]
    for sim in sims:
        sim.setup()
    gc.collect()
    gc.freeze()  # tens of thousands of long-lived simulated objects: keep the collector from rescanning them
    if conn is None:
        start = time.monotonic() + 0.1
    else:
        conn.send("ready")
        start = conn.recv()
    for sim in sims:
        for client in sim.clients:
            client.calls.clear()
            client.start = start
    threads = [threading.Thread(target=sim.run, args=(start, loop), name=f"ntp-load-{i}-{loop}", daemon=True)
               for i, sim in enumerate(sims) for loop in ("beats", "watches")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(spec.duration_s + 30.0)
    gc.unfreeze()
    if any(t.is_alive() for t in threads):
        raise TimeoutError(f"load threads did not finish within {spec.duration_s + 30.0}s")
    if conn is None:
        return sims
    conn.send([_Seen(sim) for sim in sims])
    conn.close()
    return []


class _Seen:
    """What one share saw, without its store connection: sent back from a load process."""

    def __init__(self, sim):
        self.errors = [repr(e) for e in sim.errors]
        self.clients = [types.SimpleNamespace(calls=c.calls, per_second=c.per_second) for c in sim.clients]
        self.deaths, self.hung_last_beat, self.worst_lag = sim.deaths, sim.hung_last_beat, sim.worst_lag
        self.beat_gap, self.worst_watch_lag = sim.beat_gap, sim.worst_watch_lag
        self.hung_watcher_polls = sim.hung_watcher_polls
        self.decided, self.decided_at = sim.decided, sim.decided_at
        self.confirmed_at, self.first_report = sim.confirmed_at, sim.first_report


class _Share:
    """The nodes one share plays: their workers' beats and watches, their launchers' publications. The beats and
    publications run on one thread and client (`beats`), the watches and the agreement on another (`watches`)."""

    def __init__(self, spec: LoadSpec, beat_client, watch_client, nodes: list[int]):
        self.spec, self.nodes = spec, nodes
        self.beat_store, self.counting = CountingStore(beat_client), CountingStore(watch_client)
        self.clients = (self.beat_store, self.counting)
        self.deaths: list[tuple[int, int, float]] = []  # (watcher, rank, wall time)
        self.errors: list[BaseException] = []
        self.worst_lag = self.worst_watch_lag = 0.0
        self.hung_last_beat: float | None = None
        self.beat_gap: dict[int, float] = {}
        """Per worker, the longest time between two of its beats as sent (monotonic)."""
        self._last_sent: dict[int, float] = {}
        wpn = spec.workers_per_node
        self.ranks = [n * wpn + i for n in nodes for i in range(wpn)]
        hung = spec.hung_rank
        watching = set(peers_of(hung, spec.nodes, spec.workers_per_node)) if hung is not None else set()
        self.hung_watcher_polls: dict[int, list[tuple[float, float]]] = {r: [] for r in self.ranks if r in watching}
        """For each of this share's peers of the hung worker: (wall time, seconds late) of every poll it ran."""
        self.publishers = {n: NodePublisher(self.beat_store, n, range(n * wpn, (n + 1) * wpn)) for n in nodes}
        self.beaters = {rank: Heartbeat(self.beat_store, rank, spec.interval_s) for rank in self.ranks}
        self.workers: dict[int, Heartbeat] = {}
        self.memberships: dict[int, Membership] = {}
        self.waits: dict[int, DecisionWait] = {}
        self.decided: dict[int, MembershipChange] = {}
        self.decided_at: dict[int, float] = {}
        self.confirms: dict[int, BarrierWait] = {}
        self.confirmed_at: dict[int, float] = {}
        self.first_report: float | None = None
        members = range(spec.world_size)
        for rank in self.ranks:
            reader = LivenessReader(self.counting, wpn if spec.per_node else None)
            hb = Heartbeat(self.counting, rank, spec.interval_s, monitor=LivenessMonitor((), spec.heartbeat_timeout_s),
                           on_dead=lambda ranks, wall, w=rank: self._dead(w, ranks, wall), reader=reader)
            self.workers[rank] = hb
            self.memberships[rank] = Membership(self.counting, rank, members, settle_s=spec.settle_s)

    def _dead(self, watcher: int, ranks: frozenset[int], wall: float) -> None:
        self.deaths.extend((watcher, r, wall) for r in ranks)
        monitor = self.workers[watcher].monitor
        if self.memberships[watcher].report_failure(0, ranks, wall, "no heartbeat",
                                                    {r: monitor.silent_for(r) for r in ranks if r in monitor.ranks}):
            self.first_report = self.first_report or time.monotonic()

    def setup(self) -> None:
        """Every worker beats once and every launcher publishes once, as when the job has started."""
        for hb in self.beaters.values():
            hb.beat()
        for pub in self.publishers.values():
            pub.publish()
        for rank, hb in self.workers.items():
            hb.watch(peers_of(rank, self.spec.nodes, self.spec.workers_per_node))

    def run(self, start: float, loop: str) -> None:
        try:
            self._run(start, loop)
        except BaseException as err:  # raised by run_load: a share that stopped early makes the load test fail
            self.errors.append(err)

    def _run(self, start: float, loop: str) -> None:
        spec = self.spec
        rng = random.Random(spec.seed + self.nodes[0] + (0 if loop == "beats" else 1_000_003))
        fastest = spec.interval_s / WATCHES_PER_BEAT
        end = start + spec.duration_s
        hang_at = None if spec.hang_at_s is None else start + spec.hang_at_s
        queue: list[tuple[float, int, str, int]] = []
        seq = 0

        def push(due, kind, who):
            nonlocal seq
            seq += 1
            heapq.heappush(queue, (due, seq, kind, who))

        if loop == "beats":
            for rank in self.ranks:  # spread the first beats: workers do not start in lockstep
                push(start + rng.uniform(0, spec.interval_s), "beat", rank)
                self._last_sent[rank] = start
            for node in self.nodes:
                push(start + rng.uniform(0, NODE_PUBLISH_S), "publish", node)
        else:
            for rank in self.ranks:
                push(start + rng.uniform(0, spec.interval_s), "watch", rank)
                push(start + rng.uniform(0, spec.step_s), "step", rank)
        pause = {rank: fastest for rank in self.ranks}
        while queue:
            due, _, kind, who = heapq.heappop(queue)
            if due >= end:
                break
            now = time.monotonic()
            if due > now:
                time.sleep(due - now)
            hung = who == spec.hung_rank and hang_at is not None and due >= hang_at
            try:
                if kind == "beat":
                    if hung:
                        continue  # stopped: no more beats, no more watching
                    sent = time.monotonic()
                    self.worst_lag = max(self.worst_lag, sent - due)
                    self.beat_gap[who] = max(self.beat_gap.get(who, 0.0), sent - self._last_sent[who])
                    self._last_sent[who] = sent
                    beat = self.beaters[who].beat()
                    if who == spec.hung_rank:
                        self.hung_last_beat = beat.wall
                    push(due + spec.interval_s, "beat", who)
                elif kind == "watch":
                    if hung:
                        continue
                    late = time.monotonic() - due
                    self.worst_watch_lag = max(self.worst_watch_lag, late)
                    if who in self.hung_watcher_polls:
                        self.hung_watcher_polls[who].append((time.time(), late))
                    news = self.workers[who].poll_peers()
                    pause[who] = next_pause(pause[who], news, fastest, spec.interval_s)
                    push(time.monotonic() + pause[who], "watch", who)
                elif kind == "step":
                    if hung or who in self.waits:
                        continue
                    if self.memberships[who].pending():
                        self.waits[who] = DecisionWait(self.memberships[who], 0, 60.0)
                        push(time.monotonic(), "agree", who)
                    else:
                        push(due + spec.step_s, "step", who)
                elif kind == "agree":
                    outcome = self.waits[who].poll()
                    if isinstance(outcome, MembershipChange):
                        self.decided[who], self.decided_at[who] = outcome, time.monotonic()
                        self.confirms[who] = self.memberships[who].confirm_wait(outcome, 60.0)
                        push(time.monotonic(), "confirm", who)
                    else:
                        push(time.monotonic() + outcome, "agree", who)
                elif kind == "confirm":
                    wait_s = self.confirms[who].poll()
                    if wait_s is None:
                        self.confirmed_at[who] = time.monotonic()
                    else:
                        push(time.monotonic() + wait_s, "confirm", who)
                else:
                    self.publishers[who].publish()
                    push(due + NODE_PUBLISH_S, "publish", who)
            except Exception as err:  # counted and raised by run_load: a failed call is a failed load test
                self.errors.append(err)
                if len(self.errors) > 100:
                    return
