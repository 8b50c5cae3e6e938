"""Re-cut a live ZeRO 1/2 optimizer onto another data-parallel group, in place: the engine, its parameters and its
optimizer object stay; only what follows from the partitioning is derived again, by DeepSpeed's own helpers where
it has them.

DeepSpeed (0.19) fixes the partitioning when its `DeepSpeedZeroOptimizer` is built: each parameter group is
flattened (in round-robin order over the data-parallel ranks with `round_robin_gradients`), padded to a multiple
of 2 x dp and cut into dp equal partitions; the fp32 masters and the optimizer tensors of partition p live on
data-parallel rank p, keyed in the torch optimizer by the partition's fp32 tensor. After a recovery or a grow an
anchor's data-parallel group has another size and order, so every partition boundary moves. `recut_zero` redoes
that part of DeepSpeed's `__init__` on the existing optimizer for the new group (docs/design.md, "Keeping an
anchor's engine", lists every field it sets) and leaves new fp32 partitions holding the parameters' values and
zeroed optimizer tensors with the step count kept: the caller then writes each fragment's elements through the
parameters' `_hp_mapping` (`fragments.local_fragments`), as it does into a freshly built engine.

The fields, in the order `DeepSpeedZeroOptimizer.__init__` sets them:
- groups: `mpu`, `model_parallel_group`, `dp_process_group`, `real_dp_process_group[i]`, `partition_count[i]`;
- flat layout: `round_robin_bit16_groups`, `_indices`, `_meta`, `_padding`, `_offsets`, `bit16_groups_flat` (the
  parameters' `.data` re-pointed into it, `_update_model_bit16_weights`), `parallel_partitioned_bit16_groups`,
  `groups_padding`;
- partition: `single_partition_of_fp32_groups[i]` (also the torch parameter group's one parameter, and the key of
  its optimizer state), `partition_size`, `params_in_partition`, `params_not_in_partition`, `first_offset`,
  `is_param_in_current_partition`;
- gradient bookkeeping: `initialize_gradient_partitioning_data_structures`, `reset_partition_gradient_structures`;
- links: `_link_all_hp_params`, `_hp_optimizer_states_linked`, `_lazy_init_hp_params_optimizer_state`,
  `_param_slice_mappings`;
and on the engine: `data_parallel_group`, `dp_world_size`, `seq_data_parallel_group`, `seq_dp_world_size` (read
again through DeepSpeed's `groups` lookups, which ask the model-parallel unit), and the checkpoint writer roles
(`_configure_checkpointing`). The gradient hooks read all of these when they fire, so they stay as registered.
"""

from __future__ import annotations

import math

import torch
from deepspeed import comm as ds_dist
from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer
from deepspeed.utils import groups as ds_groups

from ntp_ds.engine.fragments import inner_optimizer


class RecutError(RuntimeError):
    """The optimizer cannot be re-cut in place (not ZeRO 1/2, offloaded, or not at a step boundary)."""


def recuttable(optimizer) -> bool:
    """Whether `recut_zero` re-cuts this optimizer (ZeRO 1/2 on the device)."""
    return isinstance(optimizer, DeepSpeedZeroOptimizer) and not optimizer.cpu_offload


def recut_zero(engine, mpu) -> None:
    """Re-partition `engine`'s ZeRO 1/2 optimizer over the data-parallel group `mpu` now names, in place.

    `mpu`: the model-parallel unit DeepSpeed reads its groups from (its `get_data_parallel_group` returns the new
    group); it becomes the engine's. Call it on every member of the new group, at a step boundary (no gradient
    accumulated, none in flight). Afterwards each parameter keeps its value, each new fp32 partition holds the
    parameters' values in the optimizer's dtype, and every per-element optimizer tensor is zero, with the step
    count kept: the caller writes the state the new cut assigns to this rank.
    """
    zero = engine.optimizer
    if not recuttable(zero):
        raise RecutError(f"only a ZeRO 1/2 optimizer on the device is re-cut in place, not {type(zero).__name__}"
                         f"{' (offloaded)' if getattr(zero, 'cpu_offload', False) else ''}")
    if any(p.grad is not None or getattr(p, "grad_accum", None) is not None
           for group in zero.bit16_groups for p in group):
        raise RecutError("re-cut at a step boundary: a gradient is still accumulated")
    _rebind_engine(engine, mpu)
    group = mpu.get_data_parallel_group()
    # The model-parallel group (its norms' reduction) may itself have been replaced; its size and rank stay.
    zero.mpu, zero.model_parallel_group = mpu, mpu.get_model_parallel_group()
    zero.dp_process_group = group
    zero.real_dp_process_group[:] = [group] * len(zero.real_dp_process_group)
    zero.partition_count[:] = [ds_dist.get_world_size(group=group)] * len(zero.partition_count)
    inner = inner_optimizer(engine)
    for i, param_group in enumerate(inner.param_groups):
        old = zero.single_partition_of_fp32_groups[i]
        state = inner.state.pop(old, {})
        new = _recut_group(zero, i)
        param_group["params"] = [new]
        inner.state[new] = _recut_state(state, old.numel(), new)
    zero.is_param_in_current_partition = {}
    for params, inside in ((zero.params_in_partition, True), (zero.params_not_in_partition, False)):
        for param in (p for group_params in params for p in group_params):
            zero.is_param_in_current_partition[zero.get_param_id(param)] = inside
    zero.initialize_gradient_partitioning_data_structures()
    zero.reset_partition_gradient_structures()
    zero._link_all_hp_params()  # (it sets every parameter's `_hp_mapping` anew, None outside the partition)
    zero._hp_optimizer_states_linked = False
    zero._lazy_init_hp_params_optimizer_state()
    zero._param_slice_mappings = zero._create_param_mapping()
    engine.save_non_zero_checkpoint = engine.save_zero_checkpoint = False
    engine._configure_checkpointing()


