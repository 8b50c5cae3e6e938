"""Run directories, stop signals and resumption under real use: `ntp-ds train` -> launcher -> 2 workers (TP 1 x 2).

One job is stopped by SIGTERM once it has completed a step or two. It must stop cleanly at a step both ranks
completed and write that step's weights, a `run_stopped` event and a `stopped` summary (exit 143). Its weights must
equal those of an uninterrupted run of that many steps; a second `ntp-ds train` into the directory is refused
without touching it; resumed (`existing_run=resume`), it must end with the weights of the uninterrupted full run.
"""

import hashlib
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from ntp_ds.run.records import SUMMARY
from tests.helpers.cli import REPO, ntp_ds

STEPS = 60
ARGS = ("parallel.tp=1", "parallel.replicas=2", "parallel.timeout_s=20", "train.global_batch=4", "train.micro_batch=2",
        "data.seq_len=16", "logging.progress=false", "logging=disabled")


def weights_hash(run_dir) -> str:
    digest = hashlib.sha256()
    for f in sorted((run_dir / "final").glob("*.safetensors")):
        digest.update(f.read_bytes())
    return digest.hexdigest()


def lines(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def train(run_dir, steps, *extra, timeout=120):
    result = ntp_ds("train", *ARGS, f"train.steps={steps}", f"run_dir={run_dir}", *extra, timeout=timeout)
    assert result.returncode == 0, result.stderr[-4000:]
    return result


def stop_with_sigterm(run_dir, after_steps: int, timeout: float = 120):
    """Start a run of STEPS steps, send SIGTERM to `ntp-ds train` once `after_steps` steps are recorded; return
    (exit status, stderr)."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "NTP_RUN_DIR", "NTP_STORE"):
        env.pop(key, None)
    proc = subprocess.Popen([sys.executable, "-m", "ntp_ds.cli", "train", *ARGS, f"train.steps={STEPS}",
                             f"run_dir={run_dir}"], stderr=subprocess.PIPE, text=True, env=env, cwd=REPO,
                            start_new_session=True)
    deadline = time.monotonic() + timeout
    try:
        metrics = run_dir / "metrics.jsonl"
        while not (metrics.is_file() and len(metrics.read_text().splitlines()) >= after_steps):
            assert proc.poll() is None, "the run ended before it was signalled"
            assert time.monotonic() < deadline, "the run did not reach its first steps in time"
            time.sleep(0.01)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
    except BaseException:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise
    return proc.returncode, err


@pytest.fixture(scope="module")
def stopped(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("stop") / "run"
    code, err = stop_with_sigterm(run_dir, after_steps=2)
    return run_dir, code, err


@pytest.mark.long  # .ci/run: its long stage (and the nccl_model stage where its file runs); README suite under 10 min
def test_sigterm_stops_every_rank_at_one_step_with_its_weights_event_and_summary(stopped, tmp_path):
    run_dir, code, err = stopped
    assert code == 143, err[-4000:]
    assert "Traceback" not in err, err[-4000:]
    summary = json.loads((run_dir / SUMMARY).read_text())
    step = summary["last_step"]
    assert summary["status"] == "stopped" and summary["stopped_by"] == "SIGTERM" and 2 <= step < STEPS
    events = lines(run_dir / "events.jsonl")
    assert [e["event"] for e in events] == ["run_start", "run_stopped"]
    assert events[-1]["step"] == step and events[-1]["signal"] == "SIGTERM"
    assert [m["step"] for m in lines(run_dir / "metrics.jsonl")] == list(range(1, step + 1))
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == f"global_step{step}"
    assert "2 of 2 workers stopped cleanly" in err

    reference = tmp_path / "reference"
    train(reference, step)
    assert weights_hash(run_dir) == weights_hash(reference), "stopped weights differ from a run of that many steps"


@pytest.mark.long  # .ci/run: its long stage (it shares the stopped run, 12 s to set up); README suite under 10 min
def test_a_directory_holding_a_run_is_refused_before_any_worker_starts(stopped, capsys):
    from ntp_ds.train import main

    run_dir, _, _ = stopped
    before = {p: p.read_bytes() for p in sorted(run_dir.rglob("*")) if p.is_file()}
    assert main([*ARGS, f"train.steps={STEPS}", f"run_dir={run_dir}"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert f"run_dir='{run_dir}' already holds a run (stopped at step" in err and "existing_run=resume" in err
    after = {p: p.read_bytes() for p in sorted(run_dir.rglob("*")) if p.is_file()}
    assert after == before, "a refused run must not touch the earlier run's files"
    summary = json.loads((run_dir / SUMMARY).read_text())
    assert main([*ARGS, f"train.steps={summary['last_step']}", f"run_dir={run_dir}", "existing_run=resume"]) == 2
    assert f"has already completed step {summary['last_step']} of train.steps" in capsys.readouterr().err
    assert main([*ARGS, f"train.steps={STEPS}", f"run_dir={run_dir}", "existing_run=resume",
                 "parallel.zero_stage=2"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "existing_run=resume: parallel.zero_stage=2 differs from the run in" in err, err
    after = {p: p.read_bytes() for p in sorted(run_dir.rglob("*")) if p.is_file()}
    assert after == before, "a refused resume must not touch the earlier run's files either"


@pytest.mark.long  # about 27 s: .ci/run runs it in its long stage (and on nccl_model where the file runs there)
def test_a_stopped_run_resumed_ends_equal_to_the_uninterrupted_run(stopped, tmp_path, capsys):
    from ntp_ds.report import main as report

    run_dir, _, _ = stopped
    step = json.loads((run_dir / SUMMARY).read_text())["last_step"]
    train(run_dir, STEPS, "existing_run=resume")
    full = tmp_path / "full"
    train(full, STEPS)
    assert weights_hash(run_dir) == weights_hash(full), "the resumed run must end with the full run's weights"
    events = lines(run_dir / "events.jsonl")
    assert [e["event"] for e in events] == ["run_start", "run_stopped", "run_resumed", "run_end"]
    assert events[2]["step"] == step
    assert [m["step"] for m in lines(run_dir / "metrics.jsonl")] == list(range(1, STEPS + 1))
    summary = json.loads((run_dir / SUMMARY).read_text())
    assert summary["status"] == "finished" and summary["resumed_from_step"] == step

    assert report([str(run_dir)]) == 0
    out = capsys.readouterr().out
    assert f"steps 1-{step}, stopped by SIGTERM" in out
    assert f"steps {step + 1}-{STEPS} (resumed from the checkpoint of step {step}), finished" in out


# -- run directory checks, before any worker starts (no process) -------------------------------------------------
def test_run_directory_that_cannot_hold_a_run_is_refused_in_one_line(tmp_path, capsys):
    from ntp_ds.train import main

    a_file = tmp_path / "a_file"
    a_file.write_text("not a directory")
    for run_dir, message in ((a_file, "is a file, not a directory"),
                             (a_file / "run", f"{a_file} is a file, not a directory"),
                             ("/proc/ntp-ds-run", "is not writable")):
        assert main([*ARGS, "train.steps=2", f"run_dir={run_dir}"]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and f"ntp-ds train: error: run_dir='{run_dir}'" in err and message in err, err
    assert main([*ARGS, "train.steps=2", f"run_dir={tmp_path / 'new'}", "existing_run=resume"]) == 2
    assert "existing_run=resume: run_dir=" in capsys.readouterr().err
    assert main([*ARGS, "train.steps=2", f"run_dir={tmp_path / 'new'}", "existing_run=again"]) == 2
    assert "existing_run='again' must be one of refuse, resume, overwrite" in capsys.readouterr().err


def test_overwrite_deletes_only_what_a_run_wrote(tmp_path):
    from ntp_ds.run.rundir import RUN_OUTPUTS, check_run_dir, clear_run

    for name in RUN_OUTPUTS:
        (tmp_path / name).mkdir() if "." not in name else (tmp_path / name).write_text("{}")
    (tmp_path / "final" / "model.safetensors").write_bytes(b"weights")
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(Exception, match="already holds a run"):
        check_run_dir(tmp_path, "refuse", (1, 1), 4)
    assert check_run_dir(tmp_path, "overwrite", (1, 1), 4) is None
    clear_run(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]
    assert check_run_dir(tmp_path, "refuse", (1, 1), 4) is None


# -- signals, with fakes (no process group) ----------------------------------------------------------------------
class FakeStore:
    """The few TCPStore calls the stop agreement makes, in memory."""

    def __init__(self):
        self.data = {}

    def check(self, keys):
        return all(k in self.data for k in keys)

    def get(self, key):
        return self.data[key]

    def set(self, key, value):
        self.data[key] = value.encode() if isinstance(value, str) else value

    def compare_set(self, key, expected, desired):
        if self.data.get(key, b"").decode() == expected:
            self.data[key] = desired.encode()
        return self.data[key]


def test_ranks_stop_after_the_same_step_and_a_later_second_signal_stops_at_once():
    from ntp_ds.control.job import read_job, publish_job
    from ntp_ds.supervise.stop import DUPLICATE_S, StopSignals

    store, now, exits = FakeStore(), [0.0], []
    publish_job(store, world_size=2, steps=10)
    writer = StopSignals(store, clock=lambda: now[0], exit_now=exits.append)
    other = StopSignals(store, clock=lambda: now[0], exit_now=exits.append)
    assert not writer.should_stop(3, publish=True) and not other.should_stop(3)
    writer.receive(signal.SIGTERM)
    writer.receive(signal.SIGINT)  # the same request delivered twice (terminal and launcher): no second signal
    assert exits == []
    assert not other.should_stop(4), "the other rank may already be in step 5: nobody stops after step 4"
    assert not writer.should_stop(4, publish=True)  # proposes to stop after step 5
    assert other.should_stop(5) and writer.should_stop(5, publish=True)
    assert (writer.exit_code, other.exit_code) == (143, 143), "the rank that got no signal exits as stopped too"
    assert read_job(store).step == 5
    now[0] = DUPLICATE_S + 0.1
    writer.receive(signal.SIGINT)
    assert exits == [128 + signal.SIGINT]
    alone = StopSignals(None)
    alone.receive(signal.SIGINT)
    assert alone.should_stop(1) and alone.exit_code == 130


def test_resume_needs_a_checkpoint_of_the_same_degrees_short_of_train_steps(tmp_path):
    from ntp_ds.engine.config import ConfigError
    from ntp_ds.run.rundir import check_run_dir

    (tmp_path / "events.jsonl").write_text('{"event": "run_start", "step": 0}\n')
    with pytest.raises(ConfigError, match=r"holds no readable checkpoint to resume from \(checkpoints/latest\)"):
        check_run_dir(tmp_path, "resume", (2, 2), 10)
    ckpt = tmp_path / "checkpoints"
    (ckpt / "global_step6").mkdir(parents=True)
    (ckpt / "latest").write_text("global_step6")
    (ckpt / "global_step6" / "ntp_topology.json").write_text('{"degrees": [2, 1], "global_steps": 6}')
    with pytest.raises(ConfigError, match=r"written by TP degrees \[2, 1\], this config gives \[2, 2\]; set "
                                          r"parallel.degrees=\[2, 1\]"):
        check_run_dir(tmp_path, "resume", (2, 2), 10)
    point = check_run_dir(tmp_path, "resume", (2, 1), 10)
    assert (point.step, point.degrees, point.path) == (6, [2, 1], ckpt)
