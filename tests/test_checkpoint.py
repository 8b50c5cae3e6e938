"""DeepSpeed checkpoints and consolidated weights under a nonuniform topology."""

import pytest
import torch
import transformers

from ntp_ds.layout.sharding import shard_tensor
from ntp_ds.models import Llama
from ntp_ds.testing.spawn import run_ranks
from tests.helpers.training import tiny_config, train_ntp, train_with_checkpoint

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


def save_and_count_communicators(rank, world, path):
    """Build a (2, 2) engine under nccl_model, take one step, save a DeepSpeed checkpoint; return the sizes of the
    communicators the save created and whether the tag check still refuses a tag that differs between ranks."""
    import ntp_ds
    from ntp_ds.batch.loader import GlobalBatchSampler, replica_micro_batches
    from ntp_ds.testing.nccl_model import communicator_sizes
    from tests.helpers.training import dataset, deepspeed_config, full_model

    config = {**deepspeed_config("adamw", 1, 8, 2), "checkpoint": {"tag_validation": "Fail"}}
    engine = ntp_ds.initialize(model=full_model(tiny_config()), config=config, ntp={"tp": 2, "replicas": 2})
    data, sampler = dataset(tiny_config()), GlobalBatchSampler(256, seed=1)
    for batch in replica_micro_batches(data, sampler, engine.batch_plan, engine.ntp_groups.replica, 0):
        engine.backward(engine(batch))
        engine.step()
    before = len(communicator_sizes())
    engine.save_checkpoint(path)
    created = communicator_sizes()[before:]
    try:
        engine.save_checkpoint(path, tag=f"mine{rank}")  # a tag that differs between ranks
        refused = ""
    except (ValueError, AssertionError) as err:  # (ours, DeepSpeed's)
        refused = str(err)
    engine.close()
    return created, refused


@pytest.mark.long  # .ci/run: its long stage (and the nccl_model stage where its file runs); README suite under 10 min
def test_a_checkpoint_creates_no_communicator_of_the_world(tmp_path, monkeypatch):
    # Before: DeepSpeed's save_checkpoint ran dist.barrier() and its tag check's all-reduces on the default group,
    # so the first checkpoint of every generation created a communicator of all W ranks under NCCL.
    monkeypatch.setenv("NTP_TEST_BACKEND", "nccl_model")
    results = run_ranks(save_and_count_communicators, 4, str(tmp_path), timeout=200)
    for created, refused in results:
        assert 4 not in created, created
        assert "checkpoint tag" in refused, refused
    assert (tmp_path / "latest").read_text() == "global_step1"
