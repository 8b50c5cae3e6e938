"""Every recipe composes and validates; overrides apply in the right order; the GPU recipes pass a dry run."""

import json
import math
import re
from dataclasses import fields
from pathlib import Path

import pytest
import torch

from ntp_ds.batch.loader import GlobalBatchSampler
from ntp_ds.engine.config import ConfigError
from ntp_ds.models import Llama, LlamaConfig
from ntp_ds.run.compose import available_recipes, compose_dict, load_config, recipe_overrides
from ntp_ds.run.config import ModelConfig, generate_deepspeed_config
from ntp_ds.run.records import RUN_CONFIG
from ntp_ds.run.rundir import _check_kept
from ntp_ds.run.dry_run import describe
from ntp_ds.overrides import UsageError

REPO = Path(__file__).resolve().parents[1]
RECIPES = ["cpu_demo", "cpu_failure_matrix", "gpu_1b_8gpu", "gpu_70b_nvl72", "gpu_qwen2_7b_8gpu"]


def validated(argv):
    cfg = load_config(argv)
    cfg.validate()
    return cfg


def test_the_shipped_recipes_are_there():
    assert set(RECIPES) <= set(available_recipes())


@pytest.mark.parametrize("recipe", RECIPES)
def test_every_recipe_composes_and_validates(recipe):
    cfg = validated([f"recipe={recipe}"])
    assert cfg.recipe == recipe
    ds = cfg.ds_config()
    assert ds["train_batch_size"] == cfg.train.global_batch
    assert ds["zero_optimization"]["stage"] == cfg.parallel.zero_stage


def test_default_config_composes():
    cfg = validated([])
    assert (cfg.parallel.tp, cfg.parallel.replicas, cfg.world_size) == (2, 2, 4)
    assert cfg.fault.faults == [] and cfg.logging.wandb.mode == "offline"
    assert cfg.run_dir.startswith("outputs/")


def test_cpu_demo_is_two_replicas_of_tp2_with_a_crash_and_its_repair():
    cfg = validated(["recipe=cpu_demo"])
    assert cfg.parallel.replica_degrees == (2, 2)
    fault, repair = cfg.fault_schedule().faults
    assert fault.kind == "crash" and 0 <= fault.rank < cfg.world_size and 1 <= fault.step <= cfg.train.steps
    assert repair.kind == "repair" and repair.rank == fault.rank and fault.step < repair.step <= cfg.train.steps
    assert cfg.fault_schedule().repairs() == {fault.rank: repair.step}
    assert cfg.logging.wandb.mode == "offline"
    assert cfg.model.name == "tiny"
    assert cfg.parallel.timeout_s == 20.0 and cfg.parallel.ntp().timeout_s == 20.0
    assert cfg.parallel.heartbeat_interval_s < cfg.parallel.heartbeat_timeout_s
    assert cfg.optim.grad_clip == 1.0


def test_readme_overrides_apply(tmp_path):
    cfg = validated(["parallel.tp=2", "parallel.replicas=2", "parallel.zero_stage=1", "fault=none", "train.steps=20",
                     "seed=0", f"hydra.run.dir={tmp_path}"])
    assert (cfg.parallel.tp, cfg.parallel.replicas, cfg.parallel.zero_stage) == (2, 2, 1)
    assert cfg.train.steps == 20 and cfg.seed == 0 and cfg.fault.faults == []
    assert cfg.run_dir == str(tmp_path)
    assert validated([f"run_dir={tmp_path}/x"]).run_dir == f"{tmp_path}/x"


def test_command_line_wins_over_the_recipe():
    cfg = validated(["recipe=cpu_demo", "fault=none", "train.steps=5", "model=tiny", "parallel.degrees=[2,1]"])
    assert cfg.fault.faults == [] and cfg.train.steps == 5
    assert cfg.parallel.replica_degrees == (2, 1) and cfg.world_size == 3
    assert cfg.data.seed == cfg.seed  # data.seed follows seed unless set
    assert validated(["seed=7"]).data.seed == 7


def test_recipe_becomes_group_choices_then_fields():
    overrides = recipe_overrides("gpu_70b_nvl72")
    assert overrides[0] == "model=llama_70b"
    assert "parallel.tp=64" in overrides and "launcher.nnodes=128" in overrides


