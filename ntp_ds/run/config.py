"""The train configuration: one dataclass per Hydra group, the checks that cross fields, and the DeepSpeed config
generated from it.

`RunConfig` is the schema of `conf/config.yaml`, registered with Hydra's ConfigStore as `run_schema` (its defaults
list extends it): OmegaConf refuses a wrong type, an unknown key or a `???` left unset while Hydra composes, and
`ntp_ds.schema` words that error as one line naming the dotted key. `validate` keeps the hand-written checks: value
ranges and choices, and what crosses fields (layout vs world size, batch divisibility, faults vs steps), each
raising a `ConfigError` whose message starts with the dotted field name.

Pure logic: no process group, no file written.
"""

from __future__ import annotations

import typing
from pathlib import Path
from dataclasses import asdict, dataclass, field, fields, make_dataclass
from typing import Any

from ntp_ds.batch import POLICIES
from ntp_ds.control.faults import FaultSchedule
from ntp_ds.engine.config import (ConfigError, FaultToleranceConfig, LivenessConfig, NTPConfig, ReplicaConfig,
                                  check_batch, check_launcher_period, load_deepspeed_config)
from ntp_ds.layout import LayoutError, Topology
from ntp_ds.models import LlamaConfig
from ntp_ds.schema import SchemaError, build, register

WANDB_MODES = ("online", "offline", "disabled")
OPTIMIZERS = ("adamw", "sgd")
DATASETS = ("synthetic", "tokens")
PRECISIONS = ("fp32", "bf16")
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
EXISTING_RUN = ("refuse", "resume", "overwrite")


@dataclass
class ModelName:
    """Which Llama to train: a name for the logs, then the shape fields of `ntp_ds.models.LlamaConfig`."""

    name: str = "tiny"
    """Name shown in logs, the dry run and the summary."""
    path: str | None = None
    """An HF model directory (`model=hf model.path=DIR`): its config.json gives the shape (the Llama fields below are
    then unused) and each rank reads only its slices of the weights. A relative path is read from the working
    directory, else from the project's root (where `recipes/hf/` lies)."""

    def llama_config(self) -> LlamaConfig:
        try:
            return LlamaConfig(**{f.name: getattr(self, f.name) for f in fields(LlamaConfig)})
        except (TypeError, ValueError) as e:
            raise ConfigError(f"model.{e}") from None

    def directory(self) -> Path:
        """The HF model directory `path` names (it must hold a config.json)."""
        from ntp_ds.overrides import config_dir

        where = Path(self.path).expanduser()
        if not where.is_absolute() and not where.exists() and (config_dir().parent / where).exists():
            where = config_dir().parent / where
        if not (where / "config.json").is_file():
            raise ConfigError(f"model.path={self.path}: no config.json there (an HF model directory is expected)")
        return where.resolve()

    def model_config(self):
        """The shape the job plans with: the HF directory's config (`path`), else the own Llama's fields."""
        if self.path is None:
            return self.llama_config()
        from ntp_ds.engine.initialize import model_config_of

        try:
            return model_config_of(str(self.directory()))
        except ConfigError as e:
            raise ConfigError(f"model.path={self.path}: {e}") from None

    def source(self):
        """What `ntp_ds.initialize` takes: the HF directory, or the own Llama's config (fresh weights from `seed`)."""
        return str(self.directory()) if self.path is not None else self.llama_config()


def _llama_fields() -> list:
    hints = typing.get_type_hints(LlamaConfig)
    return [(f.name, hints[f.name], field(default=f.default)) for f in fields(LlamaConfig)]


ModelConfig = make_dataclass("ModelConfig", _llama_fields(), bases=(ModelName,), namespace={"__module__": __name__})
ModelConfig.__doc__ = ("The `model` group: `name`, then every `LlamaConfig` field with its type and default, taken "
                       "from `LlamaConfig` itself (its docstrings document them) so the shape is declared once.")


@dataclass
class ParallelConfig(ReplicaConfig, LivenessConfig):
    """Replicas, their TP degrees, the ZeRO stage and the failure bounds: `ReplicaConfig`'s and `LivenessConfig`'s
    fields (declared there once, with their defaults; conf/parallel/default.yaml sets this command's), and the ZeRO
    stage DeepSpeed reads."""

    zero_stage: int = 1
    """DeepSpeed ZeRO stage: 0, 1 or 2."""

    def ntp(self, live: bool = False) -> NTPConfig:
        """The engine's NTP settings; `live`: with `fault_tolerance` on, at this config's liveness bounds (the faults
        are armed from `fault.faults` by whoever starts the rank)."""
        kw = {f.name: getattr(self, f.name) for f in fields(ReplicaConfig)}
        if live:
            kw["fault_tolerance"] = FaultToleranceConfig(
                enabled=True, **{f.name: getattr(self, f.name) for f in fields(LivenessConfig)})
        return NTPConfig(**kw)


