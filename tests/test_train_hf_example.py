"""examples/train_hf.py, a DeepSpeed user's script on the fault-tolerant loop, end to end: a small HF Qwen2 on a
token file, 2 replicas x TP 2, a crash at step 5 and its repair at step 9. Under `ntp-ds launch`, `torchrun` and
`deepspeed` the final weights it writes equal those of the same script run without failures.

The `torchrun` and `deepspeed` cases (marker `launchers`) run in CI's second stage (.ci/run): each starts a sentinel
in front of every worker, twice the processes on a 2-core machine.
"""

import json
import sys

import pytest
import torch
from safetensors.torch import load_file

from ntp_ds.batch.token_file import write_token_file
from tests.helpers.cli import REPO, run
from tests.helpers.training import hf_weights, tiny_qwen2

STEPS = 10
FAULTS = [{"rank": 3, "step": 5, "phase": "forward", "kind": "crash"}, {"rank": 3, "step": 9, "kind": "repair"}]
LAUNCHERS = {
    "ntp-ds launch": [sys.executable, "-m", "ntp_ds.cli", "launch", "--nproc-per-node", "4"],
    "torchrun": ["torchrun", "--nproc-per-node", "4"],
    "deepspeed": ["deepspeed", "--num_gpus", "4"],
}


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    """The inputs, and the weights of the failure-free run under `ntp-ds launch`."""
    root = tmp_path_factory.mktemp("train_hf")
    tiny_qwen2().save_pretrained(root / "model")
    gen = torch.Generator().manual_seed(5)
    write_token_file(root / "tokens.bin", [torch.randint(0, 96, (20_000,), generator=gen).numpy()], vocab_size=96)
    (root / "ds.json").write_text(json.dumps({
        "train_batch_size": 8, "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
        "zero_optimization": {"stage": 1}, "gradient_clipping": 1.0, "steps_per_print": 10**9,
        "zero_allow_untested_optimizer": True}))
    reference, _ = train(root, "ntp-ds launch", "failure_free", [])
    return root, reference


def train(root, launcher: str, out: str, faults: list):
    command = LAUNCHERS[launcher] + [
        str(REPO / "examples" / "train_hf.py"), "--model", str(root / "model"), "--data", str(root / "tokens.bin"),
        "--seq-len", "16", "--steps", str(STEPS), "--tp", "2", "--replicas", "2",
        "--deepspeed_config", str(root / "ds.json"), "--faults", json.dumps(faults), "--out", str(root / out)]
    result = run(command, timeout=280)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    return hf_weights(root / out), result


def check_through_crash_and_repair(job, launcher: str):
    root, reference = job
    weights, result = train(root, launcher, launcher.replace(" ", "_"), FAULTS)
    assert "recovery after step 4: TP degrees [2, 2] -> [2, 1]" in result.stderr, result.stderr[-4000:]
    assert "join after step 8: TP degrees [2, 1] -> [2, 2]" in result.stderr, result.stderr[-4000:]
    assert set(weights) == set(reference)
    for name, tensor in reference.items():
        diff = (weights[name] - tensor).abs().max().item()
        assert diff <= 1e-4, f"{name}: max abs difference {diff:.3g} from the failure-free run"
    start = load_file(root / "model" / "model.safetensors")
    moved = max((tensor - start[name]).abs().max().item() for name, tensor in reference.items())
    assert moved > 1e-3, "training must move the weights for the comparison to mean anything"


@pytest.mark.launchers
def test_under_ntp_ds_launch_a_crash_and_its_repair_end_at_the_failure_free_weights(job):
    check_through_crash_and_repair(job, "ntp-ds launch")


@pytest.mark.launchers
@pytest.mark.parametrize("launcher", ["torchrun", "deepspeed"])
def test_under_a_foreign_launcher_a_sentinel_keeps_the_job_through_a_crash_and_its_repair(job, launcher):
    check_through_crash_and_repair(job, launcher)