def test_generated_deepspeed_config():
    cfg = validated(["optim=sgd", "optim.lr=0.5", "train.precision=bf16", "parallel.zero_stage=2",
                     "optim.warmup_steps=10"])
    ds = generate_deepspeed_config(cfg)
    assert ds["optimizer"] == {"type": "SGD", "params": {"lr": 0.5, "momentum": 0.0, "weight_decay": 0.0}}
    assert ds["bf16"] == {"enabled": True} and ds["zero_optimization"] == {"stage": 2}
    assert ds["scheduler"]["params"]["warmup_num_steps"] == 10
    assert validated([]).ds_config()["optimizer"]["params"]["torch_adam"] is True


def test_deepspeed_config_passes_through_whole(tmp_path):
    path = tmp_path / "ds.json"
    ds = {"train_batch_size": 16, "train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": 0},
          "optimizer": {"type": "SGD", "params": {"lr": 0.01}}, "my_key": 1}
    path.write_text(json.dumps(ds))
    assert validated([f"deepspeed_config={path}"]).ds_config() == ds
    path.write_text(json.dumps({**ds, "zero_optimization": {"stage": 3}}))
    with pytest.raises(ConfigError, match="deepspeed_config: zero_optimization.stage=3"):
        validated([f"deepspeed_config={path}"])


@pytest.mark.parametrize("argv, message", [
    (["recipe=nope"], "recipe='nope': no such recipe"),
    (["model=gpt"], "model=gpt: no such option"),
    (["train.steps"], "malformed override 'train.steps'"),
    (["train.stepz=3"], "train.stepz is not a known setting; valid: checkpoint_every, global_batch, "),
    (["train.steps=many"], "train.steps='many' must be an integer"),
    (["parallel.degrees=[2,x]"], "parallel.degrees[1]='x' must be an integer"),
    (["parallel.degrees=2"], "parallel.degrees=2 must be a list"),
    (["parallel.tp=null"], "parallel.tp=null is not allowed: the field is not optional"),
    (["parallel.tp=???"], "parallel.tp is missing (???): give it a value, e.g. parallel.tp=VALUE"),
    (["model.hidden_size=wide"], "model.hidden_size='wide' must be an integer"),
    (["model.hiden_size=64"], "model.hiden_size is not a known setting; valid: head_dim, hidden_size, "),
    (["logging.progress=maybe"], "logging.progress='maybe' must be true or false"),
    (["optim.betas=[0.9,high]"], "optim.betas[1]='high' must be a number"),
    (["parallel.tp=8"], "parallel.tp=8 does not fit model tiny"),
    (["parallel.degrees=[2,3]"], "parallel.degrees[1]=3 must lie in"),
    (["launcher.nproc_per_node=3"], "launcher.nproc_per_node=3"),
    (["fault=one_crash", "parallel.replicas=1"], "fault.faults[0].rank=3 does not exist"),
    (["fault.faults=[{rank:0,step:1,phase:fwd,kind:crash}]"], "fault.faults[0].phase='fwd'"),
    (["fault.faults=[{rank:0,step:50,phase:forward,kind:crash}]"], "fault.faults[0].step=50"),
    (["logging.wandb.mode=loud"], "logging.wandb.mode='loud'"),
    (["train.global_batch=3"], "train.global_batch/micro_batch"),
])
def test_bad_input_names_the_field(argv, message):
    with pytest.raises((UsageError, ConfigError)) as info:
        validated(argv)
    assert message in str(info.value)
    assert "\n" not in str(info.value)


def test_a_key_the_schema_refuses_in_a_recipe_names_the_recipe(tmp_path, monkeypatch):
    (tmp_path / "typo.yaml").write_text("model: tiny\nparallel:\n  tpp: 2\n")
    (tmp_path / "unset.yaml").write_text("train:\n  steps: ???\n")
    monkeypatch.setattr("ntp_ds.run.compose.recipes_dir", lambda: tmp_path)
    with pytest.raises(UsageError, match=r"^parallel.tpp is not a known setting; .* \(in recipe typo\)$"):
        load_config(["recipe=typo"])
    with pytest.raises(UsageError, match=r"^train.steps is missing \(\?\?\?\): .*\(in recipe unset\)$"):
        load_config(["recipe=unset"])
    assert load_config(["recipe=unset", "train.steps=3"]).train.steps == 3


def test_the_model_schema_is_llama_config_plus_a_name_and_a_path():
    assert [f.name for f in fields(ModelConfig)] == ["name", "path"] + [f.name for f in fields(LlamaConfig)]
    cfg = validated(["model=llama_1b"])
    assert cfg.model.llama_config() == LlamaConfig(**{k: v for k, v in cfg.to_dict()["model"].items()
                                                     if k not in ("name", "path")})
    assert cfg.model.path is None and cfg.model.source() == cfg.model.llama_config()


