"""HF safetensors directories: read a rank's shard of every tensor (never the whole tensor), write unsharded weights."""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from ntp_ds.layout.shard_layout import ParamSpec, ShardLayout

SAFETENSORS_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "F64": torch.float64}


def weight_files(path: Path) -> dict[str, str]:
    """Map tensor names to the safetensors file holding them (single file or sharded index)."""
    index = path / "model.safetensors.index.json"
    if index.exists():
        return dict(json.loads(index.read_text())["weight_map"])
    with safe_open(path / "model.safetensors", framework="pt") as f:
        return {name: "model.safetensors" for name in f.keys()}


def checkpoint_dtype(path, name: str) -> torch.dtype:
    """The dtype tensor `name` is stored in."""
    path = Path(path)
    with safe_open(path / weight_files(path)[name], framework="pt") as f:
        return SAFETENSORS_DTYPES[f.get_slice(name).get_dtype()]


def read_shard(f, name: str, spec: ParamSpec, full_shape: tuple[int, ...], layout: ShardLayout,
               rank: int) -> torch.Tensor:
    """Read only `rank`'s units of tensor `name` from an open safetensors file."""
    sl = f.get_slice(name)
    if tuple(sl.get_shape()) != tuple(full_shape):
        raise ValueError(f"{name} has shape {tuple(sl.get_shape())} in the checkpoint; the config gives {full_shape}")
    if spec.kind == "replicated":
        return sl[:]
    u = spec.unit_size
    spans = [(a * u, b * u) for a, b in layout.owned(spec.kind, rank)]
    parts = [sl[a:b] if spec.dim == 0 else sl[:, a:b] for a, b in spans]
    return torch.cat(parts, dim=spec.dim)


@torch.no_grad()
def load_shards(model, path) -> None:
    """Copy this rank's shard of every parameter of `model` (a CausalLMShard) from the directory `path`."""
    path = Path(path)
    files = weight_files(path)
    specs = model.param_specs()
    by_file: dict[str, list[str]] = {}
    for name in specs:
        if name not in files:
            raise KeyError(f"{name} is missing from the checkpoint in {path}")
        by_file.setdefault(files[name], []).append(name)
    for file, names in by_file.items():
        with safe_open(path / file, framework="pt") as f:
            for name in names:
                model.get_parameter(name).copy_(read_shard(f, name, *specs[name], model.layout, model.tp_rank))


def write_hf_dir(path, config, state: dict[str, torch.Tensor]) -> None:
    """Write unsharded weights and `config.to_hf_dict()` as an HF model directory."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config.to_hf_dict(), indent=2))
    save_file({k: v.contiguous() for k, v in state.items()}, str(path / "model.safetensors"),
              metadata={"format": "pt"})


def write_whole_tensors(path, config, tensors: dict[str, torch.Tensor], me: int, writer: dict[str, int],
                        full_shapes: dict[str, tuple[int, ...]]) -> None:
    """Writer `me`'s part of an HF directory whose tensors `layout.plan_whole_tensors` gave to writers: its whole
    tensors in a file of their own, and, from writer 0, config.json and the index (fp32 sizes) that
    `from_pretrained` reads first. A single writer writes `model.safetensors` and no index."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    writers = sorted(set(writer.values()))
    file_of = {w: f"model-{i + 1:05d}-of-{len(writers):05d}.safetensors" for i, w in enumerate(writers)}
    if len(writers) == 1:
        file_of = {writers[0]: "model.safetensors"}
    if tensors:
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(path / file_of[me]), metadata={"format": "pt"})
    if me == 0:
        (path / "config.json").write_text(json.dumps(config.to_hf_dict(), indent=2))
        if len(writers) == 1:
            return
        total = sum(math.prod(full_shapes[n]) * 4 for n in writer)
        index = {"metadata": {"total_size": total}, "weight_map": {n: file_of[w] for n, w in sorted(writer.items())}}
        (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
