"""Model configurations, read from and written to Hugging Face `config.json` form.

`LlamaConfig` is the own Llama's; `HFConfig` carries any supported transformers decoder's `config.json` and the
shapes the engine plans with. Both give the same fields to the layout, memory and checkpoint code.
"""

from __future__ import annotations

from dataclasses import dataclass

from ntp_ds.layout.cost import unit_cost
from ntp_ds.layout.shard_layout import LayoutError, ModelUnits

SUPPORTED_ACT = "silu"


def model_units(config, seq_len: int | None = None) -> ModelUnits:
    """The units of a decoder config (either family: SwiGLU FFN) and what each costs at `seq_len` tokens."""
    cost = unit_cost(config.hidden_size, config.head_dim, config.num_hidden_layers,
                     seq_len or config.max_position_embeddings, ffn_matrices=3)
    return ModelUnits(heads=config.num_attention_heads, kv_heads=config.num_key_value_heads,
                      ffn=config.intermediate_size, vocab=config.vocab_size, cost=cost)


@dataclass
class LlamaConfig:
    """Shape and numerics of a Llama-style decoder."""

    vocab_size: int = 32000
    """Vocabulary rows of the embedding and the output head."""
    hidden_size: int = 4096
    """Width of the residual stream."""
    intermediate_size: int = 11008
    """Inner width of the SwiGLU MLP (its FFN units)."""
    num_hidden_layers: int = 32
    """Number of decoder blocks."""
    num_attention_heads: int = 32
    """Query heads per block."""
    num_key_value_heads: int | None = None
    """KV heads per block (grouped-query attention); None means one per query head."""
    head_dim: int | None = None
    """Width of one head; None means hidden_size // num_attention_heads."""
    rms_norm_eps: float = 1e-6
    """Epsilon added to the mean square in RMSNorm."""
    rope_theta: float = 10000.0
    """Base of the rotary position embedding frequencies."""
    max_position_embeddings: int = 2048
    """Longest sequence the model is meant for."""
    tie_word_embeddings: bool = False
    """Whether the output head reuses the input embedding matrix."""
    initializer_range: float = 0.02
    """Standard deviation of the normal init of every matrix."""

    def __post_init__(self):
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                     "num_key_value_heads", "max_position_embeddings"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name}={value!r} must be a positive integer")
        if self.num_attention_heads % self.num_key_value_heads:
            raise LayoutError(f"num_attention_heads={self.num_attention_heads} must be a multiple of "
                              f"num_key_value_heads={self.num_key_value_heads}")
        if self.head_dim is None:
            if self.hidden_size % self.num_attention_heads:
                raise ValueError(f"hidden_size={self.hidden_size} must be divisible by num_attention_heads="
                                 f"{self.num_attention_heads} when head_dim is unset")
            self.head_dim = self.hidden_size // self.num_attention_heads
        if not isinstance(self.head_dim, int) or self.head_dim < 2 or self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim!r} must be a positive even integer (rotary embedding)")
        if not self.rms_norm_eps > 0:
            raise ValueError(f"rms_norm_eps={self.rms_norm_eps} must be positive")
        if not self.rope_theta > 0:
            raise ValueError(f"rope_theta={self.rope_theta} must be positive")
        if not self.initializer_range >= 0:
            raise ValueError(f"initializer_range={self.initializer_range} must be non-negative")

    def units(self, seq_len: int | None = None) -> ModelUnits:
        """Sharding units of this model (query heads, KV heads, FFN columns, vocabulary rows) and their cost at
        sequences of `seq_len` tokens (default max_position_embeddings)."""
        return model_units(self, seq_len)

    @classmethod
    def from_hf_dict(cls, d: dict) -> "LlamaConfig":
        """Read a Hugging Face Llama `config.json` dict (transformers 4 or 5 form), refusing features we lack."""
        if d.get("model_type", "llama") != "llama":
            raise ValueError(f"model_type={d.get('model_type')!r} is not supported; expected 'llama'")
        if d.get("hidden_act", SUPPORTED_ACT) != SUPPORTED_ACT:
            raise ValueError(f"hidden_act={d['hidden_act']!r} is not supported; expected {SUPPORTED_ACT!r}")
        for name in ("attention_bias", "mlp_bias"):
            if d.get(name):
                raise ValueError(f"{name}=True is not supported; Llama projections here have no bias")
        rope = dict(d.get("rope_parameters") or {})
        scaling = d.get("rope_scaling") or {}
        rope_type = rope.get("rope_type", scaling.get("rope_type", scaling.get("type", "default")))
        if rope_type != "default":
            raise ValueError(f"rope_type={rope_type!r} is not supported; only the default rotary embedding is")
        theta = rope.get("rope_theta", d.get("rope_theta", 10000.0))
        return cls(
            vocab_size=d["vocab_size"],
            hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"],
            num_hidden_layers=d["num_hidden_layers"],
            num_attention_heads=d["num_attention_heads"],
            num_key_value_heads=d.get("num_key_value_heads"),
            head_dim=d.get("head_dim"),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=float(theta),
            max_position_embeddings=d.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            initializer_range=float(d.get("initializer_range", 0.02)),
        )

    def to_hf_dict(self, dtype: str | None = None) -> dict:
        """Write the `config.json` dict of an HF `LlamaForCausalLM`, loadable by transformers 4 and 5."""
        d = {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "hidden_act": SUPPORTED_ACT,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_parameters": {"rope_type": "default", "rope_theta": self.rope_theta},
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "initializer_range": self.initializer_range,
            "attention_bias": False,
            "mlp_bias": False,
        }
        if dtype is not None:
            d["dtype"] = d["torch_dtype"] = dtype
        return d


