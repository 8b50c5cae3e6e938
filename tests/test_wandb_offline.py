"""The W&B offline run holds the goodput keys, read back from its .wandb file with no network.

wandb writes an offline run as `run-*.wandb`: protobuf `Record`s in LevelDB-log framing (a 7-byte file header, then
32 KiB blocks of records with 7-byte headers crc32c(4) length(2) type(1); FULL=1, FIRST=2, MIDDLE=3, LAST=4). wandb
ships no reader for it, so this file has a small one.
"""

import json

from ntp_ds.goodput import GoodputMeter, StepTiming
from ntp_ds.goodput.wandb_log import WandbLogger
from ntp_ds.run.records import RunRecorder
from tests.helpers.wandb_records import GOODPUT_KEYS, read_history


def test_offline_run_holds_goodput_keys_and_events(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    logger = WandbLogger(mode="offline", project="ntp-ds-test", entity=None, name="t", tags=["test"],
                         run_dir=tmp_path, config={"parallel": {"tp": 2}})
    recorder = RunRecorder(tmp_path, logger)
    meter = GoodputMeter(allocated_gpus=4, healthy_tp=2)
    for step in range(1, 4):
        degrees = (2, 2) if step < 3 else (2, 1)
        metrics = meter.record_step(StepTiming(step, 1.0, 0.7, 0.2, 512, degrees))
        recorder.step({**metrics, "loss": 5.0 - step})
    recorder.event("recovery", 3, detection_s=0.25, recovery_s=1.5, redone_s=0.5, degrees_before=[2, 2],
                   degrees_after=[2, 1])
    recorder.finish({**meter.summary(), "final_loss": 2.0})

    rows = read_history(tmp_path)
    steps = [r for r in rows if "goodput" in r]
    assert [r["step"] for r in steps] == [1, 2, 3]
    assert GOODPUT_KEYS <= set(steps[-1])
    assert steps[-1]["tp_degree/replica_1"] == 1
    assert steps[-1]["active_gpu_fraction"] == 0.75
    events = [r for r in rows if "event/recovery_s" in r]
    assert events and events[0]["event/recovery_s"] == 1.5 and events[0]["step"] == 3
    # the same records on disk
    assert (tmp_path / "summary.json").is_file()
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 3 and json.loads(lines[-1])["goodput"] == steps[-1]["goodput"]
    assert json.loads((tmp_path / "events.jsonl").read_text())["event"] == "recovery"


def test_disabled_mode_writes_no_wandb_files(tmp_path):
    logger = WandbLogger(mode="disabled", project="p", entity=None, name="n", tags=[], run_dir=tmp_path, config={})
    assert not logger.enabled
    recorder = RunRecorder(tmp_path, logger)
    recorder.step({"step": 1, "goodput": 0.5})
    recorder.finish({"goodput": 0.5})
    assert not (tmp_path / "wandb").exists()
    assert (tmp_path / "metrics.jsonl").read_text().count("\n") == 1


def test_dashboard_lists_its_panels_offline_and_push_needs_an_entity(capsys):
    from ntp_ds.goodput.dashboard import main

    assert main(["--replicas", "2"]) == 0
    out = capsys.readouterr().out
    assert "TP degree per replica (0: dropped): tp_degree/replica_0, tp_degree/replica_1\n" in out
    assert "Bytes moved against the lost shard: event/bytes_moved, event/lost_shard_bytes" in out
    assert main(["--push"]) == 2 and "--push needs --entity" in capsys.readouterr().err
    assert main(["--replicas", "0"]) == 2
