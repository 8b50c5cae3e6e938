"""`ntp_ds.initialize`: validate, build groups and the local shard, and wrap it in an NTPEngine."""

from __future__ import annotations

import copy
import math
import os

import deepspeed
import torch
import torch.distributed as dist
from deepspeed.runtime.config import DeepSpeedConfig

from ntp_ds.batch import max_micro_batch, plan_batch
from ntp_ds.comm.groups import NTPMpu, ReplicaGroups, backend_for_device, build_groups
from ntp_ds.engine.config import ConfigError, NTPConfig, check_batch, env_world_size, load_deepspeed_config
from ntp_ds.engine.engine import NTPEngine
from ntp_ds.layout import LayoutError, Topology, plan_gradient_sync
from ntp_ds.models import Llama, LlamaConfig
from ntp_ds.models.sharding import shard_tensor


def _model_config(model) -> LlamaConfig:
    if isinstance(model, Llama):
        return model.config
    if isinstance(model, LlamaConfig):
        return model
    if isinstance(model, (str, os.PathLike)):
        import json
        from pathlib import Path

        return LlamaConfig.from_hf_dict(json.loads((Path(model) / "config.json").read_text()))
    raise ConfigError(f"model must be an ntp_ds.models.Llama, a LlamaConfig or an HF directory, "
                      f"got {type(model).__name__}")


def build_topology(units, ntp: NTPConfig) -> Topology:
    try:
        return Topology.from_degrees(units, ntp.replica_degrees)
    except LayoutError as e:
        raise ConfigError(f"ntp.degrees={list(ntp.replica_degrees)}: {e}") from None


def _local_model(model, config: LlamaConfig, groups: ReplicaGroups) -> Llama:
    layout, tp_rank, tp_group = groups.layout, groups.tp_rank, groups.tp_group
    if isinstance(model, (str, os.PathLike)):
        return Llama.from_pretrained(model, layout=layout, tp_rank=tp_rank, tp_group=tp_group)
    shard = Llama(config, layout=layout, tp_rank=tp_rank, tp_group=tp_group)
    if isinstance(model, Llama):
        specs = shard.param_specs()
        full = dict(model.named_parameters())
        with torch.no_grad():
            for name, p in shard.named_parameters():
                p.copy_(shard_tensor(full[name].detach(), specs[name][0], layout, tp_rank))
    return shard


def _rank_deepspeed_config(ds_config: dict, groups: ReplicaGroups, micro_sizes: tuple[int, ...]) -> dict:
    """DeepSpeed sees this replica's own micro-batch plan; a contributor gets no optimizer and no ZeRO."""
    cfg = copy.deepcopy(ds_config)
    cfg["train_micro_batch_size_per_gpu"] = max(micro_sizes)
    cfg["gradient_accumulation_steps"] = len(micro_sizes)
    cfg["train_batch_size"] = max(micro_sizes) * len(micro_sizes) * len(groups.dp_ranks)
    if not groups.is_anchor:
        # The contributor accumulates on its own (NTPEngine.is_gradient_accumulation_boundary): DeepSpeed must not
        # scale its gradients by an accumulation count.
        for key in ("optimizer", "scheduler", "zero_optimization"):
            cfg.pop(key, None)
        cfg["gradient_accumulation_steps"] = 1
        cfg["train_batch_size"] = max(micro_sizes)
    return cfg


def _micro_limits(config: LlamaConfig, topology: Topology, ntp: NTPConfig, ds_config: dict, seq_len: int):
    if ntp.memory_budget_gb is None:
        return None
    from ntp_ds.batch.memory import rank_memory

    budget = int(ntp.memory_budget_gb * 2**30)
    limits = []
    for layout in topology.layouts:
        static, per_sample = rank_memory(config, layout, ds_config, seq_len, dp=ntp.replicas)
        limits.append(max_micro_batch(static, per_sample, budget, ds_config["train_micro_batch_size_per_gpu"]))
    return tuple(limits)


def initialize(model, config, ntp=None, optimizer=None, lr_scheduler=None, seq_len: int | None = None) -> NTPEngine:
    """Build this rank's NTPEngine.

    `model`: an unsharded `Llama` (every rank keeps only its shard of it), a `LlamaConfig` (fresh weights) or an HF
    directory. `config`: a DeepSpeed config dict or JSON path; `train_batch_size` is the failure-free global batch.
    `ntp`: an NTPConfig or a dict of its fields. Every check runs before a process group is built.
    """
    ds_config = load_deepspeed_config(config)
    ntp = NTPConfig.from_any(ntp)
    ntp.validate(env_world_size())
    model_config = _model_config(model)
    topology = build_topology(model_config.units(), ntp)
    sync = plan_gradient_sync(topology)
    check_batch(ds_config, ntp)
    limits = _micro_limits(model_config, topology, ntp, ds_config, seq_len or model_config.max_position_embeddings)
    batch_plan = plan_batch(topology.degrees, ntp.tp, ds_config["train_batch_size"],
                            ds_config["train_micro_batch_size_per_gpu"], ntp.batch_policy, sync.anchors, limits)
    if ds_config.get("gradient_clipping", 0) and any(lay.shares_kv() for lay in topology.layouts):
        raise ConfigError("gradient_clipping>0 is not supported yet with a layout that shares a KV head between "
                          "ranks; choose TP degrees that divide num_key_value_heads or disable clipping")

    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
    if not dist.is_initialized():
        deepspeed.init_distributed(dist_backend=backend_for_device(), timeout=_timedelta(ntp.timeout_s))
    groups = build_groups(topology, sync, dist.get_rank())
    module = _local_model(model, model_config, groups)
    if torch.cuda.is_available():
        module = module.to(torch.device("cuda", torch.cuda.current_device()))
    specs = module.param_specs()
    rank_cfg = _rank_deepspeed_config(ds_config, groups, batch_plan.replicas[groups.replica].micro_sizes)
    mpu = NTPMpu(groups)
    anchor = groups.is_anchor
    engine = NTPEngine(ntp_groups=groups, batch_plan=batch_plan, specs={n: s for n, (s, _) in specs.items()},
                       full_shapes={n: shape for n, (_, shape) in specs.items()}, timeout_s=ntp.timeout_s,
                       args=None, model=module, optimizer=optimizer if anchor else None,
                       model_parameters=[p for p in module.parameters()],
                       lr_scheduler=lr_scheduler if anchor else None, mpu=mpu, dist_init_required=False,
                       config=rank_cfg, config_class=DeepSpeedConfig(rank_cfg, mpu))
    return engine


def _timedelta(seconds: float):
    from datetime import timedelta

    return timedelta(seconds=seconds)
