"""Live recovery through a work-balanced degraded layout: survivors give some of their own FFN columns away.

`ShardLayout.without_ranks` evens out each survivor's work: the survivor that takes a lost query head (one costs as
much as a dozen or more FFN columns here) gives some of its own FFN columns to a sibling survivor, and recovery
reports those extra moves as `rebalanced_bytes`. In the tiny models of tests/test_recovery.py the lost heads spread
evenly and nothing is rebalanced; the models here are shaped so that they cannot (3 query heads at TP 3, 4 at TP 4),
and the degraded replica stays the anchor, so the given columns' optimizer state moves between survivors too.

Judged as tests/test_recovery.py judges: every surviving rank's shards (and the consolidated weights) equal the
single-process failure-free reference under `preserve_global_batch`, AdamW, to 1e-4, and recovery is lossless.
"""

import math

from ntp_ds.engine.initialize import model_config_of
from ntp_ds.layout import ShardLayout
from ntp_ds.layout import units as U
from ntp_ds.layout.shard_layout import OWNED_KINDS
from ntp_ds.models import empty_shard
from ntp_ds.testing.spawn import run_ranks
from tests.helpers.training import Scenario, assert_equivalent, full_model, tiny_config, train_with_recovery

STEPS = 5
GLOBAL_BATCH, MICRO = 12, 2


def mha_3_heads():
    """3 query heads, each its own KV head (head_dim 16; a head costs about 25 FFN columns, its KV head 11 more): at
    TP 3 less rank 1, rank 0 takes head 1 and gives 3 of its 24 FFN columns away."""
    return full_model(tiny_config(num_attention_heads=3, num_key_value_heads=3))


def gqa_4_heads():
    """4 query heads on 2 KV heads (head_dim 8, hidden 32, 64 FFN columns): at TP 4 less rank 3 its sibling in the
    KV group takes head 3 and gives 4 of its 16 columns away; the others' columns end non-contiguous."""
    return full_model(tiny_config(num_attention_heads=4, num_key_value_heads=2, hidden_size=32, intermediate_size=64))


def fault(rank, step, phase, kind="crash"):
    return {"rank": rank, "step": step, "phase": phase, "kind": kind}


def run(degrees, stage, faults, make_model, timeout=200):
    ntp = {"tp": max(degrees), "replicas": len(degrees), "degrees": tuple(degrees), "min_tp": 1}
    scenario = Scenario(ntp, stage, tuple(faults), STEPS, global_batch=GLOBAL_BATCH, micro=MICRO, make_model=make_model)
    return run_ranks(train_with_recovery, sum(degrees), scenario, timeout=timeout, store=True)


def the_event(results):
    """The one recovery's event, as every surviving rank recorded it."""
    events = [e for res in results.values() for e in res["events"]]
    assert {e["generation"] for e in events} and len({e["generation"] for e in events}) == 1, "one recovery expected"
    assert len(events) == len(results), "every survivor records the recovery once"
    return events


def given_away(make_model, healthy_tp, lost_tp, degraded):
    """Per kind, the units each survivor held in the healthy layout and no longer holds in `degraded` (pure)."""
    units = model_config_of(make_model()).units()
    healthy = ShardLayout.balanced(units, healthy_tp)
    survivors = [i for i in range(healthy_tp) if i not in lost_tp]
    return {kind: [U.subtract(healthy.owned(kind, old), degraded.owned(kind, new)) for new, old in enumerate(survivors)]
            for kind in OWNED_KINDS}, healthy, survivors


def unit_elements(make_model):
    """Per kind, the parameter elements of one unit summed over the model's tensors of that kind."""
    specs = empty_shard(model_config_of(make_model()), device="meta").param_specs()
    units = model_config_of(make_model()).units()
    out = {}
    for spec, shape in specs.values():
        out[spec.kind] = out.get(spec.kind, 0) + math.prod(shape) // units.count(spec.kind)
    return out


def rebalanced_bytes_expected(make_model, healthy, survivors, degraded):
    """Bytes of owned units a survivor holds now that a sibling survivor held before (fp32 parameters): what
    `rebalanced_bytes` counts, from the layouts alone."""
    per_unit, total = unit_elements(make_model), 0
    for new, old in enumerate(survivors):
        for kind in OWNED_KINDS:
            siblings = U.union(*(healthy.owned(kind, o) for o in survivors if o != old))
            taken = U.subtract(U.intersect(degraded.owned(kind, new), siblings), healthy.owned(kind, old))
            total += U.count(taken) * per_unit[kind] * 4
    return total


def unshared_state_bytes(make_model, healthy, survivors, victim_tp):
    """Bytes of AdamW state (fp32 master and two moments) of the victim's units that no survivor of its replica
    holds too: no KV head a sibling shares, no replicated tensor. The victim's replica is the only anchor (one anchor
    per TP index), so the victim held the whole state of its shard; these bytes can only come from its copy."""
    per_unit, total = unit_elements(make_model), 0
    for kind in ("heads", "kv", "ffn", "vocab", "replicated"):
        alive = U.union(*(healthy.owned(kind, o) for o in survivors))
        total += U.count(U.subtract(healthy.owned(kind, victim_tp), alive)) * per_unit[kind] * 3 * 4
    return total


