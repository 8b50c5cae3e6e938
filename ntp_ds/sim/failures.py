"""Failure model: event streams over time and static failure snapshots.

An *event* starts at ``time`` (hours), takes down an aligned block of
``size`` GPUs starting at ``first`` (one GPU, a ``blast_radius`` block, or a
whole scale-up domain) and is repaired ``repair`` hours later.  Events are
hardware (``kind == 0``, repaired in days) or software (``kind == 1``,
repaired in hours).

Exponential model: every GPU originates events at rate ``1 / gpu_mtbf_hours``,
so the cluster sees a Poisson stream at ``N / mtbf``.  With correlation
``rho`` an event triggers another one in the same domain with probability
``rho`` (a geometric cascade, ``correlation_window_hours`` apart on average);
the primary rate is scaled by ``1 - rho`` so the total rate is unchanged.

Trace model: a CSV with columns ``time_hours, gpu`` and optionally ``kind``
(``hw``/``sw``), ``repair_hours`` and ``blast`` (``gpu``, ``domain`` or a
number of GPUs).  Missing fields are drawn from the configured mix.
"""
from __future__ import annotations

import csv
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .cluster import Layout
from .config import ConfigError, FailureConfig

HW, SW, POWER = 0, 1, 2


@dataclass(frozen=True)
class FailureEvents:
    time: np.ndarray     # float hours, sorted
    first: np.ndarray    # first GPU of the failed block
    size: np.ndarray     # GPUs in the block
    kind: np.ndarray     # HW or SW
    repair: np.ndarray   # hours until repaired

    def __len__(self) -> int:
        return int(self.time.size)

    @property
    def hw_count(self) -> int:
        return int(np.count_nonzero(self.kind == HW))


def mean_repair_hours(f: FailureConfig) -> float:
    hw = 0.5 * (f.hw_repair_hours[0] + f.hw_repair_hours[1])
    sw = 0.5 * (f.sw_repair_hours[0] + f.sw_repair_hours[1])
    return f.hw_fraction * hw + (1.0 - f.hw_fraction) * sw


def mean_blast_gpus(f: FailureConfig, domain_size: int) -> float:
    return (1.0 - f.domain_fraction) * f.blast_radius + f.domain_fraction * domain_size


def steady_failed_fraction(f: FailureConfig, domain_size: int) -> float:
    """Little's law: events/GPU/h * GPUs/event * hours down (overlaps ignored)."""
    gpu = mean_blast_gpus(f, domain_size) * mean_repair_hours(f) / f.gpu_mtbf_hours
    lo, hi = f.power_repair_hours
    power = 0.5 * (lo + hi) / f.power_domain_mtbf_hours     # every GPU is in one power domain
    return gpu + power


def event_rate_for_fraction(fraction: np.ndarray | float, layout: Layout,
                            f: FailureConfig) -> np.ndarray:
    """Cluster-wide events per hour that keep ``fraction`` of GPUs down."""
    per_event = mean_blast_gpus(f, layout.domain_size) * mean_repair_hours(f)
    return np.asarray(fraction, dtype=float) * layout.num_gpus / per_event


