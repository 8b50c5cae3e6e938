"""Detection and agreement: find the dead members of a generation, agree on the next one, meet its members.

Every wait here watches the peers it waits on: a member found dead on the way ends the wait at once (the recovery's
attempt then starts again without it), where the store's own barrier would wait for its bound. What this rank saw of
its watched peers (`Detector.monitor`) and the verdicts its heartbeat gave (`Detector.declared`) carry from one
attempt to the next.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

from ntp_ds.comm.groups import ring_neighbours
from ntp_ds.control.keys import barrier_key
from ntp_ds.control.liveness import LivenessMonitor
from ntp_ds.control.membership import BarrierTimeout, BarrierWait, MembershipChange


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
    timeout and a beat, and then belong in one decision, not one attempt each."""
    return heartbeat_timeout_s / 2 + heartbeat_interval_s


class Detector:
    """One rank's view of its peers' deaths during a recovery: reads of the store's beats, exits and fences, judged
    for a bounded set of watched peers (`monitor`), plus its heartbeat's own verdicts (`declared`)."""

    def __init__(self, reader, *, heartbeat_timeout_s: float, heartbeat_interval_s: float,
                 first_beat_timeout_s: float, collective_timeout_s: float,
                 clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep):
        self.reader = reader
        self.heartbeat_timeout_s, self.heartbeat_interval_s = heartbeat_timeout_s, heartbeat_interval_s
        self.first_beat_timeout_s, self.collective_timeout_s = first_beat_timeout_s, collective_timeout_s
        self.clock, self.sleep = clock, sleep
        self.monitor = LivenessMonitor((), heartbeat_timeout_s, clock=clock)
        """What this rank saw of the peers whose beats it judges (a bounded set: those its heartbeat watched, or
        its ring neighbours at a rendezvous); every other member's death reaches it through the exit and fence logs."""
        self.declared: dict[int, str] = {}
        """Members this rank's heartbeat declared dead, with why: a hung peer still beats, so only this verdict
        names it."""

    def poll_dead(self, among: Iterable[int]) -> tuple[frozenset[int], dict[int, str]]:
        """One read of the store (the watched peers' beats, the exit and fence logs): which of `among` are dead,
        and why. Beats are judged for the monitor's ranks only; an exit or a fence request counts for anyone."""
        view = self.reader.read(self.monitor.ranks, fences=True)
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
        deadline = self.clock() + 2 * self.heartbeat_timeout_s + self.collective_timeout_s
        pause = 0.05
        members = set(membership.members)  # after a failed confirm, the generation it adopted
        seen = self.monitor
        seen.retain(members - {membership.rank})
        dead, reasons = frozenset(), {}
        while self.clock() < deadline:
            dead, reasons = self.poll_dead(members)
            reported = {r for rep in membership.reports(membership.generation) for r in rep.ranks}
            dead |= (reported | set(self.declared)) & members
            suspects = [r for r in seen.ranks if r not in dead and seen.silent_for(r) > self.heartbeat_timeout_s / 2]
            if dead and not suspects:
                break
            self.sleep(pause)  # backs off to a beat interval (not while a suspect waits): every survivor polls here
            pause = 0.05 if suspects else min(2 * pause, max(0.05, self.heartbeat_interval_s))
        if not dead:
            raise error
        return dead, "; ".join(self.declared.get(r) or reasons.get(r) or f"rank {r} reported dead by a peer"
                               for r in sorted(dead))

    def agree(self, membership, dead: frozenset[int], reason: str, silent: dict[int, float]) -> MembershipChange:
        """Report `dead` in the membership's generation, await the decision every survivor adopts, and confirm it
        with the other survivors (watched meanwhile)."""
        generation = membership.generation
        membership.report_failure(generation, dead, time.time(), reason, {r: silent[r] for r in dead if r in silent})
        # A survivor blocked in a collective with a hung peer arrives only after its process-group timeout.
        bound = 2 * self.collective_timeout_s + self.heartbeat_timeout_s
        change = membership.await_decision(generation, bound)
        wait = membership.confirm_wait(change, bound)
        if wait is not None:  # (None: a stale change, the membership has moved past it)
            self.watch(wait, set(change.survivors) - {membership.rank},
                       f"the survivors confirmed generation {change.generation}")
        return change

    def arrive(self, store, rank: int, generation: int, members: tuple[int, ...]) -> None:
        """Meet the new generation's members before joining its process group, watching the ring neighbours' beats
        and everyone's exits and fences."""
        self.monitor = LivenessMonitor(ring_neighbours(list(members), rank), self.heartbeat_timeout_s, clock=self.clock,
                                       first_beat_timeout_s=self.first_beat_timeout_s)
        wait = BarrierWait(store, barrier_key(generation, "arrive", members), rank, members, self.collective_timeout_s)
        self.watch(wait, set(members) - {rank}, f"generation {generation}'s rendezvous")

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
        while (pause := wait.poll()) is not None:
            dead, reasons = self.poll_dead(others)
            if dead:
                self.declared.update(reasons)
                raise RuntimeError(f"rank(s) {sorted(dead)} died before {what}: "
                                   + "; ".join(reasons[r] for r in sorted(dead)))
            self.sleep(pause)
