"""Pure layout logic: who owns which units, and the plans that move units between layouts."""

from ntp_ds.layout.cost import UnitCost, unit_cost
from ntp_ds.layout.pace import max_rank_work, rank_work, replica_paces
from ntp_ds.layout.plan import (SyncPlan, TensorMove, Topology, Transfer, plan_buddies, plan_gradient_sync,
                                plan_transfer, plan_whole_tensors)
from ntp_ds.layout.shard_layout import KINDS, LayoutError, ModelUnits, ParamSpec, ShardLayout

__all__ = ["KINDS", "LayoutError", "ModelUnits", "ParamSpec", "ShardLayout", "SyncPlan", "TensorMove", "Topology",
           "Transfer", "UnitCost", "max_rank_work", "plan_buddies", "plan_gradient_sync", "plan_transfer",
           "plan_whole_tensors", "rank_work", "replica_paces", "unit_cost"]
