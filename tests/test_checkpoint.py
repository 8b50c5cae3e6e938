"""DeepSpeed checkpoints and consolidated weights under a nonuniform topology."""

import pytest
import torch
import transformers

from ntp_ds.models import Llama
from ntp_ds.layout.sharding import shard_tensor

from ntp_ds.testing.spawn import run_ranks
from tests.training import tiny_config, train_ntp, train_with_checkpoint

NTP = {"tp": 3, "replicas": 2, "degrees": (3, 2)}


@pytest.mark.long  # about 27 s: .ci/run runs it in its long stage (and on nccl_model where the file runs there)
def test_resume_from_checkpoint_matches_uninterrupted_run_and_save_pretrained_loads_in_hf(tmp_path):
    straight = run_ranks(train_ntp, 5, NTP, "adamw", 1, 12, 2, 6, timeout=240)
    saved = run_ranks(train_with_checkpoint, 5, NTP, 1, 3, str(tmp_path), False, timeout=240)
    resumed = run_ranks(train_with_checkpoint, 5, NTP, 1, 3, str(tmp_path), True, timeout=240)
    for a, b in zip(straight, resumed):
        assert b["global_steps"] == 6
        for name, shard in a["shards"].items():
            torch.testing.assert_close(b["shards"][name], shard, msg=lambda m: f"{name}: {m}")

    hf = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "hf")
    hf_params = dict(hf.named_parameters())
    specs = Llama(tiny_config()).param_specs()
    for res in saved:
        for name, shard in res["shards"].items():
            want = shard_tensor(hf_params[name].detach(), specs[name][0], res["layout"], res["tp_rank"])
            torch.testing.assert_close(shard, want, msg=lambda m: f"save_pretrained {name}: {m}")
