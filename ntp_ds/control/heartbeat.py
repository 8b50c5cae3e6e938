"""Liveness: workers beat to the store; a monitor decides which ranks have gone silent.

A crashed worker is usually seen first by its gloo neighbours ("Connection closed by peer", within milliseconds) or
by the launcher that waits on it (`mark_exited`). A hung worker (SIGSTOP, a wedged driver) is seen by nobody until
a collective times out, so every worker beats from a daemon thread and a rank whose beat counter has not moved for
`heartbeat_timeout_s` is dead. Silence is measured on the observer's own monotonic clock, never by comparing wall
clocks of two machines; the wall stamp in a beat only estimates when the rank was last alive.

Reading every peer's key every poll does not scale: at thousands of ranks the store would serve hundreds of millions
of reads per second at the worst moment, delaying healthy beats past the timeout. So the launcher of each node reads
its own workers' beats (one request) and publishes one key per node, `node/{n}` (`NodePublisher`); a watcher reads
the keys of the nodes its peers live on in one request (`LivenessReader`) and backs off while nothing is news. A
worker started without a launcher (no `NTP_NODE_SIZE`) is read per rank, and so is a node whose key has stopped
moving (its launcher is gone): per-node reads are an economy, never a second source of truth.

Backing off makes a quiet watcher slow to learn of a death, so every record of one (an abnormal exit, a fence
request) also raises an alarm (`raise_alarm`): it bumps the job's alarm epoch and sets, in one request, one key per
bucket of ALARM_BUCKET watchers (`alarm/{bucket}/{epoch}`, the buckets listed in `alarm/buckets`). Each watching
heartbeat has a thread blocked in the store's `wait` for its bucket's key of the next epoch, which wakes it to poll
at once. The store answers such a wait when the key is set (no polling), so a death reaches every rank in one store
round trip whatever the backoff, a raise costs O(W / ALARM_BUCKET) key writes, and a quiet job costs nothing but one
open wait per rank. A stopping heartbeat sets its bucket's key to end its own waiting thread (a thread still inside
the store's C++ call when the interpreter finalizes can abort the process); its bucket-mates wake too, see that the
epoch has not moved, and wait again, so a job's end costs each rank at most ALARM_BUCKET wakes.

Ranks here are launch ranks (the RANK a worker started with): they name a worker across every generation.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from datetime import timedelta

from torch.distributed import DistStoreError

from ntp_ds.envs import NODE_SIZE_ENV

log = logging.getLogger(__name__)

EXITED_KEY = "exited"
"""Store key to which `mark_exited` appends one `RANK REASON` line per worker known to have exited."""
WATCHES_PER_BEAT = 4
"""How often per beat interval a heartbeat thread that watches peers polls them."""
ALARM_BUCKET = 32
"""Watching ranks per alarm key: rank r waits on the key of bucket r // ALARM_BUCKET. Larger buckets make a raise
cheaper (W / ALARM_BUCKET keys) and each stop wake more bucket-mates."""
ALARM_EPOCH_KEY = "alarm/epoch"
"""Store counter of the alarms raised so far in the job."""
ALARM_BUCKETS_KEY = "alarm/buckets"
"""Store key to which the first watcher of each bucket appends the bucket's number: whose key an alarm sets."""
ALARM_WAIT_S = 3600.0
"""How long one wait for an alarm lasts before it is renewed. Long: the store client logs each wait that runs out
(a stopping heartbeat sets its own key to end the wait)."""
FENCE_KEY = "fence"
"""Store key to which `request_fence` appends one `RANK REASON` line per worker its peers declared dead."""


NODE_PUBLISH_S = 0.25
"""How often a launcher publishes its node's liveness key."""
NODE_STALE_S = 1.0
"""A node key unchanged for this long (its launcher is gone or hung) is bypassed: its ranks are read per rank."""


def heartbeat_key(rank: int) -> str:
    return f"heartbeat/{rank}"


def node_key(node: int) -> str:
    return f"node/{node}"


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


def read_beats(store, ranks: Iterable[int]) -> dict[int, Beat]:
    """Read the latest beat of each rank that has beaten at least once (two store round trips when all have)."""
    ranks = list(ranks)
    keys = [heartbeat_key(r) for r in ranks]
    if not keys:
        return {}
    if store.check(keys):
        return {r: Beat.decode(v) for r, v in zip(ranks, store.multi_get(keys))}
    return {r: Beat.decode(store.get(k)) for r, k in zip(ranks, keys) if store.check([k])}