@dataclass
class DataConfig:
    """The token stream: a seeded generated language or a token file, read in the same order by every run."""

    name: str = "synthetic"
    """`synthetic` (ntp_ds.batch.loader.SyntheticTokens) or `tokens` (ntp_ds.batch.token_file.TokenFile)."""
    seq_len: int = 64
    """Tokens per sample."""
    size: int | None = 4096
    """Samples in the dataset; the sampler wraps around into a new seeded permutation. null (tokens): the whole file."""
    seed: int = 0
    """Seed of the generated language and of the sample order."""
    branching: int = 4
    """synthetic: successors per token in the generated language (lower is easier); 0: uniform random tokens."""
    path: str | None = None
    """tokens: the flat binary token file (ids back to back); FILE.json beside it may give dtype and vocabulary."""
    dtype: str | None = None
    """tokens: uint16 or uint32; null: the dtype of the sidecar FILE.json."""

    def dataset(self, vocab_size: int):
        """The dataset the loader reads; the token file is checked against the model's vocabulary."""
        if self.name == "tokens":
            from ntp_ds.batch.token_file import TokenFile

            data = TokenFile(self.path, self.seq_len, self.dtype, self.size)
            data.check_vocab(vocab_size)
            return data
        from ntp_ds.batch.loader import SyntheticTokens

        return SyntheticTokens(vocab_size, self.seq_len, self.size, self.seed, self.branching)


@dataclass
class OptimConfig:
    """Optimizer, turned into the DeepSpeed `optimizer` (and `scheduler`) sections."""

    name: str = "adamw"
    """`adamw` (torch AdamW, no fused CUDA op) or `sgd`."""
    lr: float = 1e-3
    """Peak learning rate."""
    weight_decay: float = 0.0
    """Decoupled weight decay (AdamW) or L2 penalty (SGD)."""
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    """AdamW moment decay rates."""
    eps: float = 1e-8
    """AdamW denominator epsilon."""
    momentum: float = 0.0
    """SGD momentum."""
    grad_clip: float = 0.0
    """Global gradient-norm clip (DeepSpeed gradient_clipping); 0 disables it."""
    warmup_steps: int = 0
    """Linear warm-up steps (DeepSpeed WarmupLR); 0: constant learning rate."""


@dataclass
class FaultConfig:
    """Fault injection schedule, read by `ntp_ds.control.FaultSchedule`; the injector lives in `ntp_ds.control`.

    The entries stay free-form mappings here: `FaultSchedule.from_config` is the one declaration of their fields and
    checks each entry (unknown, missing and wrong fields, ranks that do not exist), naming `fault.faults[i].FIELD`.
    """

    faults: list[dict[str, Any]] = field(default_factory=list)
    """List of {rank, step, phase, kind}: launch rank, step 1..train.steps, phase forward|backward|grad_sync|
    optimizer|recovery, kind crash|hang|device_error."""


@dataclass
class WandbConfig:
    """Where the W&B run goes."""

    mode: str = "offline"
    """online, offline (no network; sync later with `wandb sync`) or disabled."""
    project: str = "ntp-ds"
    """W&B project."""
    entity: str | None = None
    """W&B team or user; null: the default entity of the logged-in user."""
    name: str | None = None
    """Run name; null: the run directory's name."""
    tags: list[str] = field(default_factory=list)
    """Tags attached to the run."""


@dataclass
class LoggingConfig:
    """Console, log files, progress bar and W&B."""

    level: str = "INFO"
    """Level of rank 0 on the console and of every rank's file run_dir/logs/rank{N}.log."""
    other_ranks_level: str = "WARNING"
    """Console level of the ranks other than 0."""
    progress: bool = True
    """tqdm progress bar of the training steps on rank 0."""
    wandb: WandbConfig = field(default_factory=WandbConfig)
    """W&B settings."""


