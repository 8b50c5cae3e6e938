"""Heartbeats and the liveness decision: fake clocks for the logic, real processes for SIGSTOP and SIGKILL."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch.distributed as dist

from ntp_ds.control.heartbeat import Heartbeat
from ntp_ds.control.liveness import Beat, LivenessMonitor
from ntp_ds.control.keys import log_count_key
from ntp_ds.control.liveness_store import (ALARM_BUCKETS_KEY, FENCE_KEY, alarm_bucket, alarm_epoch, alarm_key,
                                           heartbeat_key, mark_exited, poll_liveness, prepare_store, raise_alarm,
                                           read_beats, read_exits, read_fences, register_alarm_watcher, request_fence)
from ntp_ds.control.store import host_store
from tests.helpers.clock import FakeClock

ROOT = Path(__file__).resolve().parents[2]


# -- pure monitor ------------------------------------------------------------------------------------------------

def test_silent_rank_is_dead_after_the_timeout():
    clock = FakeClock()
    # (a watcher that looks only every 1.5 s or so: its gaps count, up to blind_gap_s)
    mon = LivenessMonitor([0, 1], heartbeat_timeout_s=2.0, clock=clock, blind_gap_s=2.0)
    mon.observe({0: Beat(1, 50.0), 1: Beat(1, 50.0)})
    clock.now += 1.5
    mon.observe({0: Beat(2, 51.5), 1: Beat(1, 50.0)})  # rank 1's counter is stuck
    assert mon.dead() == set()
    clock.now += 0.6
    assert mon.dead() == {1}
    assert "no heartbeat for 2.10s" in mon.reason(1)
    clock.now += 1.0
    mon.observe({1: Beat(2, 53.0)})  # a beat again (SIGCONT): alive
    assert mon.dead() == set()
    clock.now += 0.5
    assert mon.dead() == {0}


def test_a_gap_the_watcher_could_not_see_does_not_count_against_its_peers():
    # Every process stalled for 4.5 s (or the store did): the watcher's next look still shows rank 1's beat from
    # before. That gap was not rank 1's silence; only time watched counts, so if it stays silent it is dead a timeout
    # later. Rank 0 beat meanwhile (it was seen fresh, and so was the store), but its training stood still: that gap
    # counts toward a hang, as for a hung rank, which beats on.
    clock = FakeClock()
    mon = LivenessMonitor([0, 1], heartbeat_timeout_s=2.0, clock=clock, hang_timeout_s=3.0)
    assert mon.blind_gap_s == 1.0  # half the timeout
    mon.observe({0: Beat(1, 50.0, 7, False), 1: Beat(1, 50.0, 7, False)})
    clock.now += 0.5
    mon.observe({0: Beat(2, 50.5, 7, False), 1: Beat(1, 50.0, 7, False)})
    clock.now += 4.5
    mon.observe({0: Beat(3, 55.0, 7, False), 1: Beat(1, 50.0, 7, False)})
    assert mon.blind_s == 4.5
    assert mon.dead() == set() and mon.silent_for(1) == 0.5 and mon.stalled_for(1) == 0.5
    assert mon.hung() == {0} and mon.stalled_for(0) == 5.0
    for n in range(3):  # looks at the usual pace: rank 0 makes progress again, rank 1 stays silent
        clock.now += 0.5
        mon.observe({0: Beat(4 + n, 56.0, 8 + n, False), 1: Beat(1, 50.0, 7, False)})
    assert mon.dead() == set() and mon.hung() == set() and mon.silent_for(1) == 2.0
    clock.now += 0.25
    mon.observe({1: Beat(1, 50.0, 7, False)})
    assert mon.dead() == {1}
    assert "no heartbeat for 2.25s" in mon.reason(1)
    assert mon.blind_s == 4.5  # the usual gaps counted in full
    clock.now += 1.0
    mon.observe({1: Beat(1, 50.0, 7, False)})
    assert mon.stalled_for(1) == 3.25 and 1 in mon.hung()  # watched time only
    with pytest.raises(ValueError, match="blind_gap_s=0 must be positive"):
        LivenessMonitor([0], 2.0, blind_gap_s=0)


def test_a_heartbeat_counts_a_gap_of_its_quiet_pace_as_watched():
    # A heartbeat looks once a beat when all is quiet: its monitor's blind gap is at least two beat intervals.
    store = dist.HashStore()
    hb = Heartbeat(store, 0, 1.5, monitor=LivenessMonitor([1], heartbeat_timeout_s=4.0), on_dead=lambda r, w: None)
    assert hb.monitor.blind_gap_s == 3.0
    hb.watch([2])
    assert hb.monitor.blind_gap_s == 3.0  # kept by a new watch
    assert Heartbeat(store, 0, 0.5, monitor=LivenessMonitor([1], 4.0),
                     on_dead=lambda r, w: None).monitor.blind_gap_s == 2.0


def test_rank_never_heard_from_is_dead_after_the_timeout():
    clock = FakeClock()
    mon = LivenessMonitor([0, 1], heartbeat_timeout_s=1.0, clock=clock)
    mon.observe({0: Beat(1, 1.0)})
    clock.now += 1.01
    assert mon.dead() == {0, 1}


def test_a_rank_never_heard_from_has_its_first_beat_bound_then_the_heartbeat_timeout():
    # A peer still connecting its heartbeat's store clients when the watch starts has not beaten yet (CI saw a whole
    # job's connections take 3.4 s against a 2 s heartbeat timeout): it is judged by the first-beat bound.
    clock = FakeClock()
    mon = LivenessMonitor([0, 1], heartbeat_timeout_s=2.0, clock=clock, first_beat_timeout_s=14.0, blind_gap_s=14.0)
    mon.observe({0: Beat(1, 1.0)})
    clock.now += 3.0
    assert mon.dead() == {0}
    assert mon.reason(0).startswith("rank 0: no heartbeat for 3.00s")
    clock.now += 10.0
    mon.observe({1: Beat(1, 1.0)})  # rank 1's first beat, 13 s in: from now on the heartbeat timeout holds
    clock.now += 1.9
    assert mon.dead() == {0}
    clock.now += 0.2
    assert mon.dead() == {0, 1}
    never = LivenessMonitor([2], heartbeat_timeout_s=2.0, clock=clock, first_beat_timeout_s=14.0)
    clock.now += 14.01
    assert never.dead() == {2}
    assert never.reason(2) == "rank 2: not one heartbeat in 14.01s (first_beat_timeout_s 14.0s)"
    with pytest.raises(ValueError, match="first_beat_timeout_s=1.0 must be at least heartbeat_timeout_s=2.0"):
        LivenessMonitor([0], 2.0, first_beat_timeout_s=1.0)


def test_exited_rank_is_dead_at_once_and_unknown_ranks_are_ignored():
    clock = FakeClock()
    mon = LivenessMonitor([0, 1, 2], heartbeat_timeout_s=10.0, clock=clock)
    mon.observe({0: Beat(1, 1.0), 7: Beat(1, 1.0)}, exited={2: "exit code -9", 8: "gone"})
    assert mon.dead() == {2}
    assert mon.reason(2) == "rank 2 exited (exit code -9)"
    assert mon.ranks == (0, 1, 2)
    mon.retain([0, 1])
    assert mon.ranks == (0, 1) and mon.dead() == set()


def test_counter_reset_counts_as_a_beat():
    clock = FakeClock()
    mon = LivenessMonitor([0], heartbeat_timeout_s=1.0, clock=clock)
    mon.observe({0: Beat(40, 1.0)})
    clock.now += 0.9
    mon.observe({0: Beat(1, 2.0)})
    clock.now += 0.9
    assert mon.dead() == set()


def test_monitor_rejects_a_non_positive_timeout():
    with pytest.raises(ValueError, match="heartbeat_timeout_s=0"):
        LivenessMonitor([0], 0)


def test_a_beating_rank_whose_progress_stands_still_outside_a_wait_is_hung():
    clock = FakeClock()
    mon = LivenessMonitor([0, 1, 2], heartbeat_timeout_s=2.0, clock=clock, hang_timeout_s=5.0)
    mon.observe({0: Beat(1, 0.0, 7, False), 1: Beat(1, 0.0, 3, True), 2: Beat(1, 0.0)})
    for beat in range(2, 8):  # everyone beats; 0 stands still working, 1 stands still waiting, 2 says nothing
        clock.now += 1.0
        mon.observe({0: Beat(beat, 0.0, 7, False), 1: Beat(beat, 0.0, 3, True), 2: Beat(beat, 0.0)})
    assert mon.dead() == set()
    assert mon.hung() == {0}
    assert "made no progress for 6.00s (hang_timeout_s 5.0s)" in mon.reason(0)
    assert mon.stalled_for(1) == 0.0 and mon.stalled_for(2) == 0.0
    mon.observe({0: Beat(8, 0.0, 7, True)})  # it started to wait: its stall was the wait's approach, not a hang
    assert mon.hung() == set()
    clock.now += 5.5
    mon.observe({0: Beat(9, 0.0, 8, False), 1: Beat(9, 0.0, 4, False)})  # moved on, then stood still again
    assert mon.hung() == set()
    clock.now += 0.1
    assert mon.hung() == set()
    assert LivenessMonitor([0], 2.0, clock=clock).hung() == set()  # no hang_timeout_s: progress is not judged
    with pytest.raises(ValueError, match="hang_timeout_s=0"):
        LivenessMonitor([0], 2.0, hang_timeout_s=0)


def test_a_standstill_is_timed_from_when_the_sender_saw_it_begin():
    # The watcher first sees rank 0's last change 0.9 s after it happened (a beat's and a poll's lag): timed from that
    # sighting it would be declared 0.9 s late. The beat says how long the count has stood (on the sender's clock, a
    # duration), so the verdict comes when the standstill reaches the bound, whenever the watcher saw it begin.
    clock = FakeClock()
    mon = LivenessMonitor([0], heartbeat_timeout_s=20.0, clock=clock, hang_timeout_s=5.0)
    mon.observe({0: Beat(1, 0.0, 7, False, 0.9)})
    clock.now += 4.0
    mon.observe({0: Beat(2, 0.0, 7, False, 4.7)})  # (0.2 s old when read: the earlier estimate stands)
    assert mon.hung() == set()
    clock.now += 0.2
    assert mon.hung() == {0}, mon.stalled_for(0)
    mon.observe({0: Beat(3, 0.0, 8, False, 0.0)})  # moved on
    assert mon.hung() == set()


def test_beats_carry_progress_through_the_store_and_the_node_key():
    from ntp_ds.control.liveness_store import NodeLiveness

    for beat in (Beat(3, 7.25), Beat(4, 8.5, 12, True), Beat(5, 9.0, 0, False), Beat(6, 9.5, 3, False, 4.25)):
        assert Beat.decode(beat.encode()) == beat
        node = NodeLiveness(1, {2: beat}, {})
        assert NodeLiveness.decode(node.encode()).beats == {2: beat}


class _Training:
    """A training thread's progress as the heartbeat reads it, set by hand."""

    def __init__(self):
        from ntp_ds.comm.wire import Progress

        self.now = Progress(0, False)

    def __call__(self):
        return self.now


