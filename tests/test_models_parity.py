"""The sharded Llama matches transformers' LlamaForCausalLM: logits, loss and gradients, at even and uneven layouts.

Tolerances are torch.testing's fp32 defaults (rtol 1.3e-6, atol 1e-5): TP only reorders fp32 sums. transformers is
imported inside the tests so that the spawned ranks, which import this module, start fast.
"""

import json

import pytest
import torch
import torch.distributed as dist

from ntp_ds.layout import units as U
from ntp_ds.layout.shard_layout import LayoutError, ShardLayout
from ntp_ds.layout.sharding import gather_units, shard_tensor, unshard_into
from ntp_ds.models import Llama, LlamaConfig
from ntp_ds.testing.spawn import run_ranks
from tests.helpers.parity_layouts import LOGITS, UNEVEN_2, UNEVEN_3, UNITS

SMALL = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=8,
             num_key_value_heads=2)


def hf_reference(tmp_path, tied: bool) -> dict:
    """Save a random HF model to disk and record its logits, loss and gradients on a batch with ignored labels."""
    import transformers

    torch.manual_seed(1 + tied)
    cfg = transformers.LlamaConfig(**SMALL, tie_word_embeddings=tied, rms_norm_eps=1e-5, rope_theta=5000.0)
    hf = transformers.LlamaForCausalLM(cfg).float()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.copy_(1 + 0.2 * torch.randn_like(p) if "norm" in name else 0.1 * torch.randn_like(p))
    path = tmp_path / f"hf_tied{int(tied)}"
    hf.save_pretrained(path)
    ids = torch.randint(0, SMALL["vocab_size"], (2, 12))
    labels = ids.clone()
    labels[0, :4] = -100
    labels[1, 7] = -100
    out = hf(input_ids=ids, labels=labels)
    out.loss.backward()
    grads = {name: p.grad.numpy() for name, p in hf.named_parameters()}
    return dict(path=str(path), ids=ids.numpy(), labels=labels.numpy(), logits=out.logits.detach().numpy(),
                loss=out.loss.item(), grads=grads)


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("hf")
    return [hf_reference(tmp, tied) for tied in (False, True)]


def check_rank(ref: dict, layout, rank: int, group) -> dict:
    """Load this rank's shard, compare it with the HF reference, return what cross-rank checks need."""
    model = Llama.from_pretrained(ref["path"], layout, rank, group)
    ids, labels = torch.from_numpy(ref["ids"]), torch.from_numpy(ref["labels"])
    logits = model(ids)
    ref_logits = torch.from_numpy(ref["logits"])
    layout = model.layout
    torch.testing.assert_close(logits, shard_tensor(ref_logits, LOGITS, layout, rank))
    loss = model(ids, labels)
    torch.testing.assert_close(loss, torch.tensor(ref["loss"]))
    loss.backward()
    specs = model.param_specs()
    assert set(specs) == set(ref["grads"])
    for name, p in model.named_parameters():
        spec, shape = specs[name]
        assert p.shape == layout.shard_shape(spec, shape, rank), name
        expected = shard_tensor(torch.from_numpy(ref["grads"][name]), spec, layout, rank)
        torch.testing.assert_close(p.grad, expected, msg=lambda m: f"{name} on rank {rank}: {m}")
    shared = {n: p.grad.numpy() for n, p in model.named_parameters() if specs[n][0].kind in ("kv", "replicated")}
    check_own_loss(model, ref, ids, labels)
    return dict(logits=logits.detach().numpy(), shared=shared)


