"""`ntp_ds.initialize`: validate, join the process group, build this rank's shard and wrap it in an NTPEngine.

`JobSpec` holds everything needed to (re)build an engine; recovery calls `build_engine` again for a new topology.
"""

from __future__ import annotations

import copy
import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Callable

import deepspeed
import torch
import torch.distributed as dist
from deepspeed.runtime.config import DeepSpeedConfig

from ntp_ds.batch import BatchPlan, lockstep_replicas, max_micro_batch, plan_batch
from ntp_ds.batch.planner import pace_costs, resume_plan
from ntp_ds.batch.straggler import Replan, rebalance
from ntp_ds.comm import wire
from ntp_ds.comm.groups import (NTPMpu, ReplicaGroups, backend_for_device, build_groups, prepare_backend,
                                start_generation, unconnected_default_group)
from ntp_ds.engine.config import (ConfigError, NTPConfig, check_batch, cuda_device_index, env_racks, env_world_size,
                                  load_deepspeed_config)
from ntp_ds.engine.engine import NTPEngine, deepspeed_batch
from ntp_ds.envs import (CUDA_DEVICE_MAX_CONNECTIONS, NCCL_ASYNC_ERROR_HANDLING, NCCL_BLOCKING_WAIT_ENV,
                         NCCL_DESYNC_DEBUG_ENV, NCCL_DUMP_ENV, RANK, STORE_ENV, WORLD_SIZE)
from ntp_ds.layout import LayoutError, Topology, plan_buddies, plan_gradient_sync, replica_paces
from ntp_ds.layout.domains import Racks
from ntp_ds.layout.generation import Generation
from ntp_ds.layout.sharding import shard_tensor
from ntp_ds.models import CausalLMShard, HFCausalLM, HFConfig, Llama, LlamaConfig
from ntp_ds.models.hf import check_supported, is_hf_model, is_model_dir


@dataclass
class JobSpec:
    """A validated job: DeepSpeed and NTP configs, the model config, and client optimizer/scheduler factories."""

    ds_config: dict
    ntp: NTPConfig
    model_config: LlamaConfig | HFConfig
    optimizer: Callable | None = None
    lr_scheduler: Callable | None = None
    seq_len: int | None = None
    racks: Racks | None = None
    """The racks the launcher described (`NTP_RACK_SIZE`): copies and watchers are placed across them."""

    def units(self):
        """The model's sharding units, costed at this job's sequence length: every layout of the job comes from
        these, so every rank degrades a replica the same way."""
        return self.model_config.units(self.seq_len)

    @property
    def zero_stage(self) -> int:
        return int(self.ds_config.get("zero_optimization", {}).get("stage", 0))

    def plan(self, topology: Topology) -> tuple:
        """Gradient-sync and batch plans of a topology (the batch from the layouts' predicted paces)."""
        sync = plan_gradient_sync(topology)
        limits = _micro_limits(self, topology)
        batch = plan_batch(replica_paces(topology.layouts, self.ntp.tp), self.ds_config["train_batch_size"],
                           self.ds_config["train_micro_batch_size_per_gpu"], self.ntp.batch_policy,
                           lockstep_replicas(sync.anchors, self.zero_stage), limits)
        return sync, batch

    def resume_plan(self, topology: Topology, interrupted: BatchPlan, kept: tuple[int, ...]) -> BatchPlan | None:
        """The rest of the `interrupted` step in `topology`, whose `kept` replicas hold their share's gradients whole
        (`ntp_ds.batch.planner.resume_plan`); None: run the whole step again. Only under `preserve_global_batch`:
        the step then has the same samples in any topology."""
        if self.ntp.batch_policy != "preserve_global_batch" or self.zero_stage > 1:
            return None
        return resume_plan(interrupted, kept, pace_costs(replica_paces(topology.layouts, self.ntp.tp)),
                           self.ds_config["train_micro_batch_size_per_gpu"], _micro_limits(self, topology))

    def buddies(self, topology: Topology, sync=None) -> dict[int, tuple[int, ...]]:
        """For every anchor rank of `topology`, the ranks keeping copies of its optimizer state (`plan_buddies`;
        empty where the state is replicated). `sync`: the topology's gradient-sync plan, if already made."""
        return plan_buddies(topology, sync or plan_gradient_sync(topology), self.zero_stage, self.ntp.zero_redundancy)

    def rebalance(self, topology: Topology, anchors: tuple[int, ...], plan: BatchPlan,
                  costs) -> Replan | None:
        """The straggler-aware re-plan of `plan` for the replicas' fitted step costs (`StepCost`; None: keep it)."""
        return rebalance(plan, costs, self.ds_config["train_micro_batch_size_per_gpu"],
                         lockstep_replicas(anchors, self.zero_stage), _micro_limits(self, topology),
                         self.ntp.straggler.threshold)