def _rebind_engine(engine, mpu) -> None:
    """Point the engine and DeepSpeed's group lookups at `mpu`, and read the data-parallel group and sizes again as
    `DeepSpeedEngine.__init__` does."""
    engine.mpu = ds_groups.mpu = mpu
    engine.data_parallel_group = ds_groups._get_data_parallel_group()
    engine.dp_world_size = ds_groups._get_data_parallel_world_size()
    engine.seq_data_parallel_group = ds_groups._get_sequence_data_parallel_group()
    engine.seq_dp_world_size = ds_groups._get_sequence_data_parallel_world_size()


def _recut_group(zero, i: int) -> torch.Tensor:
    """Lay parameter group `i` out for the optimizer's new group as `DeepSpeedZeroOptimizer.__init__` does; return
    its new fp32 partition (the parameters' values)."""
    group = zero.real_dp_process_group[i]
    dp, partition_id = ds_dist.get_world_size(group=group), ds_dist.get_rank(group=group)
    params = zero.bit16_groups[i]
    if zero.round_robin_gradients:
        ordered, indices = zero._round_robin_reorder(params, dp)
    else:
        ordered, indices = params, list(range(len(params)))
    element_size = params[0].element_size()
    param_alignment = 16 // math.gcd(16, element_size) if zero.parameter_alignment else 1
    meta = [torch.zeros_like(p.data, device="meta") for p in ordered]
    padding, offsets, end = [], [], 0
    for index, m in enumerate(meta):
        offsets.append(end)
        end += m.numel()
        pad = 0 if index == len(meta) - 1 else (-end) % param_alignment
        padding.append(pad)
        end += pad
    zero.round_robin_bit16_groups[i], zero.round_robin_bit16_indices[i] = ordered, indices
    zero.round_robin_bit16_meta[i], zero.round_robin_bit16_padding[i] = meta, padding
    zero.round_robin_bit16_offsets[i] = offsets
    alignment = zero.nccl_start_alignment_factor * dp
    old_flat = zero.bit16_groups_flat[i]
    # The parameters are views of the old flat buffer. Where they keep their offsets and the new buffer is no
    # longer, the new one is the old one's front (no copy); else the parameters are flattened anew (a copy).
    aligned = -(-end // alignment) * alignment
    same_offsets = all(p.data.data_ptr() == old_flat[o:].data_ptr() for p, o in zip(ordered, offsets))
    if same_offsets and aligned <= old_flat.numel():
        old_flat[end:aligned].zero_()
        flat = old_flat.narrow(0, 0, aligned)
    else:
        flat = zero.flatten_dense_tensors_aligned(ordered, alignment, param_padding=padding).detach()
    zero.bit16_groups_flat[i] = flat
    zero._update_model_bit16_weights(i)
    partitions = zero.get_data_parallel_partitions(flat, i)
    zero.parallel_partitioned_bit16_groups[i] = partitions
    left = sum(t.numel() for t in partitions[:partition_id])
    size = partitions[partition_id].numel()
    zero.groups_padding[i] = size if end <= left else max(0, left + size - end)
    for part in partitions:
        if part.data_ptr() % (2 * zero.nccl_start_alignment_factor):
            raise RecutError(f"parameter group {i}: a partition of the new cut starts unaligned")
    fp32 = partitions[partition_id].detach().clone().to(device=zero.device, dtype=zero.master_weights_and_grads_dtype)
    fp32.requires_grad = True
    zero.single_partition_of_fp32_groups[i] = fp32
    zero.partition_size[i] = flat.numel() // dp
    zero.params_in_partition[i], zero.params_not_in_partition[i], zero.first_offset[i] = zero.get_partition_info(
        ordered, zero.partition_size[i], partition_id, padding)
    return fp32


def _recut_state(state: dict, old_numel: int, new: torch.Tensor) -> dict:
    """The optimizer state of the new partition `new`: every per-element tensor of the old one (`old_numel`
    elements) zeroed at the new size; the step and any other scalar kept."""
    out = {}
    for key, value in state.items():
        if torch.is_tensor(value) and value.dim() > 0 and value.numel() == old_numel:
            out[key] = torch.zeros_like(new, dtype=value.dtype)
        else:
            out[key] = value
    return out
