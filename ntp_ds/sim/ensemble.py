"""Many seeds of one scenario: medians and 5th-95th percentile bands of every figure.

``run_seeds(config, seeds=N)`` runs seeds ``config.seed .. config.seed + N - 1`` (in worker
processes when ``workers > 1``) and returns an :class:`Ensemble`.  Spare domains needed are read
per seed (the peak, or the ``spares.quantile`` time quantile, of the missing capacity) and then
reported as the ``spares.seed_quantile`` quantile over seeds, so a count covers that share of
possible months, not just the one a single seed drew.
"""
from __future__ import annotations

import dataclasses
import os
import sys
import time as _time
from dataclasses import dataclass

import numpy as np

from .calibration import Calibration
from .config import SimConfig
from .engine import PolicyOutcome, SimResult, run

BAND = (5.0, 95.0)
OUTCOME_FIELDS = ("goodput", "mean_capacity", "interruptions", "rejoins", "downtime_hours",
                  "lost_work_hours", "spare_domains_needed", "mean_extra_power", "max_power")
FAILURE_FIELDS = ("events", "hardware", "software", "power", "mean_failed_fraction",
                  "peak_failed_fraction", "spare_swaps", "hot_swaps", "idle_spare_failures",
                  "repair_wait_hours")


def band(values) -> tuple[float, float, float]:
    """``(median, 5th percentile, 95th percentile)`` of ``values``."""
    v = np.asarray(values, dtype=float)
    lo, hi = np.percentile(v, BAND)
    return float(np.median(v)), float(lo), float(hi)


@dataclass
class Ensemble:
    results: list[SimResult]
    wall_seconds: float = 0.0

    @property
    def first(self) -> SimResult:
        return self.results[0]

    @property
    def config(self) -> SimConfig:
        return self.first.config

    @property
    def seeds(self) -> list[int]:
        return [r.config.seed for r in self.results]

    def outcome(self, policy: str, name: str) -> tuple[float, float, float]:
        return band([getattr(r.outcomes[policy], name) for r in self.results])

    def failure(self, name: str) -> tuple[float, float, float]:
        return band([getattr(r.failures, name) for r in self.results])

    def spares_needed(self, policy: str) -> int:
        """Spare domains that cover ``spares.seed_quantile`` of the seeds' needs."""
        need = [r.outcomes[policy].spare_domains_needed for r in self.results]
        return int(np.quantile(need, self.config.spares.seed_quantile, method="higher"))

    def loss(self, policy: str, tp: int, fraction: float) -> tuple[float, float, float]:
        return band([r.loss(policy, tp, fraction) for r in self.results])

    def loss_rows(self) -> list[tuple[str, int, float, float, float, float]]:
        """``(policy, tp, fraction, median, p5, p95)`` in the first seed's order."""
        rows = []
        for i, row in enumerate(self.first.loss_vs_failures):
            med, lo, hi = band([r.loss_vs_failures[i].throughput_loss for r in self.results])
            rows.append((row.policy, row.tp, row.failed_fraction, med, lo, hi))
        return rows

    def timeline(self, policy: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        stack = np.stack([r.timeline[policy] for r in self.results])
        lo, hi = np.percentile(stack, BAND, axis=0)
        return np.median(stack, axis=0), lo, hi

    def median_outcome(self, policy: str) -> PolicyOutcome:
        """The policy's outcome with every field at its median over seeds."""
        vals = {f: self.outcome(policy, f)[0] for f in OUTCOME_FIELDS}
        vals["spare_domains_needed"] = self.spares_needed(policy)
        for f in ("interruptions", "rejoins"):
            vals[f] = int(round(vals[f]))
        return dataclasses.replace(self.first.outcomes[policy], **vals)


def _one(args) -> SimResult:
    cfg, cal = args
    return run(cfg, cal, progress=False)


def default_workers(seeds: int) -> int:
    return max(1, min(seeds, os.cpu_count() or 1))


def run_seeds(config: SimConfig, seeds: int = 1, workers: int = 0,
              calibration: Calibration | None = None, progress: bool | None = None) -> Ensemble:
    """Run ``seeds`` seeds of ``config`` in up to ``workers`` processes (0: one per core)."""
    start = _time.perf_counter()
    config.validate()
    cfgs = [dataclasses.replace(config, seed=config.seed + i) for i in range(seeds)]
    if progress is None:
        progress = seeds > 1 and sys.stderr.isatty()
    if seeds == 1:
        results = [run(cfgs[0], calibration, progress=progress if progress else None)]
        return Ensemble(results, _time.perf_counter() - start)
    workers = default_workers(seeds) if workers <= 0 else min(workers, seeds)
    bar = None
    if progress:
        from tqdm import tqdm
        bar = tqdm(total=seeds, desc="seeds", unit="seed", file=sys.stderr)
    results: list[SimResult] = []
    if workers == 1:
        for c in cfgs:
            results.append(_one((c, calibration)))
            if bar is not None:
                bar.update(1)
    else:
        import multiprocessing as mp
        from concurrent.futures import ProcessPoolExecutor

        method = "fork" if "fork" in mp.get_all_start_methods() else "spawn"
        with ProcessPoolExecutor(max_workers=workers, mp_context=mp.get_context(method)) as pool:
            for r in pool.map(_one, [(c, calibration) for c in cfgs]):
                results.append(r)
                if bar is not None:
                    bar.update(1)
    if bar is not None:
        bar.close()
    return Ensemble(results, _time.perf_counter() - start)
