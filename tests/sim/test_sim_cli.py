"""`ntp-ds simulate` through ``ntp_ds.sim.cli.main``: outputs and bad input."""
from __future__ import annotations

import csv
from pathlib import Path

import pytest
import yaml

from ntp_ds.overrides import config_dir, flatten, recipes_dir
from ntp_ds.sim import SimConfig
from ntp_ds.sim.cli import main
from ntp_ds.sim.runspec import load_config

REPO = Path(__file__).resolve().parents[2]
# keep CLI runs small: 2048 GPUs, 5 days, a short sweep
FAST = ["sim.cluster.num_gpus=2048", "sim.duration_days=5", "sim.timeline_points=121",
        "sim.sweep.failed_fractions=[0.0,0.01]", "sim.sweep.trials=1"]


def _rows(path: Path) -> list[dict]:
    with path.open() as fh:
        return list(csv.DictReader(fh))


def _header(path: Path) -> list[str]:
    with path.open() as fh:
        return next(csv.reader(fh))


def test_config_and_recipe_dirs_are_the_repo_ones():
    assert config_dir() == REPO / "conf"
    assert (config_dir() / "simulate.yaml").is_file()
    assert (recipes_dir() / "sim" / "paper_eval.yaml").is_file()


def test_default_yaml_mirrors_the_dataclass_defaults():
    data = yaml.safe_load((config_dir() / "sim" / "default.yaml").read_text())
    assert SimConfig.from_dict(data) == SimConfig()


def test_help_prints_usage(capsys):
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    assert "usage: ntp-ds simulate" in out and "paper_eval" in out