def test_only_a_waiting_rank_declares_a_stalled_peer_hung():
    from ntp_ds.comm.wire import Progress

    store = dist.HashStore()
    seen, done, on_dead = _verdicts()
    mine, theirs = _Training(), _Training()
    theirs.now = Progress(5, False)
    peer = Heartbeat(store, 1, interval_s=0.01, progress=theirs).start()
    mon = LivenessMonitor([1], heartbeat_timeout_s=5.0, hang_timeout_s=0.2)
    try:
        with Heartbeat(store, 0, interval_s=0.01, monitor=mon, on_dead=on_dead, progress=mine):
            assert not done.wait(0.6), "a peer's long work was judged while this rank did not wait on it"
            mine.now = Progress(1, True)
            assert done.wait(3.0)
            assert seen == [frozenset({1})]
            assert "made no progress" in mon.reason(1)
    finally:
        peer.stop()


def test_a_rank_stuck_in_its_own_work_says_where_at_half_the_hang_timeout(caplog):
    # The warning comes from the stalled rank itself, with its training thread's stack: what a false hang verdict on
    # a loaded machine, or a true one, needs to be understood. A wait, however long, says nothing.
    from ntp_ds.comm.wire import Progress

    store = dist.HashStore()
    training = _Training()
    mon = LivenessMonitor([], heartbeat_timeout_s=5.0, hang_timeout_s=0.2)
    _, _, on_dead = _verdicts()
    with caplog.at_level("WARNING", logger="ntp_ds.control.heartbeat"):
        training.now = Progress(3, True)
        with Heartbeat(store, 0, interval_s=0.01, monitor=mon, on_dead=on_dead, progress=training):
            time.sleep(0.5)
            assert "no progress" not in caplog.text
            training.now = Progress(4, False)
            deadline = time.monotonic() + 5.0
            while "no progress" not in caplog.text and time.monotonic() < deadline:
                time.sleep(0.05)
    assert "rank 0: its training has made no progress outside a wait" in caplog.text
    assert __file__ in caplog.text  # the training thread's stack: this test, sleeping
    assert caplog.text.count("no progress") == 1, "one warning per stretch"


