"""The global gradient norm with every element of the model counted once, for DeepSpeed's `gradient_clipping`.

DeepSpeed sums squared gradients over its model-parallel group, counting a parameter on every TP rank when it is
marked `tensor_model_parallel` and on TP rank 0 alone otherwise (a replicated parameter). Under NTP a parameter is
sharded by units (each element on one TP rank: marked), replicated (norm weights: not marked), or, for the K and V
projections of a layout that shares a KV head, partly shared: a KV head read by several TP ranks carries the same
gradient on each (summed over its holders in backward), so only its lowest holder may count it. Such a parameter
is marked and carries which of its units this rank counts; the norm then sees only those elements of the slice of
the gradient DeepSpeed hands it (ZeRO 1/2: `counted_grad_norm`; stage 0: `clip_fp32_gradients`).

The anchors' reduced gradients are the whole model's (contributors add theirs into them before the reduction), so
the norm the anchors compute is the global one, and contributors compute none.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch

from ntp_ds.comm import wire
from ntp_ds.layout import units as U
from ntp_ds.layout.shard_layout import ParamSpec, ShardLayout

COUNTED_ATTR = "ntp_counted_units"
"""Parameter attribute: a `CountedUnits`, present only on a parameter of which this rank counts some units but not
all of them."""


@dataclass(frozen=True)
class CountedUnits:
    """Which units of a parameter's shard this rank counts in the global norm, in the order the shard stores them."""

    dim: int
    unit_size: int
    counted: tuple[bool, ...]

    def element_mask(self, shape: torch.Size, start: int, length: int, device) -> torch.Tensor:
        """The mask over elements `start`..`start + length` of the flattened shard: True where this rank counts it."""
        rows = torch.tensor(self.counted, device=device).repeat_interleave(self.unit_size)
        view = [1] * len(shape)
        view[self.dim] = shape[self.dim]
        return rows.view(view).expand(shape).reshape(-1)[start:start + length]


def counted_kv_units(layout: ShardLayout, tp_rank: int) -> tuple[bool, ...]:
    """For each KV head `tp_rank` holds (in increasing order), whether it is the head's lowest holder."""
    below = U.union(*(layout.owned("kv", r) for r in range(tp_rank))) if tp_rank else ()
    own = layout.owned("kv", tp_rank)
    mine = set(U.units_of(U.subtract(own, below)))
    return tuple(u in mine for u in U.units_of(own))


def mark_norm_counting(named_params, specs: dict[str, ParamSpec], layout: ShardLayout, tp_rank: int) -> None:
    """Tell DeepSpeed's norm which parameters are sharded, and record the KV heads of which this rank is not the
    lowest holder."""
    kv_counted = counted_kv_units(layout, tp_rank) if layout.shares_kv() else None
    for name, p in named_params:
        spec = specs[name]
        p.tensor_model_parallel = spec.kind != "replicated"
        if hasattr(p, COUNTED_ATTR):
            delattr(p, COUNTED_ATTR)
        if spec.kind == "kv" and kv_counted is not None and not all(kv_counted):
            setattr(p, COUNTED_ATTR, CountedUnits(spec.dim, spec.unit_size, kv_counted))


def counted_slice(grad: torch.Tensor, param, start: int = 0) -> torch.Tensor:
    """`grad`, elements `start`.. of `param`'s flattened gradient, with the elements this rank does not count zeroed
    (itself when it counts them all)."""
    units = getattr(param, COUNTED_ATTR, None)
    if units is None:
        return grad
    flat = grad.reshape(-1)
    mask = units.element_mask(param.shape, start, flat.numel(), flat.device)
    return torch.where(mask, flat, torch.zeros((), dtype=flat.dtype, device=flat.device))


def count_once_in_zero_norm(optimizer) -> None:
    """Make a ZeRO 1/2 optimizer's global norm count every element once. DeepSpeed hands its norm, per parameter
    group, the gradient pieces of `params_in_partition` in order, the first from `first_offset` on; the pieces of a
    partly counted parameter are masked before DeepSpeed's own sum and reductions."""
    # A weak reference: the optimizer holds this function, and a cycle through it would keep the engine's process
    # groups open after a release until a full garbage collection.
    holder = weakref.ref(optimizer)

    def get_grad_norm_direct(gradients, params, norm_type=2):
        opt = holder()
        group = next((i for i, ps in enumerate(opt.params_in_partition) if ps is params), None)
        first = int(opt.first_offset[group]) if group is not None else 0
        pieces = [g for g in gradients if not getattr(g, "_zero_padding", False)]
        masked = [counted_slice(g, p, first if j == 0 else 0) for j, (g, p) in enumerate(zip(pieces, params))]
        return type(opt).get_grad_norm_direct(opt, masked + pieces[len(masked):], params, norm_type)

    optimizer.get_grad_norm_direct = get_grad_norm_direct


def clip_by_counted_norm(params, max_norm: float, tp_group, tp_rank: int) -> torch.Tensor:
    """Stage 0: clip the gradients of `params` (this rank's shard, reduced over data parallelism) to `max_norm` by
    the norm of the whole model (the squared sums of the replica's TP ranks added); return that norm."""
    params = [p for p in params if p.grad is not None]
    counted = [counted_slice(p.grad, p) for p in params if getattr(p, "tensor_model_parallel", False) or tp_rank == 0]
    local = torch.nn.utils.get_total_norm(counted).float() if counted else None
    device = params[0].grad.device if params else wire.device_of(tp_group)
    squared = (local ** 2 if local is not None else torch.zeros((), device=device)).reshape(1)
    wire.all_reduce(squared, tp_group, name="grad_norm")
    total = squared[0].sqrt()
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
    return total
