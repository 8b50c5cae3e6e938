"""Detection and agreement: find the dead members of a generation, agree on the next one, meet its members.

Every wait here watches the peers it waits on: a member found dead on the way ends the wait at once (the recovery's
attempt then starts again without it), where the store's own barrier would wait for its bound. What this rank saw of
its watched peers (`Detector.monitor`) and the verdicts its heartbeat gave (`Detector.declared`) carry from one
attempt to the next.
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Callable, Iterable

from ntp_ds.control.heartbeat import WATCHES_PER_BEAT, suspect_after_s
from ntp_ds.control.keys import barrier_key
from ntp_ds.control.liveness import LivenessMonitor
from ntp_ds.control.liveness_store import request_fence
from ntp_ds.control.membership import BarrierTimeout, BarrierWait, MembershipChange
from ntp_ds.control.node_local import NodeLocal
from ntp_ds.layout.domains import spread_neighbours


def first_beat_timeout(heartbeat_timeout_s: float, collective_timeout_s: float) -> float:
    """How long a peer may go unheard before its first beat. Connecting the heartbeat's store clients waits on the
    store's server: seconds when a whole job connects at once (seen here: 3.4 s on a loaded 2-core machine), and not
    the peer's own work, so neither a hang nor a silence. It gets the job's collective bound on top of the heartbeat
    timeout (CI once saw rank 0 declared dead at start)."""
    return heartbeat_timeout_s + collective_timeout_s


def decision_settle_s(heartbeat_timeout_s: float, heartbeat_interval_s: float) -> float:
    """How long a decision waits, after the first report, for members that have not acknowledged yet (it commits at
    once when every member not reported dead has). A member that has not acknowledged is judging a watched peer
    silent for half the timeout (`Detector.detect` answers only once it has its verdict), or is dead and not yet
    reported: deaths at one moment (a node, a rack) reach their watchers' verdicts within the other half of the
    timeout and a beat, and then belong in one decision, not one attempt each (where their verdicts come further
    apart, each report of new deaths starts the window again, within a bound: `membership.DecisionWait`)."""
    return heartbeat_timeout_s / 2 + heartbeat_interval_s


class Detector:
    """One rank's view of its peers' deaths during a recovery: reads of the store's beats, exits and fences, judged
    for a bounded set of watched peers (`monitor`), plus its heartbeat's own verdicts (`declared`)."""

    def __init__(self, reader, *, heartbeat_timeout_s: float, heartbeat_interval_s: float,
                 first_beat_timeout_s: float, collective_timeout_s: float,
                 clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep,
                 node: NodeLocal | None = None, domain_of: Callable[[int], int] | None = None):
        self.reader = reader
        self.node = node
        """The node's own store, through which the new generation's members meet (`BarrierWait`); None: none."""
        self.domain_of = domain_of
        """A launch rank's failure domain (its rack, or its node), which the rendezvous's watchers are placed across
        (`layout.domains.spread_neighbours`); None: none known."""
        self.heartbeat_timeout_s, self.heartbeat_interval_s = heartbeat_timeout_s, heartbeat_interval_s
        self.first_beat_timeout_s, self.collective_timeout_s = first_beat_timeout_s, collective_timeout_s
        self.clock, self.sleep = clock, sleep
        self.monitor = LivenessMonitor((), heartbeat_timeout_s, clock=clock)
        """What this rank saw of the peers whose beats it judges (a bounded set: those its heartbeat watched, or
        its ring neighbours at a rendezvous); every other member's death reaches it through the exit and fence logs."""
        self.declared: dict[int, str] = {}
        """Members this rank's heartbeat declared dead, with why: a hung peer still beats, so only this verdict
        names it."""
        self.reasons: dict[int, str] = {}
        """The last detection's dead, each with its own reason (what its fence request files)."""
        self.recorded: set[int] = set()
        """Ranks the exit and fence logs name, as last read: their launchers know of them already."""

    def poll_dead(self, among: Iterable[int], direct: bool = True) -> tuple[frozenset[int], dict[int, str]]:
        """One read of the store (the watched peers' beats, the exit and fence logs): which of `among` are dead,
        and why. Beats are judged for the monitor's ranks only; an exit or a fence request counts for anyone. Not
        `direct`: from the launcher's copy where it serves (`LivenessReader`)."""
        view = self.reader.read(self.monitor.ranks, fences=True, direct=direct)
        self.recorded = set(view.fences) | set(view.exited)
        self.monitor.observe(view.beats, view.exited)
        reasons = {r: f"rank {r} declared dead by a peer ({why})" for r, why in view.fences.items()}
        reasons.update((r, f"rank {r} exited ({why})") for r, why in view.exited.items())
        reasons.update((r, self.monitor.reason(r)) for r in self.monitor.dead())
        dead = frozenset(r for r in reasons if r in among)  # (`among`, a set, may hold the whole job: not copied)
        return dead, {r: reasons[r] for r in dead}

    def detect(self, membership, error: BaseException) -> tuple[frozenset[int], str]:
        """Find the dead members of `membership`'s generation: marked exited, fenced or reported by a peer,
        declared by this rank's heartbeat, or, of the watched peers, silent past the heartbeat timeout. Raise
        `error` if none is found within the bound (the failure was this rank's own).

        A watched peer silent for half the timeout is judged before the answer is given (dead, or beating again):
        peers that died together (a node) are then reported together, not one generation after another."""
        detection = Detection(self, membership, error)
        while (pause := detection.poll()) is not None:
            self.sleep(pause)
        return detection.result

    def to_fence(self) -> dict[int, str]:
        """Of the last detection's dead, those to fence, with their reasons: not the ones the logs name already (a
        fence request is a write to the rank's key, which every survivor would otherwise make)."""
        return {r: why for r, why in self.reasons.items() if r not in self.recorded}

    def agree(self, membership, dead: frozenset[int], reason: str, silent: dict[int, float]) -> MembershipChange:
        """Report `dead` in the membership's generation, await the decision every survivor adopts, and confirm it
        with the other survivors (watched meanwhile)."""
        agreement = Agreement(self, membership, dead, reason, silent)
        while (pause := agreement.poll()) is not None:
            self.sleep(pause)
        return agreement.change

    def arrive(self, store, rank: int, generation: int, members: tuple[int, ...]) -> None:
        """Meet the new generation's members before joining its process group, watching the beats of its two
        neighbours on a ring across the failure domains (`layout.domains.spread_neighbours`) and everyone's exits and
        fences."""
        arrival = self.arrival(store, rank, generation, members)
        while (pause := arrival.poll()) is not None:
            self.sleep(pause)

    def arrival(self, store, rank: int, generation: int, members: tuple[int, ...]) -> Watching:
        """`arrive`, one poll at a time."""
        self.monitor = LivenessMonitor(spread_neighbours(members, rank, self.domain_of), self.heartbeat_timeout_s,
                                       clock=self.clock, first_beat_timeout_s=self.first_beat_timeout_s)
        self.list_watched(rank)
        wait = BarrierWait(store, barrier_key(generation, "arrive", members), rank, members, self.collective_timeout_s,
                           node=self.node)
        return Watching(self, wait, set(members) - {rank}, f"generation {generation}'s rendezvous")

    def finish(self, store, rank: int, generation: int, members: tuple[int, ...], timeout_s: float) -> None:
        """Meet the new generation's members once each has installed its engine (the recovery's last barrier),
        watching as `arrive` does: a member that dies meanwhile ends the wait at once (the attempt then starts again
        without it), not at the barrier's bound."""
        ending = self.ending(store, rank, generation, members, timeout_s)
        while (pause := ending.poll()) is not None:
            self.sleep(pause)

    def ending(self, store, rank: int, generation: int, members: tuple[int, ...], timeout_s: float) -> Watching:
        """`finish`, one poll at a time."""
        wait = BarrierWait(store, barrier_key(generation, "done", members), rank, members, timeout_s, node=self.node)
        # (a set, as the rendezvous's: a grown generation's members are in global-rank order, not sorted)
        return Watching(self, wait, set(members) - {rank}, f"generation {generation}'s end")

    def list_watched(self, rank: int) -> None:
        """Tell the launcher's copy (`LivenessReader.want`) whose keys this rank's recovery watches now."""
        want = getattr(self.reader, "want", None)
        if want is not None:
            want(rank, self.monitor.ranks, self.heartbeat_interval_s, "recovery")

    def missed(self, timeout: BarrierTimeout) -> frozenset[int]:
        """The ranks that never reached a barrier within its bound, from now on declared dead (for the next
        attempt's detection): a rank that cannot arrive in that long is lost, whether or not anyone saw it go (a rack
        lost whole takes its watchers with it, and its launchers, who would mark its exits)."""
        why = f"did not arrive at barrier {timeout.name!r} within {timeout.timeout_s:g} s"
        self.declared.update((r, f"rank {r} {why}") for r in timeout.missing)
        return timeout.missing

    def watch(self, wait, others: set[int], what: str) -> None:
        """Poll `wait` (a store barrier) to its end; a member of `others` found dead meanwhile ends it with a
        RuntimeError naming it (and is kept in `declared`, for the next attempt's detection)."""
        watching = Watching(self, wait, others, what)
        while (pause := watching.poll()) is not None:
            self.sleep(pause)