def test_wire_progress_moves_at_every_wait_and_phase_point():
    from ntp_ds.comm import wire

    start = wire.progress()
    assert not start.waiting
    with wire.waiting():
        inside = wire.progress()
        assert inside.waiting and inside.count > start.count
        with wire.working():  # a phase point inside DeepSpeed's step: this rank's own work
            assert not wire.progress().waiting
        assert wire.progress().waiting and wire.progress().count > inside.count
    assert not wire.progress().waiting


# -- store-backed, in process --------------------------------------------------------------------------------------

def test_beats_and_exits_round_trip_through_the_store():
    store = dist.HashStore()
    assert read_beats(store, [0, 1]) == {} and read_exits(store) == {}
    store.set(heartbeat_key(1), Beat(3, 7.5).encode())
    assert read_beats(store, [0, 1]) == {1: Beat(3, 7.5)}
    store.set(heartbeat_key(0), Beat(1, 7.0).encode())
    assert read_beats(store, [0, 1]) == {0: Beat(1, 7.0), 1: Beat(3, 7.5)}
    mark_exited(store, 1, "exit code\n1")
    mark_exited(store, 1, "later")
    assert read_exits(store) == {1: "exit code 1"}
    mon = LivenessMonitor([0, 1], 30.0)
    assert poll_liveness(store, mon) == {1}


