"""No wait of the host on the device in the step's hot path (under NCCL it would also stop the host from queueing
work ahead of the device)."""

import pytest

from ntp_ds.testing.spawn import run_ranks

pytestmark = pytest.mark.timeout(120)


def where_tokens_are_counted(rank, world):
    import torch

    import ntp_ds
    import ntp_ds.engine.engine as engine_module
    from tests.helpers.training import deepspeed_config, full_model, tiny_config

    engine = ntp_ds.initialize(model=full_model(tiny_config()), config=deepspeed_config("sgd", 0, 2, 2),
                               ntp={"tp": 1, "replicas": 1})
    seen = []
    engine_module.counted_tokens = lambda labels: seen.append(labels.device.type) or 1
    engine.device = torch.device("meta")  # a device the host can read nothing back from
    batch = {"input_ids": torch.zeros(2, 8, dtype=torch.long), "labels": torch.zeros(2, 8, dtype=torch.long),
             "global_tokens": 14}
    try:
        engine(batch)
    except Exception:  # the model cannot run on meta inputs; the count came first
        pass
    return seen


def test_the_loss_weight_counts_tokens_on_the_callers_labels_not_on_the_device():
    # Before: the labels were moved to the device first and counted there, `int(labels.sum())`: a device sync in
    # every micro-batch's forward.
    assert run_ranks(where_tokens_are_counted, 1, timeout=100) == [["cpu"]]
