"""`save_pretrained` writes whole tensors from the first anchor replica's ranks: none of them gathers the model, and
no tensor is pickled."""

import pytest
import torch

from ntp_ds.testing.spawn import run_ranks
from tests.helpers.training import hf_weights

pytestmark = pytest.mark.timeout(240)


def save(rank, world, path, degrees):
    import ntp_ds
    from ntp_ds.comm import wire
    from tests.helpers.training import deepspeed_config, full_model, tiny_config

    ntp = {"tp": max(degrees), "replicas": len(degrees), "degrees": degrees}
    engine = ntp_ds.initialize(model=full_model(tiny_config()), config=deepspeed_config("sgd", 1, 12, 2), ntp=ntp)
    before = wire.traffic()
    with wire.recording() as calls:
        engine.save_pretrained(path)
    received = sum(v for (op, way), v in wire.traffic_since(before).items() if way == "received")
    full = engine.consolidated_state_dict()  # the pickled reference, made apart from the save
    engine.close()
    return {"ops": sorted({c.op for c in calls}), "received": received, "full": full,
            "writer": engine.ntp_groups.replica == 0}


@pytest.mark.parametrize("degrees", [(2,), (3, 2)])
def test_each_writer_assembles_its_own_tensors_and_the_directory_holds_the_model(tmp_path, degrees):
    # Before: TP rank 0 of the first replica gathered every rank's shards as pickled objects (the whole model in fp32
    # on one host) and wrote one file.
    results = run_ranks(save, sum(degrees), str(tmp_path), degrees, timeout=200)
    full = results[0]["full"]
    model_bytes = sum(t.numel() * 4 for t in full.values())
    for r in results:
        assert not {"gather_object", "all_gather_object", "broadcast_object"} & set(r["ops"]), r["ops"]
        # A writer receives the units it lacks of the tensors it writes: about 1/tp of the model at most.
        assert r["received"] <= model_bytes / degrees[0] + 1024, (r["received"], model_bytes)
    assert sum(r["writer"] for r in results) == degrees[0]
    files = sorted(p.name for p in tmp_path.glob("*.safetensors"))
    assert files == [f"model-{i + 1:05d}-of-{degrees[0]:05d}.safetensors" for i in range(degrees[0])]
    saved = hf_weights(tmp_path)
    assert set(saved) == set(full)
    for name, tensor in full.items():
        torch.testing.assert_close(saved[name], tensor, rtol=0, atol=0, msg=lambda m: f"{name}: {m}")