def test_heartbeat_thread_beats_and_stops_within_its_bound():
    store = dist.HashStore()
    hb = Heartbeat(store, 3, interval_s=0.01).start()
    first = read_beats(store, [3])[3].counter
    time.sleep(0.2)
    assert read_beats(store, [3])[3].counter > first + 3
    t0 = time.monotonic()
    assert hb.stop(timeout_s=2.0)
    assert time.monotonic() - t0 < 1.0
    stopped = read_beats(store, [3])[3].counter
    time.sleep(0.05)
    assert read_beats(store, [3])[3].counter == stopped


def _verdicts():
    """(seen, done, on_dead): an `on_dead` that records each verdict in `seen` and sets `done`."""
    seen, done = [], threading.Event()

    def on_dead(ranks, wall):
        seen.append(ranks)
        done.set()

    return seen, done, on_dead


class _StalledStore:
    """A store client of a stalled server: while `reads` is clear its reads wait, while `writes` is clear its beats
    (`set`) are not applied. Back, it answers the reads queued during the stall before any beat lands."""

    clone = None  # no alarm thread: the heartbeat polls

    def __init__(self, store, reads: threading.Event, writes: threading.Event):
        self._store, self._reads, self._writes = store, reads, writes

    def __getattr__(self, name):
        method = getattr(self._store, name)

        def gated(*args, **kwargs):
            if name == "set":
                return method(*args, **kwargs) if self._writes.is_set() else None
            if not self._reads.wait(30.0):
                raise TimeoutError(f"the stalled store never answered {name}")
            return method(*args, **kwargs)
        return gated