def mark_exited(store, rank: int, reason: str, alarm: bool = True) -> None:
    """Record that worker `rank` has exited (the launcher saw it, or the worker is leaving on its own) and wake the
    watchers (`alarm=False`: a worker that finished the job, whose peers are finishing too)."""
    store.append(EXITED_KEY, f"{rank} {' '.join(reason.split())}\n")
    if alarm:
        raise_alarm(store)


def alarm_bucket(rank: int) -> int:
    """The alarm bucket of watching rank `rank`."""
    return rank // ALARM_BUCKET


def alarm_key(bucket: int, epoch: int) -> str:
    """Store key whose setting wakes the watchers of `bucket` waiting for alarm `epoch`."""
    return f"alarm/{bucket}/{epoch}"


def alarm_epoch(store) -> int:
    """How many alarms the job has raised so far."""
    return int(store.add(ALARM_EPOCH_KEY, 0))


def register_alarm_watcher(store, rank: int) -> None:
    """List the bucket of `rank` among those an alarm wakes (once per bucket: the registry stays W / ALARM_BUCKET
    entries long)."""
    bucket = alarm_bucket(rank)
    if store.add(f"alarm/watchers/{bucket}", 1) == 1:
        store.append(ALARM_BUCKETS_KEY, f"{bucket} ")


def raise_alarm(store) -> None:
    """Wake every watching heartbeat now: it polls its peers at once instead of at its backed-off pace. Call after
    the record that is news (an exit, a fence request), so a woken watcher reads it. The epoch moves first, so a
    watcher woken by its key always finds it moved; then one request sets the new epoch's key of every bucket."""
    epoch = store.add(ALARM_EPOCH_KEY, 1)
    if not store.check([ALARM_BUCKETS_KEY]):
        return
    buckets = sorted({int(b) for b in store.get(ALARM_BUCKETS_KEY).decode().split()})
    if buckets:
        store.multi_set([alarm_key(b, epoch) for b in buckets], ["1"] * len(buckets))


def read_exits(store) -> dict[int, str]:
    """Return {rank: reason} of every worker marked as exited."""
    return _read_lines(store, EXITED_KEY)


def prepare_store(store) -> None:
    """Create the exit and fence logs empty if absent, so a watcher can read them in the same request as node keys
    (a `multi_get` of a missing key would wait for it). Idempotent: every launcher calls it."""
    for key in (EXITED_KEY, FENCE_KEY):
        store.compare_set(key, "", "")


def request_fence(store, ranks: Iterable[int], reason: str) -> None:
    """Ask the launchers to stop workers `ranks` for good: their peers declared them dead (a hung worker must never
    come back into the job, and stopping it closes its connections, which ends every wait on it).

    Only the first request for a rank is logged and raises the alarm: every peer that sees a death, and then every
    survivor's recovery, asks for its fence, and a line per request would grow the log (which every watcher reads) by
    the world size at each failure, an alarm per request cost the store survivors x watchers key writes.
    """
    news = False
    for rank in ranks:
        if store.add(f"{FENCE_KEY}/{rank}", 1) == 1:
            store.append(FENCE_KEY, f"{rank} {' '.join(reason.split())}\n")
            news = True
    if news:
        raise_alarm(store)


def read_fences(store) -> dict[int, str]:
    """Return {rank: reason} of every worker some peer asked to be stopped."""
    return _read_lines(store, FENCE_KEY)


def _read_lines(store, key: str) -> dict[int, str]:
    if not store.check([key]):
        return {}
    return _parse_lines(store.get(key))


def _parse_lines(raw: bytes) -> dict[int, str]:
    out = {}
    for line in raw.decode().splitlines():
        rank, _, reason = line.partition(" ")
        out.setdefault(int(rank), reason)
    return out


@dataclass(frozen=True)
class NodeLiveness:
    """What a node's launcher publishes: a sequence number that rises with every publication, the latest beat of each
    of its workers that has beaten, and those of its workers that have exited."""

    seq: int
    beats: dict[int, Beat]
    exited: dict[int, str]

    def encode(self) -> str:
        return json.dumps({"seq": self.seq, "beats": {str(r): b.fields() for r, b in self.beats.items()},
                           "exited": {str(r): why for r, why in self.exited.items()}}, separators=(",", ":"))

    @classmethod
    def decode(cls, raw: bytes | str) -> NodeLiveness:
        d = json.loads(raw)
        return cls(d["seq"], {int(r): Beat.from_fields(f) for r, f in d["beats"].items()},
                   {int(r): why for r, why in d["exited"].items()})


