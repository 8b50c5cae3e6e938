"""`ntp-ds report RUN_DIR` draws the goodput timeline PNG and prints the summary table; `--against OTHER_RUN`
overlays the two runs' loss curves and prints their largest loss difference."""

import math
import re

from ntp_ds.cli import main as cli
from ntp_ds.goodput import GoodputMeter, StepTiming
from ntp_ds.report import LOSS_OVERLAY, TIMELINE, loss_difference, loss_key, summary_table
from ntp_ds.run.records import RunRecorder, read_run

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def fake_run(run_dir, finished=True, join=False):
    """A run of 6 steps in which replica 1 drops from TP 2 to TP 1 after a failure at step 4 (and, with `join`, a
    repaired worker joins it back at the boundary after step 5)."""
    recorder = RunRecorder(run_dir)
    meter = GoodputMeter(allocated_gpus=4, healthy_tp=2)
    recorder.event("run_start", 0, degrees=[2, 2])
    for step in range(1, 7):
        degrees = (2, 2) if step < 4 or (join and step == 6) else (2, 1)
        if join and step == 6:
            meter.record_lost("recovery", 0.5, active_gpus=4)
            recorder.event("join", 5, degrees_before=[2, 1], degrees_after=[2, 2], grow_s=0.5,
                           boundary_to_step_s=1.5)
        if step == 4:
            recorder.event("failure", 4, rank=3, kind="crash")
            meter.record_lost("detection", 0.2, active_gpus=3)
            meter.record_lost("recovery", 0.8, active_gpus=3)
            recorder.event("recovery", 4, detection_s=0.2, recovery_s=0.8, redone_s=0.0, degrees_after=[2, 1])
        recorder.step({**meter.record_step(StepTiming(step, 1.0, 0.8, 0.1, 256 * sum(degrees), degrees)),
                       "loss": 6.0 - step / 10})
    if finished:
        recorder.finish({**meter.summary(), "final_loss": 5.4, "model": "tiny", "final_weights": str(run_dir / "final")})
    else:
        recorder.close()


def test_report_writes_a_png_and_a_table(tmp_path, capsys):
    fake_run(tmp_path)
    assert cli(["report", str(tmp_path)]) == 0
    png = tmp_path / TIMELINE
    assert png.read_bytes()[:8] == PNG_MAGIC and png.stat().st_size > 10_000
    out = capsys.readouterr().out
    for piece in ("goodput", "tokens/s", "[2, 2] -> [2, 1]", "final loss", str(png)):
        assert piece in out
    assert re.search(r"^recoveries +1$", out, re.MULTILINE)


