"""This rank's optimizer state as fragments of its parameters, and installing such state into a fresh engine.

A fragment is the part of one parameter's flattened local shard that this rank's optimizer owns: all of it without
ZeRO, a slice of it under ZeRO 1/2 (`param._hp_mapping`). Fragments are DeepSpeed-layout-free, so they can be copied
to another replica every step and re-sliced into a differently partitioned engine after a failure.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ntp_ds.layout.zero import START_ALIGNMENT, FlatOrder

MASTER = "fp32"


@dataclass
class Fragment:
    """Elements [start, start + numel) of a parameter's flattened local shard, with their optimizer tensors."""

    start: int
    numel: int
    tensors: dict[str, torch.Tensor]


def inner_optimizer(engine):
    return getattr(engine.optimizer, "optimizer", engine.optimizer)


def uses_hp_mapping(engine) -> bool:
    return any(hasattr(p, "_hp_mapping") for p in engine.module.parameters())


def optimizer_step(engine) -> int:
    """The optimizer's step count (0 before the first step)."""
    for state in inner_optimizer(engine).state.values():
        if "step" in state:
            return int(state["step"])
    return 0


def state_keys(engine) -> tuple[str, ...]:
    """Names of the per-element optimizer tensors (e.g. exp_avg, exp_avg_sq for Adam); empty for plain SGD."""
    for state in inner_optimizer(engine).state.values():
        return tuple(k for k, v in state.items() if torch.is_tensor(v) and v.numel() > 1)
    return ()


def local_fragments(engine, keys: tuple[str, ...]) -> dict[str, Fragment]:
    """Views (not copies) of this rank's fp32 masters and optimizer tensors, per parameter name."""
    out = {}
    inner = inner_optimizer(engine)
    for name, p in engine.module.named_parameters():
        mapping = getattr(p, "_hp_mapping", None)
        if hasattr(p, "_hp_mapping"):
            if mapping is None:
                continue
            addr = mapping.lp_fragment_address
            tensors = {MASTER: mapping.get_hp_fragment()}
            tensors.update({k: mapping.get_hp_fragment(k) for k in keys})
            out[name] = Fragment(addr.start, addr.numel, tensors)
        else:
            state = inner.state.get(p, {})
            tensors = {MASTER: p.data.view(-1)}
            tensors.update({k: state[k].view(-1) for k in keys if k in state})
            out[name] = Fragment(0, p.numel(), tensors)
    return out


def flat_sources(engine, keys: tuple[str, ...]) -> tuple[list[torch.Tensor], dict[str, tuple[int, int, int, int]]]:
    """The flat tensors that hold this rank's optimizer state, and where each parameter's fragment lies in them.

    Sources come in runs of 1 + len(keys): fp32 masters, then each optimizer tensor. Under ZeRO 1/2 a run is one
    parameter group's flat partition (the live tensors, no copy); without ZeRO it is one parameter. Per parameter:
    (index of its run's first source, offset in those sources, fragment start in the local shard, numel).
    """
    inner = inner_optimizer(engine)
    width = 1 + len(keys)
    if uses_hp_mapping(engine):
        sources = []
        for flat in engine.optimizer.single_partition_of_fp32_groups:
            sources += [flat] + [inner.state[flat][k] for k in keys]
        index = {}
        for name, p in engine.module.named_parameters():
            m = getattr(p, "_hp_mapping", None)
            if m is not None:
                index[name] = (m.param_group_index * width, m.hp_fragment_address.start, m.lp_fragment_address.start,
                               m.lp_fragment_address.numel)
        return sources, index
    sources, index = [], {}
    for name, p in engine.module.named_parameters():
        state = inner.state.get(p, {})
        index[name] = (len(sources), 0, 0, p.numel())
        sources += [p.data.view(-1).float()] + [state[k].view(-1) for k in keys]
    return sources, index


def fragment_addresses(engine) -> dict[str, tuple[int, int]]:
    """(start, numel) of the fragment this rank's optimizer owns, per parameter (those with none are left out)."""
    out = {}
    for name, p in engine.module.named_parameters():
        if hasattr(p, "_hp_mapping"):
            if p._hp_mapping is not None:
                out[name] = (p._hp_mapping.lp_fragment_address.start, p._hp_mapping.lp_fragment_address.numel)
        else:
            out[name] = (0, p.numel())
    return out