class NodePublisher:
    """A launcher's side of liveness: read its own workers' beats and publish them as one key, `node/{node}`.

    Two requests per publication however many workers the node runs (one once every worker has beaten).
    """

    def __init__(self, store, node: int, ranks: Iterable[int]):
        self.store, self.node, self.ranks = store, node, tuple(ranks)
        self.seq = 0
        self._all_beating = False

    def publish(self, exited: Mapping[int, str] | None = None) -> NodeLiveness:
        """Publish the latest beats of this node's workers and those of them known to have exited."""
        keys = [heartbeat_key(r) for r in self.ranks]
        if self._all_beating:  # keys are never deleted: once all exist, skip the existence check
            beats = {r: Beat.decode(v) for r, v in zip(self.ranks, self.store.multi_get(keys))}
        else:
            beats = read_beats(self.store, self.ranks)
            self._all_beating = len(beats) == len(self.ranks)
        self.seq += 1
        liveness = NodeLiveness(self.seq, beats, dict(exited or {}))
        self.store.set(node_key(self.node), liveness.encode())
        return liveness


@dataclass(frozen=True)
class LivenessView:
    """One read of the store for a watcher: beats of the watched ranks, exits and fence requests."""

    beats: dict[int, Beat]
    exited: dict[int, str]
    fences: dict[int, str]