def check_own_loss(model, ref: dict, ids, labels) -> None:
    """A loss function of the caller's own, on the full-vocabulary logits every rank gets, gives HF's loss and this
    rank's share of HF's gradients."""
    import torch.nn.functional as F

    model.zero_grad()
    full = model(ids, full_logits=True)
    torch.testing.assert_close(full, torch.from_numpy(ref["logits"]))
    loss = F.cross_entropy(full[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100)
    torch.testing.assert_close(loss, torch.tensor(ref["loss"]))
    loss.backward()
    specs = model.param_specs()
    for name, p in model.named_parameters():
        expected = shard_tensor(torch.from_numpy(ref["grads"][name]), specs[name][0], model.layout, model.tp_rank)
        torch.testing.assert_close(p.grad, expected, msg=lambda m: f"own loss, {name} on rank {model.tp_rank}: {m}")


def _parity_worker(rank, world_size, layout, refs):
    dist.init_process_group("gloo")
    try:
        return [check_rank(ref, layout, rank, dist.group.WORLD) for ref in refs]
    finally:
        dist.destroy_process_group()


def check_across_ranks(ref: dict, layout: ShardLayout, per_rank: list[dict]):
    """Gathered logits equal HF's; KV and norm gradients are bit-identical on every rank holding them."""
    full = torch.zeros(ref["logits"].shape)
    for rank, out in enumerate(per_rank):
        unshard_into(full, torch.from_numpy(out["logits"]), LOGITS, layout, rank)
    torch.testing.assert_close(full, torch.from_numpy(ref["logits"]))
    model = Llama(LlamaConfig(**SMALL), layout, 0, init=False)
    specs = model.param_specs()
    pairs = [(r, s) for r in range(layout.tp) for s in range(r + 1, layout.tp)]
    for name in per_rank[0]["shared"]:
        spec = specs[name][0]
        for r, s in pairs:
            common = U.intersect(layout.owned(spec.kind, r), layout.owned(spec.kind, s))
            a = gather_units(torch.from_numpy(per_rank[r]["shared"][name]), spec, layout, r, common)
            b = gather_units(torch.from_numpy(per_rank[s]["shared"][name]), spec, layout, s, common)
            assert torch.equal(a, b), f"{name} differs between ranks {r} and {s} on units {common}"


def test_tp1_matches_hf(references):
    for ref in references:
        out = check_rank(ref, None, 0, None)
        torch.testing.assert_close(torch.from_numpy(out["logits"]), torch.from_numpy(ref["logits"]))


@pytest.mark.parametrize("layout", [ShardLayout.balanced(UNITS, 2), ShardLayout.balanced(UNITS, 3), UNEVEN_2,
                                    UNEVEN_3], ids=["tp2", "tp3", "uneven2", "uneven3"])
def test_sharded_matches_hf(references, layout):
    results = run_ranks(_parity_worker, layout.tp, layout, references, timeout=90)
    for i, ref in enumerate(references):
        check_across_ranks(ref, layout, [r[i] for r in results])


@pytest.mark.parametrize("tied", [False, True])
def test_save_pretrained_round_trip(tmp_path, tied):
    import transformers

    config = LlamaConfig(**SMALL, tie_word_embeddings=tied, rope_theta=20000.0)
    ours = Llama(config, seed=3)
    ours.save_pretrained(tmp_path)
    hf = transformers.LlamaForCausalLM.from_pretrained(tmp_path)
    ids = torch.randint(0, config.vocab_size, (2, 9))
    torch.testing.assert_close(ours(ids), hf(input_ids=ids).logits)
    again = Llama.from_pretrained(tmp_path)
    assert again.config == config
    for (name, a), (_, b) in zip(ours.state_dict().items(), again.state_dict().items()):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("chunk", [64, 2])
def test_seeded_init_is_layout_independent(chunk, monkeypatch):
    # With chunks of 2 units, uneven ranges start and end inside chunks: a rank draws whole chunks and keeps its part.
    monkeypatch.setattr("ntp_ds.models.llama.INIT_CHUNK_UNITS", chunk)
    config = LlamaConfig(**SMALL)
    torch.manual_seed(5)
    full = Llama(config).state_dict()
    for rank in range(UNEVEN_3.tp):
        torch.manual_seed(5)
        shard = Llama(config, UNEVEN_3, rank)
        for name, (spec, _) in shard.param_specs().items():
            assert torch.equal(shard.get_parameter(name), shard_tensor(full[name], spec, UNEVEN_3, rank)), name
    assert not torch.equal(Llama(config, seed=6).lm_head.weight, Llama(config, seed=7).lm_head.weight)
    assert torch.equal(Llama(config, seed=6).lm_head.weight, Llama(config, seed=6).lm_head.weight)


def test_sharded_model_refuses_to_run_or_save_without_group(tmp_path):
    shard = Llama(LlamaConfig(**SMALL), UNEVEN_2, 1)
    with pytest.raises(RuntimeError, match="tp_group"):
        shard(torch.zeros(1, 4, dtype=torch.long))
    with pytest.raises(ValueError, match="tp=2"):
        shard.save_pretrained(tmp_path)


def test_config_round_trips_through_hf():
    import transformers

    hf = transformers.LlamaConfig(**SMALL, tie_word_embeddings=True, rope_theta=500000.0, rms_norm_eps=1e-5)
    config = LlamaConfig.from_hf_dict(hf.to_dict())
    assert (config.head_dim, config.rope_theta, config.tie_word_embeddings) == (8, 500000.0, True)
    assert config.units().counts == UNITS.counts
    again = transformers.LlamaConfig(**config.to_hf_dict())
    assert again.rope_parameters["rope_theta"] == 500000.0 and again.head_dim == 8
    assert LlamaConfig.from_hf_dict(json.loads(json.dumps(config.to_hf_dict()))) == config
    legacy = {**config.to_hf_dict(), "rope_theta": 1234.0}
    del legacy["rope_parameters"]
    assert LlamaConfig.from_hf_dict(legacy).rope_theta == 1234.0


@pytest.mark.parametrize("change, error, field", [
    (dict(num_key_value_heads=3), LayoutError, "num_key_value_heads"),
    (dict(hidden_size=65), ValueError, "hidden_size"),
    (dict(vocab_size=0), ValueError, "vocab_size"),
    (dict(head_dim=7), ValueError, "head_dim"),
])
def test_config_validation_names_the_field(change, error, field):
    with pytest.raises(error, match=field):
        LlamaConfig(**{**SMALL, **change})


def test_config_refuses_unsupported_features():
    base = LlamaConfig(**SMALL).to_hf_dict()
    for bad, field in [(dict(rope_parameters={"rope_type": "llama3", "rope_theta": 1.0}), "rope_type"),
                       (dict(hidden_act="gelu"), "hidden_act"), (dict(model_type="mistral"), "model_type")]:
        with pytest.raises(ValueError, match=field):
            LlamaConfig.from_hf_dict({**base, **bad})
