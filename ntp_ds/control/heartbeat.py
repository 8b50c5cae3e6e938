"""Liveness: workers beat to the store from a daemon thread (`Heartbeat`), which also watches peers and reports the
dead.

A crashed worker is usually seen first by its gloo neighbours ("Connection closed by peer", within milliseconds) or
by the launcher that waits on it (`mark_exited`). A hung worker (SIGSTOP, a wedged driver) is seen by nobody until
a collective times out, so every worker beats and its watchers judge the beats they read: the judgement is
`ntp_ds.control.liveness` (no I/O), the keys, logs and alarms in the store and their reading are
`ntp_ds.control.liveness_store`.

Ranks here are launch ranks (the RANK a worker started with): they name a worker across every generation.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterable
from datetime import timedelta

from torch.distributed import DistStoreError

from ntp_ds.control.keys import RELAYED_EPOCH_KEY, alarm_key, heartbeat_key, relayed_alarm_key
from ntp_ds.control.liveness import Beat, LivenessMonitor
from ntp_ds.control.liveness_store import (ALARM_WAIT_S, LivenessReader, alarm_bucket, alarm_epoch,
                                           register_alarm_watcher, woken_epoch)
from ntp_ds.control.node_local import SHARED_AGE_S

log = logging.getLogger(__name__)

WATCHES_PER_BEAT = 4
"""How often per beat interval a heartbeat thread that watches peers polls them."""


SUSPECT_PERIODS = 2.5
"""A peer silent for half the timeout, or for this many of its launcher's periods where that is longer, is suspect
(its watcher polls fast): a node key moves once per period, and a copy read once a period may show it unchanged
twice, a silence of two periods that is no news."""


def suspect_after_s(heartbeat_timeout_s: float, reader) -> float:
    """How long a watched peer may be silent before its watcher polls fast: half the timeout, or `SUSPECT_PERIODS`
    of the launchers' period where the job's store's budget made it longer (`LivenessReader.period_s`)."""
    return max(heartbeat_timeout_s / 2, SUSPECT_PERIODS * getattr(reader, "period_s", 0.0))


