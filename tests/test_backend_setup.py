"""What ntp_ds sets before the first process group: DeepSpeed's CPU shared-memory comm op is not built."""

import importlib
import os

import deepspeed.ops
from deepspeed.ops.op_builder.cpu import ShareMemCommBuilder

import ntp_ds.testing.nccl_model  # noqa: F401  (registers the backend its NCCL branch runs under)
from ntp_ds.comm.groups import prepare_backend
from ntp_ds.envs import NCCL_DUMP_ENV, TEST_BACKEND_ENV


def test_deepspeed_does_not_build_its_shm_comm_op(monkeypatch):
    """`deepspeed.init_distributed` builds its backend through `build_shm_op`: after `prepare_backend` it returns None
    without loading (JIT-compiling) the op."""
    ds_torch = importlib.import_module("deepspeed.comm.torch")  # `deepspeed.comm.torch` the attribute is torch itself
    ops = deepspeed.ops.__compatible_ops__
    monkeypatch.setitem(ops, ShareMemCommBuilder.NAME, ops.get(ShareMemCommBuilder.NAME, False))
    loads = []
    monkeypatch.setattr(ShareMemCommBuilder, "load", lambda self, verbose=False: loads.append(self.NAME))
    prepare_backend()
    assert ds_torch.build_shm_op() is None and loads == []
    monkeypatch.setitem(ops, ShareMemCommBuilder.NAME, True)  # the observation works: a compatible op is loaded
    ds_torch.build_shm_op()
    assert loads == [ShareMemCommBuilder.NAME] or ds_torch.get_accelerator().create_op_builder(
        "ShareMemCommBuilder") is None


def test_under_cuda_nothing_probes_deepspeed_op_compatibility(monkeypatch):
    """Reading `deepspeed.ops.__compatible_ops__` probes every op DeepSpeed knows (nvcc runs on a CUDA machine).
    DeepSpeed's CUDA accelerator has no shared-memory comm op, so `build_shm_op` returns before reading it, and
    `prepare_backend` must not read it either."""
    from deepspeed.accelerator import real_accelerator
    from deepspeed.accelerator.cuda_accelerator import CUDA_Accelerator

    ds_torch = importlib.import_module("deepspeed.comm.torch")
    probes = []
    # Unread, as in a fresh process, and restored after: through the module's dict, since getattr would probe.
    monkeypatch.setitem(vars(deepspeed.ops), "__compatible_ops__", {})
    monkeypatch.delitem(vars(deepspeed.ops), "__compatible_ops__")
    monkeypatch.setattr(deepspeed.ops, "_probe_compatible_ops", lambda: probes.append("probe") or {})
    monkeypatch.setattr(real_accelerator, "ds_accelerator", CUDA_Accelerator())
    assert ds_torch.build_shm_op() is None and probes == []
    prepare_backend()
    assert probes == [], "prepare_backend probed DeepSpeed's op compatibility under the CUDA accelerator"
    deepspeed.ops.__compatible_ops__  # noqa: B018  (the observation works: a read probes)
    assert probes == ["probe"]


def test_under_nccl_no_dump_signal_no_watchdog_sleep_no_monitor_kill(monkeypatch):
    names = (NCCL_DUMP_ENV, "TORCH_NCCL_ASYNC_ERROR_HANDLING", "TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC",
             "TORCH_NCCL_ENABLE_MONITORING")
    for name in names:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv(TEST_BACKEND_ENV, "gloo")
    prepare_backend()
    assert not any(name in os.environ for name in names)
    monkeypatch.setenv(TEST_BACKEND_ENV, "nccl_model")  # the NCCL branch
    monkeypatch.setenv("TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC", "15000")  # torch's default: 60 s asleep per failed op
    prepare_backend()
    assert {name: os.environ[name] for name in names} == {
        NCCL_DUMP_ENV: "0", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "0", "TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC": "100",
        "TORCH_NCCL_ENABLE_MONITORING": "0"}
    monkeypatch.setenv(NCCL_DUMP_ENV, "1")  # refused by name before any group (tests/test_errors.py); never kept
    prepare_backend()
    assert os.environ[NCCL_DUMP_ENV] == "0"


def test_under_nccl_groups_are_created_non_blocking_within_the_jobs_timeout(monkeypatch):
    from datetime import timedelta

    from ntp_ds.comm.groups import creation_options
    from ntp_ds.envs import NONBLOCKING_TIMEOUT_ENV

    monkeypatch.delenv(NONBLOCKING_TIMEOUT_ENV, raising=False)
    monkeypatch.setenv(TEST_BACKEND_ENV, "gloo")
    prepare_backend(12.5)
    assert NONBLOCKING_TIMEOUT_ENV not in os.environ
    monkeypatch.setenv(TEST_BACKEND_ENV, "nccl_model")
    prepare_backend(12.5)
    assert os.environ[NONBLOCKING_TIMEOUT_ENV] == "13", "whole seconds, never shorter than timeout_s"
    assert creation_options("nccl_model", timedelta(seconds=12.5)).config.blocking == 0
    assert creation_options("gloo", timedelta(seconds=12.5)) is None