@dataclass
class LauncherConfig:
    """How `ntp-ds train` starts its workers when it runs outside any launcher (see `ntp_ds.supervise.launch`)."""

    name: str = "local"
    """Launcher; `local` spawns the workers of this node and hosts the rendezvous store."""
    nnodes: int = 1
    """Nodes taking part."""
    node_rank: int = 0
    """This node's index; node 0 hosts the store."""
    nproc_per_node: int | None = None
    """Workers per node; null: the world size (sum of the replicas' degrees) divided by nnodes."""
    store: str | None = None
    """HOST:PORT of the store node 0 hosts; null on a single node: a free local port. Or
    `etcd://HOST:PORT[,HOST:PORT...][/JOB]`: an etcd v3 cluster that no node hosts (`control.etcd_store`)."""
    rack_size: int | None = None
    """Contiguous nodes per rack (nodes 0..rack_size-1 form the first): copies of each replica's state and its
    watchers are placed in other racks, so that a rack lost whole loses no state and is seen from outside it. null:
    racks unknown."""
    grace_s: float = 60.0
    """Seconds workers get to stop cleanly (finish the step, write weights and summary) after SIGINT or SIGTERM."""
    fork: bool = True
    """Fork the workers from `ntp-ds train`, which imports torch, DeepSpeed and ntp_ds once for all of them (on Linux
    machines without CUDA devices; elsewhere, and with false, each worker is a fresh interpreter that imports them)."""


@dataclass
class TrainSection:
    """Steps and batch."""

    steps: int = 20
    """Optimizer steps to run."""
    global_batch: int = 8
    """Failure-free global batch in samples (DeepSpeed train_batch_size)."""
    micro_batch: int = 2
    """Samples per micro-batch (DeepSpeed train_micro_batch_size_per_gpu)."""
    precision: str = "fp32"
    """fp32 or bf16."""
    save_final: bool = True
    """Write the consolidated weights to run_dir/final (HF form) at the end (also when stopped by a signal)."""
    save_checkpoint: bool = True
    """Write DeepSpeed's checkpoint to run_dir/checkpoints at the end and when stopped (`existing_run=resume`)."""
    checkpoint_every: int = 0
    """Also write it every this many steps; 0: only at the end and when stopped."""


