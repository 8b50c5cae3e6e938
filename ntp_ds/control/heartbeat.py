"""Liveness: workers beat to the store; a monitor decides which ranks have gone silent.

A crashed worker is usually seen first by its gloo neighbours ("Connection closed by peer", within milliseconds) or
by the launcher that waits on it (`mark_exited`). A hung worker (SIGSTOP, a wedged driver) is seen by nobody until
a collective times out, so every worker beats from a daemon thread and a rank whose beat counter has not moved for
`heartbeat_timeout_s` is dead. Silence is measured on the observer's own monotonic clock, never by comparing wall
clocks of two machines; the wall stamp in a beat only estimates when the rank was last alive.

Ranks here are launch ranks (the RANK a worker started with): they name a worker across every generation.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

log = logging.getLogger(__name__)

EXITED_KEY = "exited"
"""Store key to which `mark_exited` appends one `RANK REASON` line per worker known to have exited."""
WATCHES_PER_BEAT = 4
"""How often per beat interval a heartbeat thread that watches peers polls them."""
FENCE_KEY = "fence"
"""Store key to which `request_fence` appends one `RANK REASON` line per worker its peers declared dead."""


def heartbeat_key(rank: int) -> str:
    return f"heartbeat/{rank}"


@dataclass(frozen=True)
class Beat:
    """One heartbeat: a counter that rises by one per beat and the sender's wall time when it beat."""

    counter: int
    wall: float

    def encode(self) -> str:
        return f"{self.counter} {self.wall!r}"

    @classmethod
    def decode(cls, raw: bytes | str) -> Beat:
        text = raw.decode() if isinstance(raw, bytes) else raw
        counter, wall = text.split()
        return cls(int(counter), float(wall))


def read_beats(store, ranks: Iterable[int]) -> dict[int, Beat]:
    """Read the latest beat of each rank that has beaten at least once (two store round trips when all have)."""
    ranks = list(ranks)
    keys = [heartbeat_key(r) for r in ranks]
    if not keys:
        return {}
    if store.check(keys):
        return {r: Beat.decode(v) for r, v in zip(ranks, store.multi_get(keys))}
    return {r: Beat.decode(store.get(k)) for r, k in zip(ranks, keys) if store.check([k])}


def mark_exited(store, rank: int, reason: str) -> None:
    """Record that worker `rank` has exited (the launcher saw it, or the worker is leaving on its own)."""
    store.append(EXITED_KEY, f"{rank} {' '.join(reason.split())}\n")


def read_exits(store) -> dict[int, str]:
    """Return {rank: reason} of every worker marked as exited."""
    return _read_lines(store, EXITED_KEY)


def request_fence(store, ranks: Iterable[int], reason: str) -> None:
    """Ask the launchers to stop workers `ranks` for good: their peers declared them dead (a hung worker must never
    come back into the job, and stopping it closes its connections, which ends every wait on it)."""
    for rank in ranks:
        store.append(FENCE_KEY, f"{rank} {' '.join(reason.split())}\n")


def read_fences(store) -> dict[int, str]:
    """Return {rank: reason} of every worker some peer asked to be stopped."""
    return _read_lines(store, FENCE_KEY)


def _read_lines(store, key: str) -> dict[int, str]:
    if not store.check([key]):
        return {}
    out = {}
    for line in store.get(key).decode().splitlines():
        rank, _, reason = line.partition(" ")
        out.setdefault(int(rank), reason)
    return out


class LivenessMonitor:
    """Decide which of `ranks` are dead from the beats and exits observed so far; no I/O, the clock is injected.

    A rank is dead once it is marked as exited, or once its beat counter has not changed for more than
    `heartbeat_timeout_s` on `clock` (counted from the monitor's creation for a rank never heard from).
    """

    def __init__(self, ranks: Iterable[int], heartbeat_timeout_s: float, clock: Callable[[], float] = time.monotonic):
        if not heartbeat_timeout_s > 0:
            raise ValueError(f"heartbeat_timeout_s={heartbeat_timeout_s} must be positive")
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self._clock = clock
        now = clock()
        self._changed_at = {int(r): now for r in ranks}
        self._counter: dict[int, int] = {}
        self._wall: dict[int, float] = {}
        self._exited: dict[int, str] = {}

    @property
    def ranks(self) -> tuple[int, ...]:
        return tuple(sorted(self._changed_at))

    def observe(self, beats: Mapping[int, Beat], exited: Mapping[int, str] | None = None) -> None:
        """Take in the beats read from the store and the ranks known to have exited; ignore ranks not watched."""
        now = self._clock()
        for rank, beat in beats.items():
            if rank in self._changed_at and self._counter.get(rank) != beat.counter:
                self._counter[rank], self._wall[rank], self._changed_at[rank] = beat.counter, beat.wall, now
        for rank, reason in (exited or {}).items():
            if rank in self._changed_at:
                self._exited.setdefault(rank, reason)

    def silent_for(self, rank: int) -> float:
        """Return the seconds since `rank`'s counter last changed (or since the monitor began watching it)."""
        return self._clock() - self._changed_at[rank]

    def dead(self) -> frozenset[int]:
        """Return the ranks that have exited or have been silent for longer than `heartbeat_timeout_s`."""
        return frozenset(r for r in self._changed_at
                         if r in self._exited or self.silent_for(r) > self.heartbeat_timeout_s)

    def last_seen(self, rank: int) -> float | None:
        """Return the wall time stamped in the latest beat seen from `rank`, or None if it never beat."""
        return self._wall.get(rank)

    def reason(self, rank: int) -> str:
        """Say why `rank` counts as dead, for the membership decision's record."""
        if rank in self._exited:
            return f"rank {rank} exited ({self._exited[rank]})"
        return f"rank {rank}: no heartbeat for {self.silent_for(rank):.2f}s (timeout {self.heartbeat_timeout_s}s)"

    def retain(self, ranks: Iterable[int]) -> None:
        """Watch only `ranks` from now on (the survivors after a membership change)."""
        keep = set(ranks)
        for table in (self._changed_at, self._counter, self._wall, self._exited):
            for rank in [r for r in table if r not in keep]:
                del table[rank]


