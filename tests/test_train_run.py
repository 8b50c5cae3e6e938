"""End to end: `ntp-ds train` -> launcher -> 4 workers at TP degrees (2, 2); rank 3 crashes in step 2 (SIGKILL).

The survivors must recover in memory (replica 1 goes on at TP 1, its lost shard pulled from replica 0, nothing
lost), re-run the interrupted step and finish. The run directory must hold every record, with the recovery event,
the W&B offline run and final weights that load in transformers.
"""

import json

import pytest
import torch

from ntp_ds.goodput import BUCKETS
from ntp_ds.models import Llama
from tests.helpers.cli import ntp_ds
from tests.helpers.wandb_records import GOODPUT_KEYS, read_history

STEPS = 4


JOB = ("recipe=cpu_demo", "parallel.tp=2", "parallel.replicas=2", "parallel.timeout_s=20", f"train.steps={STEPS}",
       "train.global_batch=8", "train.micro_batch=2", "data.seq_len=16", "logging.progress=false")


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("run") / "r"
    result = ntp_ds("train", *JOB, "fault.faults=[{rank:3,step:2,phase:backward,kind:crash}]",
                    f"hydra.run.dir={run_dir}", timeout=240)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    return run_dir, result


def test_a_crashed_rank_is_recovered_in_memory(trained):
    run_dir, result = trained
    assert "injecting crash on rank 3 at step 2, phase backward" in result.stderr
    assert "rank 3 killed by SIGKILL" in result.stderr
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    assert [e["event"] for e in events] == ["run_start", "recovery", "run_end"]
    recovery = events[1]
    assert recovery["step"] == 2 and recovery["dead"] == [3]
    assert recovery["degrees_before"] == [2, 2] and recovery["degrees_after"] == [2, 1]
    assert recovery["lossless"] is True
    assert 0 < recovery["bytes_moved"] == recovery["lost_shard_bytes"]
    assert recovery["faults"] == ["crash on rank 3 at step 2 (backward)"]
    for key in ("detection_s", "recovery_s", "redone_s", "agreement_s", "regroup_s", "reshard_s"):
        assert recovery[key] >= 0
    assert 0 < recovery["failure_to_step_s"] < 20
    # What the recovery rebuilt, counted where it happened: replica 0, which lost nothing, keeps its engines (their
    # ZeRO partitions re-cut in place) and its TP group; rank 2, now replica 1 alone at TP 1, builds an engine; the
    # rest of the new generation's groups are new (the world, replica 1's TP group of one, the DP groups of ranks 0
    # and 1 and the contributor's own, and the two exchange families {0, 2} and {1, 2}).
    assert recovery["engines_rebuilt"] == 1
    assert recovery["communicators_created"] == 7 and recovery["communicators_kept"] == 1
    assert 0 < recovery["healthy_stall_s"] < 20  # replica 0 lost nothing, and waited from the failure to step 2
    assert "recovered at step 2 from the loss of rank 3; TP degrees [2, 2] -> [2, 1]" in result.stderr


def test_run_directory_holds_every_record(trained):
    run_dir, result = trained
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == list(range(1, STEPS + 1))
    assert [m["tp_degree/replica_1"] for m in metrics] == [2, 1, 1, 1]
    assert [m["active_gpu_fraction"] for m in metrics] == [1.0, 0.75, 0.75, 0.75]
    assert all(0 < m["goodput"] <= 1 for m in metrics)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == STEPS and summary["recoveries"] == 1 and summary["faults_scheduled"] == 1
    assert 0 < summary["goodput"] <= 1 and summary["degrees_end"] == [2, 1]
    assert summary["time/detection_s"] + summary["time/recovery_s"] > 0
    assert sum(summary[f"time/{b}_s"] for b in BUCKETS) == pytest.approx(summary["wall_s"])
    assert sorted(p.name for p in (run_dir / "logs").iterdir()) == [f"rank{r}.log" for r in range(4)]
    assert f"done: {STEPS} steps, goodput" in result.stderr
    assert f"loss {summary['first_loss']:.4f} at the first step, {summary['final_loss']:.4f} at the last" in result.stderr
    assert summary["final_loss"] < summary["first_loss"], "the demo's generated language is learnable"
    assert "3 of 4 workers finished successfully" in result.stderr


def test_wandb_offline_run_holds_goodput_keys_and_the_recovery(trained):
    run_dir, _ = trained
    rows = read_history(run_dir)
    steps = [r for r in rows if "goodput" in r]
    assert [r["step"] for r in steps] == list(range(1, STEPS + 1))
    assert GOODPUT_KEYS <= set(steps[-1]) and "loss" in steps[-1]
    (event,) = [r for r in rows if "event/bytes_moved" in r]
    assert event["step"] == 2 and event["event/bytes_moved"] > 0


