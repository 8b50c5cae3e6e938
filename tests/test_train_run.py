"""One end-to-end run: `ntp-ds train` -> launcher -> 3 workers at TP degrees (2, 1), 3 steps, a fault scheduled.

Live recovery is not built yet, so the scheduled fault must be reported as not injected and the static topology
must train to the end. The run directory must hold every record, the W&B offline run and loadable final weights.
"""

import json

import pytest
import torch

from ntp_ds.goodput import BUCKETS
from ntp_ds.models import Llama
from tests.test_cli import ntp_ds
from tests.test_wandb_offline import GOODPUT_KEYS, read_history

STEPS = 3


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("run") / "r"
    result = ntp_ds("train", "parallel.tp=2", "parallel.replicas=2", "parallel.degrees=[2,1]", f"train.steps={STEPS}",
                    "train.global_batch=6", "train.micro_batch=2", "data.seq_len=16", "logging.progress=false",
                    "fault.faults=[{rank:2,step:2,phase:backward,kind:crash}]", f"hydra.run.dir={run_dir}",
                    timeout=240)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    return run_dir, result


def test_run_directory_holds_every_record(trained):
    run_dir, result = trained
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2, 3]
    assert all(m["tp_degree/replica_0"] == 2 and m["tp_degree/replica_1"] == 1 for m in metrics)
    assert all(m["active_gpu_fraction"] == 0.75 and 0 < m["goodput"] <= 1 for m in metrics)
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    assert [e["event"] for e in events] == ["run_start", "fault_skipped", "run_end"]
    assert events[1]["rank"] == 2 and events[1]["step"] == 2
    assert "recovery" not in {e["event"] for e in events}
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == STEPS and summary["recoveries"] == 0 and summary["faults_scheduled"] == 1
    assert 0 < summary["goodput"] <= 1 and summary["degrees_end"] == [2, 1]
    assert sorted(p.name for p in (run_dir / "logs").iterdir()) == ["rank0.log", "rank1.log", "rank2.log"]
    assert "live recovery is not available" in result.stderr
    assert "done: 3 steps, goodput" in result.stderr


def test_wandb_offline_run_holds_goodput_keys(trained):
    run_dir, _ = trained
    rows = [r for r in read_history(run_dir) if "goodput" in r]
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert GOODPUT_KEYS <= set(rows[-1]) and "loss" in rows[-1]


def test_final_weights_load_in_transformers(trained):
    transformers = pytest.importorskip("transformers")
    run_dir, _ = trained
    hf = transformers.LlamaForCausalLM.from_pretrained(run_dir / "final")
    ours = Llama.from_pretrained(run_dir / "final")
    ids = torch.randint(0, ours.config.vocab_size, (2, 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, ours(ids), rtol=1e-4, atol=1e-4)
    init = Llama(ours.config, seed=0)
    moved = max((p - q).abs().max().item() for p, q in zip(ours.parameters(), init.parameters()))
    assert moved > 0, "the final weights must be the trained ones"


def test_report_of_the_run(trained, capsys):
    from ntp_ds.report import TIMELINE
    from ntp_ds.report import main as report

    run_dir, _ = trained
    assert report([str(run_dir)]) == 0
    assert (run_dir / TIMELINE).read_bytes()[:4] == b"\x89PNG"
    assert "1 scheduled, not injected" in capsys.readouterr().out


# -- the Trainer's recovery seam, with fakes (no process group) ---------------------------------------------------
class FakeEngine:
    """Enough of an NTPEngine for the Trainer: a topology, a batch plan, a loss; optionally fails once."""

    def __init__(self, degrees, fail_at_step=None):
        from types import SimpleNamespace

        from ntp_ds.batch import plan_batch

        topology = SimpleNamespace(degrees=tuple(degrees))
        self.ntp_groups = SimpleNamespace(topology=topology, replica=0)
        self.batch_plan = plan_batch(tuple(degrees), 2, 4, 2, "preserve_global_batch")
        self.fail_at_step, self.steps, self.saved = fail_at_step, 0, None

    def __call__(self, batch):
        return torch.tensor(float(self.steps))

    def backward(self, loss):
        if self.fail_at_step == self.steps + 1:
            self.fail_at_step = None
            raise RuntimeError("Connection closed by peer")

    def is_gradient_accumulation_boundary(self):
        return True

    def step(self):
        self.steps += 1

    def save_pretrained(self, path):
        self.saved = path


class FakeRecovery:
    def __init__(self):
        self.calls = []

    def recover(self, trainer, step, error):
        from ntp_ds.run.trainer import RecoveryReport

        self.calls.append((step, str(error)))
        engine = FakeEngine((2, 1))
        engine.steps = trainer.engine.steps
        return RecoveryReport(engine=engine, detection_s=0.05, recovery_s=0.2, fields={"lossless": True})


def fake_trainer(tmp_path, recovery, faults=()):
    from ntp_ds.run.config import RunConfig
    from ntp_ds.run.records import RunRecorder
    from ntp_ds.run.trainer import Trainer

    cfg = RunConfig.from_dict({"model": {"name": "tiny", "vocab_size": 32, "hidden_size": 16, "intermediate_size": 32,
                                         "num_hidden_layers": 1, "num_attention_heads": 2},
                               "train": {"steps": 3, "global_batch": 4, "micro_batch": 2},
                               "data": {"seq_len": 8, "size": 64}, "fault": {"faults": list(faults)}})
    ticks = iter(range(10_000))
    return Trainer(cfg, FakeEngine((2, 2), fail_at_step=2), RunRecorder(tmp_path), run_dir=tmp_path,
                   recovery=recovery, clock=lambda: next(ticks) * 0.1)


def test_recovery_seam_swaps_the_engine_accounts_the_time_and_records_the_event(tmp_path):
    recovery = FakeRecovery()
    trainer = fake_trainer(tmp_path, recovery)
    summary = trainer.train()
    assert recovery.calls == [(2, "Connection closed by peer")]
    metrics = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2, 3]
    assert [m["tp_degree/replica_1"] for m in metrics] == [2, 1, 1]
    events = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    (event,) = [e for e in events if e["event"] == "recovery"]
    assert event["step"] == 2 and event["degrees_before"] == [2, 2] and event["degrees_after"] == [2, 1]
    assert event["detection_s"] == pytest.approx(0.05) and event["lossless"] is True
    assert summary["recoveries"] == 1 and summary["degrees_end"] == [2, 1]
    assert summary["time/detection_s"] == pytest.approx(0.05)
    assert summary["time/recovery_s"] > 0 and summary["time/redone_s"] > 0
    assert sum(summary[f"time/{b}_s"] for b in BUCKETS) == pytest.approx(summary["wall_s"])
    assert trainer.engine.saved == tmp_path / "final"


def test_without_recovery_faults_are_skipped_and_an_error_ends_the_run(tmp_path):
    trainer = fake_trainer(tmp_path, None, faults=[{"rank": 1, "step": 2, "phase": "forward", "kind": "crash"}])
    with pytest.raises(RuntimeError, match="Connection closed by peer"):
        trainer.train()
    events = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    assert [e["event"] for e in events] == ["run_start", "fault_skipped"]
