"""Batch planning and the deterministic per-replica data loader."""

from ntp_ds.batch.planner import (POLICIES, BatchError, BatchPlan, ReplicaBatch, StepCost, lockstep_replicas,
                                  max_micro_batch, plan_batch, predict_step_s)

__all__ = ["POLICIES", "BatchError", "BatchPlan", "ReplicaBatch", "StepCost", "lockstep_replicas", "max_micro_batch",
           "plan_batch", "predict_step_s"]
