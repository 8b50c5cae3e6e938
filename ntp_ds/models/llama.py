"""Llama decoder whose TP rank holds any set of heads, FFN columns and vocabulary rows a ShardLayout gives it.

Parameter names are those of Hugging Face `LlamaForCausalLM`, so HF checkpoints load shard by shard and an unsharded
model saves back to HF form.
"""

from __future__ import annotations

import json
import zlib
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F
from safetensors.torch import save_file

from ntp_ds.layout import units as U
from ntp_ds.layout.shard_layout import ParamSpec, ShardLayout
from ntp_ds.models.config import LlamaConfig
from ntp_ds.models.causal_lm import CausalLMShard
from ntp_ds.models.checkpoint import checkpoint_dtype, load_shards
from ntp_ds.models.tp_layers import (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding, check_shard,
                                     copy_to_tp, local_kv_index)

INIT_CHUNK_UNITS = 64
"""Units drawn from one generator by `Llama.init_weights`."""


def _draw_shard(name: str, spec: ParamSpec, shape: tuple[int, ...], layout: ShardLayout, tp_rank: int, seed: int,
                std: float, device) -> torch.Tensor:
    """`tp_rank`'s shard of a normal tensor whose chunks of units are drawn from their own seeded generators."""
    total = layout.units.count(spec.kind)
    pieces = []
    for a, b in layout.owned(spec.kind, tp_rank):
        for chunk in range(a // INIT_CHUNK_UNITS, (b - 1) // INIT_CHUNK_UNITS + 1):
            lo, hi = chunk * INIT_CHUNK_UNITS, min((chunk + 1) * INIT_CHUNK_UNITS, total)
            key = f"{seed}/{name}/{chunk}".encode()
            gen = torch.Generator(device=device).manual_seed(zlib.crc32(key) * 1_000_003 + seed % 1_000_003)
            block_shape = list(shape)
            block_shape[spec.dim] = (hi - lo) * spec.unit_size
            block = torch.empty(block_shape, device=device).normal_(0.0, std, generator=gen)
            start, stop = max(a, lo) - lo, min(b, hi) - lo
            pieces.append(block.narrow(spec.dim, start * spec.unit_size, (stop - start) * spec.unit_size))
    return torch.cat(pieces, dim=spec.dim)


class RMSNorm(nn.Module):
    """Root-mean-square norm computed in fp32; its weight is replicated on every TP rank."""

    def __init__(self, dim: int, eps: float, device=None, dtype=None):
        super().__init__()
        self.spec, self.full_shape, self.eps = ParamSpec("replicated"), (dim,), eps
        self.weight = nn.Parameter(torch.ones(dim, device=device, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


def rotary(config: LlamaConfig, seq_len: int, device, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Return cos and sin [seq_len, head_dim] of the default rotary embedding for positions 0..seq_len-1."""
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float, device=device) / dim))
    freqs = torch.arange(seq_len, device=device, dtype=torch.float)[:, None] * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the two halves of each head's channels by the position angles (HF's rotate-half convention)."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


class Attention(nn.Module):
    """Causal grouped-query attention over the rank's query heads and the KV heads they read."""

    def __init__(self, config: LlamaConfig, layout: ShardLayout, rank: int, group=None, device=None, dtype=None):
        super().__init__()
        c, hd, kw = config, config.head_dim, dict(device=device, dtype=dtype)
        self.head_dim, self.group = hd, group
        self.q_proj = ColumnParallelLinear(c.hidden_size, c.num_attention_heads * hd, ParamSpec("heads", 0, hd),
                                           layout, rank, group, **kw)
        self.k_proj = ColumnParallelLinear(c.hidden_size, c.num_key_value_heads * hd, ParamSpec("kv", 0, hd),
                                           layout, rank, group, **kw)
        self.v_proj = ColumnParallelLinear(c.hidden_size, c.num_key_value_heads * hd, ParamSpec("kv", 0, hd),
                                           layout, rank, group, **kw)
        self.o_proj = RowParallelLinear(c.num_attention_heads * hd, c.hidden_size, ParamSpec("heads", 1, hd),
                                        layout, rank, group, **kw)
        kv_index = local_kv_index(layout, rank)
        n_q, n_kv = len(kv_index), U.count(layout.owned("kv", rank))
        self.regular_gqa = n_q % n_kv == 0 and kv_index == [i // (n_q // n_kv) for i in range(n_q)]
        self.register_buffer("kv_index", torch.tensor(kv_index, device=device), persistent=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = copy_to_tp(x, self.group)
        B, T, _ = x.shape
        q, k, v = (proj(x).view(B, T, -1, self.head_dim).transpose(1, 2)
                   for proj in (self.q_proj, self.k_proj, self.v_proj))
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        if self.regular_gqa:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        else:
            k, v = k.index_select(1, self.kv_index), v.index_select(1, self.kv_index)
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, -1))


class MLP(nn.Module):
    """SwiGLU MLP over the rank's FFN columns."""

    def __init__(self, config: LlamaConfig, layout: ShardLayout, rank: int, group=None, device=None, dtype=None):
        super().__init__()
        h, f, kw = config.hidden_size, config.intermediate_size, dict(device=device, dtype=dtype)
        self.group = group
        self.gate_proj = ColumnParallelLinear(h, f, ParamSpec("ffn", 0, 1), layout, rank, group, **kw)
        self.up_proj = ColumnParallelLinear(h, f, ParamSpec("ffn", 0, 1), layout, rank, group, **kw)
        self.down_proj = RowParallelLinear(f, h, ParamSpec("ffn", 1, 1), layout, rank, group, **kw)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = copy_to_tp(x, self.group)
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    """Pre-norm decoder block: attention then MLP, each added to the replicated residual stream."""

    def __init__(self, config: LlamaConfig, layout: ShardLayout, rank: int, group=None, device=None, dtype=None):
        super().__init__()
        kw = dict(device=device, dtype=dtype)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, **kw)
        self.self_attn = Attention(config, layout, rank, group, **kw)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, **kw)
        self.mlp = MLP(config, layout, rank, group, **kw)

    def forward(self, x, cos, sin):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class Decoder(nn.Module):
    """Embedding, blocks and final norm: HF's `LlamaModel`, returning replicated hidden states."""

    def __init__(self, config: LlamaConfig, layout: ShardLayout, rank: int, group=None, device=None, dtype=None):
        super().__init__()
        kw = dict(device=device, dtype=dtype)
        self.config = config
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, layout, rank, group, **kw)
        self.layers = nn.ModuleList(Block(config, layout, rank, group, **kw) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, **kw)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        cos, sin = rotary(self.config, input_ids.shape[1], x.device, x.dtype)
        for layer in self.layers:
            x = layer(x, cos, sin)
        return self.norm(x)


class Llama(CausalLMShard):
    """Causal LM; `layout=None` is the unsharded model (TP 1), otherwise the shard of TP rank `tp_rank`.

    Every weight is initialized as this rank's shard of one full tensor drawn from `seed`, so any layout gets the
    same model; `seed=None` draws the seed from torch's global RNG (ranks must then share its state), and
    `init=False` leaves the weights unset for loading.
    """

    def __init__(self, config: LlamaConfig, layout: ShardLayout | None = None, tp_rank: int = 0, tp_group=None,
                 seed: int | None = None, init: bool = True, device=None, dtype=None):
        super().__init__()
        layout = layout or ShardLayout.balanced(config.units(), 1)
        check_shard(config.units(), layout, tp_rank, tp_group)
        self.config, self.layout, self.tp_rank, self.tp_group = config, layout, tp_rank, tp_group
        kw = dict(device=device, dtype=dtype)
        self.model = Decoder(config, layout, tp_rank, tp_group, **kw)
        if not config.tie_word_embeddings:
            self.lm_head = ColumnParallelLinear(config.hidden_size, config.vocab_size, ParamSpec("vocab", 0, 1),
                                                layout, tp_rank, tp_group, **kw)
        if init:
            self.init_weights(int(torch.randint(0, 2**62, ()).item()) if seed is None else seed)

    def embedding(self) -> VocabParallelEmbedding:
        return self.model.embed_tokens

    def logits(self, input_ids: torch.Tensor) -> torch.Tensor:
        self.check_runnable()
        h = copy_to_tp(self.model(input_ids), self.tp_group)
        if self.config.tie_word_embeddings:
            return F.linear(h, self.model.embed_tokens.weight)
        return self.lm_head(h)

    @torch.no_grad()
    def init_weights(self, seed: int = 0):
        """Normal(0, initializer_range) matrices and unit norms; this rank draws only its own units.

        Units are drawn in fixed chunks of `INIT_CHUNK_UNITS`, each from a generator seeded by (seed, name, chunk),
        so a unit's values do not depend on the layout (any layout gets the same model) and a rank never builds a
        full tensor: it draws the chunks its units fall in, at most two more than its own per contiguous range.
        """
        for name, (spec, shape) in self.param_specs().items():
            p = self.get_parameter(name)
            if spec.kind == "replicated":
                p.fill_(1.0)
                continue
            if p.is_meta:
                continue
            p.copy_(_draw_shard(name, spec, shape, self.layout, self.tp_rank, seed, self.config.initializer_range,
                                p.device))

    @classmethod
    def from_pretrained(cls, path, layout: ShardLayout | None = None, tp_rank: int = 0, tp_group=None, dtype=None,
                        device=None) -> "Llama":
        """Load an HF Llama directory (config.json + safetensors), reading only this rank's shard of each tensor.

        `dtype=None` keeps the checkpoint's dtype.
        """
        path = Path(path)
        config = LlamaConfig.from_hf_dict(json.loads((path / "config.json").read_text()))
        model = cls(config, layout, tp_rank, tp_group, init=False, device=device,
                    dtype=dtype or checkpoint_dtype(path, "model.embed_tokens.weight"))
        load_shards(model, path)
        return model

    def save_pretrained(self, path):
        """Write config.json and model.safetensors in HF form; only the unsharded (TP 1) model can be saved."""
        if self.layout.tp != 1:
            raise ValueError(f"save_pretrained needs the unsharded model; this is a shard of tp={self.layout.tp}")
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        tensors = {name: p.detach().cpu().contiguous() for name, p in self.named_parameters()}
        dtype = str(next(iter(tensors.values())).dtype).removeprefix("torch.")
        (path / "config.json").write_text(json.dumps(self.config.to_hf_dict(dtype), indent=2) + "\n")
        save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