def test_every_dashboard_panel_plots_a_key_the_run_logs(trained):
    from ntp_ds.goodput.dashboard import build_workspace, plotted_keys

    run_dir, _ = trained
    workspace = build_workspace("offline", "ntp-ds-test", replicas=2)
    logged = {k for row in read_history(run_dir) for k in row}
    keys = plotted_keys(workspace)
    assert len(keys) > 15 and {"goodput", "loss", "tp_degree/replica_1", "active_gpus", "event/recovery_s"} <= keys
    assert keys <= logged, f"plotted but never logged: {sorted(keys - logged)}"


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
    out = capsys.readouterr().out
    assert "[2, 2] -> [2, 1]" in out and "lossless" in out


@pytest.mark.long  # .ci/run: its long stage (and the nccl_model stage where its file runs); README suite under 10 min
def test_report_against_the_failure_free_run_shows_equal_losses(trained, tmp_path, capsys):
    """Under preserve_global_batch the loss over the global batch is the failure-free run's at every step, though the
    writer's replica ran a larger share of the batch after the recovery."""
    from ntp_ds.report import LOSS_OVERLAY
    from ntp_ds.report import main as report

    run_dir, _ = trained
    clean = tmp_path / "clean"
    result = ntp_ds("train", *JOB, "fault=none", "logging.wandb.mode=disabled", "train.save_final=false",
                    "train.save_checkpoint=false", f"hydra.run.dir={clean}", timeout=240)
    assert result.returncode == 0, result.stderr[-5000:]
    assert report([str(run_dir), "--out", str(tmp_path / "timeline.png"), "--against", str(clean)]) == 0
    assert (tmp_path / LOSS_OVERLAY).read_bytes()[:4] == b"\x89PNG"
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if x.startswith("largest |global_loss difference|"))
    assert line.endswith(f"({STEPS} common steps)"), line
    assert float(line.split(": ")[1].split()[0]) <= 1e-5, line
    faulted = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    reference = [json.loads(x) for x in (clean / "metrics.jsonl").read_text().splitlines()]
    assert faulted[0]["loss"] == reference[0]["loss"]
    assert max(abs(a["loss"] - b["loss"]) for a, b in zip(faulted, reference)) > 1e-4  # the replica's own share
    # the failure-free run reads 1.00 of failure-free; the faulted run less, by what its failure cost
    assert json.loads((clean / "summary.json").read_text())["throughput_ratio"] == pytest.approx(1.0)
    assert json.loads((run_dir / "summary.json").read_text())["throughput_ratio"] < 1.0


# -- the Trainer's recovery seam, with fakes (no process group) ---------------------------------------------------
class FakeEngine:
    """Enough of an NTPEngine for the Trainer: a topology, a batch plan, a loss; optionally fails once."""

    def __init__(self, degrees, fail_at_step=None):
        from types import SimpleNamespace

        from ntp_ds.batch import plan_batch

        topology = SimpleNamespace(degrees=tuple(degrees))
        self.ntp_groups = SimpleNamespace(topology=topology, replica=0, tp_rank=0, plan=SimpleNamespace(anchors=(0,)))
        self.batch_plan = plan_batch(tuple(2 / t for t in degrees), 4, 2, "preserve_global_batch")
        self.fail_at_step, self.global_steps, self.saved = fail_at_step, 0, None
        self.job = SimpleNamespace(ntp=SimpleNamespace(straggler=SimpleNamespace(enabled=False)))
        self.on_phase = lambda step, phase: None

    def __call__(self, batch):
        self.on_phase(self.global_steps + 1, "forward")
        return torch.tensor(float(self.global_steps))

    def backward(self, loss):
        if self.fail_at_step == self.global_steps + 1:
            self.fail_at_step = None
            raise ConnectionError("Connection closed by peer")

    def is_gradient_accumulation_boundary(self):
        return True

    def step(self):
        self.global_steps += 1

    def save_pretrained(self, path):
        self.saved = path

    def save_checkpoint(self, path):
        self.checkpoint = (path, self.global_steps)


