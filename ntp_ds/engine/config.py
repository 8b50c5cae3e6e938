"""NTP configuration and the checks that run before any process group exists."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path

from ntp_ds.batch import POLICIES, BatchError
from ntp_ds.envs import CUDA_VISIBLE_DEVICES, LOCAL_RANK, LOCAL_WORLD_SIZE, NODE_SIZE_ENV, RACK_SIZE_ENV, WORLD_SIZE
from ntp_ds.layout.domains import Racks


class ConfigError(ValueError):
    """A configuration mistake; the message names the field and value at fault and what would be valid."""


@dataclass
class StragglerConfig:
    """Straggler-aware batch planning (`ntp_ds.batch.straggler`): a replica whose measured step work is longer than
    its peers' takes a smaller share of the global batch, re-planned at step boundaries."""

    enabled: bool = False
    """Re-plan the batch from measured times; off: shares follow the TP degrees only."""
    threshold: float = 0.05
    """Adopt a new plan only when it predicts a step shorter by more than this fraction (hysteresis)."""
    every_steps: int = 5
    """Steps measured under one plan before each decision (their median counts): at most one re-plan per window."""

    def validate(self, where: str = "ntp.straggler") -> None:
        if not isinstance(self.enabled, bool):
            raise ConfigError(f"{where}.enabled={self.enabled!r} must be true or false")
        if isinstance(self.threshold, bool) or not isinstance(self.threshold, (int, float)) \
                or not 0 <= self.threshold < 1:
            raise ConfigError(f"{where}.threshold={self.threshold!r} must be a fraction in [0, 1), e.g. 0.05")
        if isinstance(self.every_steps, bool) or not isinstance(self.every_steps, int) or self.every_steps < 1:
            raise ConfigError(f"{where}.every_steps={self.every_steps!r} must be a positive number of steps")


@dataclass
class LivenessConfig:
    """The liveness bounds of a job under live recovery: declared once, read by `ntp.fault_tolerance` (the library)
    and by `parallel` (`ntp-ds train`'s Hydra schema, `ntp_ds.run.config.ParallelConfig`)."""

    heartbeat_interval_s: float = 0.5
    """How often each rank beats to the job's store."""
    heartbeat_timeout_s: float = 3.0
    """A peer silent this long is dead (a crash is seen at once, through its launcher or its connections)."""
    hang_timeout_s: float | None = 120.0
    """A peer that beats but whose training (its host, or its device: `ntp_ds.comm.device`) makes no progress (no
    phase point, outside any wait) this long while this rank waits on it is hung: it is fenced and its launcher
    kills it (None: never judged by progress). Longer than a rank's longest stretch of its own work between phase
    points (a micro-batch, a write of its weights)."""
    join_timeout_s: float = 600.0
    """How long a joining worker (a repair, `ntp-ds launch --join`, NTP_JOIN) waits to be taken in."""