def link_round_robin(engine) -> None:
    """Make DeepSpeed's parameter-to-partition links (`param._hp_mapping`) follow its round-robin flat layout.

    With `round_robin_gradients` DeepSpeed 0.19 flattens each parameter group in round-robin order
    (`round_robin_bit16_groups`), but unless some parameter is padded (`parameter_alignment`) its
    `_link_all_hp_params` passes no offsets, and `_init_lp_to_hp_mapping` then lays the parameters end to end in
    their original order (`bit16_groups`): every fragment address (which parameter, which elements, where in the
    fp32 partition) describes the non-round-robin layout, while the optimizer steps the real one. Training is
    unaffected (it steps whole flat partitions), but every fragment read or written through the links (the redundant
    copies, re-slicing, DeepSpeed's own `safe_get_full_fp32_param`) takes another parameter's elements. This links
    every group with the real offsets, now and whenever DeepSpeed links again (checkpoint load, offload reload)."""
    zero = engine.optimizer
    if not getattr(zero, "round_robin_gradients", False) or not hasattr(zero, "round_robin_bit16_offsets"):
        return
    import weakref

    from deepspeed import comm as dist
    from deepspeed.utils.mixed_precision_linkage import link_hp_params

    ref = weakref.ref(zero)  # no bound method on the optimizer: a cycle would keep its process groups open

    def _link_all_hp_params():
        self = ref()
        if self.cpu_offload:
            self._get_offload_gradient_dict()
        for i, _ in enumerate(self.optimizer.param_groups):
            group = self.real_dp_process_group[i]
            partition_id = dist.get_rank(group=group)
            partition_size = self.bit16_groups_flat[i].numel() // dist.get_world_size(group=group)
            offset_of = {id(p): o
                         for p, o in zip(self.round_robin_bit16_groups[i], self.round_robin_bit16_offsets[i])}
            link_hp_params(lp_param_list=self.bit16_groups[i],
                           flat_hp_partition=self.single_partition_of_fp32_groups[i],
                           gradient_dict=self.averaged_gradients, offload_gradient_dict=self.offload_gradient_dict,
                           use_offload=self.cpu_offload, param_group_index=i,
                           partition_start=partition_id * partition_size, partition_size=partition_size,
                           dp_group=group, param_offsets=[offset_of[id(p)] for p in self.bit16_groups[i]])

    zero._link_all_hp_params = _link_all_hp_params
    zero._link_all_hp_params()
    zero._hp_optimizer_states_linked = False
    zero._param_slice_mappings = zero._create_param_mapping()
    if zero.cpu_offload:
        zero._create_optimizer_mapping()


def flat_order(engine) -> FlatOrder | None:
    """How this engine's optimizer lays out its parameters (`layout.zero`), read off DeepSpeed; None where that rule
    does not describe it (an optimizer other than ZeRO 1/2 that links fragments, groups of different dtypes)."""
    names = {id(p): n for n, p in engine.module.named_parameters()}
    if not uses_hp_mapping(engine):
        return FlatOrder((tuple(names.values()),), partitioned=False)
    zero = engine.optimizer
    groups = getattr(zero, "bit16_groups", None)
    if (not groups or not hasattr(zero, "round_robin_gradients")
            or getattr(zero, "nccl_start_alignment_factor", None) != START_ALIGNMENT):
        return None
    sizes = {p.element_size() for group in groups for p in group}
    if len(sizes) != 1:
        return None
    alignment = 16 // math.gcd(16, sizes.pop()) if getattr(zero, "parameter_alignment", False) else 1
    return FlatOrder(tuple(tuple(names[id(p)] for p in group) for group in groups), alignment,
                     round_robin=bool(zero.round_robin_gradients))


@torch.no_grad()
def reset_state(engine, step: int, keys: tuple[str, ...]) -> None:
    """Give a freshly built engine's optimizer zeroed state tensors `keys` and step count `step`, so that
    `local_fragments` returns writable views of every fragment (fp32 masters stay as DeepSpeed initialised them:
    the parameters' values)."""
    inner = inner_optimizer(engine)
    if uses_hp_mapping(engine):
        if keys:
            for group in engine.optimizer.single_partition_of_fp32_groups:
                held = inner.state.get(group, {})
                # A tensor of the partition's size is zeroed where it is (no second copy of the state at once).
                inner.state[group] = {"step": torch.tensor(float(step)), **{
                    k: held[k].zero_() if _sized_as(held.get(k), group) else torch.zeros_like(group) for k in keys}}
            # The fragments' links to the state tensors are made anew: they may point at tensors just replaced.
            engine.optimizer._hp_optimizer_states_linked = False
            engine.optimizer._lazy_init_hp_params_optimizer_state()
        return
    if keys:
        for p in engine.module.parameters():
            inner.state[p] = {"step": torch.tensor(float(step))}
            inner.state[p].update({k: torch.zeros_like(p) for k in keys})


def _sized_as(tensor, like: torch.Tensor) -> bool:
    return torch.is_tensor(tensor) and tensor.shape == like.shape and tensor.dtype == like.dtype \
        and tensor.device == like.device


@torch.no_grad()
def params_from_masters(engine) -> None:
    """Make the parameters of every new anchor the image of the fp32 masters its optimizer holds (DeepSpeed's own
    copy into the low-precision partition and all-gather over the data-parallel group, as after a step). Without
    DeepSpeed's fragment mapping the masters are the parameters themselves."""
    if engine.optimizer is not None and uses_hp_mapping(engine):
        engine.optimizer.update_lp_params()