class FakeRecovery:
    """The live recovery a `FaultTolerantEngine` drives: each recovery goes on at TP degrees (2, 1)."""

    def __init__(self, engine):
        import torch.distributed as dist

        self.engine, self.calls, self.store, self.rank = engine, [], dist.HashStore(), 0
        self.members = None  # the writer is TP rank 0 of the first anchor replica
        self.on_phase = None

    def recover(self, error):
        from types import SimpleNamespace

        self.calls.append(str(error))
        engine = FakeEngine((2, 1))
        engine.global_steps, self.engine = self.engine.global_steps, engine
        return SimpleNamespace(engine=engine, event={"dead": [3], "detection_s": 0.05, "lossless": True,
                                                     "degrees_before": [9], "degrees_after": [9]})

    def at_boundary(self, completed, num_steps=None):
        return None


def fake_trainer(tmp_path, recovery=FakeRecovery, faults=(), injector=None):
    """A Trainer of 3 steps whose engine fails in step 2; under a `FaultTolerantEngine` driving `recovery` (a
    FakeRecovery class), or, with `recovery=None`, on the plain engine."""
    from ntp_ds.fault_tolerant import FaultTolerantEngine
    from ntp_ds.run.config import RunConfig
    from ntp_ds.run.records import RunRecorder
    from ntp_ds.run.trainer import Trainer

    cfg = RunConfig.from_dict({"model": {"name": "tiny", "vocab_size": 32, "hidden_size": 16, "intermediate_size": 32,
                                         "num_hidden_layers": 1, "num_attention_heads": 2},
                               "train": {"steps": 3, "global_batch": 4, "micro_batch": 2},
                               "data": {"seq_len": 8, "size": 64}, "fault": {"faults": list(faults)},
                               "parallel": {"tp": 2, "replicas": 2}})
    ticks = iter(range(10_000))
    engine = FakeEngine((2, 2), fail_at_step=2)
    if recovery is not None:
        engine = FaultTolerantEngine(engine, recovery(engine), injector=injector, stop_on_signals=False)
    return Trainer(cfg, engine, RunRecorder(tmp_path), run_dir=tmp_path, clock=lambda: next(ticks) * 0.1)


def test_recovery_seam_swaps_the_engine_accounts_the_time_and_records_the_event(tmp_path):
    trainer = fake_trainer(tmp_path)
    summary = trainer.train()
    assert trainer.engine.recovery.calls == ["Connection closed by peer"]
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


