"""Bad input fails before any process group exists, with a message naming the field and value."""

import pytest
import torch.distributed as dist

import ntp_ds
from ntp_ds.engine import ConfigError
from ntp_ds.engine.config import cuda_device_index
from tests.helpers.training import deepspeed_config, full_model, tiny_config


def init(monkeypatch, ntp, ds=None, world_size=None, **model):
    if world_size is not None:
        monkeypatch.setenv("WORLD_SIZE", str(world_size))
    else:
        monkeypatch.delenv("WORLD_SIZE", raising=False)
    ntp_ds.initialize(model=full_model(tiny_config(**model)), config=ds or deepspeed_config("sgd", 1, 12, 2), ntp=ntp)


@pytest.mark.parametrize("ntp, ds, world, model, message", [
    ({"tp": 7}, None, None, {}, r"tp=7 exceeds the query-head count num_attention_heads=6"),
    ({"tp": 3}, None, None, {"intermediate_size": 2}, r"tp=3 leaves rank 2 with zero ffn units"),
    ({"tp": 3, "replicas": 2, "degrees": (3, 2)}, deepspeed_config("sgd", 1, 11, 2), None, {},
     r"train_batch_size=11 is not divisible by the 2 replicas"),
    # proportional: a replica takes what it finishes in a healthy step (under preserve_global_batch it would take one
    # sample and the step would be charged its pace).
    ({"tp": 3, "replicas": 2, "degrees": (3, 1), "batch_policy": "proportional"}, deepspeed_config("sgd", 1, 2, 1),
     None, {}, r"train_batch_size=2 leaves replica 1 \(pace [0-9.]+\) no sample"),
    ({"tp": 2}, deepspeed_config("sgd", 3, 12, 2), None, {}, r"zero_optimization.stage=3 is not supported"),
    ({"tp": 3, "replicas": 2, "degrees": (3, 2)}, None, 6, {}, r"world size 6 does not match the topology"),
    ({"tp": 2, "replicas": 2, "degrees": (2,)}, None, None, {}, r"ntp.degrees=\[2\] lists 1 replicas"),
    ({"tp": 2, "batch_policy": "greedy"}, None, None, {}, r"ntp.batch_policy='greedy'"),
    ({"tp": 2, "replicas": 2, "degrees": (2, 3)}, None, None, {}, r"ntp.degrees\[1\]=3 must lie in"),
    ({"tp": 2, "pipeline": 2}, None, None, {}, r"ntp.pipeline is not a known NTP setting"),
    ({"tp": 2}, deepspeed_config("sgd", 1, 12, 2, clip=-1.0), None, {}, r"gradient_clipping=-1.0 must be a number"),
    ({"tp": 2}, {**deepspeed_config("sgd", 2, 12, 2, clip=1.0),
                 "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}, None, {},
     r"gradient_clipping=1.0 with zero_optimization.offload_optimizer is not supported"),
    ({"tp": 2}, deepspeed_config("sgd", 0, 12, 2, bf16=True, clip=1.0), None, {},
     r"gradient_clipping=1.0 with bf16 at zero_optimization.stage=0 is not supported"),
])
def test_error_names_field_before_any_process_group(monkeypatch, ntp, ds, world, model, message):
    with pytest.raises(ConfigError, match=message):
        init(monkeypatch, ntp, ds, world, **model)
    assert not dist.is_initialized()


def test_missing_batch_size_is_named(monkeypatch):
    ds = deepspeed_config("sgd", 1, 12, 2)
    del ds["train_micro_batch_size_per_gpu"]
    with pytest.raises(ConfigError, match="train_micro_batch_size_per_gpu is missing"):
        init(monkeypatch, {"tp": 2}, ds)


@pytest.mark.parametrize("env, devices, index", [
    ({}, 1, 0),
    ({"WORLD_SIZE": "8", "LOCAL_RANK": "3"}, 4, 3),
])
def test_each_rank_of_a_node_takes_its_own_cuda_device(env, devices, index):
    assert cuda_device_index(env, devices) == index


@pytest.mark.parametrize("env, devices, message", [
    # Rank 4 of a node with 4 devices took device 0 (4 % 4), already rank 0's.
    ({"WORLD_SIZE": "8", "LOCAL_RANK": "4"}, 4, r"LOCAL_RANK=4 but this process sees 4 CUDA device\(s\)"),
    # DeepSpeed's engine sets the LOCAL_RANK-th device too, so one visible device per rank cannot serve rank 1.
    ({"WORLD_SIZE": "2", "LOCAL_RANK": "1", "CUDA_VISIBLE_DEVICES": "1"}, 1, r"ranks of this node would share"),
    ({"WORLD_SIZE": "2"}, 2, r"LOCAL_RANK is not set in a world of 2 ranks"),
])
def test_ranks_that_would_share_a_cuda_device_are_refused(env, devices, message):
    with pytest.raises(ConfigError, match=message):
        cuda_device_index(env, devices)


@pytest.mark.parametrize("name, value", [("TORCH_NCCL_BLOCKING_WAIT", "1"), ("TORCH_NCCL_DUMP_ON_TIMEOUT", "1"),
                                         ("TORCH_NCCL_DESYNC_DEBUG", "1")])
def test_nccl_settings_recovery_cannot_run_under_are_refused_by_name(monkeypatch, name, value):
    monkeypatch.setenv("NTP_TEST_BACKEND", "nccl_model")
    monkeypatch.setenv(name, value)
    with pytest.raises(ConfigError, match=rf"^{name}={value} is not supported with ntp_ds: "):
        init(monkeypatch, {"tp": 2})
    assert not dist.is_initialized()
    monkeypatch.setenv(name, "0")  # the harmless value passes this check
    from ntp_ds.engine.initialize import check_nccl_environment
    check_nccl_environment()


def test_one_device_queue_is_refused_with_the_copies_overlapping_the_next_step(monkeypatch):
    monkeypatch.setenv("NTP_TEST_BACKEND", "nccl_model")
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    with pytest.raises(ConfigError, match=r"^CUDA_DEVICE_MAX_CONNECTIONS=1 is not supported with "
                                          r"ntp.redundancy_overlap=true"):
        init(monkeypatch, {"tp": 2, "replicas": 2, "redundancy_overlap": True})
    assert not dist.is_initialized()
    from ntp_ds.engine.config import NTPConfig
    from ntp_ds.engine.initialize import check_overlap_environment
    check_overlap_environment(NTPConfig.from_any({"tp": 2, "replicas": 2}))  # without the overlap: no objection
    monkeypatch.setenv("NTP_TEST_BACKEND", "gloo")  # no NCCL, no device queue to hold
    check_overlap_environment(NTPConfig.from_any({"tp": 2, "replicas": 2, "redundancy_overlap": True}))