def model_config_of(model) -> LlamaConfig | HFConfig:
    """The model config of what `initialize` was given; an HF model's TP plan is checked here."""
    if isinstance(model, Llama):
        return model.config
    if isinstance(model, LlamaConfig):
        return model
    if not (is_hf_model(model) or is_model_dir(model)):
        raise ConfigError(f"model must be an ntp_ds.models.Llama, a LlamaConfig, a transformers causal LM "
                          f"(AutoModelForCausalLM; from_config(...) for fresh weights) or an HF model directory "
                          f"with a config.json; got {model!r}")
    try:
        if is_hf_model(model):
            hf_config = model.config
        else:
            import transformers

            hf_config = transformers.AutoConfig.from_pretrained(model)
        check_supported(hf_config)
        config = HFConfig.from_transformers(hf_config)
    except ValueError as e:
        raise ConfigError(f"model: {e}") from None
    return config


def build_topology(units, ntp: NTPConfig, racks: Racks | None = None) -> Topology:
    """The job's topology as launched, placed in `racks` (launch rank = global rank) when the launcher said."""
    try:
        topology = Topology.from_degrees(units, ntp.replica_degrees)
    except LayoutError as e:
        raise ConfigError(f"ntp.degrees={list(ntp.replica_degrees)}: {e}") from None
    return Generation.initial(topology, racks=racks).topology


def _micro_limits(spec: JobSpec, topology: Topology):
    if spec.ntp.memory_budget_gb is None:
        return None
    from ntp_ds.batch.memory import rank_memory

    budget = int(spec.ntp.memory_budget_gb * 2**30)
    seq_len = spec.seq_len or spec.model_config.max_position_embeddings
    micro = spec.ds_config["train_micro_batch_size_per_gpu"]
    return tuple(max_micro_batch(*rank_memory(spec.model_config, lay, spec.ds_config, seq_len, len(topology.layouts)),
                                 budget, micro) for lay in topology.layouts)


def shard_module(model, config: LlamaConfig | HFConfig, groups: ReplicaGroups) -> CausalLMShard:
    """This rank's shard of `model`: an unsharded Llama or transformers model, an HF directory, or a LlamaConfig
    for fresh weights."""
    layout, tp_rank, tp_group = groups.layout, groups.tp_rank, groups.tp_group
    if is_hf_model(model):
        return HFCausalLM.from_model(model, layout, tp_rank, tp_group)
    if isinstance(model, (str, os.PathLike)):
        return HFCausalLM.from_pretrained(model, layout=layout, tp_rank=tp_rank, tp_group=tp_group)
    if not isinstance(model, Llama):
        return Llama(config, layout=layout, tp_rank=tp_rank, tp_group=tp_group, seed=0)
    shard = Llama(config, layout=layout, tp_rank=tp_rank, tp_group=tp_group, init=False)
    specs, full = shard.param_specs(), dict(model.named_parameters())
    with torch.no_grad():
        for name, p in shard.named_parameters():
            p.copy_(shard_tensor(full[name].detach(), specs[name][0], layout, tp_rank))
    return shard


def _rank_deepspeed_config(ds_config: dict, groups: ReplicaGroups, micro_sizes: tuple[int, ...]) -> dict:
    """DeepSpeed sees this replica's own micro-batch plan; a contributor gets no optimizer and no ZeRO."""
    cfg = copy.deepcopy(ds_config)
    cfg.update(deepspeed_batch(micro_sizes, len(groups.dp_ranks), groups.is_anchor))
    if not groups.is_anchor:
        for key in ("optimizer", "scheduler", "zero_optimization"):
            cfg.pop(key, None)
    return cfg


