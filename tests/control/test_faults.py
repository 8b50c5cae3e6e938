"""Fault injection: schedule validation, when faults fire, and real crash / hang / device error in a child."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch.distributed as dist

from ntp_ds.comm.failures import DeviceError
from ntp_ds.control import inject
from ntp_ds.control.faults import (FAULT_COUNT_KEY, Fault, FaultInjector, FaultSchedule, clock_domain, fault_key,
                                   fired_key, send_fault, trigger)
from ntp_ds.control.liveness_store import mark_exited
from ntp_ds.control.job import publish_job, publish_step
from ntp_ds.control.store import host_store
from tests.helpers.stores import CountingStore

ROOT = Path(__file__).resolve().parents[2]
GOOD = {"rank": 1, "step": 3, "phase": "backward", "kind": "crash"}


# -- validation ----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("items, message", [
    ([{**GOOD, "rank": 7}], r"fault\.faults\[0\]\.rank=7 does not exist \(world size 5\)"),
    ([GOOD, {**GOOD, "rank": -1}], r"fault\.faults\[1\]\.rank=-1 must be a non-negative integer"),
    ([{**GOOD, "step": 1.5}], r"fault\.faults\[0\]\.step=1\.5 must be a non-negative integer"),
    ([{**GOOD, "phase": "fwd"}], r"fault\.faults\[0\]\.phase='fwd' must be one of forward, backward, grad_sync"),
    ([{**GOOD, "kind": "melt"}], r"fault\.faults\[0\]\.kind='melt' must be one of crash, hang, device_error"),
    ([{k: v for k, v in GOOD.items() if k != "phase"}], r"fault\.faults\[0\]\.phase is missing"),
    ([{**GOOD, "when": 3}], r"fault\.faults\[0\]\.when is not a fault field"),
    ([[1, 3]], r"fault\.faults\[0\] must be a mapping"),
    ({"rank": 1}, r"fault\.faults must be a list"),
    ([GOOD, dict(GOOD)], r"fault\.faults\[1\] repeats rank 1, step 3, phase backward of fault\.faults\[0\]"),
])
def test_schedule_errors_name_the_field(items, message):
    with pytest.raises(ValueError, match=message):
        FaultSchedule.from_config(items, world_size=5)


def test_schedule_reads_hydra_lists():
    from omegaconf import OmegaConf

    cfg = OmegaConf.create({"faults": [GOOD, {**GOOD, "rank": 0, "kind": "hang"}]})
    schedule = FaultSchedule.from_config(cfg.faults, world_size=2)
    assert schedule.for_rank(1) == (Fault(1, 3, "backward", "crash"),)
    assert FaultSchedule.from_config(None, 2).faults == ()
    assert Fault.decode(Fault(1, 3, "backward", "crash").encode()) == Fault(1, 3, "backward", "crash")
    with pytest.raises(ValueError, match=r"fault\.kind='x'"):
        Fault(0, 0, "forward", "x")


# -- the injector's logic ----------------------------------------------------------------------------------------------

class Recorder:
    def __init__(self):
        self.fired = []

    def __call__(self, fault):
        self.fired.append(fault)


def test_scheduled_fault_fires_once_at_its_exact_step_and_phase():
    schedule = FaultSchedule.from_config([GOOD, {**GOOD, "rank": 0}], world_size=2)
    fire = Recorder()
    inj = FaultInjector(schedule, rank=1, fire=fire)
    fired_at = []
    for step in range(6):
        for phase in ("forward", "backward", "grad_sync", "optimizer"):
            inj.check(step, phase)
            fired_at += [(step, phase)] * (len(fire.fired) - len(fired_at))
    assert fired_at == [(3, "backward")]
    assert fire.fired == [Fault(1, 3, "backward", "crash")]
    assert inj.pending == ()
    resumed = Recorder()
    FaultInjector(schedule, rank=1, fire=resumed).check(4, "backward")  # a job resumed past step 3
    assert resumed.fired == []
    with pytest.raises(ValueError, match="phase='fwd'"):
        inj.check(0, "fwd")


def test_sent_fault_is_polled_cheaply_and_fires_at_or_after_its_step():
    store, clock, fire = CountingStore(), [0.0], Recorder()
    inj = FaultInjector(FaultSchedule(), rank=2, store=store, poll_interval_s=0.5, clock=lambda: clock[0],
                        wall=lambda: 123.0, fire=fire)
    inj.check(0, "forward")
    polled = store.calls
    for _ in range(100):
        inj.check(0, "backward")
    assert store.calls == polled  # no round trip between polls
    send_fault(store.inner, Fault(0, 0, "forward", "hang"))  # another rank's
    send_fault(store.inner, Fault(2, 1, "grad_sync", "device_error"))
    inj.check(5, "grad_sync")
    assert fire.fired == []  # not polled yet
    clock[0] = 0.6
    inj.check(5, "forward")
    assert inj.pending == (Fault(2, 1, "grad_sync", "device_error"),)
    inj.check(5, "grad_sync")  # step 5 >= 1: a late fault still fires
    assert fire.fired == [Fault(2, 1, "grad_sync", "device_error")]
    record = json.loads(store.inner.get(fired_key(2)))
    assert record == {"rank": 2, "step": 1, "phase": "grad_sync", "kind": "device_error", "at_step": 5, "wall": 123.0,
                      "monotonic": 0.6, "clock": clock_domain()}


def test_a_listening_injector_reads_the_store_only_when_an_alarm_tells_it():
    # Between failures the training thread does not talk to the store: faults sent to the job come with an alarm.
    store, clock, fire, hearing = CountingStore(), [0.0], Recorder(), [True]
    inj = FaultInjector(FaultSchedule(), rank=2, store=store, poll_interval_s=0.5, clock=lambda: clock[0], fire=fire)
    told = inj.listen(lambda: hearing[0])
    inj.check(0, "forward")  # one read: faults sent before it listened
    first = store.calls
    assert first > 0
    for step in range(1, 50):
        clock[0] += 1.0
        inj.check(step, "backward")
    assert store.calls == first  # however long the job runs
    send_fault(store.inner, Fault(2, 1, "grad_sync", "device_error"))
    inj.check(50, "grad_sync")
    assert fire.fired == []  # not told yet
    told()  # the heartbeat's alarm thread
    inj.check(50, "grad_sync")
    assert fire.fired == [Fault(2, 1, "grad_sync", "device_error")]
    # Alarms no longer heard (the store broke the waiting thread): it reads by the clock again.
    hearing[0] = False
    calls = store.calls
    clock[0] += 1.0
    inj.check(51, "forward")
    assert store.calls > calls


def test_sending_a_fault_raises_the_alarm():
    from ntp_ds.control.liveness_store import alarm_epoch

    store = dist.HashStore()
    before = alarm_epoch(store)
    send_fault(store, Fault(1, 3, "forward", "crash"))
    assert alarm_epoch(store) == before + 1


def test_detection_is_timed_from_a_fault_only_on_the_host_whose_clock_fired_it():
    from ntp_ds.control.faults import detection_from_faults

    here = {"monotonic": 10.0, "clock": clock_domain(), "wall": 5.0}
    elsewhere = {"monotonic": 1.0, "clock": "another host", "wall": 4.0}
    assert detection_from_faults([here], noticed=12.5, measured=0.7) == 2.5
    # Another host's clocks are not this rank's: the reporters' own measurement stands.
    assert detection_from_faults([elsewhere], noticed=12.5, measured=0.7) == 0.7
    assert detection_from_faults([here, elsewhere], noticed=12.5, measured=0.7) == 0.7
    assert detection_from_faults([], noticed=12.5, measured=0.7) == 0.7


def test_a_fault_counted_but_not_yet_written_is_read_at_the_next_poll():
    store, clock, fire = dist.HashStore(), [0.0], Recorder()
    inj = FaultInjector(FaultSchedule(), rank=0, store=store, poll_interval_s=0.1, clock=lambda: clock[0], fire=fire)
    store.add(FAULT_COUNT_KEY, 1)  # a sender between its add and its set
    inj.check(0, "forward")
    store.set(fault_key(1), Fault(0, 0, "optimizer", "crash").encode())
    clock[0] = 0.2
    inj.check(0, "optimizer")
    assert fire.fired == [Fault(0, 0, "optimizer", "crash")]


def test_device_error_is_a_runtime_error():
    with pytest.raises(DeviceError, match="rank 4 at step 2, phase recovery") as err:
        trigger(Fault(4, 2, "recovery", "device_error"))
    assert isinstance(err.value, RuntimeError)


# -- real processes ------------------------------------------------------------------------------------------------

CHILD = """
import json, sys, time
from ntp_ds.comm.failures import DeviceError
from ntp_ds.control.faults import PHASES, FaultInjector, FaultSchedule
from ntp_ds.control.store import connect_store
store = connect_store(sys.argv[2], 20.0) if len(sys.argv) > 2 else None
inj = FaultInjector(FaultSchedule.from_config(json.loads(sys.argv[1]), 2), 1, store, poll_interval_s=0.01)
for step in range(1000):
    for phase in PHASES:
        print(step, phase, flush=True)
        try:
            inj.check(step, phase)
        except DeviceError:
            print("DeviceError", flush=True)
            sys.exit(3)
    time.sleep(0.02)
