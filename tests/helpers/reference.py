"""Every rank's shards against the single-process reference trained on the same samples."""

import torch

from ntp_ds.layout.sharding import shard_tensor
from ntp_ds.models import Llama


def assert_matches_reference(results, reference: Llama, optim: str):
    ref = dict(reference.named_parameters())
    specs = reference.param_specs()

    def check(got, want, where):
        if optim == "sgd":
            torch.testing.assert_close(got, want, msg=lambda m: f"{where}: {m}")
        else:
            diff = (got - want).abs().max().item()
            assert diff <= 1e-4, f"{where}: max abs difference {diff:.3g} > 1e-4"

    for res in results:
        for name, shard in res["shards"].items():
            want = shard_tensor(ref[name].detach(), specs[name][0], res["layout"], res["tp_rank"])
            check(shard, want, f"replica {res['replica']} tp rank {res['tp_rank']} {name}")
    full = next(r["full"] for r in results if r["full"] is not None)
    assert set(full) == set(ref)
    for name, tensor in full.items():
        check(tensor, ref[name].detach(), f"consolidated {name}")
    moved = max((ref[n].detach() - reference_init[n]).abs().max().item() for n in ref)
    assert moved > 1e-3, "training must move the weights for the comparison to mean anything"


reference_init = {}