@dataclass
class HFConfig:
    """A transformers decoder's full `config.json` dict, with the shape fields the engine plans with read from it.

    Build it with `from_transformers` (a `PretrainedConfig`) or `from_pretrained` (a directory), which fill every
    default, so the dict is complete and `to_hf_dict` writes back what transformers reads.
    """

    hf: dict
    """The config dict (`PretrainedConfig.to_dict()`), `model_type` included."""

    def __post_init__(self):
        d = self.hf
        if not d.get("model_type"):
            raise ValueError("model_type is missing from the Hugging Face config")
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"):
            value = d.get(name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name}={value!r} must be a positive integer (model_type {d['model_type']!r})")
        if self.num_attention_heads % self.num_key_value_heads:
            raise LayoutError(f"num_attention_heads={self.num_attention_heads} must be a multiple of "
                              f"num_key_value_heads={self.num_key_value_heads}")

    @classmethod
    def from_transformers(cls, config) -> "HFConfig":
        """Read a transformers `PretrainedConfig` (of a model instance, or loaded with `AutoConfig`)."""
        return cls(config.to_dict())

    @classmethod
    def from_pretrained(cls, path) -> "HFConfig":
        """Read the `config.json` of an HF model directory through transformers (which fills the defaults)."""
        import transformers

        return cls.from_transformers(transformers.AutoConfig.from_pretrained(path))

    def to_transformers(self):
        """The transformers `PretrainedConfig` of this dict."""
        import transformers

        return transformers.AutoConfig.for_model(**self.hf)

    @property
    def model_type(self) -> str:
        return self.hf["model_type"]

    @property
    def vocab_size(self) -> int:
        return self.hf["vocab_size"]

    @property
    def hidden_size(self) -> int:
        return self.hf["hidden_size"]

    @property
    def intermediate_size(self) -> int:
        return self.hf["intermediate_size"]

    @property
    def num_hidden_layers(self) -> int:
        return self.hf["num_hidden_layers"]

    @property
    def num_attention_heads(self) -> int:
        return self.hf["num_attention_heads"]

    @property
    def num_key_value_heads(self) -> int:
        return self.hf.get("num_key_value_heads") or self.num_attention_heads

    @property
    def head_dim(self) -> int:
        return self.hf.get("head_dim") or self.hidden_size // self.num_attention_heads

    @property
    def tie_word_embeddings(self) -> bool:
        return bool(self.hf.get("tie_word_embeddings", False))

    @property
    def max_position_embeddings(self) -> int:
        return self.hf.get("max_position_embeddings", 2048)

    def units(self, seq_len: int | None = None) -> ModelUnits:
        """Sharding units of this model (query heads, KV heads, FFN columns, vocabulary rows) and their cost at
        sequences of `seq_len` tokens (default max_position_embeddings)."""
        return model_units(self, seq_len)

    def to_hf_dict(self, dtype: str | None = None) -> dict:
        """The `config.json` dict, naming the causal-LM class `AutoModelForCausalLM` builds for it."""
        d = dict(self.hf)
        if not d.get("architectures"):
            from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

            d["architectures"] = [MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[self.model_type]]
        if dtype is not None:
            d["dtype"] = dtype
        return d