def test_the_recovery_event_waits_for_the_rerun_step_and_the_injector_follows_the_engine(tmp_path):
    class Injector:
        def __init__(self):
            self.seen = []

        def check(self, step, phase):
            self.seen.append((step, phase))

        def stretch(self, busy_s):
            return 0.0

    injector = Injector()
    trainer = fake_trainer(tmp_path, injector=injector)
    trainer.train()
    assert trainer.engine.on_phase == injector.check, "the recovered engine reports its phases too"
    assert injector.seen and all(phase == "forward" for _, phase in injector.seen)
    events = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    (event,) = [e for e in events if e["event"] == "recovery"]
    assert event["failure_to_step_s"] > 0
    steps = [json.loads(line)["time"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert steps[1] <= event["time"] <= steps[2], "recorded once the interrupted step has completed"


def test_without_recovery_an_error_ends_the_run(tmp_path):
    trainer = fake_trainer(tmp_path, None, faults=[{"rank": 1, "step": 2, "phase": "forward", "kind": "crash"}])
    with pytest.raises(ConnectionError, match="Connection closed by peer"):
        trainer.train()
    events = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    assert [e["event"] for e in events] == ["run_start"]
    assert events[0]["faults"] == [{"rank": 1, "step": 2, "phase": "forward", "kind": "crash"}]


def test_a_rank_that_becomes_the_writer_takes_over_the_records(tmp_path):
    from ntp_ds.run.records import RunRecorder

    switches = []

    def switch_writer(writer):
        switches.append(writer)
        return RunRecorder(tmp_path, resume=True) if writer else RunRecorder(None)

    trainer = fake_trainer(tmp_path)
    trainer.engine.ntp_groups.replica = 1  # starts in a replica that is not the first anchor: not the writer
    trainer.recorder = RunRecorder(None)
    trainer.switch_writer = switch_writer
    trainer.train()
    assert switches == [True]
    metrics = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [2, 3], "the new writer appends from the step it re-ran"
    events = [json.loads(line)["event"] for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    assert events == ["recovery", "run_end"] and (tmp_path / "summary.json").is_file()


class KeptBackwardRecovery(FakeRecovery):
    """A recovery in which this rank's replica (0) kept its finished backward of the interrupted step: the new engine
    runs only the rest of that step (replica 1's samples spread over both replicas), then the step's own plan."""

    def recover(self, error):
        from ntp_ds.batch.planner import pace_costs, resume_plan

        interrupted = self.engine.batch_plan
        outcome = super().recover(error)
        engine, after = outcome.engine, outcome.engine.batch_plan
        engine.batch_plan = resume_plan(interrupted, [0], pace_costs([1.0, 2.0]), 2)
        engine.kept_grads_step = engine.global_steps + 1
        step = engine.step

        def step_then_plan():
            step()
            engine.batch_plan, engine.kept_grads_step = after, None

        engine.step = step_then_plan
        self.plans = (interrupted, engine.batch_plan)
        return outcome


def test_a_replica_that_kept_its_backward_counts_those_micro_batches_losses_in_the_step(tmp_path, monkeypatch):
    """The step's loss is over every sample whose gradients the step applies: the micro-batches run before the
    failure (their backward kept) and the rest run after the recovery, not the rest alone."""
    from ntp_ds.batch.loader import replica_micro_batches

    monkeypatch.setattr(FakeEngine, "__call__", lambda self, batch: batch["input_ids"][:, 0].float().mean())
    trainer = fake_trainer(tmp_path, KeptBackwardRecovery)
    trainer.train()
    interrupted, rest = trainer.engine.recovery.plans
    assert rest.kept == 2 and rest.replicas[0].samples == 1, rest
    firsts = [t for plan in (interrupted, rest)
              for batch in replica_micro_batches(trainer.dataset, trainer.sampler, plan, 0, 1)
              for t in batch["input_ids"][:, 0].tolist()]
    assert len(firsts) == 3
    metrics = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2, 3]
    assert metrics[1]["loss"] == pytest.approx(sum(firsts) / 3)


def test_a_writer_that_loses_the_role_hands_its_records_over(tmp_path):
    from ntp_ds.run.records import RunRecorder

    class Recorder(RunRecorder):
        handed_over = False

        def hand_over(self):
            type(self).handed_over = True
            super().hand_over()

    class Demoting(FakeRecovery):
        def recover(self, error):
            outcome = super().recover(error)
            outcome.engine.ntp_groups.replica = 1
            return outcome

    trainer = fake_trainer(tmp_path, Demoting)
    trainer.recorder = Recorder(tmp_path)
    trainer.switch_writer = lambda writer: RunRecorder(None)
    trainer.train()
    assert Recorder.handed_over and not trainer.recorder.active
    metrics = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1]


def test_a_stop_request_ends_the_run_after_the_agreed_step_with_weights_checkpoint_and_summary(tmp_path):
    class StopAfter:
        signal = None

        def __init__(self, after):
            self.after, self.asked = after, []

        def should_stop(self, completed, publish=False):
            self.asked.append(completed)
            if completed >= self.after:
                self.signal = 15
            return self.signal is not None

    stop = StopAfter(1)
    trainer = fake_trainer(tmp_path, None)
    trainer.engine.fail_at_step = None
    trainer.stop = stop
    summary = trainer.train()
    assert stop.asked == [0, 1], "asked before the first step and after each step, until it stops"
    assert trainer.engine.saved == tmp_path / "final" and trainer.engine.checkpoint == (tmp_path / "checkpoints", 1)
    events = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    assert [e["event"] for e in events] == ["run_start", "run_stopped"]
    assert events[1]["step"] == 1 and events[1]["signal"] == "SIGTERM"
    assert summary["status"] == "stopped" and summary["last_step"] == 1 and summary["stopped_by"] == "SIGTERM"
    assert json.loads((tmp_path / "summary.json").read_text())["status"] == "stopped"


def test_a_worker_that_joins_never_takes_the_records_from_one_that_trained_all_along():
    from types import SimpleNamespace

    from ntp_ds.layout import Topology
    from ntp_ds.run.trainer import is_writer
    from tests.helpers.training import tiny_config

    # Two anchor replicas of TP 2; rank 0 died and launch rank 4 took its place (global rank 0 again).
    topology = Topology.from_degrees(tiny_config().units(), (2, 2))
    members = (4, 1, 2, 3)

    def engine(rank):
        replica, tp_rank = topology.locate(rank)
        return SimpleNamespace(ntp_groups=SimpleNamespace(topology=topology, replica=replica, tp_rank=tp_rank,
                                                          rank=rank, plan=SimpleNamespace(anchors=(0, 1))))

    assert [is_writer(engine(r), members) for r in range(4)] == [False, False, True, False]
    assert [is_writer(engine(r), (0, 1, 2, 3)) for r in range(4)] == [True, False, False, False]
    assert [is_writer(engine(r)) for r in range(4)] == [True, False, False, False]