def next_pause(pause: float, news: bool, fastest: float, slowest: float) -> float:
    """Back off between two polls: back to `fastest` on news, else twice the last pause, at most `slowest`."""
    return fastest if news else min(2 * pause, slowest)


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
                 reader: LivenessReader | None = None, progress: Callable[[], object] | None = None,
                 beats_to=None, alarms_from=None):
        if not interval_s > 0:
            raise ValueError(f"interval_s={interval_s} must be positive")
        if (monitor is None) != (on_dead is None):
            raise ValueError("pass monitor and on_dead together, or neither")
        self.store, self.rank, self.interval_s = store, rank, interval_s
        self.beats_to = beats_to
        """The node's own store (`node_store`), where the launcher reads this rank's beats; None: the job's store.
        A beat it fails goes to the job's store (its launcher is gone, and its watchers then read there)."""
        self.alarms_from = alarms_from
        """A client of the node's store of the alarm thread's own, where the launcher relays the job's alarms
        (`AlarmRelay`); None, or no relay there: the thread waits in the job's store. `stop` ends that wait through
        `beats_to`, the node's other client."""
        self._relayed = False  # whether the alarm thread waits on the relay now
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
        self.on_alarm: list[Callable[[], None]] = []
        """Called, from the thread that waits for alarms, with each alarm (`FaultInjector.listen`)."""

    def beat(self) -> Beat:
        """Send one beat now."""
        self._counter += 1
        now = self._progress() if self._progress is not None else None
        if now is None:
            beat = Beat(self._counter, self._wall())
        else:
            beat = Beat(self._counter, self._wall(), now.count, now.waiting,
                        None if now.since is None else max(0.0, time.monotonic() - now.since))
        if self.beats_to is not None:
            try:
                self.beats_to.set(heartbeat_key(self.rank), beat.encode())
                return beat
            except Exception as err:
                log.warning("rank %d beats to the job's store: its node's store failed (%s)", self.rank, err)
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

    @property
    def hears_alarms(self) -> bool:
        """Whether a thread of this heartbeat waits for alarms now (it stops on a broken store)."""
        return self._alarm_thread is not None and self._alarm_thread.is_alive() and self._alarm_epoch is not None

    def _await_alarms(self, store) -> None:
        """Register, then wait for alarm after alarm on this rank's bucket key of the next epoch (each wait renewed
        every ALARM_WAIT_S) and wake the polling thread, which reads what the alarm announced. Where the launcher
        relays the alarms (`alarms_from`), wait on its node's key instead, and in the job's store only if the relay
        is gone."""
        if self.alarms_from is not None and self._await_relayed(self.alarms_from):
            return
        self._relayed = False
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
                self._wake.set()  # poll at once (a bucket-mate's stop, found below, costs one poll)
                hooks = list(self.on_alarm)
                for hook in hooks:
                    hook()
                # Coalesce: the alarms raised within the next fast poll's pause (the deaths of a node or a rack,
                # each fenced by its own watcher) are read by that poll, not woken for one by one by every rank.
                if self._stop.wait(self.interval_s / WATCHES_PER_BEAT):
                    return
                # Read once for the node's ranks, woken with this one: a node-mate's read within SHARED_AGE_S (less
                # than the pause just slept) was made after the raise that woke them.
                shared = self.interval_s / WATCHES_PER_BEAT > SHARED_AGE_S
                epoch = woken_epoch(store, key, self._alarm_epoch,
                                    alarm_epoch(store, self.reader.shared() if shared else None),
                                    lambda: alarm_epoch(store))
                if epoch is None:  # a bucket-mate's stop, not an alarm: wait again
                    continue
                self.alarms += 1  # (after the hooks: a count read elsewhere says they have run)
                self._alarm_epoch = epoch
            except DistStoreError as err:
                if "timeout" in str(err).lower():  # the wait ran out: renew it
                    continue
                log.debug("rank %d stops waiting for alarms: %s", self.rank, err)
                return  # the store is gone or broken: the polling thread alone watches (and reports the error)
            except Exception as err:
                log.debug("rank %d stops waiting for alarms: %s", self.rank, err)
                return

    def _await_relayed(self, node) -> bool:
        """Wait for the alarms the launcher relays into the node's store (`AlarmRelay`), as `_await_alarms` waits in
        the job's store: the node's ranks cost the job's store nothing per alarm. Return True once stopped, False
        where there is no relay or it is gone (then the job's store serves)."""
        def relayed_epoch() -> int:
            raw = node.compare_set(RELAYED_EPOCH_KEY, "\0", "\0")  # (its value, or "\0" where there is none)
            return -1 if raw == b"\0" else int(raw)

        try:
            if (epoch := relayed_epoch()) < 0:
                return False
        except Exception as err:
            log.debug("rank %d waits for alarms in the job's store: %s", self.rank, err)
            return False
        self._alarm_epoch, self._relayed = epoch, True
        while not self._stop.is_set():  # (as `_await_alarms`: the stop is checked after `_alarm_epoch` is written)
            key = relayed_alarm_key(self._alarm_epoch + 1)
            try:
                node.wait([key], timedelta(seconds=ALARM_WAIT_S))
                if self._stop.is_set():
                    return True
                self._wake.set()
                for hook in list(self.on_alarm):
                    hook()
                if self._stop.wait(self.interval_s / WATCHES_PER_BEAT):  # (the relay coalesces too)
                    return True
                epoch = woken_epoch(node, key, self._alarm_epoch, relayed_epoch(), relayed_epoch)
                if epoch is None:  # a node-mate's stop
                    continue
                if epoch < 0:
                    break
                self.alarms += 1
                self._alarm_epoch = epoch
            except DistStoreError as err:
                if "timeout" in str(err).lower():
                    continue
                break
            except Exception:
                break
        if self._stop.is_set():
            return True
        log.warning("rank %d waits for alarms in the job's store: its launcher's relay is gone", self.rank)
        return False

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
                if self.monitor is not None:  # news (fast polls) is read from the job's store itself
                    tick = next_pause(tick, self.poll_peers(direct=tick == fastest), fastest, self.interval_s)
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

    def poll_peers(self, direct: bool = True) -> bool:
        """Poll the peers once (not `direct`: from the launcher's copy where it serves, `LivenessReader`); report
        the newly dead; return whether anything was news (keep polling fast)."""
        with self._lock:
            view = self.reader.read(self.monitor.ranks, fences=bool(self._members), direct=direct)
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
            half = suspect_after_s(self.monitor.heartbeat_timeout_s, self.reader)
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
        self.reader.want(self.rank, self.monitor.ranks, self.interval_s)
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
                if epoch is not None and self._relayed:
                    if self.beats_to is not None:  # (not `alarms_from`: its client is held by the wait)
                        self.beats_to.set(relayed_alarm_key(epoch + 1), "stop")
                elif epoch is not None:
                    self.store.set(alarm_key(alarm_bucket(self.rank), epoch + 1), "stop")
                self._alarm_thread.join(timeout_s)
            except Exception as err:  # the store is gone: so is the wait
                log.debug("rank %d could not end its alarm wait: %s", self.rank, err)
        return not self._thread.is_alive()

    def __enter__(self) -> Heartbeat:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