@pytest.mark.parametrize("blind_gap_s", [None, 60.0], ids=["watched-time-only", "every-gap-counts"])
def test_a_stalled_store_gets_no_live_rank_declared_dead(blind_gap_s):
    # Two ranks watch each other (timeout 2 s) while the store stalls for 4 s. Their first looks after it still show
    # the beats from before; only a watcher that counts the stall as its peers' silence (the rule switched off by a
    # blind gap of a minute) declares them dead.
    store = dist.HashStore()
    reads, writes = threading.Event(), threading.Event()
    reads.set(), writes.set()
    seen, done, on_dead = _verdicts()
    beats = [Heartbeat(_StalledStore(store, reads, writes), r, interval_s=0.1, on_dead=on_dead,
                       monitor=LivenessMonitor([1 - r], 2.0, blind_gap_s=blind_gap_s)).start() for r in (0, 1)]
    try:
        time.sleep(0.5)
        reads.clear(), writes.clear()
        time.sleep(4.0)
        reads.set()
        time.sleep(0.3)
        writes.set()
        if blind_gap_s is None:
            assert not done.wait(3.0), f"live ranks declared dead after the store's stall: {seen}"
            # (a watcher whose first look came after the beats resumed saw them fresh, and needed no credit)
            assert any(b.monitor.blind_s >= 4.0 for b in beats)
        else:
            assert done.wait(5.0) and seen[0] in ({0}, {1})
    finally:
        reads.set(), writes.set()
        for b in beats:
            b.stop()


def test_heartbeat_reports_each_dead_peer_once():
    store = dist.HashStore()
    seen, done, on_dead = _verdicts()
    peer = Heartbeat(store, 1, interval_s=0.01).start()
    mon = LivenessMonitor([1, 2], heartbeat_timeout_s=0.1)
    with Heartbeat(store, 0, interval_s=0.01, monitor=mon, on_dead=on_dead) as hb:
        assert done.wait(3.0)  # rank 2 never beats
        time.sleep(0.1)
        assert seen == [frozenset({2})]
        hb.retain([1])
        peer.stop()
        done.clear()
        assert done.wait(3.0)
        assert seen == [frozenset({2}), frozenset({1})]


def test_an_abnormal_exit_wakes_a_quiet_watcher_at_once_and_a_finished_worker_does_not():
    # A watcher that has backed off to one poll per 5 s beat learns of an exit through the alarm, in a store round
    # trip; a worker that finished the job marks its exit without waking anyone.
    store, _ = host_store()
    prepare_store(store)
    seen, dead = [], threading.Event()

    def on_dead(ranks, wall):
        seen.append(ranks)
        dead.set()

    for r in (1, 2):
        Heartbeat(store.clone(), r, interval_s=5.0).beat()
    watcher = Heartbeat(store.clone(), 0, interval_s=5.0, monitor=LivenessMonitor([], 60.0), on_dead=on_dead)
    with watcher:
        watcher.watch([1, 2])
        time.sleep(1.5)  # quiet: the watcher is in its 5 s pause
        mark_exited(store, 2, "finished", alarm=False)
        time.sleep(0.5)
        assert watcher.alarms == 0 and not seen, "a finished worker raised an alarm"
        t0 = time.monotonic()
        mark_exited(store, 1, "exit code -9")
        assert dead.wait(2.0), "the alarm did not wake the watcher"
        assert time.monotonic() - t0 < 0.5
        assert 1 in frozenset().union(*seen)  # (the finished rank 2 is read as gone too)
        deadline = time.monotonic() + 3.0  # (counted once the alarms raised in a fast poll's pause are coalesced)
        while watcher.alarms == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert watcher.alarms == 1