def check_rebalanced_recovery(results, make_model, degrees, replica, victim_tp, degrees_after):
    """The final state equals the failure-free run's; the degraded replica's layout is the work-balanced one, in
    which a survivor gave FFN columns of its own away; the recovery event reports those bytes as rebalanced, the same
    on every rank, beside a lossless, minimal move of the lost shard, and the optimizer state only the dead held
    restored from its copy."""
    assert_equivalent(results, GLOBAL_BATCH, STEPS, make_model)
    assert all(tuple(r["degrees"]) == degrees_after for r in results.values())
    # The degraded replica's layout, as its members ended with it: the same on every member.
    members = [r for r in results.values() if r["replica"] == replica]
    assert sorted(m["tp_rank"] for m in members) == list(range(degrees_after[replica]))
    degraded = members[0]["layout"]
    assert all(m["layout"] == degraded for m in members)
    given, healthy, survivors = given_away(make_model, degrees[replica], {victim_tp}, degraded)
    assert degraded == healthy.without_ranks({victim_tp})
    # Survivors keep their heads; at least one gives some of its own FFN columns to a sibling.
    assert all(g == () for g in given["heads"]), given["heads"]
    assert any(U.count(g) for g in given["ffn"]), f"no survivor gave an FFN column away: {given}"
    events = the_event(results)
    assert all(e["lossless"] for e in events), "recovery must be lossless"
    totals = {(e["bytes_moved"], e["lost_shard_bytes"], e["kv_rereplicated_bytes"], e["rebalanced_bytes"])
              for e in events}
    assert len(totals) == 1, f"ranks disagree on the totals: {totals}"
    (moved, lost, rereplicated, rebalanced), = totals
    print(f"bytes_moved={moved} lost_shard_bytes={lost} kv_rereplicated_bytes={rereplicated} "
          f"rebalanced_bytes={rebalanced} given={given}")
    assert rebalanced > 0, "the given FFN columns must be reported as rebalanced"
    assert rebalanced == rebalanced_bytes_expected(make_model, healthy, survivors, degraded)
    assert moved - rereplicated - rebalanced == lost, (
        f"moved {moved} parameter bytes ({rereplicated} re-replicated, {rebalanced} rebalanced) for a lost shard "
        f"of {lost}")
    restored = {(e["optimizer_bytes_restored"], e["lost_optimizer_bytes"]) for e in events}
    assert len(restored) == 1, "ranks disagree on the optimizer totals"
    (restored, lost_state), = restored
    unshared = unshared_state_bytes(make_model, healthy, survivors, victim_tp)
    print(f"optimizer_bytes_restored={restored} lost_optimizer_bytes={lost_state} unshared={unshared} "
          f"optimizer_bytes_moved={events[0]['optimizer_bytes_moved']}")
    assert 0 < unshared == lost_state, f"{lost_state} optimizer bytes reported lost, {unshared} only the dead held"
    assert restored == lost_state, f"restored {restored} optimizer bytes of the {lost_state} no survivor holds"
    assert all(e["optimizer_bytes_moved"] > 0 for e in events)
    assert {e["state_index"] for e in events} == {"layouts"}


def test_head_taker_gives_own_ffn_columns_and_their_optimizer_state_to_its_sibling():
    # (3, 2) with 3 MHA heads: replica 0 (TP 3) is the only anchor, replica 1 (TP 2) its contributor and the holder
    # of its copies. Rank 1 dies at step 3: replica 0 goes on at TP 2 and stays the anchor (its layout comes first
    # among two of degree 2). Its rank 0 takes head 1 and gives FFN columns 21..23 to rank 2, which must get their
    # parameters and AdamW moments (ZeRO 1, DP 1 per TP index: rank 0 held them whole) from the survivors.
    results = run((3, 2), 1, [fault(1, 3, "forward")], mha_3_heads)
    assert set(results) == {0, 2, 3, 4}
    check_rebalanced_recovery(results, mha_3_heads, (3, 2), 0, 1, (2, 2))


def test_gqa_head_taker_gives_own_ffn_columns_under_zero2():
    # (4, 2) with 4 heads on 2 KV heads, ZeRO 2: rank 3 dies in its gradient sync of step 3. Rank 2 (same KV group)
    # takes head 3 and gives FFN columns 44..47 away; the lost columns and vocabulary rows go to ranks 0 and 1, whose
    # shards end non-contiguous. Replica 0 (now TP 3) stays the anchor. Rank 3's state of KV head 1 and of the
    # replicated tensors is also rank 2's (and the same): the new layout has no TP index 3, so every new rank takes it
    # from a survivor, and only the rest comes from rank 3's copy: they are not lost (67584 bytes are, not 81792).
    results = run((4, 2), 2, [fault(3, 3, "grad_sync")], gqa_4_heads)
    assert set(results) == {0, 1, 2, 4, 5}
    check_rebalanced_recovery(results, gqa_4_heads, (4, 2), 0, 3, (3, 2))