def test_run_writes_csvs_and_plots(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(FAST + [f"out={out}"]) == 0
    loss = out / "loss_vs_failures.csv"
    assert _header(loss) == ["policy", "tp", "failed_fraction", "throughput_loss",
                             "throughput_loss_p5", "throughput_loss_p95"]
    rows = _rows(loss)
    assert {r["policy"] for r in rows} == {"dp_drop", "ntp", "ntp_pw", "ckpt_restart"}
    assert {int(r["tp"]) for r in rows} == {4, 8}
    assert {float(r["failed_fraction"]) for r in rows} == {0.0, 0.01}
    assert all(0.0 <= float(r["throughput_loss"]) <= 1.0 for r in rows)
    zero = [float(r["throughput_loss"]) for r in rows
            if float(r["failed_fraction"]) == 0 and r["policy"] != "ckpt_restart"]
    assert zero == [0.0] * len(zero)
    spares = out / "spares.csv"
    assert _header(spares)[:2] == ["policy", "spare_domains_needed"]
    need = {r["policy"]: int(r["spare_domains_needed"]) for r in _rows(spares)}
    assert set(need) == {"dp_drop", "ntp", "ntp_pw", "ckpt_restart"}
    assert need["ntp_pw"] <= need["ntp"] <= need["dp_drop"]
    good = {r["policy"]: float(r["goodput"]) for r in _rows(out / "goodput.csv")}
    assert good["ckpt_restart"] < good["dp_drop"] <= good["ntp"] + 1e-9 < good["ntp_pw"] + 2e-9
    assert len(_rows(out / "timeline.csv")) == 120
    # one seed: the band collapses onto the median
    for r in _rows(out / "goodput.csv"):
        assert r["goodput_p5"] == r["goodput"] == r["goodput_p95"] and r["seeds"] == "1"
    for name in ("loss_vs_failures", "goodput_timeline", "spares", "summary"):
        png = (out / f"{name}.png").read_bytes()
        assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 5000
    printed = capsys.readouterr().out
    assert "2048 GPUs" in printed and "NTP-PW" in printed and "goodput" in printed


def test_recipe_is_merged_and_command_line_wins():
    cfg, out = load_config(["recipe=paper_eval", "sim.cluster.tp=16", "sim.ntp.min_tp=14",
                            "sim.model.tokens_per_batch=33554432", "out=x", "seed=3"])
    recipe = yaml.safe_load((recipes_dir() / "sim" / "paper_eval.yaml").read_text())
    assert cfg.cluster.num_gpus == recipe["cluster"]["num_gpus"] == 32768
    assert cfg.cluster.domain_size == 32 and cfg.model.hidden == 20480
    assert cfg.failures.hw_fraction == 0.78 and cfg.ntp.tp_step == recipe["ntp"]["tp_step"]
    assert cfg.cluster.tp == 16            # the override beats the recipe
    assert cfg.seed == 3 and out == Path("x")
    assert cfg.hardware.dp_overlap == SimConfig().hardware.dp_overlap  # untouched default


def test_paper_eval_recipe_runs(tmp_path, capsys):
    out = tmp_path / "paper"
    argv = ["recipe=paper_eval", "sim.duration_days=3", "sim.sweep.trials=1",
            "sim.timeline_points=73", f"out={out}"]
    assert main(argv) == 0
    rows = _rows(out / "loss_vs_failures.csv")
    assert {int(r["tp"]) for r in rows} == {8, 16, 32}
    printed = capsys.readouterr().out
    assert "32768 GPUs, 1024 x NVL32, TP32" in printed


def test_flatten_round_trips_through_hydra():
    data = {"failures": {"trace": "it's a \\path\\'q\\", "hw_repair_hours": [2e-05, 1.5]},
            "ntp": {"rebalance": False}, "sweep": {"tp_degrees": []}}
    flat = flatten(data, "sim.")
    assert "sim.ntp.rebalance=false" in flat and "sim.sweep.tp_degrees=[]" in flat
    cfg, _ = load_config(flat)
    assert cfg.failures.trace == "it's a \\path\\'q\\"
    assert cfg.failures.hw_repair_hours == [2e-05, 1.5]
    assert cfg.ntp.rebalance is False and cfg.sweep.tp_degrees == []


@pytest.mark.parametrize("argv,needles", [
    (["recipe=nope"], ["recipe", "nope", "paper_eval"]),
    (["sim.cluster.tp"], ["malformed", "sim.cluster.tp"]),
    (["sim.cluster.tp=[1,"], ["malformed", "sim.cluster.tp"]),
    (["=3"], ["malformed"]),
    (["sim.cluster.foo=1"], ["sim.cluster.foo", "not a known setting", "domain_size"]),
    (["bogus=1"], ["bogus", "not a known setting"]),
    (["sim.cluster.tp=16"], ["sim.cluster.tp", "16", "domain_size"]),
    (["sim.cluster.tp=abc"], ["sim.cluster.tp='abc' must be an integer"]),
    (["sim.cluster.tp=???"], ["sim.cluster.tp is missing (???)"]),
    (["sim.failures.hw_repair_hours=[1,x]"], ["sim.failures.hw_repair_hours[1]='x' must be a number"]),
    (["sim.ntp.rebalance=maybe"], ["sim.ntp.rebalance='maybe' must be true or false"]),
    (["sim.cluster=8"], ["sim.cluster=8 must be a mapping"]),
    (["seeds=many"], ["seeds='many' must be an integer"]),
    (["sim.seed=3"], ["sim.seed", "seed=N"]),
    (["sim.failures.hw_fraction=1.5"], ["sim.failures.hw_fraction", "1.5"]),
    (["sim.ntp.min_tp=9"], ["sim.ntp.min_tp", "9"]),
    (["seed=-1"], ["seed", "-1"]),
    (["+sim.extra=1"], ["sim.extra"]),
    (["sim.failures.model=trace", "sim.failures.trace=/no/such.csv"],
     ["sim.failures.trace", "/no/such.csv"]),
    (["seeds=0"], ["seeds", "0"]),
    (["workers=-1"], ["workers", "-1"]),
    (["calibrate=/no/such/run"], ["calibrate", "/no/such/run"]),
    (["sim.cluster.tp=4,8"], ["sim.cluster.tp=4,8", "-m"]),
    (["sim.failures.gpu_mtbf_hours=0"], ["sim.failures.gpu_mtbf_hours", "inf"]),
    (["sim.model.tokens_per_batch=8192"], ["sim.model.tokens_per_batch", "sequences"]),
    (["sim.ntp.batch_granularity=lumpy"], ["sim.ntp.batch_granularity", "fluid"]),
    (["sim.cluster.hot_spares=8"], ["sim.cluster.hot_spares", "8"]),
    (["recipe=nvl72_hot_spares", "sim.spares.domains=4"], ["sim.spares.domains", "hot_spares"]),
])
def test_bad_input_is_one_line_and_exit_2(argv, needles, tmp_path, capsys):
    assert main(argv + [f"out={tmp_path / 'x'}"]) == 2
    captured = capsys.readouterr()
    err = captured.err.strip()
    assert len(err.splitlines()) == 1, err
    assert "Traceback" not in captured.err + captured.out
    for needle in needles:
        assert needle in err, (needle, err)
    assert not (tmp_path / "x").exists()


def test_a_key_the_schema_refuses_in_a_recipe_names_the_recipe(tmp_path, monkeypatch, capsys):
    (tmp_path / "sim").mkdir()
    (tmp_path / "sim" / "typo.yaml").write_text("cluster:\n  tpp: 8\n")
    (tmp_path / "sim" / "unset.yaml").write_text("cluster:\n  tp: ???\n")
    monkeypatch.setattr("ntp_ds.sim.runspec.recipes_dir", lambda: tmp_path)
    assert main(["recipe=typo", f"out={tmp_path / 'x'}"]) == 2
    assert capsys.readouterr().err.strip().endswith("sim.cluster.tpp is not a known setting; valid: domain_size, "
                                                   "hot_spares, microbatches, num_gpus, pp, tp (in recipe typo)")
    assert main(["recipe=unset", f"out={tmp_path / 'x'}"]) == 2
    err = capsys.readouterr().err.strip()
    assert "sim.cluster.tp is missing (???)" in err and err.endswith("(in recipe unset)")
    cfg, _ = load_config(["recipe=unset", "sim.cluster.tp=8"])
    assert cfg.cluster.tp == 8