def test_only_the_first_fence_request_of_a_rank_raises_the_alarm_and_is_logged():
    # Every peer of a dead rank, then every survivor's recovery, asks for its fence: one alarm and one log line per
    # death, not one per request (which would cost survivors x buckets key writes, and grow the log every watcher
    # reads by the world size at each failure).
    store = dist.HashStore()
    for rank in (7, 8, 40):  # buckets 0 and 1
        register_alarm_watcher(store, rank)
    assert store.get(ALARM_BUCKETS_KEY).decode().split() == ["0", "1"]
    request_fence(store, [3], "no heartbeat")
    assert alarm_epoch(store) == 1 and store.check([alarm_key(0, 1), alarm_key(1, 1)])
    request_fence(store, [3], "declared dead by a peer")
    assert alarm_epoch(store) == 1 and not store.check([alarm_key(0, 2)])
    assert read_fences(store) == {3: "no heartbeat"}
    request_fence(store, [3, 4], "collective error")
    assert alarm_epoch(store) == 2 and store.check([alarm_key(0, 2), alarm_key(1, 2)])
    for _ in range(50):
        request_fence(store, [3, 4], "declared dead by a peer")
    assert alarm_epoch(store) == 2
    assert int(store.get(log_count_key(FENCE_KEY))) == 2 and read_fences(store) == {3: "no heartbeat",
                                                                                   4: "collective error"}


def test_a_stopping_watcher_ends_its_wait_and_its_bucket_mates_keep_waiting_for_alarms():
    # Watchers 0 and 1 share an alarm key. Rank 1's stop sets it to end its own wait; rank 0 wakes too, finds no
    # alarm (the epoch did not move), counts none and waits again: the next raise still reaches it at once.
    store, _ = host_store()
    prepare_store(store)
    woken = threading.Event()
    watchers = [Heartbeat(store.clone(), r, interval_s=5.0, monitor=LivenessMonitor([], 60.0),
                          on_dead=lambda ranks, wall: woken.set()) for r in (0, 1)]
    for hb in watchers:
        hb.start()
        hb.watch([5])
    Heartbeat(store.clone(), 5, interval_s=5.0).beat()
    try:
        deadline = time.monotonic() + 5.0
        while any(hb._alarm_epoch is None for hb in watchers) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert alarm_bucket(0) == alarm_bucket(1)
        assert watchers[1].stop(5.0) and not watchers[1]._alarm_thread.is_alive()
        time.sleep(0.5)
        assert watchers[0].alarms == 0 and watchers[0]._alarm_thread.is_alive()
        time.sleep(1.5)  # rank 0 is in its 5 s pause
        mark_exited(store, 5, "exit code -9")
        assert woken.wait(2.0), "the alarm did not wake the bucket-mate of a stopped watcher"
        deadline = time.monotonic() + 2.0  # (the count is the proof: a backed-off poll would have counted none)
        while watchers[0].alarms == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert watchers[0].alarms == 1
    finally:
        for hb in watchers:
            hb.stop(5.0)


class RaiseBeforeDelete:
    """A shared HashStore whose first `delete_key` is preceded by an alarm raised elsewhere: the raise's key write
    lands between a woken watcher's epoch read and its delete, the one order in which a delete could undo it."""

    def __init__(self):
        self.store, self.raised = dist.HashStore(), False

    def __getattr__(self, name):
        return getattr(self.store, name)

    def clone(self):
        return self

    def delete_key(self, key):
        if not self.raised:
            self.raised = True
            raise_alarm(self.store)
        return self.store.delete_key(key)


def test_a_raise_undone_by_a_woken_mates_delete_is_written_again():
    store = RaiseBeforeDelete()
    register_alarm_watcher(store, 1)  # a bucket-mate's registration; its stop sets the key of epoch 1
    store.set(alarm_key(alarm_bucket(0), 1), "stop")
    watcher = Heartbeat(store, 0, interval_s=5.0, monitor=LivenessMonitor([], 60.0), on_dead=lambda *a: None)
    with watcher:
        deadline = time.monotonic() + 5.0
        while watcher.alarms == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert store.raised and alarm_epoch(store) == 1
        assert watcher.alarms == 1, "the watcher missed the raise that its own delete undid"
        assert store.check([alarm_key(0, 1)]), "the raise's key was not written again for the other bucket-mates"


