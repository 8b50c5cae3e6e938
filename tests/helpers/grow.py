"""The grow cases' runner: a failure, then workers that join the running job."""

from ntp_ds.testing.spawn import run_ranks
from tests.helpers.recovery import GLOBAL_BATCH, MICRO
from tests.helpers.training import Scenario, train_with_recovery

STEPS = 6


def run(degrees, stage, faults, joins, min_tp=1, timeout=240, joiner_overrides=None, timeout_s=12.0,
        ntp_overrides=None):
    ntp = {"tp": max(degrees), "replicas": len(degrees), "min_tp": min_tp, **(ntp_overrides or {})}
    world = sum(degrees)
    joins = {world + i: step for i, step in enumerate(joins)}
    scenario = Scenario(ntp, stage, tuple(faults), STEPS, global_batch=GLOBAL_BATCH, micro=MICRO, timeout_s=timeout_s,
                        joins=joins, joiner_overrides=joiner_overrides)
    return run_ranks(train_with_recovery, world, scenario, timeout=timeout, store=True, joiners=len(joins))


def join_events(results):
    return [e for r in results.values() for e in r["events"] if "joined" in e]
