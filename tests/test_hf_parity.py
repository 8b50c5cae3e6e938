"""transformers' own Llama, Qwen2, Qwen3 and Mistral, sharded through their TP plan, match the unsharded models.

Logits, loss and every gradient at TP 1, 2, 3 and uneven, non-contiguous layouts whose ranks share KV heads and read
them irregularly, tied and untied, in fp32 with torch.testing's defaults (rtol 1.3e-6, atol 1e-5): TP only reorders
fp32 sums. One spawn of three ranks runs every layout and family (TP 2 layouts on a two-rank subgroup), since
starting a process that imports transformers costs seconds on two cores. Then a save/load round trip through
`AutoModelForCausalLM`, the refusals, and one equivalence run of the NTP engine on a Qwen2 model.
"""

import pytest
import torch
import torch.distributed as dist

from ntp_ds.layout import units as U
from ntp_ds.layout.shard_layout import ShardLayout
from ntp_ds.layout.sharding import gather_units, shard_tensor, unshard_into
from ntp_ds.models import HFCausalLM
from ntp_ds.testing.spawn import run_ranks
from tests.helpers.parity_layouts import LOGITS, UNEVEN_2, UNEVEN_3, UNITS

pytestmark = pytest.mark.timeout(240)

SMALL = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=8,
             num_key_value_heads=2, head_dim=8, rms_norm_eps=1e-5)
FAMILIES = {
    "llama": dict(pad_token_id=3, attention_bias=True),  # o_proj bias: replicated, added after the reduce
    "qwen2": dict(),  # q/k/v biases sharded with their heads
    "qwen3": dict(),  # q/k norms: gradients summed over the TP group
    "mistral": dict(sliding_window=8),  # a real attention mask (sequence 12)
}
LAYOUTS = {"tp2": ShardLayout.balanced(UNITS, 2), "uneven2": UNEVEN_2, "tp3": ShardLayout.balanced(UNITS, 3),
           "uneven3": UNEVEN_3}


def hf_model(family: str, tied: bool, seed: int):
    """A random transformers causal LM of `family` with every weight, bias and norm drawn away from its init."""
    import transformers

    cfg = transformers.AutoConfig.for_model(family, **SMALL, **FAMILIES[family], tie_word_embeddings=tied)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg).float()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1 + 0.2 * torch.randn_like(p) if "norm" in name else 0.1 * torch.randn_like(p))
    return model


def hf_reference(tmp_path, family: str, tied: bool) -> dict:
    """Save a random HF model and record its logits, loss and gradients on a batch with ignored labels."""
    model = hf_model(family, tied, seed=len(family) + tied)
    path = tmp_path / f"{family}_tied{int(tied)}"
    model.save_pretrained(path)
    ids = torch.randint(0, SMALL["vocab_size"], (2, 12))
    ids[0, 5] = 3  # Llama's padding token: its embedding row gets no gradient
    labels = ids.clone()
    labels[0, :4] = -100
    labels[1, 7] = -100
    out = model(input_ids=ids, labels=labels)
    out.loss.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    return dict(name=path.name, path=str(path), ids=ids, labels=labels, logits=out.logits.detach(),
                loss=out.loss.detach(), grads=grads, model=model)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny matmuls on a loaded two-core machine: one intra-op thread is faster by orders of magnitude."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("hf")
    return [hf_reference(tmp, family, tied) for family in FAMILIES for tied in (False, True)]


def check_rank(ref: dict, layout, rank: int, group) -> dict:
    """Load this rank's shard from the directory, compare it with HF; return its logits and shared gradients."""
    model = HFCausalLM.from_pretrained(ref["path"], layout, rank, group)
    layout = model.layout
    where = f"{ref['name']} tp={layout.tp} rank {rank}"
    logits = model(ref["ids"])
    torch.testing.assert_close(logits, shard_tensor(ref["logits"], LOGITS, layout, rank), msg=lambda m: f"{where}: {m}")
    loss = model(ref["ids"], ref["labels"])
    torch.testing.assert_close(loss, ref["loss"], msg=lambda m: f"{where}: {m}")
    loss.backward()
    specs = model.param_specs()
    assert set(specs) == set(ref["grads"]), where
    for name, p in model.named_parameters():
        spec, shape = specs[name]
        assert p.shape == layout.shard_shape(spec, shape, rank), f"{where} {name}"
        expected = shard_tensor(ref["grads"][name], spec, layout, rank)
        torch.testing.assert_close(p.grad, expected, msg=lambda m: f"{where} {name}: {m}")
    shared = {n: p.grad for n, p in model.named_parameters() if specs[n][0].kind in ("kv", "replicated")}
    return dict(logits=logits.detach(), shared=shared, specs={n: s for n, (s, _) in specs.items()})


def _parity_worker(rank, world_size, refs):
    """Every layout and family on ranks 0..2; the two-rank layouts on a subgroup of ranks 0 and 1."""
    dist.init_process_group("gloo")
    try:
        pair = dist.new_group([0, 1])
        out = {}
        for label, layout in LAYOUTS.items():
            group = dist.group.WORLD if layout.tp == world_size else pair
            if rank < layout.tp:
                out[label] = [check_rank(ref, layout, rank, group) for ref in refs]
        return out
    finally:
        dist.destroy_process_group()


