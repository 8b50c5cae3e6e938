"""Recovery inputs for a job at any scale, built from shapes alone (meta tensors): no weights, no processes.

The fragment addresses follow ZeRO 1/2's partitioning (`layout.zero`: one parameter group in the model's order,
padded to a multiple of 2 x the data-parallel degree, cut into equal contiguous partitions, one per anchor
replica), so the planning code sees what a real job's ranks would hold, at a size whose data could never fit here.
"""

from __future__ import annotations

from ntp_ds.layout import Topology, plan_buddies, plan_gradient_sync
from ntp_ds.layout.zero import FlatOrder, anchor_addresses
from ntp_ds.models import Llama, LlamaConfig


def llama_70b() -> LlamaConfig:
    """A Llama-3-70B-shaped decoder."""
    return LlamaConfig(vocab_size=128256, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                       num_attention_heads=64, num_key_value_heads=8)


def shape_specs(config: LlamaConfig) -> tuple[dict, dict]:
    """(specs, full shapes) per parameter name, from a model built on the meta device."""
    model = Llama(config, init=False, device="meta")
    specs = model.param_specs()
    return {n: s for n, (s, _) in specs.items()}, {n: shape for n, (_, shape) in specs.items()}


def zero_order(specs) -> FlatOrder:
    """The flat order of a ZeRO 1/2 optimizer over one parameter group of the model's parameters."""
    return FlatOrder((tuple(specs),))


def zero_addresses(topology: Topology, rank: int, specs, full_shapes) -> dict[str, tuple[int, int]]:
    """(start, numel) in its local shard of every parameter fragment anchor `rank`'s ZeRO partition holds."""
    return anchor_addresses(zero_order(specs), topology, rank, specs, full_shapes)


def gathered_offers(old: Topology, new: Topology, old_rank_of: dict[int, int], specs, full_shapes,
                    step: int = 1) -> list[dict]:
    """What every new rank contributes to recovery's state gather: the fragments it can serve (its own, as an old
    anchor, and its buddy copies, one per anchor) and the addresses of its new fragments."""
    old_plan, new_plan = plan_gradient_sync(old), plan_gradient_sync(new)
    buddies = plan_buddies(old, old_plan, 1, 1)
    copies_on: dict[int, list[int]] = {}
    for owner, holders in buddies.items():
        for h in holders:
            copies_on.setdefault(h, []).append(owner)
    addresses: dict[tuple, dict] = {}

    def of(rank: int, topology: Topology = old, plan=old_plan) -> dict:
        """Addresses depend only on the layout, TP index and data-parallel index: computed once for each."""
        replica, tp = topology.locate(rank)
        key = (topology is new, topology.layouts[replica], tp, plan.anchors.index(replica))
        if key not in addresses:
            addresses[key] = zero_addresses(topology, rank, specs, full_shapes)
        return addresses[key]

    out = []
    for new_rank in range(new.world_size):
        o = old_rank_of[new_rank]
        owners = ([o] if old_plan.is_anchor(old.locate(o)[0]) else []) + copies_on.get(o, [])
        offer = {"keys": ("exp_avg", "exp_avg_sq"), "steps": {w: step for w in owners},
                 "held": {w: of(w) for w in owners}}
        need = of(new_rank, new, new_plan) if new_plan.is_anchor(new.locate(new_rank)[0]) else {}
        out.append({"offer": offer, "need": need})
    return out