class Among:
    """Sorted member ranks (W long), asked whether they hold a rank (by bisection), without `but`."""

    def __init__(self, members: tuple[int, ...], but: int | None = None):
        self.members, self.but = members, but

    def __contains__(self, rank) -> bool:
        i = bisect.bisect_left(self.members, rank)
        return rank != self.but and i < len(self.members) and self.members[i] == rank


class Detection:
    """`Detector.detect`, one poll at a time: `poll` returns the seconds to pause before the next, or None once
    `result` (the dead and why) is known; it raises the rank's own `error` when nobody is found dead in time. (The
    recovery runs it to the end; a harness that plays many ranks on one thread polls it itself.)"""

    def __init__(self, detector: Detector, membership, error: BaseException):
        self.detector, self.membership, self.error = detector, membership, error
        self.deadline = detector.clock() + 2 * detector.heartbeat_timeout_s + detector.collective_timeout_s
        self._pause = 0.05
        # (after a failed confirm, the generation it adopted; asked about a few ranks at a time: not copied)
        self._members = Among(membership.members)
        detector.monitor.retain(Among(membership.members, but=membership.rank))
        detector.list_watched(membership.rank)
        self._dead: frozenset[int] = frozenset()
        self._reasons: dict[int, str] = {}
        self.result: tuple[frozenset[int], str] | None = None
        self.reasons: dict[int, str] = {}
        """Each of the dead found, with its own reason."""

    def poll(self) -> float | None:
        d, membership, members = self.detector, self.membership, self._members
        if d.clock() >= self.deadline:
            return self._end()
        seen = d.monitor
        dead, self._reasons = d.poll_dead(members)
        # (the node's ranks read the reports together: a read at most a pause old, `NodeLocal.read`)
        reported = {r for rep in membership.reports(membership.generation, self._pause) for r in rep.ranks}
        self._dead = dead | {r for r in reported | d.declared.keys() if r in members}
        after = suspect_after_s(d.heartbeat_timeout_s, d.reader)
        suspects = [r for r in seen.ranks if r not in self._dead and seen.silent_for(r) > after]
        if self._dead and not suspects:
            return self._end()
        # Backs off to a beat interval (not while a suspect waits): every survivor polls here.
        pause = self._pause
        self._pause = 0.05 if suspects else min(2 * pause, max(0.05, d.heartbeat_interval_s))
        return pause

    def _end(self) -> None:
        if not self._dead:
            raise self.error
        d = self.detector
        self.reasons = d.reasons = {r: d.declared.get(r) or self._reasons.get(r) or f"rank {r} reported dead by a peer"
                                    for r in sorted(self._dead)}
        self.result = self._dead, "; ".join(self.reasons.values())
        return None


