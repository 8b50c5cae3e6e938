"""Cluster-scale goodput simulator for nonuniform tensor parallelism.

Answers, for a cluster size, scale-up domain and failure rate, how much
throughput a job loses under each failure-handling policy (``dp_drop``,
``ntp``, ``ntp_pw``, ``ckpt_restart``) and how many spare domains keep it
training without pauses.  Pure Python and numpy.

    from ntp_ds.sim import SimConfig, run, run_seeds
    result = run(SimConfig())
    result.outcomes["ntp"].goodput
    ens = run_seeds(SimConfig(), seeds=8, workers=2)
    ens.outcome("ntp", "goodput")      # (median, 5th, 95th percentile)
"""
from .config import (BoostConfig, CheckpointConfig, ClusterConfig, ConfigError,
                     FailureConfig, HardwareConfig, ModelConfig, NTPConfig, SimConfig,
                     SpareConfig, SweepConfig)
from .calibration import Calibration
from .engine import FailureSummary, PolicyOutcome, SimResult, run
from .ensemble import Ensemble, run_seeds
from .policies import POLICIES
from .sweep import LossPoint
from .throughput import StepBreakdown

__all__ = [
    "run", "run_seeds", "Ensemble", "Calibration", "SimConfig", "SimResult", "ConfigError", "POLICIES",
    "ClusterConfig", "ModelConfig", "HardwareConfig", "FailureConfig", "NTPConfig",
    "BoostConfig", "CheckpointConfig", "SpareConfig", "SweepConfig",
    "PolicyOutcome", "FailureSummary", "LossPoint", "StepBreakdown",
]
