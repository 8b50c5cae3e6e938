"""Per-rank memory estimates, used to fit a degraded replica's micro-batch into the memory budget."""

from __future__ import annotations

from ntp_ds.layout import ShardLayout
from ntp_ds.layout import units as U


def _dtype_bytes(ds_config: dict) -> int:
    return 2 if ds_config.get("bf16", {}).get("enabled") else 4


def rank_memory(config, layout: ShardLayout, ds_config: dict, seq_len: int, dp: int) -> tuple[int, int]:
    """Return (static bytes, activation bytes per sample) of the most loaded rank of `layout`.

    Static: weights and gradients in the training dtype plus fp32 master and two Adam moments, the latter divided
    over the ZeRO group when ZeRO partitions them. Activations: a rough per-layer count of saved tensors.
    """
    width = _dtype_bytes(ds_config)
    stage = int(ds_config.get("zero_optimization", {}).get("stage", 0))
    optim_share = dp if stage >= 1 else 1
    hd, h = config.head_dim, config.hidden_size
    worst_static, worst_act = 0, 0
    for r in range(layout.tp):
        heads, kv = U.count(layout.owned("heads", r)), U.count(layout.owned("kv", r))
        ffn, vocab = U.count(layout.owned("ffn", r)), U.count(layout.owned("vocab", r))
        per_layer = (2 * heads * hd + 2 * kv * hd) * h + 3 * ffn * h + 2 * h
        params = config.num_hidden_layers * per_layer + vocab * h * (1 if config.tie_word_embeddings else 2) + h
        static = params * (2 * width + (12 if width == 2 else 8) // optim_share)
        act_per_token = config.num_hidden_layers * (4 * h + 2 * (heads + 2 * kv) * hd + 3 * ffn) + vocab
        worst_static = max(worst_static, static)
        worst_act = max(worst_act, act_per_token * seq_len * width)
    return worst_static, worst_act