def test_report_marks_joins_as_well_as_recoveries(tmp_path, capsys):
    fake_run(tmp_path, join=True)
    assert cli(["report", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert re.search(r"^recoveries +1$", out, re.MULTILINE) and re.search(r"^joins +1$", out, re.MULTILINE)
    assert re.search(r"^  join at step 5 +TP \[2, 1\] -> \[2, 2\], 1.50 s from the boundary", out, re.MULTILINE)
    # the run lost 1.5 s (detection, recovery, the join) and its degraded steps 4 and 5 took 1 s for 3/4 of a
    # healthy step's tokens: 7.5 s of wall, of which 7.5 - 1.5 - 2 x 0.25 would have been enough without failures
    assert re.search(r"^of failure-free +0.73 ", out, re.MULTILINE)


def test_report_to_another_path_and_of_an_unfinished_run(tmp_path, capsys):
    fake_run(tmp_path / "run", finished=False)
    out = tmp_path / "plots" / "t.png"
    assert cli(["report", str(tmp_path / "run"), "--out", str(out)]) == 0
    assert out.read_bytes()[:8] == PNG_MAGIC
    assert "unfinished" in capsys.readouterr().out


def test_summary_table_without_summary_uses_the_last_step(tmp_path):
    fake_run(tmp_path, finished=False)
    metrics, events, summary = read_run(tmp_path)
    assert summary == {}
    table = summary_table(metrics, events, summary, tmp_path)
    assert re.search(r"^steps +6$", table, re.MULTILINE) and re.search(r"^recoveries +1$", table, re.MULTILINE)


def test_report_of_a_directory_without_a_run(tmp_path, capsys):
    assert cli(["report", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "holds no step in metrics.jsonl" in err
    assert cli(["report", str(tmp_path / "missing")]) == 2


def test_report_reads_damaged_records_and_says_what_it_skipped(tmp_path, capsys):
    fake_run(tmp_path)
    summary = tmp_path / "summary.json"
    summary.write_text(summary.read_text()[:40])  # truncated
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 7, "goodp\n[1, 2]\n')
    assert cli(["report", str(tmp_path)]) == 0
    captured = capsys.readouterr()
    warnings = captured.err.strip().splitlines()
    assert len(warnings) == 2 and "Traceback" not in captured.err, captured.err
    assert warnings[0].startswith("ntp-ds report: warning: metrics.jsonl: skipped 2 damaged lines (lines 7, 8 of 8)")
    assert warnings[1].startswith("ntp-ds report: warning: summary.json is damaged (")
    assert "unfinished" in captured.out and re.search(r"^steps +6$", captured.out, re.MULTILINE)


def reference_run(run_dir, losses: dict):
    """A failure-free run that recorded `losses` ({step: loss})."""
    recorder = RunRecorder(run_dir)
    meter = GoodputMeter(allocated_gpus=4, healthy_tp=2)
    recorder.event("run_start", 0, degrees=[2, 2])
    for step, loss in sorted(losses.items()):
        recorder.step({**meter.record_step(StepTiming(step, 1.0, 0.8, 0.1, 1024, (2, 2))), "loss": loss})
    recorder.finish({**meter.summary(), "final_loss": losses[max(losses)], "model": "tiny"})


def test_report_against_a_failure_free_run_overlays_the_losses(tmp_path, capsys):
    fake_run(tmp_path / "faulted")  # loss 6.0 - step / 10 at steps 1-6, a recovery at step 4
    losses = {step: 6.0 - step / 10 for step in range(1, 6)}
    losses[5] += 0.25
    reference_run(tmp_path / "reference", losses)
    out = tmp_path / "plots" / "timeline.png"
    assert cli(["report", str(tmp_path / "faulted"), "--out", str(out), "--against", str(tmp_path / "reference")]) == 0
    overlay = out.parent / LOSS_OVERLAY
    assert overlay.read_bytes()[:8] == PNG_MAGIC and overlay.stat().st_size > 10_000
    printed = capsys.readouterr().out
    assert f"loss overlay: {overlay}" in printed
    assert f"largest |loss difference| against {tmp_path / 'reference'}: 0.25 at step 5 (5 common steps)" in printed


def test_loss_difference_at_common_steps(tmp_path):
    fake_run(tmp_path / "a")
    fake_run(tmp_path / "b")
    a, b = read_run(tmp_path / "a")[0], read_run(tmp_path / "b")[0]
    assert loss_difference(a, b) == (0.0, 1, 6)
    later = [{**m, "loss": m["loss"] + 1.0} for m in b if m["step"] > 2]
    largest, step, common = loss_difference(a, later)
    assert (round(largest, 12), common) == (1.0, 4) and step in (3, 4, 5, 6)
    largest, step, common = loss_difference(a, [{**m, "step": m["step"] + 10} for m in b])
    assert math.isnan(largest) and (step, common) == (None, 0)


def test_report_against_a_directory_without_a_run(tmp_path, capsys):
    fake_run(tmp_path / "run")
    (tmp_path / "empty").mkdir()
    for other in ("empty", "missing"):
        assert cli(["report", str(tmp_path / "run"), "--against", str(tmp_path / other)]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("ntp-ds report: error: --against=")
    assert not (tmp_path / "run" / LOSS_OVERLAY).exists()


def test_runs_are_compared_on_the_global_batch_loss_when_both_recorded_it(tmp_path):
    fake_run(tmp_path / "a")
    a = read_run(tmp_path / "a")[0]
    with_global = [{**m, "global_loss": m["loss"] + 0.5} for m in a]
    assert loss_key(a, with_global) == "loss"
    assert loss_key(with_global, [{**m, "global_loss": m["loss"]} for m in a]) == "global_loss"
    largest, _, common = loss_difference(with_global, [{**m, "global_loss": m["loss"]} for m in a], "global_loss")
    assert (round(largest, 12), common) == (0.5, 6)