def test_heartbeat_survives_store_errors_and_keeps_the_error():
    class FlakyStore:
        calls = 0

        def set(self, key, value):
            FlakyStore.calls += 1
            if FlakyStore.calls > 1:
                raise RuntimeError("store unreachable")

    hb = Heartbeat(FlakyStore(), 0, interval_s=0.01).start()
    time.sleep(0.1)
    assert hb.stop(1.0)
    assert FlakyStore.calls > 3 and "unreachable" in str(hb.error)


def test_heartbeat_arguments_are_checked():
    with pytest.raises(ValueError, match="interval_s=0"):
        Heartbeat(dist.HashStore(), 0, interval_s=0)
    with pytest.raises(ValueError, match="together"):
        Heartbeat(dist.HashStore(), 0, monitor=LivenessMonitor([1], 1.0))


# -- real processes ------------------------------------------------------------------------------------------------

WORKER = """
import sys, time
from ntp_ds.control.heartbeat import Heartbeat
from ntp_ds.control.store import connect_store
Heartbeat(connect_store(sys.argv[1], 20.0), int(sys.argv[2]), interval_s=0.05).start()
time.sleep(60)
"""


def _state(pid: int) -> str:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


@pytest.mark.timeout(60)
def test_stopped_and_killed_workers_are_reported_dead_in_time():
    store, address = host_store(timeout_s=20.0)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, "-c", WORKER, address, str(r)], cwd=ROOT, env=env)
             for r in range(3)]
    try:
        deadline = time.monotonic() + 40.0
        while len(read_beats(store, range(3))) < 3:
            assert time.monotonic() < deadline, "workers did not start beating"
            assert all(p.poll() is None for p in procs), "a worker exited early"
            time.sleep(0.05)
        timeout_s, slack_s = 1.0, 1.0
        mon = LivenessMonitor(range(3), heartbeat_timeout_s=timeout_s)
        poll_liveness(store, mon)
        os.kill(procs[1].pid, signal.SIGSTOP)
        os.kill(procs[2].pid, signal.SIGKILL)
        t_signal, found = time.monotonic(), {}
        while len(found) < 2 and time.monotonic() < t_signal + timeout_s + slack_s:
            for rank in poll_liveness(store, mon):
                found.setdefault(rank, time.monotonic() - t_signal)
            time.sleep(0.02)
        assert set(found) == {1, 2}, f"detected {found}"
        assert all(timeout_s - 0.1 <= t <= timeout_s + slack_s for t in found.values()), found
        assert _state(procs[1].pid) == "T"
        assert procs[2].wait(5.0) == -signal.SIGKILL
        assert 0 not in mon.dead()
    finally:
        for p in procs:
            p.kill()
            p.wait(5.0)


def test_alarms_raised_within_a_fast_poll_s_pause_wake_a_watcher_once():
    # A rack lost at once: its ranks' fences raise an alarm each, within a moment. A watcher is woken by the first,
    # and the others are read by its next poll: one wake (and its two requests), not one per death.
    store, _ = host_store()
    prepare_store(store)
    dead = threading.Event()
    watcher = Heartbeat(store.clone(), 0, interval_s=2.0, monitor=LivenessMonitor([], 60.0),
                        on_dead=lambda ranks, wall: dead.set())
    with watcher:
        watcher.watch([1], members=range(10))
        deadline = time.monotonic() + 5.0
        while watcher._alarm_epoch is None and time.monotonic() < deadline:
            time.sleep(0.01)
        for r in range(2, 10):
            request_fence(store, [r], "rack lost")
        assert dead.wait(2.0)
        time.sleep(1.0)  # past the coalescing pause (0.5 s): the epoch read then covers all eight
        assert watcher.alarms == 1 and watcher._alarm_epoch == 8
        request_fence(store, [1], "later")
        deadline = time.monotonic() + 3.0
        while watcher.alarms == 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert watcher.alarms == 2 and watcher._alarm_epoch == 9


