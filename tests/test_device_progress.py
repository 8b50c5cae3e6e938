"""The device's own progress (`ntp_ds.comm.device`): events at phase points and around waits say whether a rank's
device is busy with its own work; a rank whose device stops is found hung by the peers waiting on it, whatever its
host does."""

import pytest

from ntp_ds.comm import activity, device, wire
from ntp_ds.control.liveness import Beat, LivenessMonitor
from tests.helpers.recovery import assert_hung_rank_3_found


class _Event:
    def __init__(self, done=False):
        self.done = done

    def query(self):
        return self.done


def test_the_oldest_pending_event_says_what_the_device_does():
    watch, events = device.DeviceWatch(), []

    def record():
        events.append(_Event())
        return events[-1]

    assert watch.look() == (0, None), "no event: the device is idle"
    watch.mark(record, own=True)
    assert watch.look() == (0, True), "an own event pending: busy with its own work"
    watch.mark(record, own=False)
    events[0].done = True
    assert watch.look() == (1, False), "its own work done, the wait's event pending: waiting on peers"
    watch.mark(record, own=True)
    assert watch.look() == (1, False), "an own event behind a pending wait: still waiting on peers"
    events[1].done = True
    assert watch.look() == (2, True)
    events[2].done = True
    assert watch.look() == (3, None)
    watch.mark(None, own=True)
    assert watch.look() == (3, None), "a host that computes synchronously records nothing"


def test_a_full_watch_never_turns_a_wait_into_own_work(monkeypatch):
    monkeypatch.setattr(device, "MAX_PENDING", 2)
    watch = device.DeviceWatch()
    watch.mark(lambda: _Event(), own=False)
    watch.mark(lambda: _Event(), own=False)
    watch.mark(lambda: _Event(), own=True)  # full: takes the newest's place, as a wait's
    assert [own for _, own in watch._items] == [False, False]


def test_a_look_that_fails_says_nothing_and_the_beat_goes_on():
    class Broken:
        def query(self):
            raise RuntimeError("CUDA error: an illegal memory access was encountered")

    watch = device.DeviceWatch()
    watch.mark(lambda: Broken(), own=True)
    assert watch.look() == (0, None)


def test_a_wait_on_a_busy_device_is_not_a_wait_on_peers(monkeypatch):
    # The host waits, but the work it queued before the wait has not run: the rank is not waiting on its peers, and
    # its progress moves only as its device completes events.
    events = []

    def record():
        events.append(_Event())
        return events[-1]

    monkeypatch.setattr(activity, "_device", device.DeviceWatch())
    monkeypatch.setattr(wire._state, "record_event", record)
    with wire.waiting():
        inside = wire.progress()
        assert inside.device_busy and not inside.waiting
        assert wire.progress().count == inside.count, "nothing completed: no progress"
        events[0].done = True
        done = wire.progress()
        assert done.waiting and not done.device_busy and done.count == inside.count + 1
    for event in events:  # (the wait's own end, a peers event, too)
        event.done = True
    with wire.working():
        assert not wire.progress().waiting
    # Under NCCL a host runs ahead of its waits and may block later outside any (a `.item()` of the user's) behind a
    # peer's stuck collective: its device's oldest pending event is a wait's, so it is waiting, not hung.
    with wire.waiting():
        pass
    for event in events[:-1]:  # what came before the wait has run; the wait's collective has not
        event.done = True
    behind = wire.progress()
    assert not events[-1].done and behind.waiting and not behind.device_busy


def test_peers_declare_a_rank_hung_whose_device_is_busy_while_its_host_waits():
    now = [0.0]
    monitor = LivenessMonitor([3], 10.0, clock=lambda: now[0], hang_timeout_s=6.0)
    for t in range(8):  # it beats; its host waits, but its device is busy with its own work: `waiting` is off
        now[0] = float(t)
        monitor.observe({3: Beat(t + 1, 0.0, progress=40, waiting=False)})
    assert monitor.hung() == frozenset({3}), monitor.stalled_for(3)


@pytest.mark.long
@pytest.mark.parametrize("phase", ["forward", "backward"])
def test_a_rank_whose_device_stops_is_found_hung_within_hang_timeout_plus_2s(monkeypatch, phase):
    # nccl_model: rank 3's device stops (a kernel that never ends) while its host goes on and then waits, in its
    # TP all-reduce, on its own stopped device; its heartbeat beats on. Before the device watch nobody judged it: its
    # host was waiting, like its peers', and the job hung until the harness's limit. Now its device's events say it
    # is busy with its own work; its peers, waiting on it, declare it hung, and recover to the failure-free weights.
    # Its TP peer (rank 2) waits on it and is not fenced: it is among the survivors.
    monkeypatch.setenv("NTP_TEST_BACKEND", "nccl_model")
    assert_hung_rank_3_found(phase, 1, "device_hang")


class _TimedEvent:
    """A timing event at `at` milliseconds of device time."""

    def __init__(self, at):
        self.at = at

    def query(self):
        return True

    def elapsed_time(self, later):
        return later.at - self.at


class _Engine:
    def __init__(self):
        from types import SimpleNamespace

        from ntp_ds.engine.config import StragglerConfig

        self.sync_wait_s, self.device_waits = 0.0, None
        self.job = SimpleNamespace(ntp=SimpleNamespace(straggler=StragglerConfig()))  # (no re-plan: off)


def test_under_cuda_a_micro_batch_is_timed_on_the_device_without_its_waits_on_other_replicas(monkeypatch):
    # The host's clock says 10 s (it waited on a sync of earlier work); the device ran the micro-batch from 1000 ms
    # to 3500 ms, 500 ms of it behind the reduction with the other replicas: its own work is 2 s. A slow fault's extra
    # host sleep counts as work. Without timing events (the host computes) the host's figure stands.
    from ntp_ds.engine.balancer import StepWork

    clock, device_ms = [0.0], iter([1000.0, 2500.0, 3000.0, 3500.0])  # (first, the wait's two, last)
    monkeypatch.setattr(wire._state, "timed_event", lambda: _TimedEvent(next(device_ms)))
    work, engine = StepWork(clock=lambda: clock[0]), _Engine()
    work.forward(engine, 4)
    clock[0] = 9.0
    engine.sync_wait_s += 1.0
    engine.device_waits.append((wire.timed_event(), wire.timed_event()))
    clock[0] = 12.0
    work.backward_done(engine, stretch=lambda busy: 0.25)
    work.end_step(engine)
    assert work.last_step == [(4, pytest.approx(2.25))]
    assert engine.device_waits is None, "the step's spans are taken"

    monkeypatch.setattr(wire._state, "timed_event", None)
    work.forward(engine, 4)
    clock[0] = 15.0
    work.backward_done(engine)
    work.end_step(engine)
    assert work.last_step == [(4, pytest.approx(3.0))]
