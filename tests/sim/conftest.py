"""Shared helpers for the simulator tests: small, fast configurations."""
from __future__ import annotations

import pytest

from ntp_ds.sim import SimConfig


def small_config(**over) -> SimConfig:
    """A 2048-GPU NVL8 cluster over 10 days; keyword args set top-level fields."""
    cfg = SimConfig()
    cfg.cluster.num_gpus = 2048
    cfg.duration_days = 10.0
    cfg.timeline_points = 241
    cfg.failures.gpu_mtbf_hours = 5000.0
    cfg.sweep.failed_fractions = [0.0, 0.005, 0.02]
    cfg.sweep.tp_degrees = [4, 8]
    cfg.sweep.trials = 2
    for k, v in over.items():
        setattr(cfg, k, v)
    return cfg


@pytest.fixture
def small_cfg() -> SimConfig:
    return small_config()