"""


def _spawn(*args) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    return subprocess.Popen([sys.executable, "-c", CHILD, *args], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            text=True)


def _state(pid: int) -> str:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind, phase", [("crash", "forward"), ("hang", "grad_sync"),
                                         ("device_error", "optimizer")])
def test_fault_happens_in_a_child_at_its_step_and_phase(kind, phase):
    proc = _spawn(json.dumps([{"rank": 1, "step": 2, "phase": phase, "kind": kind}]))
    try:
        if kind == "hang":
            lines, deadline = [], time.monotonic() + 40.0
            while f"2 {phase}" not in lines:
                assert time.monotonic() < deadline and proc.poll() is None
                lines.append(proc.stdout.readline().strip())
            while _state(proc.pid) != "T":
                assert time.monotonic() < deadline, "the child did not stop itself"
                time.sleep(0.02)
            return
        out, _ = proc.communicate(timeout=40.0)
        lines = out.split("\n")
        if kind == "crash":
            assert proc.returncode == -signal.SIGKILL
            assert lines[-2] == f"2 {phase}"
        else:
            assert proc.returncode == 3
            assert lines[-3:-1] == [f"2 {phase}", "DeviceError"]
    finally:
        proc.kill()
        proc.wait(5.0)


@pytest.mark.timeout(60)
def test_fault_sent_by_the_cli_reaches_a_running_job():
    store, address = host_store(timeout_s=20.0)
    publish_job(store, world_size=2, steps=1000)
    proc = _spawn("[]", address)
    try:
        deadline = time.monotonic() + 40.0
        while not proc.stdout.readline().startswith("3 "):  # the job is running
            assert time.monotonic() < deadline and proc.poll() is None
        assert inject.main(["--store", address, "--rank", "1", "--step", "1", "--phase", "optimizer",
                            "--kind", "crash"]) == 0
        out, _ = proc.communicate(timeout=20.0)
        assert proc.returncode == -signal.SIGKILL
        assert out.split("\n")[-2].endswith(" optimizer")
        assert json.loads(store.get(fired_key(1)))["kind"] == "crash"
    finally:
        proc.kill()
        proc.wait(5.0)


@pytest.mark.parametrize("argv, field", [
    (["--store", "nope", "--rank", "1", "--step", "0", "--phase", "forward", "--kind", "crash"], "--store"),
    (["--store", "h:1", "--rank", "-2", "--step", "0", "--phase", "forward", "--kind", "crash"], "--rank=-2"),
    (["--store", "h:1", "--rank", "1", "--step", "-1", "--phase", "forward", "--kind", "crash"], "--step=-1"),
    (["--store", "h:1", "--rank", "1", "--step", "0", "--phase", "fwd", "--kind", "crash"], "--phase"),
    (["--store", "h:1", "--rank", "1", "--step", "0", "--phase", "forward"], "--kind"),
    (["--store", "127.0.0.1:1", "--rank", "1", "--step", "1", "--phase", "forward", "--kind", "hang",
      "--timeout-s", "0.2"], "--store=127.0.0.1:1"),
])
def test_cli_errors_are_one_line_naming_the_field(argv, field, capsys):
    assert inject.main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and field in err, err


def test_a_fault_sent_to_the_job_reaches_a_listening_injector_through_the_heartbeat_s_alarm():
    # The path a job under live recovery takes (fault_tolerant.start wires it): the heartbeat's alarm thread tells
    # the injector, whose next phase point reads the store and fires the fault.
    from ntp_ds.control.heartbeat import Heartbeat
    from ntp_ds.control.liveness import LivenessMonitor

    store, address = host_store(timeout_s=20.0)
    fire = Recorder()
    heartbeat = Heartbeat(store.clone(), 0, 0.2, monitor=LivenessMonitor((), 2.0), on_dead=lambda ranks, wall: None)
    injector = FaultInjector(FaultSchedule(), rank=0, store=store.clone(), fire=fire)
    heartbeat.on_alarm.append(injector.listen(lambda: heartbeat.hears_alarms))
    heartbeat.start()
    try:
        deadline = time.monotonic() + 10.0
        while not heartbeat.hears_alarms:  # its alarm thread registers first
            assert time.monotonic() < deadline, "the heartbeat never waited for alarms"
            time.sleep(0.01)
        injector.check(1, "forward")  # the read it makes when it starts listening
        send_fault(store.clone(), Fault(0, 2, "backward", "crash"))
        while heartbeat.alarms == 0:
            assert time.monotonic() < deadline, "the alarm never reached the heartbeat"
            time.sleep(0.01)
        injector.check(2, "backward")
        assert fire.fired == [Fault(0, 2, "backward", "crash")]
    finally:
        heartbeat.stop()


def test_cli_checks_the_fault_against_the_running_job(capsys):
    store, address = host_store(timeout_s=5.0)
    base = ["--store", address, "--phase", "forward", "--kind", "crash", "--timeout-s", "5"]
    assert inject.main([*base, "--rank", "1", "--step", "3"]) == 2
    assert "no ntp_ds job has published itself" in capsys.readouterr().err
    publish_job(store, world_size=4, steps=20)
    publish_step(store, 6)
    mark_exited(store, 2, "killed by SIGKILL")
    for argv, message in ((["--rank", "4", "--step", "8"], "--rank=4 does not exist (the job's world size is 4"),
                          (["--rank", "1", "--step", "0"], "--step=0 does not exist: steps count from 1"),
                          (["--rank", "1", "--step", "21"], "--step=21 does not exist (the job runs steps 1..20)"),
                          (["--rank", "2", "--step", "8"], "--rank=2 has already left the job (killed by SIGKILL)")):
        assert inject.main([*base, *argv]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and message in err, err
    assert store.add(FAULT_COUNT_KEY, 0) == 0, "a refused fault is not sent"
    assert inject.main([*base, "--rank", "3", "--step", "4"]) == 0
    out = capsys.readouterr().out
    assert out.count("\n") == 1 and "after step 6 (the job has completed step 6)" in out
    assert Fault.decode(store.get(fault_key(1))) == Fault(3, 4, "forward", "crash")


@pytest.mark.timeout(30)
def test_cli_against_a_port_that_is_no_store_gives_up_within_its_timeout(capsys):
    import socket

    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)
        port = listener.getsockname()[1]
        started = time.monotonic()
        assert inject.main(["--store", f"127.0.0.1:{port}", "--rank", "1", "--step", "3", "--phase", "forward",
                            "--kind", "crash", "--timeout-s", "1.5"]) == 2
        elapsed = time.monotonic() - started
    err = capsys.readouterr().err
    assert elapsed < 1.5 + 1.0, f"took {elapsed:.1f} s"
    assert err.count("\n") == 1 and "did not answer as a store within 1.5s" in err, err