@dataclass
class FaultToleranceConfig(LivenessConfig):
    """Live recovery in the caller's own training loop (`ntp_ds.fault_tolerant`): `ntp.fault_tolerance` is true, or a
    mapping of these fields and of `LivenessConfig`'s."""

    enabled: bool = False
    """`ntp_ds.initialize` returns a `FaultTolerantEngine`, whose `attempt` recovers a step a peer's failure broke."""
    faults: tuple = ()
    """Injected faults: `{rank, step, phase, kind}` entries, as `fault.faults` of `ntp-ds train`."""
    last_good_dir: str | None = None
    """Where the survivors write the last good weights (HF form) when no replica can go on (None: not written)."""

    def validate(self, where: str = "ntp.fault_tolerance") -> None:
        if not isinstance(self.enabled, bool):
            raise ConfigError(f"{where}.enabled={self.enabled!r} must be true or false")
        for name in ("heartbeat_interval_s", "heartbeat_timeout_s", "join_timeout_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ConfigError(f"{where}.{name}={value!r} must be a positive number of seconds")
        if self.heartbeat_interval_s >= self.heartbeat_timeout_s:
            raise ConfigError(f"{where}.heartbeat_interval_s={self.heartbeat_interval_s} must be shorter than "
                              f"heartbeat_timeout_s={self.heartbeat_timeout_s}")
        if self.hang_timeout_s is not None and (isinstance(self.hang_timeout_s, bool) or not isinstance(
                self.hang_timeout_s, (int, float)) or not self.hang_timeout_s > 0):
            raise ConfigError(f"{where}.hang_timeout_s={self.hang_timeout_s!r} must be a positive number of seconds "
                              "or null")


def _sub_config(cls, value, where: str, mapping_enables: bool = False):
    """A nested setting given as its dataclass, a mapping of its fields, None (defaults) or, for one with an
    `enabled` field, a bool; with `mapping_enables`, a mapping without `enabled` turns the feature on."""
    if isinstance(value, cls):
        return value
    if isinstance(value, bool) and any(f.name == "enabled" for f in fields(cls)):
        return cls(enabled=value)
    if value is not None and not isinstance(value, Mapping):
        raise ConfigError(f"{where}={value!r} must be a mapping of its settings")
    value = dict(value or {})
    known = {f.name for f in fields(cls)}
    unknown = sorted(set(value) - known)
    if unknown:
        raise ConfigError(f"{where}.{unknown[0]} is not a known setting; valid: {sorted(known)}")
    if mapping_enables and value and "enabled" not in value:
        value["enabled"] = True
    return cls(**value)


@dataclass
class ReplicaConfig:
    """How replicas are laid out and how a degraded replica trains: declared once, read by `ntp` (the library's
    `NTPConfig`) and by `parallel` (`ntp-ds train`'s Hydra schema, `ntp_ds.run.config.ParallelConfig`)."""

    tp: int = 1
    """Healthy tensor-parallel degree of a replica."""
    replicas: int = 1
    """Number of data-parallel replicas."""
    degrees: tuple[int, ...] | None = None
    """TP degree of each replica at start (default: every replica at `tp`); e.g. (3, 2) after a loss."""
    batch_policy: str = "preserve_global_batch"
    """`proportional`: a replica at t' of t GPUs takes t'/t of the samples; `preserve_global_batch`: healthy
    replicas also take the remainder, so every step sees the failure-free global batch."""
    min_tp: int = 1
    """Smallest TP degree a replica may train at; below it the replica is dropped."""
    zero_redundancy: int = 1
    """In-memory copies of each ZeRO partition kept on other replicas."""
    redundancy_on_host: bool = False
    """Keep the copies in the buddy's host memory (pinned under CUDA) instead of device memory, filled through two
    staging buffers of `bucket_size` elements: for when device memory is the constraint."""
    redundancy_overlap: bool = False
    """Let the per-step copies travel during the next step (awaited before its optimizer step) instead of completing
    them at the step's end. Faster, but an owner that dies before its copy arrived leaves that step's partition
    nowhere: recovery then reports `lossless: false`."""
    redundancy_keep_previous: bool = False
    """Keep each copy of the step before too, while the next one travels (twice the copies' memory), so that a
    death before the newest copy of the dead rank's state arrived rolls the job back one step instead of losing it.
    Whole only where a second copy of every state survives the death as well (`zero_redundancy` 2 or more)."""
    memory_budget_gb: float | None = None
    """Per-rank memory budget; a degraded replica lowers its micro-batch to fit it."""
    timeout_s: float = 300.0
    """Bound on every wait for a peer."""
    bucket_size: int = 500_000_000
    """Elements per message of the gradient and parameter exchange between replicas (as DeepSpeed's
    `reduce_bucket_size`): bounds the exchange buffers, and smaller buckets start streaming sooner in backward."""
    control_fanout: int = 32
    """Members of one group of the control tree that carries the per-step votes and sums over the whole job: a
    reduction crosses about fanout x log_fanout(world) hops, instead of a ring's 2 x world."""
    straggler: StragglerConfig = field(default_factory=StragglerConfig)
    """Give a replica slower than its peers a smaller share of the global batch (a mapping of its fields also works)."""

    def __post_init__(self):
        if self.degrees is not None:
            self.degrees = tuple(int(d) for d in self.degrees)
        if isinstance(self.straggler, Mapping) or self.straggler is None:
            self.straggler = _sub_config(StragglerConfig, self.straggler, "ntp.straggler")

    @property
    def replica_degrees(self) -> tuple[int, ...]:
        return tuple(self.degrees) if self.degrees is not None else (self.tp,) * self.replicas


@dataclass
class NTPConfig(ReplicaConfig):
    """The library's NTP settings (`ntp_ds.initialize(ntp=...)`): `ReplicaConfig`'s, and live recovery."""

    fault_tolerance: FaultToleranceConfig = field(default_factory=FaultToleranceConfig)
    """Live recovery in the caller's own loop: true, or a mapping of `FaultToleranceConfig` fields."""

    def __post_init__(self):
        super().__post_init__()
        self.fault_tolerance = _sub_config(FaultToleranceConfig, self.fault_tolerance, "ntp.fault_tolerance",
                                           mapping_enables=True)

    @classmethod
    def from_any(cls, value) -> "NTPConfig":
        if isinstance(value, cls):
            return value
        if value is None:
            return cls()
        value = dict(value)
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ConfigError(f"ntp.{unknown[0]} is not a known NTP setting; valid: {sorted(known)}")
        return cls(**value)

    def validate(self, world_size: int | None) -> None:
        if self.tp < 1:
            raise ConfigError(f"ntp.tp={self.tp} must be at least 1")
        if self.replicas < 1:
            raise ConfigError(f"ntp.replicas={self.replicas} must be at least 1")
        if self.batch_policy not in POLICIES:
            raise ConfigError(f"ntp.batch_policy={self.batch_policy!r} must be one of {POLICIES}")
        if not 1 <= self.min_tp <= self.tp:
            raise ConfigError(f"ntp.min_tp={self.min_tp} must lie in 1..tp={self.tp}")
        if self.bucket_size < 1:
            raise ConfigError(f"ntp.bucket_size={self.bucket_size} must be a positive number of elements")
        if self.zero_redundancy < 0:
            raise ConfigError(f"ntp.zero_redundancy={self.zero_redundancy} must be 0 or more")
        if self.control_fanout < 2:
            raise ConfigError(f"ntp.control_fanout={self.control_fanout} must be at least 2")
        self.straggler.validate()
        self.fault_tolerance.validate()
        check_launcher_period(self.fault_tolerance)
        degrees = self.replica_degrees
        if len(degrees) != self.replicas:
            raise ConfigError(f"ntp.degrees={list(degrees)} lists {len(degrees)} replicas but "
                              f"ntp.replicas={self.replicas}")
        for r, d in enumerate(degrees):
            if not self.min_tp <= d <= self.tp:
                raise ConfigError(f"ntp.degrees[{r}]={d} must lie in min_tp={self.min_tp}..tp={self.tp}")
        if world_size is not None and world_size != sum(degrees):
            raise ConfigError(f"world size {world_size} does not match the topology: degrees {list(degrees)} "
                              f"need {sum(degrees)} processes")


def check_launcher_period(liveness: LivenessConfig, where: str = "ntp.fault_tolerance",
                          env: Mapping[str, str] = os.environ) -> None:
    """In a job so large that its launchers publish less often than its workers beat (`launcher_period_s`), a
    timeout must outlast two of their periods: a live node's key moves only once a period."""
    from ntp_ds.control.node_store import launch_nodes, launcher_period_s

    nodes = launch_nodes(env)
    if nodes is None:
        return
    period = launcher_period_s(nodes, liveness.heartbeat_interval_s)
    if period > liveness.heartbeat_interval_s and liveness.heartbeat_timeout_s <= 2 * period:
        raise ConfigError(f"{where}.heartbeat_timeout_s={liveness.heartbeat_timeout_s} must be longer "
                          f"than two of the launchers' periods: {nodes} nodes publish their liveness every "
                          f"{period:g} s (the job's store's budget between failures), so set it above "
                          f"{2 * period:g} s")


def load_deepspeed_config(config) -> dict:
    """Read a DeepSpeed config given as a dict or a JSON path, and reject what NTP cannot run."""
    if isinstance(config, (str, Path)):
        try:
            config = json.loads(Path(config).read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise ConfigError(f"config={str(config)!r} is not a readable DeepSpeed JSON file: {e}") from None
    if not isinstance(config, dict):
        raise ConfigError(f"config must be a DeepSpeed config dict or JSON path, got {type(config).__name__}")
    config = json.loads(json.dumps(config))
    stage = int(config.get("zero_optimization", {}).get("stage", 0))
    if stage not in (0, 1, 2):
        raise ConfigError(f"zero_optimization.stage={stage} is not supported: ZeRO-3 partitions parameters, "
                          f"which NTP already shards by layout; use stage 0, 1 or 2")
    for key in ("train_batch_size", "train_micro_batch_size_per_gpu"):
        if key not in config:
            raise ConfigError(f"{key} is missing from the DeepSpeed config; NTP plans batches from it")
        if not isinstance(config[key], int) or config[key] < 1:
            raise ConfigError(f"{key}={config[key]!r} must be a positive integer")
    if config.get("fp16", {}).get("enabled"):
        raise ConfigError("fp16.enabled=true is not supported: use bf16 or fp32")
    clip = config.get("gradient_clipping", 0)
    if not isinstance(clip, (int, float)) or isinstance(clip, bool) or clip < 0:
        raise ConfigError(f"gradient_clipping={clip!r} must be a number >= 0 (0 disables clipping)")
    if clip:
        # These two compute DeepSpeed's norm from per-parameter norms, where no element can be counted once.
        zero = config.get("zero_optimization", {})
        if zero.get("offload_optimizer", {}).get("device", "none") not in ("none", None):
            raise ConfigError(f"gradient_clipping={clip} with zero_optimization.offload_optimizer is not supported: "
                              "the norm would count a KV head shared by TP ranks more than once; keep the optimizer "
                              "on the device or set gradient_clipping=0")
        if stage == 0 and config.get("bf16", {}).get("enabled"):
            raise ConfigError(f"gradient_clipping={clip} with bf16 at zero_optimization.stage=0 is not supported: "
                              "use stage 1 or 2 (its norm counts every element once) or set gradient_clipping=0")
    return config


def env_world_size() -> int | None:
    value = os.environ.get(WORLD_SIZE)
    return int(value) if value else None


def env_racks(env: Mapping[str, str] = os.environ) -> Racks | None:
    """The racks the launcher described: `NTP_RACK_SIZE` nodes per rack, of `NTP_NODE_SIZE` ranks (ntp-ds launch)
    or `LOCAL_WORLD_SIZE` (torchrun, deepspeed); None where it did not. A ConfigError names a bad value."""
    raw = env.get(RACK_SIZE_ENV)
    if not raw:
        return None
    node = env.get(NODE_SIZE_ENV) or env.get(LOCAL_WORLD_SIZE)
    if not raw.isdigit() or int(raw) < 1:
        raise ConfigError(f"{RACK_SIZE_ENV}={raw!r} must be a positive number of nodes per rack")
    if not node or not node.isdigit() or int(node) < 1:
        raise ConfigError(f"{RACK_SIZE_ENV}={raw} needs the ranks per node: {NODE_SIZE_ENV} (set by ntp-ds launch) or "
                          f"{LOCAL_WORLD_SIZE} (torchrun, deepspeed), a positive number (found {node!r})")
    return Racks(int(node), int(raw))


def cuda_device_index(env: Mapping[str, str], device_count: int) -> int:
    """This rank's CUDA device: the LOCAL_RANK-th the process sees, as DeepSpeed's engine sets it too. Raise a
    ConfigError where two ranks of one node would share a device (NCCL refuses two ranks of one communicator on one
    device)."""
    local_rank, world_size = env.get(LOCAL_RANK), int(env.get(WORLD_SIZE) or 1)
    if local_rank is None:
        if world_size == 1:
            return 0
        raise ConfigError(f"LOCAL_RANK is not set in a world of {world_size} ranks, so every rank of a node would "
                          "take CUDA device 0: start the job with a launcher that sets it (ntp-ds launch, torchrun, "
                          "deepspeed) or export it per rank")
    index = int(local_rank)
    if 0 <= index < device_count:
        return index
    raise ConfigError(f"LOCAL_RANK={index} but this process sees {device_count} CUDA device(s) "
                      f"(CUDA_VISIBLE_DEVICES={env.get(CUDA_VISIBLE_DEVICES, '(unset)')}): ranks of this node "
                      f"would share a device. Start at most {device_count} ranks per node, each seeing all of them")


def check_batch(ds_config: dict, ntp: NTPConfig, topology) -> None:
    """Raise a ConfigError (not a BatchError deep in a rank) for a batch `topology` (a `Topology`) cannot split."""
    from ntp_ds.batch import plan_batch
    from ntp_ds.layout import replica_paces

    try:
        plan_batch(replica_paces(topology.layouts, ntp.tp), ds_config["train_batch_size"],
                   ds_config["train_micro_batch_size_per_gpu"], ntp.batch_policy)
    except BatchError as e:
        raise ConfigError(str(e)) from None
