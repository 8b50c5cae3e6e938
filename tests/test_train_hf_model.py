"""`ntp-ds train model=hf model.path=DIR`: transformers' Qwen2 from an HF directory, each rank reading its slices,
trained through a crash to the failure-free run's weights; the Qwen2.5-7B recipe's dry run validates."""

import pytest
from safetensors.torch import load_file

from tests.helpers.cli import ntp_ds
from tests.helpers.training import final_weights, tiny_qwen2

JOB = ("model=hf", "parallel.tp=2", "parallel.replicas=2", "parallel.timeout_s=20", "train.steps=6",
       "train.global_batch=8", "train.micro_batch=2", "data.seq_len=16", "logging=disabled",
       "logging.progress=false", "optim.grad_clip=1.0", "train.save_checkpoint=false")


@pytest.mark.long
def test_an_hf_model_from_its_directory_trains_through_a_crash_to_the_failure_free_weights(tmp_path):
    model_dir = tmp_path / "qwen2"
    tiny_qwen2().save_pretrained(model_dir)
    runs = {}
    for name, faults in (("clean", "fault=none"), ("crash", "fault.faults=[{rank:1,step:3,phase:backward,kind:crash}]")):
        run_dir = tmp_path / name
        result = ntp_ds("train", *JOB, f"model.path={model_dir}", faults, f"hydra.run.dir={run_dir}", timeout=240)
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
        runs[name] = (final_weights(run_dir), result.stderr)
    assert "from the loss of rank 1; TP degrees [2, 2] -> [1, 2]" in runs["crash"][1], runs["crash"][1][-3000:]
    clean, crash = runs["clean"][0], runs["crash"][0]
    start = load_file(model_dir / "model.safetensors")
    assert set(clean) == set(crash) == set(start)
    for name, tensor in clean.items():
        diff = (crash[name] - tensor).abs().max().item()
        assert diff <= 1e-4, f"{name}: max abs difference {diff:.3g} from the failure-free run"
    moved = max((tensor - start[name]).abs().max().item() for name, tensor in clean.items())
    assert moved > 1e-3, "training must move the weights for the comparison to mean anything"


@pytest.mark.long  # .ci/run: its long stage (and the nccl_model stage where its file runs); README suite under 10 min
def test_the_qwen2_7b_recipe_dry_run_validates():
    result = ntp_ds("train", "recipe=gpu_qwen2_7b_8gpu", "dry_run=true", timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    out = result.stdout
    assert "model qwen2.5-7b (7.62B parameters, bf16)" in out, out[:600]
    for piece in ("healthy TP 4", "1 GPU lost: TP 3", "replica 1: ranks 4-7 (TP 4, anchor)"):
        assert piece in out, piece


def test_model_path_without_a_config_is_named(tmp_path):
    result = ntp_ds("train", "model=hf", f"model.path={tmp_path}", "dry_run=true", timeout=60)
    assert result.returncode == 2
    assert f"model.path={tmp_path}: no config.json there" in result.stderr
