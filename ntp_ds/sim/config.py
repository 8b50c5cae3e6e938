"""Configuration dataclasses for the cluster-scale goodput simulator.

Every field has a default so ``SimConfig()`` is a runnable scenario.  The
Hydra config group ``conf/sim/default.yaml`` mirrors these defaults one to
one.  ``SimulateConfig`` (``sim`` plus the command's own keys) is the schema
of ``conf/simulate.yaml``, registered with Hydra's ConfigStore as
``simulate_schema``: OmegaConf checks types, unknown keys and ``???`` values
while Hydra composes.  ``SimConfig.from_dict`` builds a config from plain
nested dicts through the same schema, and ``validate`` keeps the hand-written
checks (ranges, choices and what crosses fields).  Both raise
:class:`ConfigError`, which names the offending field and value.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Optional

from ntp_ds.schema import SchemaError, build, register


class ConfigError(ValueError):
    """Invalid simulator configuration; ``field`` is a dotted path."""

    def __init__(self, field_name: str, value: Any, reason: str, message: str | None = None):
        self.field = field_name
        self.value = value
        self.reason = reason
        super().__init__(message or f"{field_name}={value!r}: {reason}")


@dataclass
class ClusterConfig:
    """The job's GPUs and how they are grouped."""

    num_gpus: int = 16384
    """GPUs in the job, spares excluded."""
    domain_size: int = 8
    """GPUs per scale-up domain (NVL8 .. NVL72)."""
    tp: int = 8
    """Tensor-parallel degree; divides domain_size - hot_spares."""
    pp: int = 1
    """Pipeline stages per data-parallel replica."""
    microbatches: int = 8
    """Microbatches per step (sets the pipeline bubble)."""
    hot_spares: int = 0
    """GPUs per domain held as hot spares (NVL72: 8 for TP64)."""


@dataclass
class ModelConfig:
    """The trained model's size and shape, for step time and sharding units."""

    params_billion: float = 70.0
    """Parameters in billions; 0 derives 12 * layers * hidden^2."""
    hidden: int = 8192
    """Hidden width."""
    heads: int = 64
    """Attention (query) heads."""
    layers: int = 80
    """Transformer blocks."""
    seq_len: int = 8192
    """Tokens per sequence."""
    tokens_per_batch: int = 16777216
    """Tokens per global batch."""
    kv_heads: int = 0
    """KV heads; 0 means heads (multi-head attention)."""
    ffn_hidden: int = 0
    """FFN width; 0 means 4 * hidden."""
    vocab: int = 128256
    """Vocabulary rows."""


@dataclass
class HardwareConfig:
    """One GPU's speed, links and power."""

    peak_tflops: float = 989.0
    """Dense bf16 peak per GPU."""
    utilisation: float = 0.45
    """Achieved fraction of peak in GEMMs."""
    scaleup_gbps: float = 450.0
    """GB/s per GPU on the scale-up link."""
    scaleout_gbps: float = 50.0
    """GB/s per GPU on the scale-out network."""
    act_bytes: int = 2
    """Bytes per activation element."""
    grad_bytes: int = 2
    """Bytes per gradient element."""
    tp_overlap: float = 0.0
    """Fraction of TP communication hidden behind compute."""
    dp_overlap: float = 0.8
    """Fraction of the DP all-reduce hidden behind compute."""
    tdp_watts: float = 700.0
    """Thermal design power per GPU."""


@dataclass
class FailureConfig:
    """When GPUs fail, how many at once, and how long repairs take."""

    model: str = "exponential"
    """exponential (from the MTBFs below) or trace (from `trace`)."""
    trace: Optional[str] = None
    """CSV of failures: time_hours,gpu[,kind][,repair_hours][,blast]; needed with model=trace."""
    gpu_mtbf_hours: float = 50000.0
    """Mean hours between failure events per GPU."""
    hw_fraction: float = 0.78
    """Share of hardware failures (the rest are software)."""
    hw_repair_hours: list[float] = field(default_factory=lambda: [72.0, 120.0])
    """[min, max] hours to repair a hardware failure."""
    sw_repair_hours: list[float] = field(default_factory=lambda: [3.0, 3.0])
    """[min, max] hours to recover from a software failure."""
    blast_radius: int = 1
    """GPUs taken out by one event; divides the domain's active GPUs."""
    domain_fraction: float = 0.0
    """Share of events that take a whole domain."""
    correlation: float = 0.0
    """Chance an event triggers another in its domain."""
    correlation_window_hours: float = 1.0
    """Hours within which a correlated event follows."""
    power_domain_mtbf_hours: float = math.inf
    """Mean hours between outages of one power domain; inf: never."""
    power_domain_domains: int = 4
    """Scale-up domains (racks) per power domain."""
    power_repair_hours: list[float] = field(default_factory=lambda: [4.0, 12.0])
    """[min, max] hours to restore a power domain."""