def draw_mix(n: int, f: FailureConfig, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    kind = np.where(rng.random(n) < f.hw_fraction, HW, SW)
    return kind, _draw_repair(kind, f, rng)


def _draw_repair(kind: np.ndarray, f: FailureConfig, rng: np.random.Generator) -> np.ndarray:
    u = rng.random(kind.size)
    lo = np.where(kind == HW, f.hw_repair_hours[0], f.sw_repair_hours[0])
    hi = np.where(kind == HW, f.hw_repair_hours[1], f.sw_repair_hours[1])
    return lo + u * (hi - lo)


def _blocks(gpu: np.ndarray, whole_domain: np.ndarray, layout: Layout,
            f: FailureConfig) -> tuple[np.ndarray, np.ndarray]:
    S, b = layout.domain_size, f.blast_radius
    size = np.where(whole_domain, S, b)
    first = (gpu // size) * size
    return first.astype(np.int64), size.astype(np.int64)


def _sorted(time, first, size, kind, repair) -> FailureEvents:
    order = np.argsort(time, kind="stable")
    return FailureEvents(time[order], first[order], size[order], kind[order], repair[order])


def power_events(f: FailureConfig, num_domains: int, domain_gpus: int, duration_h: float,
                 rng: np.random.Generator) -> FailureEvents:
    """Whole power domains (``power_domain_domains`` adjacent racks) failing together.

    Each power domain fails at rate ``1 / power_domain_mtbf_hours``; every rack in it goes
    down for the same repair draw from ``power_repair_hours``.  When ``k`` does not divide
    the domains the last power domain is smaller.
    """
    k = f.power_domain_domains
    groups = -(-num_domains // k)
    n = int(rng.poisson(groups / f.power_domain_mtbf_hours * duration_h))
    time = rng.random(n) * duration_h
    group = rng.integers(0, groups, n)
    lo, hi = f.power_repair_hours
    repair = lo + rng.random(n) * (hi - lo)
    dom = group[:, None] * k + np.arange(k)[None, :]
    keep = (dom < num_domains).ravel()
    rep = lambda a: np.repeat(a, k)[keep]  # noqa: E731
    return FailureEvents(rep(time), (dom.ravel()[keep] * domain_gpus).astype(np.int64),
                         np.full(int(keep.sum()), domain_gpus, dtype=np.int64),
                         np.full(int(keep.sum()), POWER, dtype=np.int64), rep(repair))


def merge(*streams: FailureEvents) -> FailureEvents:
    cat = [np.concatenate([getattr(e, a) for e in streams])
           for a in ("time", "first", "size", "kind", "repair")]
    return _sorted(*cat)


def generate(f: FailureConfig, layout: Layout, duration_h: float,
             rng: np.random.Generator, hot_spares: int = 0) -> FailureEvents:
    """Events of the exponential model over ``[0, duration_h)``.

    With ``hot_spares`` the events index physical GPUs, ``domain_size + hot_spares`` per
    domain, idle hot spares included.
    """
    if hot_spares:
        layout = Layout(layout.num_domains * (layout.domain_size + hot_spares),
                        layout.domain_size + hot_spares, 1, 1)
    N = layout.num_gpus
    rate = N / f.gpu_mtbf_hours * (1.0 - f.correlation)
    n = int(rng.poisson(rate * duration_h))
    time = np.sort(rng.random(n) * duration_h)
    gpu = rng.integers(0, N, n)
    if f.correlation > 0 and n:
        cascade = rng.geometric(1.0 - f.correlation, n)      # >= 1 events each
        parent = np.repeat(np.arange(n), cascade)
        pos = np.arange(parent.size) - np.repeat(np.cumsum(cascade) - cascade, cascade)
        gaps = rng.exponential(f.correlation_window_hours, parent.size) * (pos > 0)
        csum = np.cumsum(gaps)
        offset = csum - np.repeat(csum[np.cumsum(cascade) - cascade], cascade)
        dom = gpu[parent] // layout.domain_size
        local = rng.integers(0, layout.domain_size, parent.size)
        gpu = np.where(pos > 0, dom * layout.domain_size + local, gpu[parent])
        time = time[parent] + offset
        keep = time < duration_h
        time, gpu = time[keep], gpu[keep]
    whole = rng.random(time.size) < f.domain_fraction
    first, size = _blocks(gpu, whole, layout, f)
    kind, repair = draw_mix(time.size, f, rng)
    return _sorted(time, first, size, kind, repair)


def load_trace(f: FailureConfig, layout: Layout, duration_h: float,
               rng: np.random.Generator) -> FailureEvents:
    """Events read from the CSV trace ``f.trace`` (rows past the run dropped)."""
    path = Path(str(f.trace)).expanduser()
    if not path.is_file():
        raise ConfigError("failures.trace", f.trace, "file not found")
    times, gpus, kinds, repairs, blasts = [], [], [], [], []
    with path.open(newline="") as fh:
        reader = csv.DictReader(fh)
        cols = {c.strip() for c in (reader.fieldnames or [])}
        if not {"time_hours", "gpu"} <= cols:
            raise ConfigError("failures.trace", f.trace, "needs columns time_hours,gpu")
        for line, row in enumerate(reader, start=2):
            row = {k.strip(): (v or "").strip() for k, v in row.items() if k}
            try:
                times.append(float(row["time_hours"]))
                gpus.append(int(row["gpu"]))
                kind = row.get("kind", "").lower()
                kinds.append({"hw": HW, "sw": SW, "": -1}[kind])
                rep = row.get("repair_hours", "")
                repairs.append(float(rep) if rep else np.nan)
                blast = row.get("blast", "").lower()
                blasts.append({"": f.blast_radius, "gpu": 1,
                               "domain": layout.domain_size}.get(blast) or int(blast))
            except (ValueError, KeyError) as exc:
                raise ConfigError("failures.trace", f.trace,
                                  f"bad row at line {line}: {exc}") from None
    time = np.asarray(times, dtype=float)
    gpu = np.asarray(gpus, dtype=np.int64)
    size = np.asarray(blasts, dtype=np.int64)
    if gpu.size and (gpu.min() < 0 or gpu.max() >= layout.num_gpus):
        raise ConfigError("failures.trace", f.trace,
                          f"gpu index outside [0, {layout.num_gpus})")
    if size.size and (np.any(size < 1) or np.any(layout.domain_size % size != 0)):
        raise ConfigError("failures.trace", f.trace, "blast must divide the domain size")
    kind = np.asarray(kinds, dtype=np.int64)
    missing = kind < 0
    kind[missing] = np.where(rng.random(int(missing.sum())) < f.hw_fraction, HW, SW)
    repair = np.asarray(repairs, dtype=float)
    gaps = np.isnan(repair)
    repair[gaps] = _draw_repair(kind[gaps], f, rng)
    keep = (time >= 0) & (time < duration_h)
    first = (gpu // size) * size
    return _sorted(time[keep], first[keep], size[keep], kind[keep], repair[keep])


def events_for(f: FailureConfig, layout: Layout, duration_h: float,
               rng: np.random.Generator, hot_spares: int = 0) -> FailureEvents:
    if f.model == "trace":
        if hot_spares:
            raise ConfigError("failures.trace", f.trace,
                              "traces index job GPUs; they cannot be used with cluster.hot_spares")
        ev = load_trace(f, layout, duration_h, rng)
    else:
        ev = generate(f, layout, duration_h, rng, hot_spares)
    if np.isfinite(f.power_domain_mtbf_hours):
        ev = merge(ev, power_events(f, layout.num_domains, layout.domain_size + hot_spares,
                                    duration_h, rng))
    return ev


def sample_failed_gpus(layout: Layout, fraction: float, blast_radius: int,
                       domain_fraction: float, trials: int,
                       rng: np.random.Generator) -> np.ndarray:
    """Static snapshots: boolean ``(trials, N)`` of failed GPUs.

    Every aligned block of ``blast_radius`` GPUs fails independently with
    probability ``(1 - q) f`` and every domain with probability ``q f``, so
    with ``q = 0`` each GPU is down with probability exactly ``f``.
    """
    N, S, b = layout.num_gpus, layout.domain_size, blast_radius
    q = domain_fraction
    down = rng.random((trials, N // b)) < (1.0 - q) * fraction
    down = np.repeat(down, b, axis=1)
    if q > 0:
        dom = rng.random((trials, N // S)) < q * fraction
        down |= np.repeat(dom, S, axis=1)
    return down


def cover_with_hot_spares(down: np.ndarray, active: int, hot_spares: int) -> np.ndarray:
    """Active GPUs still missing once each domain's healthy hot spares replace failed ones.

    ``down`` is ``(trials, domains * (active + hot_spares))``: physical slots, the spares last
    in each domain.  The healthy spares of a domain replace its failed active GPUs in slot
    order; returns ``(trials, domains * active)``.
    """
    trials = down.shape[0]
    phys = down.reshape(trials, -1, active + hot_spares)
    act = phys[..., :active]
    free = hot_spares - phys[..., active:].sum(axis=-1)
    covered = np.cumsum(act, axis=-1) <= free[..., None]
    return (act & ~covered).reshape(trials, -1)


def group_failed_counts(down: np.ndarray, layout: Layout) -> np.ndarray:
    """Failed GPUs per TP group from a ``(..., N)`` boolean array."""
    shape = down.shape[:-1] + (layout.num_groups, layout.tp)
    return down.reshape(shape).sum(axis=-1)