class LivenessReader:
    """Read what a watcher needs to judge `ranks`: per node when launchers publish node keys, per rank otherwise.

    With `node_size` (rank r lives on node r // node_size), one `multi_get` brings the keys of the nodes the ranks
    live on plus the exit and fence logs: the requests scale with the watcher's polls, not with its peers. A node
    whose key has not changed for `stale_s` on `clock` is read per rank instead, so a lost launcher never hides a
    live worker (nor keeps a dead one alive: its key stops, and so do the beats behind it).
    """

    def __init__(self, store, node_size: int | None = None, *, stale_s: float = NODE_STALE_S,
                 clock: Callable[[], float] = time.monotonic):
        if node_size is not None and node_size < 1:
            raise ValueError(f"node_size={node_size} must be a positive number of ranks per node (or None)")
        self.store, self.node_size, self.stale_s, self._clock = store, node_size, stale_s, clock
        self._seq: dict[int, tuple[int, float]] = {}  # node -> (seq, when it last changed)
        self._present: set[str] = set()  # node keys seen to exist (never deleted)

    @classmethod
    def from_env(cls, store, env: Mapping[str, str] = os.environ, **kwargs) -> LivenessReader:
        """Read per node when the launcher said how many ranks each node runs (`NTP_NODE_SIZE`), else per rank."""
        size = env.get(NODE_SIZE_ENV)
        if size is not None and (not size.isdigit() or int(size) < 1):
            raise ValueError(f"{NODE_SIZE_ENV}={size!r} must be a positive integer (ranks per node)")
        return cls(store, int(size) if size else None, **kwargs)

    def read(self, ranks: Iterable[int], fences: bool = True) -> LivenessView:
        """Read the beats of `ranks`, every exit and (with `fences`; always when read per node) every fence request."""
        ranks = sorted(set(ranks))
        if self.node_size is None:
            return LivenessView(read_beats(self.store, ranks), read_exits(self.store),
                                read_fences(self.store) if fences else {})
        nodes = sorted({r // self.node_size for r in ranks})
        keys = [node_key(n) for n in nodes] + [EXITED_KEY, FENCE_KEY]
        if not set(keys) <= self._present:
            if not self.store.check(keys):  # a launcher has not published yet: read per rank meanwhile
                return LivenessView(read_beats(self.store, ranks), read_exits(self.store),
                                    read_fences(self.store) if fences else {})
            self._present.update(keys)
        values = self.store.multi_get(keys)
        now, wanted = self._clock(), set(ranks)
        beats: dict[int, Beat] = {}
        exited = _parse_lines(values[-2])
        stale: list[int] = []
        for node, raw in zip(nodes, values):
            liveness = NodeLiveness.decode(raw)
            seq, since = self._seq.get(node, (None, now))
            if seq != liveness.seq:
                self._seq[node] = (liveness.seq, now)
            elif now - since > self.stale_s:
                stale += [r for r in ranks if r // self.node_size == node]
            beats.update((r, b) for r, b in liveness.beats.items() if r in wanted)
            for rank, why in liveness.exited.items():
                exited.setdefault(rank, why)
        if stale:
            beats.update(read_beats(self.store, stale))
        return LivenessView(beats, exited, _parse_lines(values[-1]))


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
        keep = ranks if isinstance(ranks, (set, frozenset)) else set(ranks)  # (the survivors: W long, not copied)
        for table in (self._changed_at, self._counter, self._exited, self._progress):
            for rank in [r for r in table if r not in keep]:
                del table[rank]


def outlive_peers(store, rank: int, world_size: int, heartbeat_timeout_s: float) -> None:
    """Keep hosting the store (rank `rank` of a job whose rank 0 hosts it) until every other rank of the launch has
    finished, exited or gone silent."""
    others = [r for r in range(world_size) if r != rank]
    monitor = LivenessMonitor(others, heartbeat_timeout_s)
    log.info("rank %d hosts the job's store: waiting for the other ranks to finish before exiting", rank)
    while poll_liveness(store, monitor) != set(others):
        time.sleep(heartbeat_timeout_s / 4)


def next_pause(pause: float, news: bool, fastest: float, slowest: float) -> float:
    """Back off between two polls: back to `fastest` on news, else twice the last pause, at most `slowest`."""
    return fastest if news else min(2 * pause, slowest)


def poll_liveness(store, monitor: LivenessMonitor, reader: LivenessReader | None = None) -> frozenset[int]:
    """Read beats and exits from the store (through `reader`, else per rank) into `monitor`; return the ranks it now
    counts as dead."""
    view = (reader or LivenessReader(store)).read(monitor.ranks, fences=False)
    monitor.observe(view.beats, view.exited)
    return monitor.dead()


class Heartbeat:
    """Beat to the store every `interval_s` from a daemon thread; optionally watch peers and report the dead.

    Give it a store client of its own (`store.clone()` or a second `connect_store`): a client serialises its calls,
    so a long wait on the training thread's client would delay the beats and make this rank look hung.
    With `monitor` and `on_dead`, the thread also polls the peers through `reader` (default: per rank) and calls
    `on_dead(new_dead, wall_time)` from the heartbeat thread once for each rank newly found dead. It polls
    WATCHES_PER_BEAT times per beat while something is news (a new death, exit or fence request, a peer silent for half
    the timeout); otherwise it backs off, doubling the pause up to one beat interval (the monitor's `blind_gap_s` is
    raised to two beat intervals if it was shorter). A second daemon thread, on a clone of the store client, waits
    for the next alarm (`raise_alarm`) and wakes the first to poll at once.

    With `progress` (a callable returning this rank's training progress, `ntp_ds.comm.wire.progress`), each beat
    carries it, and while this rank's training thread waits, a peer whose progress has stood still outside a wait for
    the monitor's `hang_timeout_s` is reported dead too: it beats, but its training is stuck, and this rank with it.
    """

    def __init__(self, store, rank: int, interval_s: float = 1.0, *, wall: Callable[[], float] = time.time,
                 monitor: LivenessMonitor | None = None,
                 on_dead: Callable[[frozenset[int], float], None] | None = None,
                 reader: LivenessReader | None = None, progress: Callable[[], object] | None = None):
        if not interval_s > 0:
            raise ValueError(f"interval_s={interval_s} must be positive")
        if (monitor is None) != (on_dead is None):
            raise ValueError("pass monitor and on_dead together, or neither")
        self.store, self.rank, self.interval_s = store, rank, interval_s
        if monitor is not None:  # it looks once a beat when all is quiet: a gap of two beats is not yet blindness
            monitor.blind_gap_s = max(monitor.blind_gap_s, 2 * interval_s)
        self.monitor, self.on_dead = monitor, on_dead
        self.reader = reader if reader is not None else LivenessReader(store)
        self.polls = 0
        """How many times the thread has polled its peers (the watching load it puts on the store)."""
        self._news: tuple = ()
        self.error: BaseException | None = None
        """The latest error of a beat or a poll, if any (the thread keeps beating through store hiccups)."""
        self._wall = wall
        self._progress = progress
        self._training_thread = threading.get_ident()  # the thread that builds the heartbeat trains
        self._own: tuple | None = None  # (own progress, since when, warned)
        self._counter = 0
        self._reported: set[int] = set()
        self._members: set[int] = set()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._alarm_thread: threading.Thread | None = None
        self._alarm_epoch: int | None = None  # the last alarm epoch the waiting thread has seen
        self.alarms = 0
        """How many alarms have woken this heartbeat."""

    def beat(self) -> Beat:
        """Send one beat now."""
        self._counter += 1
        now = self._progress() if self._progress is not None else None
        if now is None:
            beat = Beat(self._counter, self._wall())
        else:
            beat = Beat(self._counter, self._wall(), now.count, now.waiting,
                        None if now.since is None else max(0.0, time.monotonic() - now.since))
        self.store.set(heartbeat_key(self.rank), beat.encode())
        return beat

    def start(self) -> Heartbeat:
        """Beat once from the caller (so a dead store fails here, loudly), then keep beating in a daemon thread."""
        if self._thread is not None:
            raise RuntimeError(f"heartbeat of rank {self.rank} is already running")
        self.beat()
        self._thread = threading.Thread(target=self._run, name=f"ntp-heartbeat-{self.rank}", daemon=True)
        self._thread.start()
        clone = getattr(self.store, "clone", None)
        if self.monitor is not None and clone is not None:  # (a store without clients of its own is only polled)
            self._alarm_thread = threading.Thread(target=self._await_alarms, args=(clone(),),
                                                  name=f"ntp-alarm-{self.rank}", daemon=True)
            self._alarm_thread.start()
        return self

    def _await_alarms(self, store) -> None:
        """Register, then wait for alarm after alarm on this rank's bucket key of the next epoch (each wait renewed
        every ALARM_WAIT_S) and wake the polling thread, which reads what the alarm announced."""
        bucket = alarm_bucket(self.rank)
        try:
            register_alarm_watcher(store, self.rank)
            self._alarm_epoch = alarm_epoch(store)
        except Exception as err:
            log.debug("rank %d waits for no alarms: %s", self.rank, err)
            return
        while not self._stop.is_set():  # (checked after `_alarm_epoch` is written: `stop` relies on that order)
            key = alarm_key(bucket, self._alarm_epoch + 1)
            try:
                store.wait([key], timedelta(seconds=ALARM_WAIT_S))
                if self._stop.is_set():
                    return
                epoch = alarm_epoch(store)
                if epoch == self._alarm_epoch:
                    # A bucket-mate's stop, not an alarm: clear the key and wait again. A raise whose key write
                    # the delete undid has moved the epoch by the second read: write the key again for the mates.
                    store.delete_key(key)
                    epoch = alarm_epoch(store)
                    if epoch == self._alarm_epoch:
                        continue
                    store.set(key, "1")
                self._alarm_epoch = epoch
                self.alarms += 1
                self._wake.set()
            except DistStoreError as err:
                if "timeout" in str(err).lower():  # the wait ran out: renew it
                    continue
                log.debug("rank %d stops waiting for alarms: %s", self.rank, err)
                return  # the store is gone or broken: the polling thread alone watches (and reports the error)
            except Exception as err:
                log.debug("rank %d stops waiting for alarms: %s", self.rank, err)
                return

    def _run(self) -> None:
        # A watching thread looks at its peers WATCHES_PER_BEAT times per beat while something is news, so a silent
        # peer is seen within a fraction of a beat of its timeout; when all is quiet it backs off to once a beat.
        # The beats themselves keep their interval.
        fastest = self.interval_s / WATCHES_PER_BEAT if self.monitor is not None else self.interval_s
        tick = fastest
        last_beat = time.monotonic()
        while True:
            self._wake.wait(tick)
            if self._stop.is_set():
                break
            if self._wake.is_set():  # an alarm: poll now, and fast while it is news
                self._wake.clear()
                tick = fastest
            try:
                if time.monotonic() - last_beat >= self.interval_s - tick / 2:
                    late = time.monotonic() - last_beat - self.interval_s
                    if late > self.interval_s:  # what delays a beat is what gets a live rank declared dead
                        log.warning("rank %d beats %.2f s late", self.rank, late)
                    self.beat()
                    last_beat = time.monotonic()
                if self._progress is not None:
                    self._watch_own_progress()
                if self.monitor is not None:
                    tick = next_pause(tick, self.poll_peers(), fastest, self.interval_s)
                self.error = None
            except Exception as err:  # a store hiccup must not end the beats; the error is kept for the caller
                tick = fastest
                if self.error is None:
                    log.warning("heartbeat of rank %d failed: %s", self.rank, err)
                self.error = err

    def _watch_own_progress(self) -> None:
        """Warn once per stretch when this rank's own training has made no progress outside a wait for half of
        `hang_timeout_s`, with where its training thread is: waiting peers declare it hung at the full timeout, and
        the warning says what it was doing."""
        hang_timeout_s = self.monitor.hang_timeout_s if self.monitor is not None else None
        if hang_timeout_s is None:
            return
        now, progress = time.monotonic(), self._progress()
        if self._own is None or self._own[0] != progress:
            self._own = (progress, now, False)
            return
        _, since, warned = self._own
        if not progress.waiting and not warned and now - since > hang_timeout_s / 2:
            self._own = (progress, since, True)
            frame = sys._current_frames().get(self._training_thread)
            where = "".join(traceback.format_stack(frame, limit=6)) if frame is not None else "(thread gone)\n"
            device = " (its device is busy with its own work)" if progress.device_busy else ""
            log.warning("rank %d: its training has made no progress outside a wait for %.2f s%s (hang_timeout_s %gs); "
                        "it is at:\n%s", self.rank, now - since, device, hang_timeout_s, where.rstrip())

    def poll_peers(self) -> bool:
        """Poll the peers once; report the newly dead; return whether anything was news (keep polling fast)."""
        with self._lock:
            view = self.reader.read(self.monitor.ranks, fences=bool(self._members))
            self.polls += 1
            self.monitor.observe(view.beats, view.exited)
            new = self.monitor.dead() - self._reported
            if self._progress is not None and self._progress().waiting:
                new |= self.monitor.hung() - self._reported
            if self._members:
                # A rank some other peer declared dead: every collective of the generation waits on it too.
                new |= (set(view.fences) & self._members) - self._reported
            self._reported |= new
            news = (frozenset(view.exited), frozenset(view.fences))
            half = self.monitor.heartbeat_timeout_s / 2
            half_hang = (self.monitor.hang_timeout_s or float("inf")) / 2
            suspect = any(self.monitor.silent_for(r) > half or self.monitor.stalled_for(r) > half_hang
                          for r in self.monitor.ranks)
            changed, self._news = news != self._news, news
        if new:
            self.on_dead(frozenset(new), self._wall())
        return bool(new) or changed or suspect

    def silences(self) -> dict[int, float]:
        """Seconds each watched peer has been silent, on this host's monotonic clock (see `LivenessMonitor`)."""
        with self._lock:
            return {r: self.monitor.silent_for(r) for r in self.monitor.ranks} if self.monitor is not None else {}

    def watch(self, ranks: Iterable[int], members: Iterable[int] = ()) -> LivenessMonitor:
        """Watch exactly `ranks` from now on, each counted alive as of now (a new generation's peers), and report any
        of `members` (the rest of the generation) once a peer of theirs has asked for it to be fenced. Return the
        monitor of the peers watched until now, with what it has seen of them (this thread no longer touches it)."""
        if self.monitor is None:
            raise RuntimeError("this heartbeat watches no peers (it has no monitor)")
        with self._lock:
            previous = self.monitor
            self.monitor = LivenessMonitor(ranks, self.monitor.heartbeat_timeout_s, self.monitor._clock,
                                           self.monitor.hang_timeout_s, self.monitor.first_beat_timeout_s,
                                           self.monitor.blind_gap_s)
            self._members = set(members)
            self._reported = set()
        return previous

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
        self._wake.set()
        if self._thread is None:
            return True
        self._thread.join(timeout_s)
        if self._alarm_thread is not None and self._alarm_thread.is_alive() and not self._thread.is_alive():
            epoch = self._alarm_epoch  # read after `_stop` is set: a thread that moves on later sees the stop
            try:  # wake our own waiting thread (this client is free now that the beating thread has ended)
                if epoch is not None:
                    self.store.set(alarm_key(alarm_bucket(self.rank), epoch + 1), "stop")
                self._alarm_thread.join(timeout_s)
            except Exception as err:  # the store is gone: so is the wait
                log.debug("rank %d could not end its alarm wait: %s", self.rank, err)
        return not self._thread.is_alive()

    def __enter__(self) -> Heartbeat:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