@dataclass
class NTPConfig:
    """How NTP runs degraded replicas."""

    min_tp: int = 6
    """A TP group below this degree stops contributing."""
    tp_step: int = 1
    """A degraded TP degree is a multiple of this."""
    rebalance: bool = True
    """Shrink degraded replicas' share of the batch."""
    reconfig_minutes: float = 1.0
    """Job-wide pause per failure (dp_drop and ntp)."""
    rejoin_minutes: float = 0.5
    """Job-wide pause when repaired GPUs rejoin."""
    batch_granularity: str = "sequence"
    """sequence (the engine's planner and layout) or fluid (ideal t'/t)."""
    exchange_overlap: float = 0.9
    """Hidden share of the cross-layout gradient exchange."""


@dataclass
class BoostConfig:
    """Power boost of degraded domains (NTP-PW)."""

    cap: float = 0.30
    """Most extra power per GPU, as a fraction of TDP."""
    perf_exponent: float = 0.5
    """Relative performance = relative power ** perf_exponent."""


@dataclass
class CheckpointConfig:
    """Checkpoint-restart, the baseline policy."""

    interval_minutes: float = 15.0
    """Minutes between checkpoints (interval_policy=fixed)."""
    restart_minutes: float = 10.0
    """Minutes to restart the job from a checkpoint."""
    write_minutes: float = 0.0
    """Blocking minutes per checkpoint."""
    interval_policy: str = "fixed"
    """fixed, or young_daly (interval from the write cost and the MTBF)."""


@dataclass
class SpareConfig:
    """Spare domains that swap in for failed ones."""

    domains: int = 0
    """Spare domains held in reserve."""
    swap_hours: float = 0.5
    """Delay before a spare replaces a failed domain."""
    quantile: float = 1.0
    """Share of run time the spare count must cover."""
    seed_quantile: float = 0.9
    """Quantile over seeds of each seed's spare need."""
    repair_slots: int = 0
    """Hardware repairs in progress at once; 0: unlimited."""
    idle_failures: bool = True
    """Spare domains fail while they wait in the pool."""


@dataclass
class SweepConfig:
    """The throughput-loss sweep over failed fractions and TP degrees."""

    failed_fractions: list[float] = field(
        default_factory=lambda: [0.0, 0.0005, 0.001, 0.002, 0.004, 0.008, 0.016])
    """Fractions of failed GPUs to evaluate."""
    tp_degrees: list[int] = field(default_factory=lambda: [4, 8])
    """TP degrees to compare; []: just cluster.tp."""
    trials: int = 8
    """Random failure placements per point."""


