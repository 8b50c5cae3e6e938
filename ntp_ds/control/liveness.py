"""Judge liveness from beats: the beat a worker sends, and `LivenessMonitor`, which decides from the beats and exits
observed so far which ranks are dead or hung (no I/O; the clock is injected).

A hung worker (SIGSTOP, a wedged driver) is seen by nobody until a collective times out, so every worker beats and a
rank whose beat counter has not moved for `heartbeat_timeout_s` is dead. Silence is measured on the observer's own
monotonic clock, never by comparing wall clocks of two machines; the wall stamp in a beat only estimates when the
rank was last alive.

Ranks here are launch ranks (the RANK a worker started with): they name a worker across every generation.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Container, Iterable, Mapping, Sequence
from dataclasses import dataclass

log = logging.getLogger("ntp_ds.control.heartbeat")  # liveness logs under one name, whichever of its modules logs


@dataclass(frozen=True)
class Beat:
    """One heartbeat: a counter that rises by one per beat, the sender's wall time when it beat and, from a training
    rank, its training thread's progress (`ntp_ds.comm.wire.progress`): a counter that moves at every phase point
    and wait, whether the thread is waiting on peers, and for how long, on the sender's own clock, both have stood
    as they are (`still_s`: a watcher that saw the last change late still times the standstill from when it began)."""

    counter: int
    wall: float
    progress: int | None = None
    waiting: bool = False
    still_s: float | None = None

    def fields(self) -> list:
        if self.progress is None:
            return [self.counter, self.wall]
        if self.still_s is None:
            return [self.counter, self.wall, self.progress, int(self.waiting)]
        return [self.counter, self.wall, self.progress, int(self.waiting), round(self.still_s, 3)]

    @classmethod
    def from_fields(cls, fields) -> Beat:
        if len(fields) == 2:  # a beat without progress (a launcher's or a joiner's): the watchers' hot path
            return cls(int(fields[0]), float(fields[1]))
        counter, wall, progress, waiting, *still = fields
        return cls(int(counter), float(wall), int(progress), bool(int(waiting)), float(still[0]) if still else None)

    def encode(self) -> str:
        return " ".join(repr(f) if isinstance(f, float) else str(f) for f in self.fields())

    @classmethod
    def decode(cls, raw: bytes | str) -> Beat:
        return cls.from_fields((raw.decode() if isinstance(raw, bytes) else raw).split())



class LivenessMonitor:
    """Decide which of `ranks` are dead from the beats and exits observed so far; no I/O, the clock is injected.

    A rank is dead once it is marked as exited, or once its beat counter has not changed for more than
    `heartbeat_timeout_s` on `clock`. A rank never heard from (no beat of it in the store yet) is dead once
    `first_beat_timeout_s` (default: `heartbeat_timeout_s`) has passed since the monitor's creation: a peer may still
    be connecting its heartbeat's store clients when this one starts watching, which takes seconds when a whole job
    connects at once, and a dead process is seen by its launcher's exit mark whatever the bound. With
    `hang_timeout_s`, a rank that beats but whose training progress has stood still, outside any wait, for more than
    `hang_timeout_s` is hung (`hung`): a live process whose training makes no progress.

    Only time the watcher watched counts against a peer. A gap between two observations longer than `blind_gap_s`
    (default: half of `heartbeat_timeout_s`; the watcher's usual pause between looks must be shorter) is time it
    could not see: its own process or the store stalled, and a stall of the store delays every peer's beats as much
    as its reads. For a peer not seen to beat since, the gap counts for nothing, neither silence nor standing
    progress (`blind_s` sums such gaps); a dead peer is then found that much later (its exit mark is not delayed).
    A peer whose counter moved was seen fresh: its progress standing still over the gap counts (a hung peer beats).
    """

    def __init__(self, ranks: Iterable[int], heartbeat_timeout_s: float, clock: Callable[[], float] = time.monotonic,
                 hang_timeout_s: float | None = None, first_beat_timeout_s: float | None = None,
                 blind_gap_s: float | None = None):
        if not heartbeat_timeout_s > 0:
            raise ValueError(f"heartbeat_timeout_s={heartbeat_timeout_s} must be positive")
        if hang_timeout_s is not None and not hang_timeout_s > 0:
            raise ValueError(f"hang_timeout_s={hang_timeout_s} must be positive (or None: no progress watch)")
        if first_beat_timeout_s is not None and not first_beat_timeout_s >= heartbeat_timeout_s:
            raise ValueError(f"first_beat_timeout_s={first_beat_timeout_s} must be at least heartbeat_timeout_s="
                             f"{heartbeat_timeout_s} (or None: the same)")
        self.heartbeat_timeout_s, self.hang_timeout_s = heartbeat_timeout_s, hang_timeout_s
        self.first_beat_timeout_s = heartbeat_timeout_s if first_beat_timeout_s is None else first_beat_timeout_s
        if blind_gap_s is not None and not blind_gap_s > 0:
            raise ValueError(f"blind_gap_s={blind_gap_s} must be positive (or None: half of heartbeat_timeout_s)")
        self.blind_gap_s = heartbeat_timeout_s / 2 if blind_gap_s is None else blind_gap_s
        self.blind_s = 0.0
        """Seconds of gaps between observations that did not count against the peers (see the class)."""
        self._clock = clock
        now = clock()
        self._observed_at = now
        self._changed_at = {int(r): now for r in ranks}
        self._counter: dict[int, int] = {}
        self._exited: dict[int, str] = {}
        self._progress: dict[int, tuple[int, bool, float]] = {}  # rank -> (progress, waiting, when it last moved)

    @property
    def ranks(self) -> tuple[int, ...]:
        return tuple(sorted(self._changed_at))

    def observe(self, beats: Mapping[int, Beat], exited: Mapping[int, str] | None = None) -> None:
        """Take in the beats read from the store and the ranks known to have exited; ignore ranks not watched."""
        now = self._clock()
        gap, self._observed_at = now - self._observed_at, now
        if gap > self.blind_gap_s:
            # This watcher saw nothing meanwhile. A peer whose counter moved was seen fresh (so was the store): its
            # progress standing still over the gap is real. Any other peer is credited the gap: its silence may be
            # the stall's (a stalled store holds every beat back, and answers the reads queued beside them first).
            fresh = {r for r, b in beats.items() if r in self._changed_at and self._counter.get(r) != b.counter}
            credited = [r for r in self._changed_at if r not in fresh]
            if credited:
                self.blind_s += gap
                log.warning("%.2f s between two looks at %d peer(s) (this process or the store stalled): that time "
                            "does not count against the %d not seen to beat since", gap, len(self._changed_at),
                            len(credited))
            for rank in credited:
                self._changed_at[rank] += gap
                if rank in self._progress:
                    progress, waiting, since = self._progress[rank]
                    self._progress[rank] = (progress, waiting, since + gap)
        for rank, beat in beats.items():
            if rank in self._changed_at and self._counter.get(rank) != beat.counter:
                self._counter[rank], self._changed_at[rank] = beat.counter, now
            if rank in self._changed_at and beat.progress is not None:
                seen = self._progress.get(rank)
                # From when it began on the sender's clock (a duration: no clocks compared), else from this sighting.
                since = now if beat.still_s is None else now - max(0.0, beat.still_s)
                if seen is None or seen[:2] != (beat.progress, beat.waiting) or since < seen[2]:
                    self._progress[rank] = (beat.progress, beat.waiting, since)
        for rank, reason in (exited or {}).items():
            if rank in self._changed_at:
                self._exited.setdefault(rank, reason)

    def silent_for(self, rank: int) -> float:
        """Return the seconds since `rank`'s counter last changed (or since the monitor began watching it)."""
        return self._clock() - self._changed_at[rank]

    def stalled_for(self, rank: int) -> float:
        """Seconds `rank`'s training progress has stood still outside a wait (0 while it waits, moves or is unknown)."""
        seen = self._progress.get(rank)
        return 0.0 if seen is None or seen[1] else self._clock() - seen[2]

    def hung(self) -> frozenset[int]:
        """Return the ranks whose training progress has stood still outside a wait for longer than `hang_timeout_s`
        (none without it). Only a rank that waits on them may call them hung: a peer's long work is not a hang
        while nobody waits for it."""
        if self.hang_timeout_s is None:
            return frozenset()
        return frozenset(r for r in self._progress if self.stalled_for(r) > self.hang_timeout_s)

    def _bound(self, rank: int) -> float:
        """How long `rank` may stay silent: `heartbeat_timeout_s`, or `first_beat_timeout_s` until its first beat."""
        return self.heartbeat_timeout_s if rank in self._counter else self.first_beat_timeout_s

    def dead(self) -> frozenset[int]:
        """Return the ranks that have exited or have been silent for longer than their bound (`heartbeat_timeout_s`;
        `first_beat_timeout_s` for a rank never heard from)."""
        return frozenset(r for r in self._changed_at if r in self._exited or self.silent_for(r) > self._bound(r))

    def reason(self, rank: int) -> str:
        """Say why `rank` counts as dead, for the membership decision's record."""
        if rank in self._exited:
            return f"rank {rank} exited ({self._exited[rank]})"
        if self.silent_for(rank) <= self._bound(rank) and self.hang_timeout_s is not None \
                and self.stalled_for(rank) > self.hang_timeout_s:
            return (f"rank {rank}: beats, but its training made no progress for {self.stalled_for(rank):.2f}s "
                    f"(hang_timeout_s {self.hang_timeout_s}s)")
        if rank not in self._counter:
            return (f"rank {rank}: not one heartbeat in {self.silent_for(rank):.2f}s "
                    f"(first_beat_timeout_s {self.first_beat_timeout_s}s)")
        return f"rank {rank}: no heartbeat for {self.silent_for(rank):.2f}s (timeout {self.heartbeat_timeout_s}s)"

    def retain(self, ranks: Iterable[int]) -> None:
        """Watch only `ranks` from now on (the survivors after a membership change)."""
        # (the survivors: W long, not copied; a container that answers `in` without a set, as `detect.Among`)
        keep = ranks if isinstance(ranks, Container) and not isinstance(ranks, Sequence) else set(ranks)
        for table in (self._changed_at, self._counter, self._exited, self._progress):
            for rank in [r for r in table if r not in keep]:
                del table[rank]
