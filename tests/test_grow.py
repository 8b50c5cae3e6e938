"""Growing back: a worker that joins a running job takes a place at a step boundary, in memory.

Each case runs real processes joined by gloo with the store in the parent; the joiners are extra processes that
ask the running job for a place (`Recovery.join`) from a given step on. Judged by final state: under
`preserve_global_batch` every rank's shards, the joiner's included, equal the single-process reference.
"""

import pytest

from ntp_ds.testing.spawn import run_ranks
from tests.test_recovery import GLOBAL_BATCH, MICRO, assert_equivalent, fault
from tests.training import train_with_recovery

STEPS = 6


def run(degrees, stage, faults, joins, min_tp=1, timeout=240):
    ntp = {"tp": max(degrees), "replicas": len(degrees), "min_tp": min_tp}
    world = sum(degrees)
    joins = {world + i: step for i, step in enumerate(joins)}
    return run_ranks(train_with_recovery, world, ntp, "adamw", stage, GLOBAL_BATCH, MICRO, STEPS, faults, 2.0, 1,
                     None, 12.0, joins, timeout=timeout, store=True, joiners=len(joins))


def join_events(results):
    return [e for r in results.values() for e in r["events"] if "joined" in e]


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_crash_then_repair_grows_back_to_the_original_degrees(stage):
    results = run((2, 2), stage, [fault(3, 2, "forward")], joins=[4])
    assert set(results) == {0, 1, 2, 4}
    assert_equivalent(results, STEPS)
    assert all(tuple(r["degrees"]) == (2, 2) for r in results.values())
    joined = join_events(results)
    assert len(joined) == 4 and all(e["joined"] == [4] and e["lossless"] for e in joined)
    assert {tuple(e["degrees_before"]) for e in joined} == {(2, 1)}
    # The joiner receives exactly its shard (a KV head its replica's survivor also holds included, from a peer
    # replica); the survivor keeps its own units in place and receives nothing.
    assert {e["bytes_moved"] for e in joined} == {joined[0]["joiner_shard_bytes"]}
