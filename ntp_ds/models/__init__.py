"""Causal LMs with nonuniform tensor parallelism, loadable from and savable to Hugging Face form.

Two families of shards, one contract (`CausalLMShard`): the own `Llama` (no transformers needed; shape planning on
meta tensors at any scale) and `HFCausalLM`, transformers' own modules sharded through their TP plan.
"""

from ntp_ds.models.causal_lm import CausalLMShard
from ntp_ds.models.config import HFConfig, LlamaConfig
from ntp_ds.models.hf import HFCausalLM
from ntp_ds.models.llama import Llama

__all__ = ["CausalLMShard", "HFCausalLM", "HFConfig", "Llama", "LlamaConfig", "empty_shard"]


def empty_shard(config: LlamaConfig | HFConfig, layout=None, tp_rank: int = 0, tp_group=None, device=None,
                dtype=None) -> CausalLMShard:
    """A shard with unset weights of the model `config` describes (recovery fills it; `device="meta"`: shapes)."""
    if isinstance(config, HFConfig):
        return HFCausalLM(config, layout, tp_rank, tp_group, device=device, dtype=dtype)
    return Llama(config, layout, tp_rank, tp_group, init=False, device=device, dtype=dtype)
