"""transformers' own causal LMs (Llama, Qwen2, Qwen3, Mistral, ...) with any ShardLayout's units on a TP rank.

The decoder layers, norms, rotary embedding and attention are transformers' modules and run unchanged. What the
config's `base_model_tp_plan` names is swapped: "colwise" and "rowwise" projections for ColumnParallelLinear /
RowParallelLinear over this rank's units (biases sharded with their output features), and the parameters of
"replicated_with_grad_allreduce" modules (Qwen3's q/k norms) get their gradients summed over the TP group. The
embedding and output head are vocab parallel and the loss is the vocab-parallel cross-entropy, so no rank holds
full-vocabulary logits. transformers is imported only when such a model is built.

Attention reshapes its projections with -1 heads, so it runs on the rank's local heads as they are. Its grouped-
query attention assumes every `num_key_value_groups` consecutive query heads read one KV head; where a rank's query
heads read its local KV heads irregularly (uneven layouts), the K and V projections emit one KV head per local
query head (an index_select, whose backward sums the copies) and that attention's group count is set to 1.
"""

from __future__ import annotations

import os
import re
import weakref
from functools import partial
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

from ntp_ds.comm import wire
from ntp_ds.layout.shard_layout import ParamSpec, ShardLayout
from ntp_ds.models.causal_lm import CausalLMShard
from ntp_ds.models.checkpoint import checkpoint_dtype, load_shards, write_hf_dir
from ntp_ds.models.config import HFConfig
from ntp_ds.models.tp_layers import (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding, check_shard,
                                     copy_to_tp, local_kv_index)
from ntp_ds.layout.sharding import shard_tensor

PROJECTION_KINDS = {"q_proj": "heads", "k_proj": "kv", "v_proj": "kv", "o_proj": "heads",
                    "gate_proj": "ffn", "up_proj": "ffn", "down_proj": "ffn"}
"""Sharding unit of each projection a TP plan may name (o_proj and down_proj are sharded along their inputs)."""
STYLES = ("colwise", "rowwise", "replicated_with_grad_allreduce")
HEAD_OUTPUTS = ("lm_head",)


def plan_of(hf_config) -> dict[str, str]:
    """The base model's TP plan, refused (naming the entry) where it holds a style or module we cannot shard."""
    plan = dict(getattr(hf_config, "base_model_tp_plan", None) or {})
    if not plan:
        raise ValueError(f"model_type={hf_config.model_type!r} has no base_model_tp_plan; ntp_ds shards HF models "
                         f"through it (Llama, Qwen2, Qwen3, Mistral and others have one)")
    for pattern, style in plan.items():
        if style not in STYLES:
            raise ValueError(f"base_model_tp_plan entry {pattern!r}: {style!r} is not supported "
                             f"(model_type {hf_config.model_type!r}); supported styles: {', '.join(STYLES)}")
        leaf = pattern.rpartition(".")[2]
        if style != "replicated_with_grad_allreduce" and leaf not in PROJECTION_KINDS:
            raise ValueError(f"base_model_tp_plan entry {pattern!r}: module {leaf!r} is not a projection ntp_ds "
                             f"knows the sharding unit of; known: {', '.join(PROJECTION_KINDS)}")
    return plan


def check_supported(hf_config) -> None:
    """Refuse, before any process group exists, a transformers config whose model ntp_ds cannot shard."""
    import transformers

    plan_of(hf_config)
    model_class = transformers.AutoModelForCausalLM._model_mapping.get(type(hf_config), None)
    if model_class is None:
        raise ValueError(f"model_type={hf_config.model_type!r} has no AutoModelForCausalLM class")
    if model_class.base_model_prefix != "model":
        raise ValueError(f"{model_class.__name__} keeps its decoder in {model_class.base_model_prefix!r}; ntp_ds "
                         f"supports causal LMs whose decoder is 'model' (HF names model.layers.*, lm_head)")
    for name, style in (getattr(model_class, "_tp_plan", None) or {}).items():
        if name not in HEAD_OUTPUTS:
            raise ValueError(f"{model_class.__name__}._tp_plan entry {name!r} ({style!r}) is not supported; "
                             f"only the output head {HEAD_OUTPUTS} may be planned outside the base model")


def _matches(pattern: str, name: str) -> bool:
    return re.fullmatch(re.escape(pattern).replace(r"\*", r"\d+"), name) is not None


def _enter_tp(group_of, module, args, kwargs):
    """Forward pre-hook of a module holding colwise projections: its hidden states enter the TP region here (on the
    group `group_of()` names now)."""
    group = group_of()
    if args:
        return (copy_to_tp(args[0], group),) + tuple(args[1:]), kwargs
    if "hidden_states" not in kwargs:
        raise TypeError(f"{type(module).__name__} got no hidden states to enter the TP region with")
    return args, {**kwargs, "hidden_states": copy_to_tp(kwargs["hidden_states"], group)}