def test_a_run_written_before_the_model_schema_can_be_resumed(tmp_path):
    cfg = validated(["model=tiny"])
    old = cfg.to_dict()
    old["model"] = {k: v for k, v in old["model"].items() if v is not None}  # it wrote only the yaml's keys
    del old["model"]["initializer_range"]
    (tmp_path / RUN_CONFIG).write_text(json.dumps(old))
    _check_kept(tmp_path, "the run dir", cfg.to_dict())
    old["model"]["hidden_size"] = 32
    (tmp_path / RUN_CONFIG).write_text(json.dumps(old))
    with pytest.raises(ConfigError, match="existing_run=resume: model="):
        _check_kept(tmp_path, "the run dir", cfg.to_dict())


def test_world_size_of_the_launcher_must_match():
    cfg = load_config(["parallel.tp=2", "parallel.replicas=2"])
    with pytest.raises(ConfigError, match="needs 4 processes but the launcher started WORLD_SIZE=3"):
        cfg.validate(world_size=3)


@pytest.mark.parametrize("recipe, expect", [
    ("gpu_1b_8gpu", ["llama_1b", "1.24B parameters", "healthy TP 4", "1 GPU lost: TP 3", "at min_tp: TP 2",
                     "replica 1: ranks 4-7"]),
    ("gpu_70b_nvl72", ["llama_70b", "70.55B parameters", "healthy TP 64", "TP 63", "at min_tp: TP 56",
                       "replica 7: ranks 448-511", "128 node(s) x 4", "fits 180 GiB"]),
])
def test_gpu_recipes_dry_run(recipe, expect):
    cfg = validated([f"recipe={recipe}"])
    text = describe(cfg)
    for piece in expect:
        assert piece in text
    assert "DOES NOT FIT" not in text
    # One pace line per degraded degree, tp-1 down to min_tp; work-balanced layouts keep within 3% of t/t'.
    pace = re.compile(r"degraded pace TP(\d+): (\d+\.\d\d)x a healthy rank \(ideal (\d+\.\d{3})x\), "
                      r"share (\d+) of (\d+) samples, step (\d+\.\d{3})x failure-free")
    rows = [pace.fullmatch(line) for line in text.splitlines() if line.startswith("degraded pace TP")]
    assert all(rows), [line for line in text.splitlines() if line.startswith("degraded pace")]
    tp, min_tp, share = cfg.parallel.tp, cfg.parallel.min_tp, cfg.train.global_batch // cfg.parallel.replicas
    assert [int(m[1]) for m in rows] == list(range(tp - 1, min_tp - 1, -1))
    for m in rows:
        degree, ratio, ideal = int(m[1]), float(m[2]), float(m[3])
        assert ideal == round(tp / degree, 3) and ratio <= 1.03 * tp / degree, m[0]
        # The planner's share: at least what the replica finishes in a healthy step, never a healthy share's more;
        # the step it charges is no longer than the degraded replica's own pace on a healthy share.
        samples, step = int(m[4]), float(m[6])
        assert int(m[5]) == share and math.floor(share / (ratio + 0.005)) <= samples <= share, m[0]
        assert 1.0 <= step <= ratio + 0.005, m[0]


def test_composed_dict_has_no_hydra_node():
    data = compose_dict(["hydra.run.dir=/tmp/somewhere"])
    assert "hydra" not in data and data["run_dir"] == "/tmp/somewhere"


def test_cpu_demo_config_learns():
    """The demo's model, data and optimizer, trained in one process: the loss falls far below ln(vocab_size)."""
    cfg = validated(["recipe=cpu_demo"])
    llama, o = cfg.model.llama_config(), cfg.optim
    model = Llama(llama, seed=cfg.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=o.lr, betas=tuple(o.betas), eps=o.eps, weight_decay=o.weight_decay)
    data = cfg.data.dataset(llama.vocab_size)
    sampler = GlobalBatchSampler(len(data), cfg.data.seed)
    losses = []
    for step in range(cfg.train.steps):
        items = [data[i] for i in sampler.indices(step, cfg.train.global_batch)]
        loss = model(torch.stack([it["input_ids"] for it in items]), labels=torch.stack([it["labels"] for it in items]))
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), o.grad_clip)
        opt.step()
        losses.append(loss.item())
    assert abs(losses[0] - math.log(llama.vocab_size)) < 0.1
    assert losses[-1] < losses[0] - 1.5, f"loss {losses[0]:.3f} -> {losses[-1]:.3f}"