@dataclass
class RunConfig:
    """Everything one training run reads."""

    seed: int = 0
    """Seeds the weights; the data has its own `data.seed`."""
    recipe: str | None = None
    """Name of recipes/NAME.yaml merged over the defaults."""
    dry_run: bool = False
    """Print shapes, per-GPU memory (healthy and degraded) and the group layout, then exit."""
    deepspeed_config: str | None = None
    """Path of a DeepSpeed JSON used whole instead of the one generated from train/optim/parallel."""
    run_dir: str | None = None
    """Where the run writes metrics, events, summary, W&B files and weights; null: hydra.run.dir."""
    existing_run: str = "refuse"
    """When run_dir already holds a run: `refuse` (exit 2, nothing touched), `resume` (continue from its last
    checkpoint, appending to its records) or `overwrite` (delete its records, weights and checkpoints first)."""
    train: TrainSection = field(default_factory=TrainSection)
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    fault: FaultConfig = field(default_factory=FaultConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    launcher: LauncherConfig = field(default_factory=LauncherConfig)

    # -- construction ------------------------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, data: dict) -> RunConfig:
        """Build from the composed config (a plain dict), checked against this schema by OmegaConf."""
        try:
            return build(cls, {k: v for k, v in data.items() if k != "hydra"})
        except SchemaError as e:
            raise ConfigError(str(e)) from None

    def to_dict(self) -> dict:
        return asdict(self)

    # -- derived -----------------------------------------------------------------------------------------------
    @property
    def world_size(self) -> int:
        """Processes the topology needs: the sum of the replicas' TP degrees."""
        return sum(self.parallel.replica_degrees)

    @property
    def allocated_gpus(self) -> int:
        """GPUs the job holds: every replica's healthy domain, degraded or not."""
        return self.parallel.replicas * self.parallel.tp

    def ds_config(self) -> dict:
        """The DeepSpeed config: the file named by `deepspeed_config` whole, else generated."""
        if self.deepspeed_config:
            try:
                return load_deepspeed_config(self.deepspeed_config)
            except ConfigError as e:
                raise ConfigError(f"deepspeed_config: {e}") from None
        return load_deepspeed_config(generate_deepspeed_config(self))

    # -- checks ------------------------------------------------------------------------------------------------
    def validate(self, world_size: int | None = None) -> None:
        """Check every field before any process starts; `world_size` is the launcher's WORLD_SIZE, if any."""
        _check_choice("logging.level", self.logging.level, LOG_LEVELS)
        _check_choice("logging.other_ranks_level", self.logging.other_ranks_level, LOG_LEVELS)
        _check_choice("logging.wandb.mode", self.logging.wandb.mode, WANDB_MODES)
        _check_choice("optim.name", self.optim.name, OPTIMIZERS)
        _check_choice("train.precision", self.train.precision, PRECISIONS)
        _check_choice("data.name", self.data.name, DATASETS)
        _check_choice("existing_run", self.existing_run, EXISTING_RUN)
        if self.train.checkpoint_every < 0:
            raise ConfigError(f"train.checkpoint_every={self.train.checkpoint_every} must be 0 (only at the end) or "
                              f"a positive number of steps")
        _check_choice("parallel.batch_policy", self.parallel.batch_policy, POLICIES)
        _check_choice("parallel.zero_stage", self.parallel.zero_stage, (0, 1, 2))
        for name in ("train.steps", "train.global_batch", "train.micro_batch", "data.seq_len", "launcher.nnodes"):
            _check_positive(name, _get(self, name))
        if self.optim.lr <= 0:
            raise ConfigError(f"optim.lr={self.optim.lr} must be positive")
        if self.optim.grad_clip < 0 or self.optim.warmup_steps < 0:
            raise ConfigError(f"optim.grad_clip={self.optim.grad_clip} and optim.warmup_steps="
                              f"{self.optim.warmup_steps} must be 0 or more")
        llama = self.model.model_config()
        if self.data.seq_len > llama.max_position_embeddings:
            raise ConfigError(f"data.seq_len={self.data.seq_len} exceeds model.max_position_embeddings="
                              f"{llama.max_position_embeddings}")
        self._check_data(llama.vocab_size)
        ntp = self._check_parallel(llama)
        self._check_world(world_size)
        ds = self.ds_config()
        try:
            check_batch(ds, ntp, Topology.from_degrees(llama.units(self.data.seq_len), ntp.replica_degrees))
        except ConfigError as e:
            raise ConfigError(f"train.global_batch/micro_batch: {e}") from None
        self._check_faults()

    def _check_data(self, vocab_size: int) -> None:
        d = self.data
        if d.size is not None or d.name == "synthetic":
            _check_positive("data.size", d.size)
        if d.name == "synthetic" and not 0 <= d.branching <= vocab_size:
            raise ConfigError(f"data.branching={d.branching} must lie in 0 (uniform tokens)..model.vocab_size="
                              f"{vocab_size}")
        if d.name == "tokens" and not d.path:
            raise ConfigError("data.path=null: data=tokens reads a token file; set data.path=FILE")
        if d.name == "tokens":
            from ntp_ds.batch.token_file import TokenFileError

            try:
                d.dataset(vocab_size)
            except TokenFileError as e:
                raise ConfigError(str(e)) from None

    def _check_parallel(self, llama: LlamaConfig) -> NTPConfig:
        p = self.parallel
        for name in ("tp", "replicas"):
            _check_positive(f"parallel.{name}", getattr(p, name))
        for name in ("timeout_s", "heartbeat_interval_s", "heartbeat_timeout_s", "hang_timeout_s", "join_timeout_s"):
            if name == "hang_timeout_s" and p.hang_timeout_s is None:  # never judged by progress
                continue
            if not getattr(p, name) > 0:
                raise ConfigError(f"parallel.{name}={getattr(p, name)} must be positive")
        if p.heartbeat_interval_s >= p.heartbeat_timeout_s:
            raise ConfigError(f"parallel.heartbeat_interval_s={p.heartbeat_interval_s} must be smaller than "
                              f"parallel.heartbeat_timeout_s={p.heartbeat_timeout_s} (a live worker beats several "
                              f"times per timeout)")
        check_launcher_period(p, "parallel")
        ntp = p.ntp()
        try:
            ntp.validate(None)
        except ConfigError as e:
            raise ConfigError(str(e).replace("ntp.", "parallel.")) from None
        for r, degree in enumerate(p.replica_degrees):
            try:
                Topology.from_degrees(llama.units(), (degree,))
            except LayoutError as e:
                field_name = f"parallel.degrees[{r}]" if p.degrees is not None else "parallel.tp"
                raise ConfigError(f"{field_name}={degree} does not fit model {self.model.name}: {e}") from None
        if self.train.precision == "bf16" and p.zero_stage == 0:
            raise ConfigError("parallel.zero_stage=0 with train.precision=bf16: live recovery cannot read that "
                              "optimizer's fp32 masters; use parallel.zero_stage=1 or 2")
        return ntp

    def _check_world(self, world_size: int | None) -> None:
        need, launcher, p = self.world_size, self.launcher, self.parallel
        degrees = (f"parallel.degrees={list(p.degrees)}" if p.degrees is not None
                   else f"parallel.tp={p.tp} x parallel.replicas={p.replicas}")
        if world_size is not None and world_size != need:
            raise ConfigError(f"{degrees} needs {need} processes but the launcher started "
                              f"WORLD_SIZE={world_size}; set parallel.tp/parallel.replicas (or degrees) to match")
        if not 0 <= launcher.node_rank < launcher.nnodes:
            raise ConfigError(f"launcher.node_rank={launcher.node_rank} must lie in 0..nnodes-1={launcher.nnodes - 1}")
        if launcher.rack_size is not None:
            _check_positive("launcher.rack_size", launcher.rack_size)
        if launcher.nproc_per_node is not None:
            _check_positive("launcher.nproc_per_node", launcher.nproc_per_node)
            if launcher.nproc_per_node * launcher.nnodes != need:
                raise ConfigError(f"launcher.nproc_per_node={launcher.nproc_per_node} x launcher.nnodes="
                                  f"{launcher.nnodes} = {launcher.nproc_per_node * launcher.nnodes} processes, but "
                                  f"{degrees} needs {need}")
        elif need % launcher.nnodes:
            raise ConfigError(f"launcher.nnodes={launcher.nnodes} does not divide the world size {need} of "
                              f"{degrees}; set launcher.nproc_per_node")
        if launcher.nnodes > 1 and not launcher.store:
            raise ConfigError(f"launcher.store=null: with launcher.nnodes={launcher.nnodes}, give HOST:PORT of the "
                              f"store node 0 hosts, or etcd://HOST:PORT[,HOST:PORT...][/JOB] of an etcd cluster")
        if launcher.store:
            from ntp_ds.control.address import validate_address

            try:
                validate_address(str(launcher.store))
            except ValueError as e:
                raise ConfigError(f"launcher.store: {e}") from None

    def _check_faults(self) -> None:
        try:
            schedule = FaultSchedule.from_config(self.fault.faults, self.world_size)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        for i, fault in enumerate(schedule.faults):
            if not 1 <= fault.step <= self.train.steps:
                raise ConfigError(f"fault.faults[{i}].step={fault.step} must lie in 1..train.steps={self.train.steps}")

    def fault_schedule(self) -> FaultSchedule:
        return FaultSchedule.from_config(self.fault.faults, self.world_size)


def generate_deepspeed_config(cfg: RunConfig) -> dict:
    """The DeepSpeed config of a run: batch, optimizer, ZeRO stage and precision from the train config."""
    o = cfg.optim
    if o.name == "sgd":
        optimizer = {"type": "SGD", "params": {"lr": o.lr, "momentum": o.momentum, "weight_decay": o.weight_decay}}
    else:
        optimizer = {"type": "AdamW", "params": {"lr": o.lr, "betas": list(o.betas), "eps": o.eps,
                                                 "weight_decay": o.weight_decay, "torch_adam": True}}
    ds = {"train_batch_size": cfg.train.global_batch, "train_micro_batch_size_per_gpu": cfg.train.micro_batch,
          "optimizer": optimizer, "zero_optimization": {"stage": cfg.parallel.zero_stage},
          "bf16": {"enabled": cfg.train.precision == "bf16"}, "gradient_clipping": o.grad_clip,
          "steps_per_print": 10**9, "wall_clock_breakdown": False, "zero_allow_untested_optimizer": True}
    if o.warmup_steps:
        ds["scheduler"] = {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": o.lr,
                                                          "warmup_num_steps": o.warmup_steps,
                                                          "warmup_type": "linear"}}
    return ds


# -- helpers ---------------------------------------------------------------------------------------------------
def _get(cfg, dotted: str):
    for part in dotted.split("."):
        cfg = getattr(cfg, part)
    return cfg


def _check_choice(name: str, value, valid) -> None:
    if value not in valid:
        raise ConfigError(f"{name}={value!r} must be one of {', '.join(map(str, valid))}")


def _check_positive(name: str, value) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ConfigError(f"{name}={value!r} must be a positive integer")


register("run_schema", RunConfig)