@dataclass
class SimConfig:
    """One simulated scenario: the schema of the `sim` group (``conf/sim/default.yaml`` mirrors its defaults)."""

    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    hardware: HardwareConfig = field(default_factory=HardwareConfig)
    failures: FailureConfig = field(default_factory=FailureConfig)
    ntp: NTPConfig = field(default_factory=NTPConfig)
    boost: BoostConfig = field(default_factory=BoostConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    spares: SpareConfig = field(default_factory=SpareConfig)
    sweep: SweepConfig = field(default_factory=SweepConfig)
    duration_days: float = 30.0
    """Simulated run length."""
    timeline_points: int = 721
    """Points of the goodput timeline."""
    seed: int = 0
    """First seed of failures and failure snapshots; set from the top-level `seed`."""

    @classmethod
    def from_dict(cls, data: dict, prefix: str = "") -> "SimConfig":
        """Build from plain nested dicts, checked against this schema; errors name ``prefix`` + the key."""
        try:
            return build(cls, data, prefix)
        except SchemaError as e:
            raise ConfigError(e.key, e.value if e.has_value else None, e.reason, str(e)) from None

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def validate(self) -> "SimConfig":
        _validate(self)
        return self


@dataclass
class SimulateConfig:
    """The schema of ``conf/simulate.yaml``: the simulator's config under ``sim``, then the command's own keys."""

    sim: SimConfig = field(default_factory=SimConfig)
    """The scenario."""
    out: str = "outputs/sim"
    """Directory for the CSVs and PNGs."""
    recipe: Optional[str] = None
    """Name of recipes/sim/NAME.yaml, merged over sim."""
    seed: int = 0
    """First seed of failures and failure snapshots (sets sim.seed)."""
    seeds: int = 1
    """Seeds to run; medians and 5th-95th percentiles when > 1."""
    workers: int = 0
    """Worker processes for seeds; 0: one per core."""
    calibrate: Optional[str] = None
    """Training run directory (metrics.jsonl, events.jsonl) or table file of measured costs."""


register("simulate_schema", SimulateConfig)


# --------------------------------------------------------------------------
# cross-field validation

def _check(ok: bool, name: str, value: Any, reason: str) -> None:
    if not ok:
        raise ConfigError(name, value, reason)


def _positive(obj: Any, prefix: str, *names: str) -> None:
    for n in names:
        v = getattr(obj, n)
        _check(v > 0 and math.isfinite(v), prefix + n, v, "must be > 0")


def _fraction(obj: Any, prefix: str, *names: str, upper_open: bool = False) -> None:
    for n in names:
        v = getattr(obj, n)
        ok = 0.0 <= v < 1.0 if upper_open else 0.0 <= v <= 1.0
        _check(ok, prefix + n, v, "must be in [0, 1)" if upper_open else "must be in [0, 1]")


def _validate(c: SimConfig) -> None:
    cl = c.cluster
    _positive(cl, "cluster.", "num_gpus", "domain_size", "tp", "pp", "microbatches")
    S, t, pp = cl.domain_size, cl.tp, cl.pp
    _check(0 <= cl.hot_spares < S, "cluster.hot_spares", cl.hot_spares,
           f"must be in [0, domain_size={S})")
    S = S - cl.hot_spares          # active GPUs per domain
    _check(t <= S, "cluster.tp", t, f"must not exceed domain_size - hot_spares = {S}")
    _check(S % t == 0, "cluster.tp", t, f"must divide domain_size - hot_spares = {S}")
    rep = t * pp
    _check(rep % S == 0 or S % rep == 0, "cluster.pp", pp,
           f"tp*pp={rep} must divide or be a multiple of domain_size={S}")
    _check(cl.num_gpus % S == 0, "cluster.num_gpus", cl.num_gpus,
           f"must be a multiple of the domain's {S} active GPUs")
    _check(cl.num_gpus % rep == 0, "cluster.num_gpus", cl.num_gpus,
           f"must be a multiple of tp*pp={rep}")

    m = c.model
    _positive(m, "model.", "hidden", "heads", "layers", "seq_len", "tokens_per_batch")
    _check(m.params_billion >= 0, "model.params_billion", m.params_billion, "must be >= 0")
    _check(m.layers % pp == 0, "cluster.pp", pp, f"must divide model.layers={m.layers}")
    for name in ("kv_heads", "ffn_hidden"):
        _check(getattr(m, name) >= 0, "model." + name, getattr(m, name), "must be >= 0")
    _check(m.vocab >= 1, "model.vocab", m.vocab, "must be >= 1")
    _check(m.heads % (m.kv_heads or m.heads) == 0, "model.kv_heads", m.kv_heads,
           f"must divide model.heads={m.heads}")
    _check(m.heads >= t, "model.heads", m.heads, f"must be at least cluster.tp={t}")

    hw = c.hardware
    _positive(hw, "hardware.", "peak_tflops", "scaleup_gbps", "scaleout_gbps",
              "act_bytes", "grad_bytes", "tdp_watts")
    _check(0 < hw.utilisation <= 1, "hardware.utilisation", hw.utilisation, "must be in (0, 1]")
    _fraction(hw, "hardware.", "tp_overlap", "dp_overlap")

    f = c.failures
    _check(f.model in ("exponential", "trace"), "failures.model", f.model,
           "must be 'exponential' or 'trace'")
    if f.model == "trace":
        _check(bool(f.trace), "failures.trace", f.trace, "a CSV path is required when model=trace")
    for name in ("gpu_mtbf_hours", "power_domain_mtbf_hours"):
        v = getattr(f, name)
        _check(v > 0 and not math.isnan(v), "failures." + name, v,
               "must be > 0 (inf means never fails)")
    _positive(f, "failures.", "correlation_window_hours")
    _check(1 <= f.power_domain_domains <= cl.num_gpus // S, "failures.power_domain_domains",
           f.power_domain_domains, f"must be in [1, {cl.num_gpus // S}] (the job's domains)")
    _fraction(f, "failures.", "hw_fraction", "domain_fraction")
    _fraction(f, "failures.", "correlation", upper_open=True)
    for n in ("hw_repair_hours", "sw_repair_hours", "power_repair_hours"):
        r = getattr(f, n)
        _check(len(r) == 2 and 0 < r[0] <= r[1], "failures." + n, r,
               "must be [min, max] with 0 < min <= max")
    _check(f.blast_radius >= 1 and S % f.blast_radius == 0, "failures.blast_radius",
           f.blast_radius, f"must be >= 1 and divide the domain's {S} active GPUs")
    _check(cl.hot_spares == 0 or f.blast_radius == 1, "failures.blast_radius", f.blast_radius,
           "must be 1 with cluster.hot_spares (single GPUs swap for hot spares)")

    n = c.ntp
    _check(1 <= n.min_tp <= t, "ntp.min_tp", n.min_tp, f"must be in [1, tp={t}]")
    _check(1 <= n.tp_step <= t, "ntp.tp_step", n.tp_step, f"must be in [1, tp={t}]")
    for name in ("reconfig_minutes", "rejoin_minutes"):
        _check(getattr(n, name) >= 0, "ntp." + name, getattr(n, name), "must be >= 0")
    _check(n.batch_granularity in ("sequence", "fluid"), "ntp.batch_granularity",
           n.batch_granularity, "must be 'sequence' or 'fluid'")
    _fraction(n, "ntp.", "exchange_overlap")
    if n.batch_granularity == "sequence":
        seqs = m.tokens_per_batch / m.seq_len / (cl.num_gpus // rep)
        _check(seqs >= 1 and float(seqs).is_integer(), "model.tokens_per_batch",
               m.tokens_per_batch,
               f"must give each of the {cl.num_gpus // rep} replicas a whole number of "
               f"sequences of seq_len={m.seq_len} (now {seqs:g}); or set "
               f"ntp.batch_granularity=fluid")

    b = c.boost
    _check(0 <= b.cap <= 2, "boost.cap", b.cap, "must be in [0, 2]")
    _check(0 <= b.perf_exponent <= 1, "boost.perf_exponent", b.perf_exponent, "must be in [0, 1]")

    k = c.checkpoint
    _positive(k, "checkpoint.", "interval_minutes")
    for name in ("restart_minutes", "write_minutes"):
        _check(getattr(k, name) >= 0, "checkpoint." + name, getattr(k, name), "must be >= 0")
    _check(k.write_minutes < k.interval_minutes, "checkpoint.write_minutes", k.write_minutes,
           "must be below interval_minutes")
    _check(k.interval_policy in ("fixed", "young_daly"), "checkpoint.interval_policy",
           k.interval_policy, "must be 'fixed' or 'young_daly'")
    _check(k.interval_policy == "fixed" or k.write_minutes > 0, "checkpoint.write_minutes",
           k.write_minutes, "must be > 0 with interval_policy=young_daly")

    s = c.spares
    _check(s.domains >= 0, "spares.domains", s.domains, "must be >= 0")
    _check(s.domains == 0 or cl.hot_spares == 0, "spares.domains", s.domains,
           "must be 0 with cluster.hot_spares (spares live inside the domains)")
    _check(s.swap_hours >= 0, "spares.swap_hours", s.swap_hours, "must be >= 0")
    _check(0 < s.quantile <= 1, "spares.quantile", s.quantile, "must be in (0, 1]")
    _check(0 < s.seed_quantile <= 1, "spares.seed_quantile", s.seed_quantile, "must be in (0, 1]")
    _check(s.repair_slots >= 0, "spares.repair_slots", s.repair_slots, "must be >= 0")

    w = c.sweep
    for i, x in enumerate(w.failed_fractions):
        _check(0 <= x <= 1, f"sweep.failed_fractions[{i}]", x, "must be in [0, 1]")
    for i, x in enumerate(w.tp_degrees):
        _check(1 <= x <= min(S, m.heads) and S % x == 0 and cl.num_gpus % (x * pp) == 0
               and ((x * pp) % S == 0 or S % (x * pp) == 0),
               f"sweep.tp_degrees[{i}]", x,
               f"must divide the domain's {S} active GPUs and fit the cluster layout")
    _check(w.trials >= 1, "sweep.trials", w.trials, "must be >= 1")

    _positive(c, "", "duration_days")
    _check(c.timeline_points >= 2, "timeline_points", c.timeline_points, "must be >= 2")
    _check(c.seed >= 0, "seed", c.seed, "must be >= 0")
