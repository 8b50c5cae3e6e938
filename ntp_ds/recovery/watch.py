"""Watching: this rank's heartbeat, and what a verdict on a peer does (fence it, end this rank's waits on the wire).

The heartbeat's thread beats, watches a bounded set of peers (those this rank exchanges data with, or its ring
neighbours while a recovery builds the next generation) and reads the fence requests of every member. A peer found
dead or hung is fenced (its launcher stops it for good, which closes its connections and ends every gloo wait on it)
and the wire is told (under NCCL this aborts the communicators, sparing the groups without a suspect). While the
engine trains, the verdict is also reported to the membership at once (`report`), from this thread: a rank still busy
with its own step (a replica that lost nothing, in its backward) has acknowledged the death by the time it notices,
so the decision is committed without waiting for it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from ntp_ds.comm import wire
from ntp_ds.control.heartbeat import Heartbeat
from ntp_ds.control.liveness import LivenessMonitor
from ntp_ds.control.liveness_store import LivenessReader, request_fence
from ntp_ds.control.node_store import connect_node_store
from ntp_ds.layout.domains import spread_neighbours
from ntp_ds.recovery.keep import departed, suspects

log = logging.getLogger("ntp_ds.recovery")


class Watch:
    """One rank's heartbeat wired to the recovery: `members()` are the current generation's (launch ranks, in
    global-rank order), `engine()` the running engine (None during a recovery), `generation()` the membership's
    number; each verdict's reason goes into `declared`."""

    def __init__(self, store, rank: int, *, interval_s: float, timeout_s: float, hang_timeout_s: float | None,
                 first_beat_timeout_s: float, generation: Callable[[], int], members: Callable[[], tuple[int, ...]],
                 engine: Callable[[], object], declared: dict[int, str],
                 report: Callable[[frozenset[int], float, str, dict[int, float], frozenset[int]], None] | None
                 = None, domain_of: Callable[[int], int] | None = None):
        self.rank, self.timeout_s = rank, timeout_s
        self.domain_of = domain_of
        """A launch rank's failure domain (rack or node): `watch_ring` places the watchers across them."""
        self.report = report
        """Called from the heartbeat's thread with a verdict (the dead, the wall time, why, how long each was
        silent, those known only from the fence log) while the engine trains and no other watched peer is suspect:
        the membership's report."""
        self.members, self.engine, self.declared = members, engine, declared
        with wire.waiting():
            # Departures are asked from the training thread and, under NCCL, the abort thread: a client of their own.
            departures = store.clone()
            wire.on_departure(lambda group: departed(departures, generation(), group))
            beat_store = store.clone()
            node_store = connect_node_store()  # (`ntp-ds launch`'s: beats and quiet polls stay on the node)
            # A peer that beats but makes no training progress while this rank waits on it is hung (hang_timeout_s).
            self.heartbeat = Heartbeat(beat_store, rank, interval_s,
                                       monitor=LivenessMonitor((), timeout_s, hang_timeout_s=hang_timeout_s,
                                                               first_beat_timeout_s=first_beat_timeout_s),
                                       on_dead=self.peers_dead,
                                       reader=LivenessReader.from_env(beat_store, mirror=node_store),
                                       progress=wire.progress, beats_to=node_store,
                                       alarms_from=node_store and connect_node_store())  # (its alarm thread's)

    def start(self) -> None:
        """Watch the engine's peers, if it runs, and start beating (connecting to the store's server is waiting,
        not this rank's work)."""
        with wire.waiting():
            if self.engine() is not None:
                self.watch_engine(self.engine())
            self.heartbeat.start()

    def watch(self, peers) -> None:
        """Watch `peers`' beats from now on; of every other member, a fence request."""
        self.heartbeat.watch(sorted(set(peers) - {self.rank}), set(self.members()) - {self.rank})

    def watch_ring(self) -> None:
        """Watch this rank's ring neighbours among the members, on a ring across the failure domains (`domain_of`;
        `layout.domains.spread_neighbours`). Until the new engine is built (and its peers are known), a death must
        still end this rank's waits: on NCCL nothing else does (no error, no timeout). Its ring neighbours watch each
        member meanwhile, and a death they see reaches every other member as a fence request."""
        self.watch(spread_neighbours(self.members(), self.rank, self.domain_of))

    def watch_engine(self, engine) -> None:
        """Watch the workers `engine` exchanges data with (`NTPEngine.watched_peers`; of its data-parallel group its
        two ring neighbours)."""
        members = self.members()
        self.watch(members[r] for r in engine.watched_peers())

    def suspects(self, dead) -> list[int] | None:
        """`keep.suspects` of `dead` (launch ranks); None while no engine runs (a recovery under way): then every
        group is suspect."""
        engine = self.engine()
        try:
            return suspects(engine.ntp_groups.topology, self.members(), dead)
        except (AttributeError, ValueError, IndexError, TypeError):
            return None

    def peers_dead(self, ranks: frozenset[int], wall: float) -> None:
        """From the heartbeat thread: a peer went silent or exited. Ask its launcher to stop it for good and end this
        rank's waits on the wire."""
        ranks = ranks & frozenset(self.members())
        if not ranks:  # a verdict on a generation this rank has already left (its dead are not members any more)
            return
        monitor = self.heartbeat.monitor
        judged = monitor.dead() | monitor.hung()  # the rest: fenced at another peer's request
        reasons = {r: monitor.reason(r) if r in judged else f"rank {r} declared dead by a peer" for r in ranks}
        reason = "; ".join(reasons[r] for r in sorted(ranks))
        self.declared.update(reasons)
        log.warning("rank %d: %s", self.rank, reason)
        try:  # what this rank judged itself (a rank some peer declared dead is in the fence log already)
            request_fence(self.heartbeat.store, [r for r in ranks if r in judged], reasons)
        finally:
            wire.peer_failed(reason, suspects=self.suspects(ranks), arrival_s=self.timeout_s)
        self._report(ranks, wall, reason, ranks - judged)

    def _report(self, ranks: frozenset[int], wall: float, reason: str, fenced: frozenset[int]) -> None:
        """Report `ranks` dead to the membership now, unless no engine runs (a recovery reports from its own
        detection) or another watched peer is silent for half the timeout: a report acknowledges this rank's view as
        complete, and deaths at one moment (a node, a rack) belong in one decision (`Detector.detect` waits for such
        a suspect's verdict the same way)."""
        if self.report is None or self.engine() is None:
            return
        monitor = self.heartbeat.monitor
        if another_suspect(monitor, ranks, self.declared):
            return
        silent = {r: monitor.silent_for(r) for r in ranks if r in monitor.ranks}
        try:
            self.report(ranks, wall, reason, silent, fenced)
        except Exception as err:  # the training thread's own detection reports it then
            log.debug("rank %d: early report of %s failed: %s", self.rank, sorted(ranks), err)


def another_suspect(monitor: LivenessMonitor, dead, declared) -> bool:
    """Whether a watched peer besides `dead` and the `declared` has been silent for half the heartbeat timeout: its
    verdict belongs in the same report (`Watch._report`)."""
    half = monitor.heartbeat_timeout_s / 2
    return any(monitor.silent_for(r) > half for r in monitor.ranks if r not in dead and r not in declared)
