"""The `ntp-ds` command: help, dispatch, one-line errors with exit status 2, the launcher and other launchers."""

import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from ntp_ds.cli import COMMANDS
from ntp_ds.cli import main as cli
from ntp_ds.run.compose import strip_launcher_args
from tests.helpers.cli import REPO, ntp_ds, run


def test_help_lists_every_command(capsys):
    assert cli(["--help"]) == 0
    out = capsys.readouterr().out
    for command in COMMANDS:
        assert f"  {command} " in out
    assert "ntp-ds train recipe=cpu_demo" in out


@pytest.mark.parametrize("command, expect", [("train", "recipe=NAME"), ("launch", "--nproc-per-node"),
                                             ("simulate", "usage: ntp-ds simulate"), ("report", "RUN_DIR"),
                                             ("inject", "--store")])
def test_command_help(command, expect, capsys):
    assert cli([command, "--help"]) == 0
    assert expect in capsys.readouterr().out


def test_unknown_command_and_missing_module(capsys, monkeypatch):
    assert cli(["trian"]) == 2
    assert "unknown command 'trian'" in capsys.readouterr().err
    monkeypatch.setitem(COMMANDS, "inject", "ntp_ds.control.not_built_yet")
    assert cli(["inject", "--rank", "1"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "not available in this build" in err


@pytest.mark.parametrize("args, env, field", [
    (["recipe=no_such_recipe"], None, "recipe='no_such_recipe'"),
    (["train.steps"], None, "malformed override 'train.steps'"),
    (["parallel.tp=2", "parallel.replicas=2", "launcher.nproc_per_node=3"], None, "launcher.nproc_per_node=3"),
    (["parallel.tp=2", "parallel.replicas=2"], {"RANK": "0", "WORLD_SIZE": "3", "LOCAL_RANK": "0"},
     "WORLD_SIZE=3"),
    (["fault=one_crash", "parallel.replicas=1"], None, "fault.faults[0].rank=3"),
    (["parallel.heartbeat_interval_s=5"], None, "parallel.heartbeat_interval_s=5.0 must be smaller"),
    (["parallel.timeout_s=0"], None, "parallel.timeout_s=0.0 must be positive"),
    (["parallel.heartbeat_timeout_s=1.5"], {"NTP_NODE_SIZE": "8", "WORLD_SIZE": "200000"},
     "parallel.heartbeat_timeout_s=1.5 must be longer than two of the launchers' periods"),
    (["parallel.control_fanout=1"], None, "parallel.control_fanout=1 must be at least 2"),
    (["train.precision=bf16", "parallel.zero_stage=0"], None, "parallel.zero_stage=0 with train.precision=bf16"),
])
def test_bad_input_is_one_line_and_exit_2(args, env, field):
    result = ntp_ds("train", *args, env=env)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    assert lines[0].startswith("ntp-ds train: error: ") and field in lines[0]


@pytest.mark.parametrize("command, arg, expect", [
    ("train", "train.steps=many", "train.steps='many' must be an integer"),
    ("train", "parallel.tpp=2", "parallel.tpp is not a known setting; valid: batch_policy, bucket_size, control_fanout, degrees"),
    ("train", "parallel.tp=???", "parallel.tp is missing (???): give it a value, e.g. parallel.tp=VALUE"),
    ("simulate", "sim.cluster.tp=abc", "sim.cluster.tp='abc' must be an integer"),
    ("simulate", "sim.cluster.tpp=8", "sim.cluster.tpp is not a known setting; valid: domain_size, hot_spares"),
    ("simulate", "sim.cluster.tp=???", "sim.cluster.tp is missing (???): give it a value"),
])
def test_the_schema_refuses_a_bad_override_in_one_line_naming_the_field(command, arg, expect, tmp_path):
    """Wrong type, unknown key, missing value: OmegaConf's checks against the registered schema, worded as one line."""
    result = ntp_ds(command, arg, f"{'out' if command == 'simulate' else 'run_dir'}={tmp_path / 'x'}")
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    assert lines[0].startswith(f"ntp-ds {command}: error: {expect}"), lines[0]
    assert not (tmp_path / "x").exists()


def test_deepspeed_local_rank_argument_is_stripped(monkeypatch):
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    assert strip_launcher_args(["--local_rank=1", "recipe=cpu_demo"]) == ["recipe=cpu_demo"]
    assert os.environ["LOCAL_RANK"] == "1"
    assert strip_launcher_args(["a=1", "--local-rank", "2", "b=2"]) == ["a=1", "b=2"]


@pytest.mark.skipif(shutil.which("deepspeed") is None, reason="deepspeed launcher not on PATH")
@pytest.mark.long  # .ci/run: its long stage (and the nccl_model stage where its file runs); README suite under 10 min
def test_deepspeed_launcher_runs_the_train_module():
    result = run(["deepspeed", "--num_gpus", "1", "--module", "ntp_ds.train", "recipe=gpu_1b_8gpu", "dry_run=true"],
                 timeout=120)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert "dry run: recipe gpu_1b_8gpu" in result.stdout


@pytest.mark.skipif(shutil.which("torchrun") is None, reason="torchrun not on PATH")
@pytest.mark.long  # .ci/run: its long stage (and the nccl_model stage where its file runs); README suite under 10 min
def test_torchrun_runs_the_train_module():
    result = run(["torchrun", "--nproc-per-node", "1", "-m", "ntp_ds.train", "recipe=cpu_demo", "dry_run=true"],
                 timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "group layout" in result.stdout


def test_dry_run_starts_nothing():
    result = ntp_ds("train", "recipe=gpu_70b_nvl72", "dry_run=true")
    assert result.returncode == 0, result.stderr
    for piece in ("70.55B parameters", "healthy TP 64", "1 GPU lost: TP 63", "group layout", "replica 7"):
        assert piece in result.stdout


WORKER = textwrap.dedent("""
    import os, signal, sys, time
    from pathlib import Path
    from ntp_ds.control.liveness_store import read_exits
    from ntp_ds.control.store import connect_from_env

    rank, out = int(os.environ["RANK"]), Path(sys.argv[1])
    store = connect_from_env(10)
    store.set(f"hello/{rank}", os.environ["WORLD_SIZE"])
    if sys.argv[2] == "all_fail":
        sys.exit(5)
    if rank == 1:
        sys.exit(3)
    if rank == 2:
        os.kill(os.getpid(), signal.SIGKILL)
    deadline = time.monotonic() + 20
    while len(read_exits(store)) < 2 and time.monotonic() < deadline:  # outlive the others' deaths
        time.sleep(0.05)
    exits = read_exits(store)
    out.joinpath(f"rank{rank}.done").write_text(f"{os.environ['LOCAL_RANK']} {sorted(exits)} {exits.get(2, '')}")
""")


def test_launcher_keeps_survivors_running(tmp_path):
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    result = ntp_ds("launch", "--nproc-per-node", "3", str(script), str(tmp_path), "some_fail", timeout=90)
    assert result.returncode == 0, result.stderr
    assert "rank 1 exited with code 3" in result.stderr
    assert "rank 2 killed by SIGKILL" in result.stderr
    assert "1 of 3 workers finished successfully" in result.stderr
    assert (tmp_path / "rank0.done").read_text() == "0 [1, 2] killed by SIGKILL"


def test_launcher_fails_when_no_worker_finishes(tmp_path):
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    result = ntp_ds("launch", "--nproc-per-node", "2", str(script), str(tmp_path), "all_fail", timeout=90)
    assert result.returncode == 5
    assert "0 of 2 workers finished successfully" in result.stderr


def test_launcher_usage_errors(capsys):
    assert cli(["launch", "--nproc-per-node", "2"]) == 2
    assert "nothing to launch" in capsys.readouterr().err
    assert cli(["launch", "--nnodes", "2", "-m", "ntp_ds.train"]) == 2
    assert "--store is required" in capsys.readouterr().err
    assert cli(["launch", "--store", "nohost", "-m", "ntp_ds.train"]) == 2
    assert "--store:" in capsys.readouterr().err


def test_launcher_kills_a_stopped_worker_once_the_others_are_done(tmp_path):
    script = tmp_path / "worker.py"
    script.write_text("import os, signal\nif os.environ['RANK'] == '1':\n    os.kill(os.getpid(), signal.SIGSTOP)\n")
    result = ntp_ds("launch", "--nproc-per-node", "2", str(script), timeout=60)
    assert result.returncode == 0, result.stderr
    assert "rank 1 stopped (SIGSTOP) while the others are done; killing it" in result.stderr
    assert "rank 1 killed by SIGKILL" in result.stderr


def test_bare_command_is_a_usage_error(capsys):
    assert cli([]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "give a command: train, launch, inject, simulate, report" in err


def test_launcher_passes_a_stop_signal_on_and_kills_workers_that_outlast_the_grace(tmp_path):
    script = tmp_path / "worker.py"
    script.write_text(textwrap.dedent("""
        import os, signal, sys, time
        from pathlib import Path
        rank = os.environ["RANK"]
        if rank == "0":
            signal.signal(signal.SIGTERM, lambda s, f: (Path(sys.argv[1], "got").write_text(str(s)), sys.exit(143)))
        else:
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
        Path(sys.argv[1], f"ready{rank}").write_text("")
        time.sleep(60)
    """))
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "ntp_ds.cli", "launch", "--nproc-per-node", "2", "--grace-s", "1",
                             str(script), str(tmp_path)], stderr=subprocess.PIPE, text=True, env=env,
                            start_new_session=True)
    try:
        deadline = time.monotonic() + 30
        while not ((tmp_path / "ready0").exists() and (tmp_path / "ready1").exists()):
            assert time.monotonic() < deadline and proc.poll() is None
            time.sleep(0.02)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=20)
    finally:
        os.killpg(proc.pid, signal.SIGKILL) if proc.poll() is None else None
    assert proc.returncode == 143, err
    assert (tmp_path / "got").read_text() == str(int(signal.SIGTERM)), "the signal reaches the worker"
    assert "did not stop within --grace-s=1 s; killing them" in err
    assert "rank 1 killed by SIGKILL" in err and "1 of 2 workers stopped cleanly" in err


def test_a_repair_both_scheduled_and_sent_starts_one_replacement():
    import torch.distributed as dist

    from ntp_ds.control.faults import Fault, send_fault
    from ntp_ds.supervise.launch import _Repairs

    store = dist.HashStore()
    repairs = _Repairs(store, {3: 9}, poll_s=0.0)
    assert repairs.due({}) == []
    assert repairs.due({3: -9}) == [(3, 9)]
    send_fault(store, Fault(rank=3, step=9, phase="boundary", kind="repair"))  # the job's rank 0 sends it too
    assert repairs.due({3: -9}) == [] and repairs.due({3: -9}) == []
    other = _Repairs(store, {}, poll_s=0.0)  # a launcher that learns of the repair from the store alone
    assert other.due({3: -9}) == [(3, 9)]