REFUSED_NCCL_ENV = {
    NCCL_BLOCKING_WAIT_ENV: ("1", "a blocking wait ends a slow peer's op at the process-group timeout and tears "
                                      "the communicator down itself; ntp_ds bounds waits and aborts on a verdict"),
    NCCL_DUMP_ENV: ("1", "a failed op leaves a dump signal in the store, and a worker that joins later finds it and "
                         "is ended by its own NCCL monitor"),
    NCCL_DESYNC_DEBUG_ENV: ("1", "torch then turns TORCH_NCCL_ASYNC_ERROR_HANDLING=0 into 3, and the first failed "
                                     "op tears every survivor down"),
}
"""Environment settings the product cannot run under NCCL with: variable -> (refused value, why)."""

OVERLAP_REFUSED_ENV = (CUDA_DEVICE_MAX_CONNECTIONS, "1")
"""With `redundancy_overlap` the state copies wait on peers on the device while the next step computes; one hardware
queue serialises every stream's work behind the first stream wait on such a copy, the buckets and collectives of the
next step included, which the peers wait for in turn."""


def check_nccl_environment() -> None:
    """Refuse, before any process group exists, the NCCL settings recovery cannot run under (`REFUSED_NCCL_ENV`)."""
    if backend_for_device() not in wire.NCCL_LIKE:
        return
    for name, (refused, why) in REFUSED_NCCL_ENV.items():
        if os.environ.get(name, "").strip() == refused:
            raise ConfigError(f"{name}={refused} is not supported with ntp_ds: {why}; unset it or set it to 0")


def check_overlap_environment(ntp: NTPConfig) -> None:
    """Refuse `OVERLAP_REFUSED_ENV` under NCCL with `ntp.redundancy_overlap`, before any process group exists."""
    name, refused = OVERLAP_REFUSED_ENV
    if ntp.redundancy_overlap and backend_for_device() in wire.NCCL_LIKE \
            and os.environ.get(name, "").strip() == refused:
        raise ConfigError(f"{name}={refused} is not supported with ntp.redundancy_overlap=true: the state copies that "
                          "travel during the next step would hold the device's one work queue, and the step's own "
                          f"transfers behind them; unset it (or turn redundancy_overlap off)")


def prepare(model, config, ntp=None, optimizer=None, lr_scheduler=None, seq_len=None) -> tuple[JobSpec, Topology]:
    """Every check that can fail on user input, before any process group exists."""
    check_nccl_environment()
    ds_config = load_deepspeed_config(config)
    ntp = NTPConfig.from_any(ntp)
    ntp.validate(env_world_size())
    check_overlap_environment(ntp)
    spec = JobSpec(ds_config, ntp, model_config_of(model), optimizer, lr_scheduler, seq_len, env_racks())
    topology = build_topology(spec.units(), ntp, spec.racks)
    check_batch(ds_config, ntp, topology)
    spec.plan(topology)
    return spec, topology


def check_error_handling() -> None:
    """Refuse a default group the caller built under NCCL without TORCH_NCCL_ASYNC_ERROR_HANDLING=0: NCCL's
    watchdog would then tear this process down at a peer's failure, and no survivor would survive it."""
    if dist.get_backend() in wire.NCCL_LIKE and os.environ.get(NCCL_ASYNC_ERROR_HANDLING) != "0":
        raise ConfigError(f"TORCH_NCCL_ASYNC_ERROR_HANDLING="
                          f"{os.environ.get(NCCL_ASYNC_ERROR_HANDLING, '(unset)')}: the process group was "
                          "built before ntp_ds.initialize, so it must be built with "
                          "TORCH_NCCL_ASYNC_ERROR_HANDLING=0 in the environment (export it before launching, or let "
                          "ntp_ds.initialize build the group)")


def join_world(ntp: NTPConfig, store=None, generation: int = 0, rank: int | None = None,
               world_size: int | None = None) -> None:
    """Join generation `generation`'s process group (on the launcher's store when there is one) and its control
    group."""
    if torch.cuda.is_available():
        torch.cuda.set_device(cuda_device_index(os.environ, torch.cuda.device_count()))
    prepare_backend(ntp.timeout_s)
    timeout = timedelta(seconds=ntp.timeout_s)
    if store is None:
        deepspeed.init_distributed(dist_backend=backend_for_device(), timeout=timeout)
        start_generation(ntp.timeout_s, ntp.control_fanout)
        return
    from ntp_ds.control.store import generation_store

    rank = int(os.environ[RANK]) if rank is None else rank
    world_size = int(os.environ[WORLD_SIZE]) if world_size is None else world_size
    with unconnected_default_group(backend_for_device(), world_size, ntp.control_fanout):
        dist.init_process_group(backend_for_device(), store=generation_store(store, generation), rank=rank,
                                world_size=world_size, timeout=timeout)
    deepspeed.init_distributed(dist_backend=backend_for_device(), timeout=timeout)
    start_generation(ntp.timeout_s, ntp.control_fanout, generation)