class ExpandedKVLinear(ColumnParallelLinear):
    """A column-parallel K or V projection that emits, for each local query head, the KV head that head reads."""

    def __init__(self, *args, head_dim: int, kv_index: list[int], **kwargs):
        super().__init__(*args, **kwargs)
        self.head_dim = head_dim
        self.register_buffer("kv_index", torch.tensor(kv_index, device=self.weight.device), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = super().forward(x)
        heads = y.view(*y.shape[:-1], -1, self.head_dim).index_select(-2, self.kv_index)
        return heads.flatten(-2)


def _projection(linear: nn.Linear, style: str, kind: str, unit: int, layout: ShardLayout, rank: int, group,
                kv_index, device, dtype) -> nn.Module:
    """The TP layer replacing one planned nn.Linear; `kv_index` set means a KV projection expanded per query head."""
    bias = linear.bias is not None
    if style == "rowwise":
        return RowParallelLinear(linear.in_features, linear.out_features, ParamSpec(kind, 1, unit), layout, rank,
                                 group, device, dtype, bias=bias)
    args = (linear.in_features, linear.out_features, ParamSpec(kind, 0, unit), layout, rank, group, device, dtype)
    if kv_index is not None:
        return ExpandedKVLinear(*args, bias=bias, head_dim=unit, kv_index=kv_index)
    return ColumnParallelLinear(*args, bias=bias)


def apply_tp_plan(base: nn.Module, config: HFConfig, layout: ShardLayout, rank: int, group, group_of, device,
                  dtype) -> list[str]:
    """Swap the planned modules of `base` (on meta) for this rank's TP layers; return the modules whose
    parameter gradients must be summed over the TP group. `group_of()`: the TP group now, for the hooks (a recovery
    may replace `group`: `CausalLMShard.set_tp_group`)."""
    plan = plan_of(base.config)
    kv_index = local_kv_index(layout, rank)
    n_q, n_kv = len(kv_index), max(kv_index) + 1
    regular = n_q % n_kv == 0 and kv_index == [i // (n_q // n_kv) for i in range(n_q)]
    units = {"heads": config.head_dim, "kv": config.head_dim, "ffn": 1}
    grad_summed, entries = [], set()
    for name, module in list(base.named_modules()):
        style = next((s for p, s in plan.items() if _matches(p, name)), None)
        if style is None:
            continue
        if style == "replicated_with_grad_allreduce":
            grad_summed.append(name)
            continue
        if not isinstance(module, nn.Linear):
            raise ValueError(f"{name} is planned {style!r} but is a {type(module).__name__}, not an nn.Linear")
        kind = PROJECTION_KINDS[name.rpartition(".")[2]]
        features = module.out_features if style == "colwise" else module.in_features
        if features != layout.units.count(kind) * units[kind]:
            raise ValueError(f"{name} has {features} {'output' if style == 'colwise' else 'input'} features; "
                             f"{layout.units.count(kind)} {kind} units of {units[kind]} make "
                             f"{layout.units.count(kind) * units[kind]}")
        parent_name = name.rpartition(".")[0]
        parent = base.get_submodule(parent_name)
        expand = kv_index if kind == "kv" and not regular else None
        base.set_submodule(name, _projection(module, style, kind, units[kind], layout, rank, group, expand, device,
                                             dtype))
        if style == "colwise":
            entries.add(parent_name)
        if kind == "heads" and style == "colwise":
            if not hasattr(parent, "num_key_value_groups"):
                raise ValueError(f"{parent_name} holds {name} but has no num_key_value_groups to set")
            parent.num_key_value_groups = n_q // n_kv if regular else 1
    for parent_name in entries:
        base.get_submodule(parent_name).register_forward_pre_hook(partial(_enter_tp, group_of), with_kwargs=True)
    return grad_summed


def _materialize(base: nn.Module, device) -> None:
    """Allocate what is still on the meta device (norm weights, rotary buffers); buffers get transformers' init."""
    if device.type == "meta":
        return
    for module in base.modules():
        for name, p in list(module.named_parameters(recurse=False)):
            if p.is_meta:
                setattr(module, name, nn.Parameter(torch.empty_like(p, device=device), p.requires_grad))
        stale = [name for name, b in module.named_buffers(recurse=False) if b.is_meta]
        for name in stale:
            module._buffers[name] = torch.empty_like(module._buffers[name], device=device)
        if stale:
            base._init_weights(module)


def _sum_over(group_of):
    return lambda grad: wire.all_reduce(grad.contiguous().clone(), group_of())


class HFCausalLM(CausalLMShard):
    """A transformers causal LM sharded by a ShardLayout; `layout=None` is the unsharded model (TP 1).

    Parameter names are transformers' (`model.layers.0.self_attn.q_proj.weight`, `lm_head.weight`). The weights
    are left unset: build with `from_pretrained` (a directory, reading only this rank's slices) or `from_model`
    (an unsharded transformers model).
    """

    def __init__(self, config: HFConfig, layout: ShardLayout | None = None, tp_rank: int = 0, tp_group=None,
                 device=None, dtype=None):
        super().__init__()
        import transformers

        layout = layout or ShardLayout.balanced(config.units(), 1)
        check_shard(config.units(), layout, tp_rank, tp_group)
        self.config, self.layout, self.tp_rank, self.tp_group = config, layout, tp_rank, tp_group
        device = torch.device(device) if device is not None else torch.get_default_device()
        dtype = dtype or torch.get_default_dtype()
        with torch.device("meta"):
            hf = transformers.AutoModelForCausalLM.from_config(config.to_transformers(), dtype=dtype)
        self.model = getattr(hf, hf.base_model_prefix)
        shard = weakref.ref(self)  # a hook holding the shard itself would make it a reference cycle

        def group_of():
            return shard().tp_group

        grad_summed = apply_tp_plan(self.model, config, layout, tp_rank, tp_group, group_of, device, dtype)
        pad = self.model.config.pad_token_id
        self.model.set_input_embeddings(VocabParallelEmbedding(
            config.vocab_size, config.hidden_size, layout, tp_rank, tp_group, device, dtype,
            padding_idx=pad if isinstance(pad, int) and 0 <= pad < config.vocab_size else None))
        if not config.tie_word_embeddings:
            self.lm_head = ColumnParallelLinear(config.hidden_size, config.vocab_size, ParamSpec("vocab", 0, 1),
                                                layout, tp_rank, tp_group, device, dtype,
                                                bias=hf.get_output_embeddings().bias is not None)
        _materialize(self.model, device)
        if tp_group is not None and layout.tp > 1:
            for name in grad_summed:
                for p in self.model.get_submodule(name).parameters():
                    p.register_hook(_sum_over(group_of))

    def embedding(self) -> VocabParallelEmbedding:
        return self.model.get_input_embeddings()

    def logits(self, input_ids: torch.Tensor) -> torch.Tensor:
        self.check_runnable()
        h = self.model(input_ids=input_ids, use_cache=False).last_hidden_state
        h = copy_to_tp(h, self.tp_group)
        if self.config.tie_word_embeddings:
            return F.linear(h, self.embedding().weight)
        return self.lm_head(h)

    @classmethod
    def from_pretrained(cls, path, layout: ShardLayout | None = None, tp_rank: int = 0, tp_group=None, dtype=None,
                        device=None) -> "HFCausalLM":
        """Load an HF model directory, reading only this rank's shard of each tensor; `dtype=None` keeps the
        checkpoint's."""
        config = HFConfig.from_pretrained(path)
        model = cls(config, layout, tp_rank, tp_group, device=device,
                    dtype=dtype or checkpoint_dtype(path, "model.embed_tokens.weight"))
        load_shards(model, path)
        return model

    @classmethod
    @torch.no_grad()
    def from_model(cls, hf: nn.Module, layout: ShardLayout | None = None, tp_rank: int = 0,
                   tp_group=None) -> "HFCausalLM":
        """This rank's shard of an unsharded transformers causal LM (left unchanged)."""
        full = dict(hf.named_parameters())
        weight = hf.get_input_embeddings().weight
        model = cls(HFConfig.from_transformers(hf.config), layout, tp_rank, tp_group, weight.device, weight.dtype)
        for name, (spec, _) in model.param_specs().items():
            model.get_parameter(name).copy_(shard_tensor(full[name].detach(), spec, model.layout, tp_rank))
        return model

    def save_pretrained(self, path) -> None:
        """Write config.json and model.safetensors that `AutoModelForCausalLM.from_pretrained` loads (TP 1 only)."""
        if self.layout.tp != 1:
            raise ValueError(f"save_pretrained needs the unsharded model; this is a shard of tp={self.layout.tp}")
        write_hf_dir(path, self.config, {n: p.detach().cpu() for n, p in self.named_parameters()})


def is_hf_model(model) -> bool:
    """Whether `model` is a transformers model instance (checked without importing transformers)."""
    return hasattr(model, "config") and hasattr(model.config, "model_type") and hasattr(model, "base_model_prefix")


def is_model_dir(model) -> bool:
    return isinstance(model, (str, os.PathLike)) and (Path(model) / "config.json").exists()
