"""Tensor-parallel building blocks driven by a ShardLayout, so a rank may own any uneven, non-contiguous set of units.

Activations entering a block are replicated over the TP group; `copy_to_tp` marks that point (its backward sums the
input gradient over the group) and `reduce_from_tp` sums the partial outputs of a row-parallel layer. A group of
None or of size 1 means no communication.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from ntp_ds.comm import wire
from ntp_ds.layout import units as U
from ntp_ds.layout.shard_layout import LayoutError, ParamSpec, ShardLayout
from ntp_ds.layout.sharding import shard_tensor, unshard_into


def _active(group) -> bool:
    return group is not None and dist.get_world_size(group) > 1


class _CopyToTP(torch.autograd.Function):
    """Identity forward; all-reduce of the gradient backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return wire.all_reduce(grad.contiguous().clone(), ctx.group), None


class _ReduceFromTP(torch.autograd.Function):
    """All-reduce forward; identity backward."""

    @staticmethod
    def forward(ctx, x, group):
        return wire.all_reduce(x.contiguous().clone(), group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def copy_to_tp(x: torch.Tensor, group=None) -> torch.Tensor:
    """Enter a TP region with a replicated activation: the gradients of all ranks' branches are summed."""
    return _CopyToTP.apply(x, group) if _active(group) else x


def reduce_from_tp(x: torch.Tensor, group=None) -> torch.Tensor:
    """Leave a TP region: sum the ranks' partial outputs into a replicated activation."""
    return _ReduceFromTP.apply(x, group) if _active(group) else x


class _SumSharedGrad(torch.autograd.Function):
    """Identity forward on a KV weight shard; backward sums each KV head's gradient over all the ranks holding it."""

    @staticmethod
    def forward(ctx, weight, spec, full_shape, layout, rank, group):
        ctx.args = spec, full_shape, layout, rank, group
        return weight.view_as(weight)

    @staticmethod
    def backward(ctx, grad):
        spec, full_shape, layout, rank, group = ctx.args
        full = grad.new_zeros(full_shape)
        unshard_into(full, grad, spec, layout, rank)
        wire.all_reduce(full, group)
        return shard_tensor(full, spec, layout, rank), None, None, None, None, None


def index_table(layout: ShardLayout, kind: str, rank: int, device=None) -> torch.Tensor:
    """Map every unit of `kind` to its local index on `rank`, or -1 where the rank does not hold it."""
    table = torch.full((layout.units.count(kind),), -1, dtype=torch.long, device=device)
    offset = 0
    for a, b in layout.owned(kind, rank):
        table[a:b] = torch.arange(offset, offset + b - a, device=device)
        offset += b - a
    return table


def local_kv_index(layout: ShardLayout, rank: int) -> list[int]:
    """For each query head `rank` owns (in unit order), the local index of the KV head it reads."""
    table = index_table(layout, "kv", rank).tolist()
    return [table[h // layout.units.group] for h in U.units_of(layout.owned("heads", rank))]


def check_shard(units, layout: ShardLayout, tp_rank: int, tp_group) -> None:
    """Refuse a layout of other units, a rank outside it, or a TP group of another size."""
    if layout.units.counts != units.counts:
        raise LayoutError(f"layout units {layout.units} do not match the config's {units}")
    if not 0 <= tp_rank < layout.tp:
        raise LayoutError(f"tp_rank={tp_rank} is outside the layout's tp={layout.tp}")
    if tp_group is not None and dist.get_world_size(tp_group) != layout.tp:
        raise LayoutError(f"tp_group has {dist.get_world_size(tp_group)} ranks; the layout has tp={layout.tp}")


class ColumnParallelLinear(nn.Module):
    """y = x W^T + b with output features sharded by units of `spec.kind` (dim 0); x must come through `copy_to_tp`.

    The bias, when there is one, is sharded with its output features. KV projections shared by several ranks get
    their weight and bias gradients summed over the holders inside backward.
    """

    def __init__(self, in_features: int, out_features: int, spec: ParamSpec, layout: ShardLayout, tp_rank: int,
                 group=None, device=None, dtype=None, bias: bool = False):
        super().__init__()
        assert spec.dim == 0, "column-parallel weights are sharded along dim 0"
        self.spec, self.full_shape, self.layout, self.tp_rank, self.group = (
            spec, (out_features, in_features), layout, tp_rank, group)
        self.shard_specs = {"weight": (spec, self.full_shape), "bias": (spec, (out_features,))}
        shape = layout.shard_shape(spec, self.full_shape, tp_rank)
        self.weight = nn.Parameter(torch.empty(shape, device=device, dtype=dtype))
        self.bias = nn.Parameter(torch.empty(shape[0], device=device, dtype=dtype)) if bias else None
        self.sum_shared = spec.kind == "kv" and layout.shares_kv() and _active(group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w, b = self.weight, self.bias
        if self.sum_shared:
            w = _SumSharedGrad.apply(w, self.spec, self.full_shape, self.layout, self.tp_rank, self.group)
            if b is not None:
                b = _SumSharedGrad.apply(b, self.spec, self.full_shape[:1], self.layout, self.tp_rank, self.group)
        return F.linear(x, w, b)


class RowParallelLinear(nn.Module):
    """y = sum over ranks of x_local W_local^T, plus a replicated bias; input features sharded by `spec.kind` (dim 1)."""

    def __init__(self, in_features: int, out_features: int, spec: ParamSpec, layout: ShardLayout, tp_rank: int,
                 group=None, device=None, dtype=None, bias: bool = False):
        super().__init__()
        assert spec.dim == 1, "row-parallel weights are sharded along dim 1"
        self.spec, self.full_shape, self.group = spec, (out_features, in_features), group
        self.shard_specs = {"weight": (spec, self.full_shape), "bias": (ParamSpec("replicated"), (out_features,))}
        shape = layout.shard_shape(spec, self.full_shape, tp_rank)
        self.weight = nn.Parameter(torch.empty(shape, device=device, dtype=dtype))
        self.bias = nn.Parameter(torch.empty(out_features, device=device, dtype=dtype)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = reduce_from_tp(F.linear(x, self.weight), self.group)
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Module):
    """Embedding whose rows are the rank's vocabulary units; tokens held elsewhere give zeros before the sum.

    `padding_idx` (a global token id) gets no gradient on the rank that holds it, as in `nn.Embedding`.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, layout: ShardLayout, tp_rank: int, group=None,
                 device=None, dtype=None, padding_idx: int | None = None):
        super().__init__()
        self.spec, self.full_shape, self.group = ParamSpec("vocab", 0, 1), (num_embeddings, embedding_dim), group
        self.shard_specs = {"weight": (self.spec, self.full_shape)}
        shape = layout.shard_shape(self.spec, self.full_shape, tp_rank)
        self.weight = nn.Parameter(torch.empty(shape, device=device, dtype=dtype))
        table = index_table(layout, "vocab", tp_rank)
        self.register_buffer("local_index", table.to(device), persistent=False)
        local_pad = -1 if padding_idx is None else int(table[padding_idx])
        self.local_padding_idx = None if local_pad < 0 else local_pad

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = self.local_index[ids]
        out = F.embedding(local.clamp(min=0), self.weight, padding_idx=self.local_padding_idx)
        out = out.masked_fill((local < 0).unsqueeze(-1), 0.0)
        return reduce_from_tp(out, self.group)


class _VocabParallelCE(torch.autograd.Function):
    """Per-token cross-entropy over the full vocabulary from vocab-sharded logits; saves only the local softmax."""

    @staticmethod
    def forward(ctx, logits, labels, table, group, ignore_index):
        x = logits.float()
        top = x.max(dim=-1).values
        if _active(group):
            wire.all_reduce(top, group, op="max")
        x = x - top.unsqueeze(-1)
        valid = labels != ignore_index
        local = torch.where(valid, table[labels.clamp(min=0)], -1)
        here = local >= 0
        target = x.gather(-1, local.clamp(min=0).unsqueeze(-1)).squeeze(-1) * here
        x.exp_()
        stats = torch.stack([x.sum(dim=-1), target])
        if _active(group):
            wire.all_reduce(stats, group)
        loss = (stats[0].log() - stats[1]) * valid
        x.div_(stats[0].unsqueeze(-1))
        ctx.save_for_backward(x, local, here, valid)
        ctx.dtype = logits.dtype
        return loss

    @staticmethod
    def backward(ctx, grad):
        softmax, local, here, valid = ctx.saved_tensors
        scale = (grad * valid).unsqueeze(-1)
        g = softmax * scale
        g.scatter_add_(-1, local.clamp(min=0).unsqueeze(-1), -scale * here.unsqueeze(-1))
        return g.to(ctx.dtype), None, None, None, None


class _GatherVocab(torch.autograd.Function):
    """Local vocab-shard logits -> the full vocabulary's on every rank of the group (each column is held by one rank:
    the others add zeros, so the sum is exact); backward keeps the rank's own columns of the gradient, since the
    caller's loss on the full logits is computed alike on every rank."""

    @staticmethod
    def forward(ctx, local, columns, vocab, group):
        full = local.new_zeros(*local.shape[:-1], vocab)
        full.index_copy_(-1, columns, local)
        ctx.save_for_backward(columns)
        return wire.all_reduce(full, group)

    @staticmethod
    def backward(ctx, grad):
        (columns,) = ctx.saved_tensors
        return grad.index_select(-1, columns), None, None, None


def gather_vocab(local_logits: torch.Tensor, table: torch.Tensor, group=None) -> torch.Tensor:
    """Return the full-vocabulary logits [..., vocab] from the rank's vocab-shard ones [..., local_vocab] (held in
    unit order; `table` is `index_table(layout, "vocab", tp_rank)`), identical on every rank of the TP group and
    differentiable (each rank's gradient flows to its own columns): what a caller's own loss function reads."""
    own = (table >= 0).nonzero().squeeze(-1)
    columns = torch.empty_like(own)
    columns[table[own]] = own
    if not _active(group):
        return local_logits.new_zeros(*local_logits.shape[:-1], table.numel()).index_copy(-1, columns, local_logits)
    return _GatherVocab.apply(local_logits, columns, table.numel(), group)


def vocab_parallel_cross_entropy(local_logits: torch.Tensor, labels: torch.Tensor, layout: ShardLayout,
                                 tp_rank: int, group=None, ignore_index: int = -100,
                                 table: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Return (sum of token losses, number of counted tokens) of the exact full-vocabulary cross-entropy.

    `local_logits` [..., local_vocab] hold the rank's vocabulary units in unit order; `labels` [...] are global token
    ids, `ignore_index` ones not counted. Both results are identical on every rank of the group; their ratio is the
    mean loss. `table` may pass a cached `index_table(layout, "vocab", tp_rank)`.
    """
    if table is None:
        table = index_table(layout, "vocab", tp_rank, local_logits.device)
    losses = _VocabParallelCE.apply(local_logits, labels, table, group, ignore_index)
    return losses.sum(), (labels != ignore_index).sum()