class Agreement:
    """`Detector.agree`, one poll at a time: the report (at the first poll), the wait for the decision, then the
    confirm barrier, watched; `poll` returns None once every survivor has confirmed `change`.

    While the decision waits, the watched peers found dead meanwhile (their beats, the exit and fence logs: read at a
    heartbeat's fastest pace at most) are reported in the same generation, by their watchers only (a claim is a write
    to the dead rank's key: a few watchers each, not every survivor): a death that comes before the commit joins the
    decision (and its acknowledgement, made on its behalf, lets the decision end without waiting out the settle window
    for it), instead of failing the confirm barrier and costing a generation of its own."""

    def __init__(self, detector: Detector, membership, dead: frozenset[int], reason: str, silent: dict[int, float]):
        self.detector, self.membership = detector, membership
        self._report = (dead, reason, {r: silent[r] for r in dead if r in silent})
        self._decision = None
        self._confirm = None
        self._reported = set(dead)
        self._read_at = -float("inf")
        self.joined: frozenset[int] = frozenset()
        """Members found dead while the decision waited, and reported in the same generation."""
        self.change: MembershipChange | None = None

    def poll(self) -> float | None:
        d, membership = self.detector, self.membership
        if self._decision is None:
            generation = membership.generation
            dead, reason, silent = self._report
            membership.report_failure(generation, dead, time.time(), reason, silent)
            # A survivor blocked in a collective with a hung peer arrives only after its process-group timeout.
            bound = 2 * d.collective_timeout_s + d.heartbeat_timeout_s
            self._decision = membership.decision_wait(generation, bound)
        if self.change is None:
            outcome = self._decision.poll()
            if not isinstance(outcome, MembershipChange):
                self._join_deaths(membership.generation)
                return outcome
            self.change = outcome
            bound = 2 * d.collective_timeout_s + d.heartbeat_timeout_s
            wait = membership.confirm_wait(outcome, bound)
            if wait is None:  # a stale change: the membership has moved past it
                return None
            self._confirm = Watching(d, wait, set(outcome.survivors) - {membership.rank},
                                     f"the survivors confirmed generation {outcome.generation}")
        return None if self._confirm is None else self._confirm.poll()

    def _join_deaths(self, generation: int) -> None:
        """Report, in `generation`, the members found dead since this rank's report (see the class)."""
        d, membership = self.detector, self.membership
        now = d.clock()
        if now - self._read_at < d.heartbeat_interval_s / WATCHES_PER_BEAT:
            return
        self._read_at = now
        dead, reasons = d.poll_dead(Among(membership.members, but=membership.rank), direct=False)
        new = dead - self._reported
        if not new:
            return
        self._reported |= new
        d.declared.update((r, reasons[r]) for r in new)
        watched = new & set(d.monitor.ranks)
        if not watched:
            return
        self.joined |= watched
        judged = {r: reasons[r] for r in watched if r not in d.recorded}  # (the logs name the rest already)
        if judged:
            request_fence(membership.store, judged, judged)
        membership.report_failure(generation, watched, time.time(), "; ".join(reasons[r] for r in sorted(watched)),
                                  {r: d.monitor.silent_for(r) for r in watched})


class Watching:
    """`Detector.watch`, one poll at a time: polls `wait` (a store barrier), and between its polls reads whether a
    member of `others` died (then raises a RuntimeError naming it, kept in the detector's `declared`); None once the
    barrier has ended."""

    def __init__(self, detector: Detector, wait, others: set[int], what: str):
        self.detector, self.wait, self.others, self.what = detector, wait, others, what
        self._read_at = -float("inf")

    def poll(self) -> float | None:
        pause = self.wait.poll()
        if pause is None:
            return None
        d = self.detector
        now = d.clock()
        if now - self._read_at < d.heartbeat_interval_s / WATCHES_PER_BEAT:  # a heartbeat's fastest pace at most
            return pause
        self._read_at = now
        dead, reasons = d.poll_dead(self.others, direct=False)  # (a barrier's watch: the copy, while it serves)
        if dead:
            d.declared.update(reasons)
            raise RuntimeError(f"rank(s) {sorted(dead)} died before {self.what}: "
                               + "; ".join(reasons[r] for r in sorted(dead)))
        return pause