def _groups_and_plan(spec: JobSpec, topology: Topology) -> tuple[ReplicaGroups, BatchPlan]:
    """This rank's groups of `topology` and its batch plan: the same for an engine built and one rebound, whose
    members must build their groups alike."""
    sync, batch_plan = spec.plan(topology)
    # Copies that travel during the next step get communicators of their own under NCCL (one stream each).
    copy_lane = spec.ntp.redundancy_overlap and spec.ntp.zero_redundancy > 0 and wire.is_nccl()
    return build_groups(topology, sync, dist.get_rank(), spec.ntp.timeout_s, copy_lane), batch_plan


def build_engine(spec: JobSpec, topology: Topology, module_for: Callable[[ReplicaGroups], CausalLMShard],
                 store=None, resharded: bool = False) -> NTPEngine:
    """Build this rank's groups, shard and NTPEngine for `topology` (the process group must exist). `resharded`:
    `module_for` assembles the shard from the job's live units, alike on every member (a recovery, a grow)."""
    groups, batch_plan = _groups_and_plan(spec, topology)
    module = module_for(groups)
    if torch.cuda.is_available():
        module = module.to(torch.device("cuda", torch.cuda.current_device()))
    specs = module.param_specs()
    rank_cfg = _rank_deepspeed_config(spec.ds_config, groups, batch_plan.replicas[groups.replica].micro_sizes)
    mpu = NTPMpu(groups)
    anchor = groups.is_anchor
    return NTPEngine(ntp_groups=groups, batch_plan=batch_plan, specs={n: s for n, (s, _) in specs.items()},
                     full_shapes={n: shape for n, (_, shape) in specs.items()}, job=spec, store=store,
                     resharded=resharded, args=None, model=module, optimizer=spec.optimizer if anchor else None,
                     model_parameters=list(module.parameters()),
                     lr_scheduler=spec.lr_scheduler if anchor else None, mpu=mpu, dist_init_required=False,
                     config=rank_cfg, config_class=DeepSpeedConfig(rank_cfg, mpu))


def rebind_engine(spec: JobSpec, topology: Topology, engine: NTPEngine, serve: Callable[[ReplicaGroups], None]) \
        -> NTPEngine:
    """Carry `engine` (detached, of a rank that keeps its place: `recovery.plan.keeps_place`) into `topology`: build
    this rank's groups as `build_engine` does, run `serve(groups)` (this rank's part of the exchange in which the
    others' `module_for` assembles their shards) and rebind the engine to them (`NTPEngine.rebind`)."""
    groups, batch_plan = _groups_and_plan(spec, topology)
    serve(groups)
    engine.rebind(groups, batch_plan)
    return engine


def initialize(model, config, ntp=None, optimizer=None, lr_scheduler=None, seq_len: int | None = None,
               store=None) -> NTPEngine:
    """Build this rank's NTPEngine.

    `model`: an unsharded `Llama` or transformers causal LM (`AutoModelForCausalLM`; every rank keeps only its
    shard of it), a `LlamaConfig` (fresh weights from seed 0) or an HF model directory (each rank reads only its
    shard; run through transformers' own modules). `config`: a DeepSpeed config dict or JSON path;
    `train_batch_size` is the failure-free global batch. `ntp`: an NTPConfig or a dict of its fields. `store`: the coordination store (default: the
    launcher's, from `NTP_STORE`, when set). Every check runs before a process group is built.
    """
    spec, topology = prepare(model, config, ntp, optimizer, lr_scheduler, seq_len)
    if store is None and os.environ.get(STORE_ENV):
        from ntp_ds.control.store import connect_from_env

        store = connect_from_env(spec.ntp.timeout_s)
    if not dist.is_initialized():
        join_world(spec.ntp, store)
    elif not wire.has_control():  # the caller built the default group itself
        check_error_handling()
        prepare_backend(spec.ntp.timeout_s)
        deepspeed.init_distributed(dist_backend=dist.get_backend(), timeout=timedelta(seconds=spec.ntp.timeout_s))
        start_generation(spec.ntp.timeout_s, spec.ntp.control_fanout)
    return build_engine(spec, topology, lambda groups: shard_module(model, spec.model_config, groups), store)

