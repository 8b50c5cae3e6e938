"""examples/train_hf.py, a DeepSpeed user's script on the fault-tolerant loop, end to end under `ntp-ds launch`:
a small HF Qwen2 on a token file, 2 replicas x TP 2, a crash and its repair; the final weights it writes equal
those of the same script run without failures."""

import json

import torch
from safetensors.torch import load_file

from ntp_ds.batch.token_file import write_token_file
from tests.test_cli import REPO, ntp_ds
from tests.training import tiny_qwen2

STEPS = 12


def inputs(tmp_path):
    model_dir = tmp_path / "model"
    tiny_qwen2().save_pretrained(model_dir)
    gen = torch.Generator().manual_seed(5)
    data = tmp_path / "tokens.bin"
    write_token_file(data, [torch.randint(0, 96, (20_000,), generator=gen).numpy()], vocab_size=96)
    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({"train_batch_size": 8, "train_micro_batch_size_per_gpu": 2,
                              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
                              "zero_optimization": {"stage": 1}, "gradient_clipping": 1.0,
                              "steps_per_print": 10**9, "zero_allow_untested_optimizer": True}))
    return model_dir, data, ds


def train(tmp_path, out: str, faults: list):
    model_dir, data, ds = inputs(tmp_path) if not (tmp_path / "ds.json").exists() else (
        tmp_path / "model", tmp_path / "tokens.bin", tmp_path / "ds.json")
    result = ntp_ds("launch", "--nproc-per-node", "4", str(REPO / "examples" / "train_hf.py"),
                    "--model", str(model_dir), "--data", str(data), "--seq-len", "16", "--steps", str(STEPS),
                    "--tp", "2", "--replicas", "2", "--deepspeed_config", str(ds), "--faults", json.dumps(faults),
                    "--out", str(tmp_path / out), timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]
    return load_file(tmp_path / out / "model.safetensors"), result


def test_the_example_trains_through_a_crash_and_its_repair_to_the_failure_free_weights(tmp_path):
    reference, _ = train(tmp_path, "failure_free", [])
    faults = [{"rank": 3, "step": 5, "phase": "forward", "kind": "crash"}, {"rank": 3, "step": 9, "kind": "repair"}]
    weights, result = train(tmp_path, "faulted", faults)
    assert "recovery after step 4: TP degrees [2, 2] -> [2, 1]" in result.stderr, result.stderr[-4000:]
    assert "join after step 8: TP degrees [2, 1] -> [2, 2]" in result.stderr, result.stderr[-4000:]
    assert set(weights) == set(reference)
    for name, tensor in reference.items():
        diff = (weights[name] - tensor).abs().max().item()
        assert diff <= 1e-4, f"{name}: max abs difference {diff:.3g} from the failure-free run"
    moved = max((tensor - load_file(tmp_path / "model" / "model.safetensors")[name]).abs().max().item()
                for name, tensor in reference.items())
    assert moved > 1e-3, "training must move the weights for the comparison to mean anything"