def poll_liveness(store, monitor: LivenessMonitor) -> frozenset[int]:
    """Read beats and exits from the store into `monitor`; return the ranks it now counts as dead."""
    monitor.observe(read_beats(store, monitor.ranks), read_exits(store))
    return monitor.dead()


class Heartbeat:
    """Beat to the store every `interval_s` from a daemon thread; optionally watch peers and report the dead.

    Give it a store client of its own (`store.clone()` or a second `connect_store`): a client serialises its calls,
    so a long wait on the training thread's client would delay the beats and make this rank look hung.
    With `monitor` and `on_dead`, each beat also polls the peers and calls `on_dead(new_dead, wall_time)` from the
    heartbeat thread once for each rank newly found dead.
    """

    def __init__(self, store, rank: int, interval_s: float = 1.0, *, wall: Callable[[], float] = time.time,
                 monitor: LivenessMonitor | None = None,
                 on_dead: Callable[[frozenset[int], float], None] | None = None):
        if not interval_s > 0:
            raise ValueError(f"interval_s={interval_s} must be positive")
        if (monitor is None) != (on_dead is None):
            raise ValueError("pass monitor and on_dead together, or neither")
        self.store, self.rank, self.interval_s = store, rank, interval_s
        self.monitor, self.on_dead = monitor, on_dead
        self.error: BaseException | None = None
        """The latest error of a beat or a poll, if any (the thread keeps beating through store hiccups)."""
        self._wall = wall
        self._counter = 0
        self._reported: set[int] = set()
        self._members: set[int] = set()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def beat(self) -> Beat:
        """Send one beat now."""
        self._counter += 1
        beat = Beat(self._counter, self._wall())
        self.store.set(heartbeat_key(self.rank), beat.encode())
        return beat

    def start(self) -> Heartbeat:
        """Beat once from the caller (so a dead store fails here, loudly), then keep beating in a daemon thread."""
        if self._thread is not None:
            raise RuntimeError(f"heartbeat of rank {self.rank} is already running")
        self.beat()
        self._thread = threading.Thread(target=self._run, name=f"ntp-heartbeat-{self.rank}", daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        # A watching thread looks at its peers WATCHES_PER_BEAT times per beat, so a silent peer is seen within a
        # fraction of a beat of its timeout (the beats themselves keep their interval).
        tick = self.interval_s / WATCHES_PER_BEAT if self.monitor is not None else self.interval_s
        last_beat = time.monotonic()
        while not self._stop.wait(tick):
            try:
                if time.monotonic() - last_beat >= self.interval_s - tick / 2:
                    self.beat()
                    last_beat = time.monotonic()
                if self.monitor is not None:
                    self._watch()
                self.error = None
            except Exception as err:  # a store hiccup must not end the beats; the error is kept for the caller
                if self.error is None:
                    log.warning("heartbeat of rank %d failed: %s", self.rank, err)
                self.error = err

    def _watch(self) -> None:
        with self._lock:
            new = poll_liveness(self.store, self.monitor) - self._reported
            if self._members:
                # A rank some other peer declared dead: every collective of the generation waits on it too.
                new |= (set(read_fences(self.store)) & self._members) - self._reported
            self._reported |= new
        if new:
            self.on_dead(frozenset(new), self._wall())

    def watch(self, ranks: Iterable[int], members: Iterable[int] = ()) -> None:
        """Watch exactly `ranks` from now on, each counted alive as of now (a new generation's peers), and report any
        of `members` (the rest of the generation) once a peer of theirs has asked for it to be fenced."""
        if self.monitor is None:
            raise RuntimeError("this heartbeat watches no peers (it has no monitor)")
        with self._lock:
            self.monitor = LivenessMonitor(ranks, self.monitor.heartbeat_timeout_s, self.monitor._clock)
            self._members = set(members)
            self._reported = set()

    def retain(self, ranks: Iterable[int]) -> None:
        """Watch only `ranks` from now on (call after adopting a membership change)."""
        if self.monitor is None:
            raise RuntimeError("this heartbeat watches no peers (it has no monitor)")
        with self._lock:
            self.monitor.retain(ranks)
            self._reported &= set(ranks)

    def stop(self, timeout_s: float = 5.0) -> bool:
        """Stop beating; wait at most `timeout_s` for the thread; return whether it has ended."""
        self._stop.set()
        if self._thread is None:
            return True
        self._thread.join(timeout_s)
        return not self._thread.is_alive()

    def __enter__(self) -> Heartbeat:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