def test_an_abnormal_exit_is_recorded_with_its_fence_and_one_alarm_a_clean_one_with_neither():
    from ntp_ds.control.liveness_store import record_exit

    store = dist.HashStore()
    prepare_store(store)
    register_alarm_watcher(store, 0)
    record_exit(store, 3, "killed by SIGKILL")
    assert read_exits(store) == {3: "killed by SIGKILL"} and read_fences(store) == {3: "killed by SIGKILL"}
    assert alarm_epoch(store) == 1
    request_fence(store, [3], "declared dead by rank 2")  # a watcher's verdict on it after: no entry, no alarm
    assert read_fences(store) == {3: "killed by SIGKILL"} and alarm_epoch(store) == 1
    record_exit(store, 4, "exited with code 0", abnormal=False)
    assert 4 in read_exits(store) and 4 not in read_fences(store) and alarm_epoch(store) == 1


def test_a_launcher_relays_alarms_to_its_node_whose_workers_neither_register_nor_wait_in_the_job_store():
    # Two workers of a node wait on the node's store, where their launcher's relay sets a key per alarm: the job's
    # store holds the relay's registration alone, a raise wakes both workers, and a worker's stop ends its own wait
    # while its node-mate keeps waiting.
    from ntp_ds.control.keys import alarm_watchers_key
    from ntp_ds.control.liveness_store import AlarmRelay, request_fence

    store, _ = host_store()
    node, node_address = host_store(0, "127.0.0.1", 10.0)
    prepare_store(store)
    relay = AlarmRelay(store.clone(), node.clone(), 32, pause_s=lambda: 0.05).start()
    woken = [threading.Event(), threading.Event()]
    watchers = [Heartbeat(store.clone(), r, interval_s=0.4, monitor=LivenessMonitor([], 60.0),
                          on_dead=lambda ranks, wall: None, beats_to=node.clone(), alarms_from=node.clone())
                for r in (0, 1)]
    for hb, event in zip(watchers, woken):
        hb.on_alarm.append(event.set)
        hb.start()
    try:
        deadline = time.monotonic() + 5.0
        while not all(hb._relayed for hb in watchers) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert all(hb._relayed for hb in watchers)
        assert store.get(ALARM_BUCKETS_KEY).decode().split() == [str(alarm_bucket(32))]
        assert not store.check([alarm_watchers_key(alarm_bucket(0))])  # (the workers' bucket: never registered)
        request_fence(store, [7], "no heartbeat")
        assert all(event.wait(2.0) for event in woken), "a relayed alarm did not wake every worker of the node"
        deadline = time.monotonic() + 2.0
        while any(hb.alarms < 1 for hb in watchers) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert [hb.alarms for hb in watchers] == [1, 1] and relay.relayed == 1 and relay.epoch == 1
        assert watchers[1].stop(5.0) and not watchers[1]._alarm_thread.is_alive()
        time.sleep(0.3)
        assert watchers[0].alarms == 1 and watchers[0]._alarm_thread.is_alive()
        woken[0].clear()
        request_fence(store, [8], "no heartbeat")
        assert woken[0].wait(2.0), "the node-mate of a stopped worker no longer hears the relay"
    finally:
        for hb in watchers:
            hb.stop(5.0)
        relay.stop(5.0)
    assert not relay._thread.is_alive()


def test_a_worker_whose_launcher_relays_nothing_waits_in_the_job_store():
    store, _ = host_store()
    node = dist.HashStore()  # a node's store without a relay's epoch in it
    prepare_store(store)
    dead = threading.Event()
    watcher = Heartbeat(store.clone(), 0, interval_s=0.4, monitor=LivenessMonitor([], 60.0),
                        on_dead=lambda ranks, wall: dead.set(), alarms_from=node)
    with watcher:
        watcher.watch([1], members=range(4))
        deadline = time.monotonic() + 5.0
        while not watcher.hears_alarms and time.monotonic() < deadline:
            time.sleep(0.01)
        assert watcher.hears_alarms and not watcher._relayed
        request_fence(store, [1], "gone")
        assert dead.wait(2.0)
