"""Cut full tensors into a rank's shard and back, and pack unit ranges of a shard into flat buffers.

Pure tensor ops, no communication. A rank stores its units in increasing unit order: local slice k (of
`spec.unit_size` rows along `spec.dim`) is its k-th owned unit. A replicated tensor is a single unit: the whole tensor.
"""

from __future__ import annotations

import math

import torch

from ntp_ds.layout import units as U
from ntp_ds.layout.shard_layout import ParamSpec, ShardLayout


def _pieces(t: torch.Tensor, spec: ParamSpec, spans) -> list[torch.Tensor]:
    """Views of `t` along `spec.dim` for unit spans [(start, stop), ...] in units of `spec.unit_size`."""
    u = spec.unit_size
    return [t.narrow(spec.dim, a * u, (b - a) * u) for a, b in spans]


def _check_units(ranges: U.Ranges, spec: ParamSpec):
    if spec.kind == "replicated" and ranges not in ((), ((0, 1),)):
        raise ValueError(f"replicated tensors have the single unit 0; got units {ranges}")


def shard_tensor(full: torch.Tensor, spec: ParamSpec, layout: ShardLayout, rank: int) -> torch.Tensor:
    """Return `rank`'s local shard of `full`: its owned units along `spec.dim`, in unit order (a new tensor)."""
    if spec.kind == "replicated":
        return full.clone()
    owned = layout.owned(spec.kind, rank)
    expected = layout.units.count(spec.kind) * spec.unit_size
    if full.shape[spec.dim] != expected:
        raise ValueError(f"dim {spec.dim} of shape {tuple(full.shape)} should be {expected} for kind {spec.kind!r}")
    return torch.cat(_pieces(full, spec, owned), dim=spec.dim)


def unshard_into(full: torch.Tensor, local: torch.Tensor, spec: ParamSpec, layout: ShardLayout,
                 rank: int) -> torch.Tensor:
    """Write `rank`'s shard `local` into its units of `full` (in place) and return `full`."""
    if spec.kind == "replicated":
        return full.copy_(local)
    owned = layout.owned(spec.kind, rank)
    offsets = U.local_offsets(owned, owned)
    for dst, src in zip(_pieces(full, spec, owned), _pieces(local, spec, offsets)):
        dst.copy_(src)
    return full


def packed_numel(spec: ParamSpec, full_shape: tuple[int, ...], kind_ranges: U.Ranges) -> int:
    """Elements of the flat buffer that packs units `kind_ranges` of a tensor of `full_shape`."""
    _check_units(kind_ranges, spec)
    if spec.kind == "replicated":
        return math.prod(full_shape) if kind_ranges else 0
    per_unit = math.prod(full_shape) // full_shape[spec.dim] * spec.unit_size
    return U.count(kind_ranges) * per_unit


def gather_units(local: torch.Tensor, spec: ParamSpec, layout: ShardLayout, rank: int, kind_ranges: U.Ranges,
                 out: torch.Tensor | None = None) -> torch.Tensor:
    """Pack units `kind_ranges` (held by `rank`) of its shard `local` into a flat 1-D buffer, in unit order.

    Each contiguous run of units is flattened row-major on its own, so the buffer layout depends only on the units
    and the full shape, never on the sending rank; `scatter_units` on any holder reverses it.
    """
    _check_units(kind_ranges, spec)
    if spec.kind == "replicated":
        pieces = [local] if kind_ranges else []
    else:
        pieces = _pieces(local, spec, _unit_runs(layout.owned(spec.kind, rank), kind_ranges))
    flat = [p.reshape(-1) for p in pieces]
    if out is None:
        return torch.cat(flat) if flat else local.new_empty(0)
    numel = sum(p.numel() for p in flat)
    if out.numel() != numel:
        raise ValueError(f"out has {out.numel()} elements; units {kind_ranges} need {numel}")
    offset = 0
    for p in flat:
        out[offset:offset + p.numel()].copy_(p)
        offset += p.numel()
    return out


def scatter_units(local: torch.Tensor, buffer: torch.Tensor, spec: ParamSpec, layout: ShardLayout, rank: int,
                  kind_ranges: U.Ranges) -> torch.Tensor:
    """Unpack a buffer made by `gather_units` for units `kind_ranges` into `rank`'s shard `local` (in place)."""
    _check_units(kind_ranges, spec)
    if spec.kind == "replicated":
        pieces = [local] if kind_ranges else []
    else:
        pieces = _pieces(local, spec, _unit_runs(layout.owned(spec.kind, rank), kind_ranges))
    numel = sum(p.numel() for p in pieces)
    if buffer.numel() != numel:
        raise ValueError(f"buffer has {buffer.numel()} elements; units {kind_ranges} need {numel}")
    offset = 0
    for p in pieces:
        p.copy_(buffer[offset:offset + p.numel()].view(p.shape))
        offset += p.numel()
    return local


def _unit_runs(owned: U.Ranges, wanted: U.Ranges) -> list[tuple[int, int]]:
    """Local offsets of `wanted`, one span per range of normalized `wanted`, which fixes the packing order."""
    return U.local_offsets(owned, U.normalize(wanted))