def check_across_ranks(ref: dict, layout: ShardLayout, per_rank: list[dict]):
    """Gathered logits equal HF's; KV and replicated gradients are bit-identical on every rank holding them."""
    full = torch.zeros(ref["logits"].shape)
    for rank, out in enumerate(per_rank):
        unshard_into(full, out["logits"], LOGITS, layout, rank)
    torch.testing.assert_close(full, ref["logits"])
    specs = per_rank[0]["specs"]
    for name in per_rank[0]["shared"]:
        spec = specs[name]
        for r in range(layout.tp):
            for s in range(r + 1, layout.tp):
                common = U.intersect(layout.owned(spec.kind, r), layout.owned(spec.kind, s))
                a = gather_units(per_rank[r]["shared"][name], spec, layout, r, common)
                b = gather_units(per_rank[s]["shared"][name], spec, layout, s, common)
                assert torch.equal(a, b), f"{ref['name']} {name} differs between ranks {r} and {s} on {common}"


def test_tp1_matches_hf(references):
    for ref in references:
        check_rank(ref, None, 0, None)
        shard = HFCausalLM.from_model(ref["model"])
        torch.testing.assert_close(shard(ref["ids"]), ref["logits"])


@pytest.mark.long  # (about 10 s: .ci/run's long stage; the README suite stays under 10 min)
def test_sharded_matches_hf(references):
    refs = [{k: v for k, v in ref.items() if k != "model"} for ref in references]
    results = run_ranks(_parity_worker, 3, refs, timeout=180)
    for label, layout in LAYOUTS.items():
        for i, ref in enumerate(refs):
            check_across_ranks(ref, layout, [results[r][label][i] for r in range(layout.tp)])


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
@pytest.mark.parametrize("tied", [False, True])
def test_save_pretrained_loads_in_transformers(tmp_path, family, tied):
    import transformers

    source = hf_model(family, tied, seed=9)
    ours = HFCausalLM.from_model(source)
    ours.save_pretrained(tmp_path)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
    assert type(loaded) is type(source) and loaded.config.tie_word_embeddings == tied
    ids = torch.randint(0, SMALL["vocab_size"], (2, 9))
    torch.testing.assert_close(loaded(input_ids=ids).logits, source(input_ids=ids).logits, rtol=0, atol=0)
    again = HFCausalLM.from_pretrained(tmp_path)
    assert (again.config.model_type, again.config.units(), again.config.tie_word_embeddings) == (
        family, ours.config.units(), tied)
    for (name, a), (_, b) in zip(ours.named_parameters(), again.named_parameters()):
        assert torch.equal(a, b), name


def test_unsupported_plan_is_refused_naming_the_entry():
    import transformers

    from ntp_ds.engine.config import ConfigError
    from ntp_ds.engine.initialize import model_config_of
    from ntp_ds.models.hf import plan_of

    cfg = transformers.Qwen3Config(**SMALL)
    cfg.base_model_tp_plan = {**cfg.base_model_tp_plan, "layers.*.mlp.experts": "grouped_gemm"}
    with pytest.raises(ValueError, match=r"'layers\.\*\.mlp\.experts': 'grouped_gemm'"):
        plan_of(cfg)
    cfg.base_model_tp_plan = {"layers.*.self_attn.qkv_proj": "colwise"}
    with pytest.raises(ValueError, match="qkv_proj"):
        plan_of(cfg)
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_embd=64, n_layer=1, n_head=8, vocab_size=128))
    with pytest.raises(ConfigError, match="model: model_type='gpt2' has no base_model_tp_plan"):
        model_config_of(gpt2)
    with pytest.raises(ConfigError, match="model must be"):
        model_config_of("/nonexistent/dir")


@pytest.mark.long  # .ci/run: its long stage (and the nccl_model stage where its file runs); README suite under 10 min
def test_qwen2_training_matches_reference(tmp_path):
    """NTP run of a Qwen2 model at TP degrees (3, 2) (the TP 3 replica's ranks read their KV heads irregularly and
    share one) ends with the weights of one process training the unsharded HF model on the same samples; the
    engine's save_pretrained writes a directory transformers loads."""
    import transformers

    from tests.helpers.training import tiny_qwen2, train_ntp, train_reference

    steps, degrees = 4, (3, 2)
    ntp = {"tp": 3, "replicas": 2, "degrees": degrees, "batch_policy": "preserve_global_batch"}
    results = run_ranks(train_ntp, sum(degrees), ntp, "sgd", 1, 12, 2, steps, None, tiny_qwen2, str(tmp_path / "hf"),
                        timeout=200)
    reference = train_reference("sgd", results[0]["global_samples"], steps, make_model=tiny_qwen2)
    ref, init = dict(reference.named_parameters()), dict(tiny_qwen2().named_parameters())
    specs = HFCausalLM.from_model(reference).param_specs()
    for res in results:
        for name, shard in res["shards"].items():
            want = shard_tensor(ref[name].detach(), specs[name][0], res["layout"], res["tp_rank"])
            torch.testing.assert_close(shard, want, msg=lambda m: f"replica {res['replica']} {name}: {m}")
    assert max((ref[n] - init[n]).abs().max().item() for n in ref) > 1e-3, "training must move the weights"
    saved = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    assert type(saved).__name__ == "Qwen2ForCausalLM"
    for name, p in saved.named_parameters():
        torch.testing.assert_close(p, ref[name].detach(), msg=lambda m: f"saved {name}: {m}")
