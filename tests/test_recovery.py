"""Live recovery, judged by final state: after a failure the weights equal the failure-free run's.

Each case runs real processes joined by gloo, with the coordination store in the parent; a fault injected at a
rank, step and phase crashes the process (SIGKILL), hangs it (SIGSTOP) or raises a device error in it. Under
`preserve_global_batch` every surviving rank's shards must equal the single-process reference trained on the same
samples, and the consolidated weights too.

The default set covers every phase, fault kind, ZeRO stage and both topologies at least once, plus the special
cases. `NTP_FULL_MATRIX=1 pytest -m matrix tests/test_recovery.py` runs the whole cross product.
"""

import dataclasses
import itertools
import os

import pytest

from ntp_ds.testing.spawn import run_ranks
from tests.helpers import training
from tests.helpers.recovery import (GLOBAL_BATCH, STEPS, assert_equivalent, assert_hung_rank_3_found,
                                    assert_lossless_and_minimal, events_of, fault, run)
from tests.helpers.training import Scenario, tiny_qwen2, train_reference, train_with_recovery

CASES = [  # (degrees, ZeRO stage, fault kind, phase, victim rank, degrees after)
    ((3, 3), 0, "crash", "forward", 4, (3, 2)),
    ((2, 2, 2), 1, "hang", "backward", 3, (2, 1, 2)),
    ((3, 3), 2, "crash", "grad_sync", 1, (2, 3)),
    ((2, 2, 2), 2, "crash", "optimizer", 5, (2, 2, 1)),
    ((3, 3), 1, "device_error", "forward", 2, (2, 3)),
    ((2, 2), 2, "crash", "backward", 3, (2, 1)),
]


@pytest.mark.parametrize("degrees, stage, kind, phase, victim, after", CASES,
                         ids=[f"{'x'.join(map(str, c[0]))}-zero{c[1]}-{c[2]}-{c[3]}" for c in CASES])
def test_failure_at_each_phase_ends_equal_to_failure_free_run(degrees, stage, kind, phase, victim, after):
    results = run(degrees, stage, [fault(victim, 3, phase, kind)])
    assert victim not in results
    assert_equivalent(results)
    assert_lossless_and_minimal(results, after)


@pytest.mark.parametrize("stage", [1, 2])
def test_death_inside_the_optimizer_step_is_rolled_back_and_the_step_run_again(stage):
    # Rank 3 dies inside DeepSpeed's optimizer step of step 3, its own partition updated; the survivors finish
    # theirs and block in the all-gather or at the commit vote. Every member is between the votes, so the step is
    # rolled back to the copies of step 2 and run again. Two copies per anchor: the one the dead rank held of its
    # predecessor's state is gone, the other remains.
    results = run((2, 2, 2), stage, [fault(3, 3, "in_optimizer")], redundancy=2)
    assert 3 not in results
    assert_equivalent(results)
    assert_lossless_and_minimal(results, (2, 1, 2))
    assert all(e["rolled_back"] for copies in events_of(results) for e in copies)


@pytest.mark.parametrize("degrees, stage, phase, victim, after, redundancy", [
    ((3, 3), 2, "grad_sync", 1, (2, 3), 1),
    ((2, 2, 2), 1, "in_optimizer", 3, (2, 1, 2), 2),
], ids=["3x3-zero2-grad_sync", "2x2x2-zero1-in_optimizer"])
def test_round_robin_gradients_recover_equal_to_failure_free_run(degrees, stage, phase, victim, after, redundancy):
    # DeepSpeed flattens each parameter group in round-robin order over the anchors (an order that changes with
    # their number), and links the parameters to it wrongly unless `fragments.link_round_robin` relinks them: every
    # fragment read or written during recovery took another parameter's elements (lm_head.weight ended 1.07 off).
    results = run(degrees, stage, [fault(victim, 3, phase)], redundancy=redundancy,
                  zero={"round_robin_gradients": True})
    assert victim not in results
    assert_equivalent(results)
    assert_lossless_and_minimal(results, after)


def test_death_inside_the_optimizer_step_with_one_copy_says_what_it_lost():
    # With one copy per anchor, the owner whose copy lived on the dead rank has only its updated state left: the
    # roll-back cannot be whole, and recovery says so.
    results = run((2, 2, 2), 1, [fault(3, 3, "in_optimizer")])
    verdicts = {(e["rolled_back"], e["lossless"]) for copies in events_of(results) for e in copies}
    assert verdicts == {(True, False)}


def test_death_inside_the_optimizer_step_goes_forward_where_the_state_is_replicated():
    # Without ZeRO every anchor of a TP index holds its whole state: the survivors all finished the step, so it
    # stands, and the dead rank's state is its replica peer's.
    results = run((2, 2), 0, [fault(3, 3, "in_optimizer")])
    assert_equivalent(results)
    assert_lossless_and_minimal(results, (2, 1))
    assert not any(e["rolled_back"] for copies in events_of(results) for e in copies)


@pytest.mark.long  # .ci/run: its long stage (and the nccl_model stage where its file runs); README suite under 10 min
def test_death_as_the_copies_set_off_rolls_back_a_step_from_the_previous_copies():
    # Rank 3 dies after step 3 committed, before its copies of that step left: its newest state is nowhere. With
    # the previous copies kept (two per anchor, each with the step before), the job returns to step 2 and runs
    # step 3 again. Without them the same death loses rank 3's step: recovery says so.
    kept = run((2, 2, 2), 1, [fault(3, 3, "refresh")], redundancy=2, redundancy_keep_previous=True)
    assert_equivalent(kept)
    assert_lossless_and_minimal(kept, (2, 1, 2))
    assert all(e["rolled_back"] for copies in events_of(kept) for e in copies)
    lost = run((2, 2, 2), 1, [fault(3, 3, "refresh")], redundancy=2)
    verdicts = {(e["rolled_back"], e["lossless"]) for copies in events_of(lost) for e in copies}
    assert verdicts == {(False, False)}


@pytest.mark.long  # .ci/run: on gloo in the long stage, and in the nccl_model stage (README suite under 15 minutes)
def test_hf_qwen2_model_recovers_equal_to_failure_free_run():
    # transformers' Qwen2 (8 heads on 2 KV heads, q/k/v biases): the survivors of replica 1 take rank 4's units
    # into a non-contiguous layout, rebuilt through transformers' modules.
    results = run((3, 3), 1, [fault(4, 3, "forward")], make_model=tiny_qwen2)
    assert set(results) == {0, 1, 2, 3, 5}
    assert_equivalent(results, make_model=tiny_qwen2)
    assert_lossless_and_minimal(results, (3, 2))


def test_hung_worker_is_detected_within_heartbeat_timeout_plus_a_second():
    # The CPU recipes' bounds: heartbeat_timeout_s 3, timeout_s 20. Rank 3 stops (SIGSTOP) before its last
    # backward: its TP peer waits on it in a TP all-reduce, its DP peers inside DeepSpeed's own reduction, which only
    # the fence (the launcher killing the declared-dead rank) can end before timeout_s.
    heartbeat_timeout_s = 3.0
    ntp = {"tp": 2, "replicas": 3, "min_tp": 1}
    results = run_ranks(train_with_recovery, 6, Scenario(ntp, 1, (fault(3, 3, "grad_sync", "hang"),), STEPS,
                                                         heartbeat_timeout_s=heartbeat_timeout_s, timeout_s=20.0),
                        timeout=200, store=True)
    assert set(results) == {0, 1, 2, 4, 5}
    assert_equivalent(results)
    assert_lossless_and_minimal(results, (2, 1, 2))
    for rank, res in results.items():
        detected = res["noticed"][0] - res["fired"][3]
        assert detected <= heartbeat_timeout_s + 1.0, f"rank {rank} saw the hang after {detected:.2f} s"


def test_a_hung_rank_that_a_peer_does_not_watch_reaches_it_through_the_fence_within_the_same_bound():
    # Four replicas at TP 1: one data-parallel group of four, in which each rank watches its two ring neighbours
    # only. Rank 2 hangs; rank 0 does not watch it and learns of it from the fence its neighbours request.
    heartbeat_timeout_s = 3.0
    results = run_ranks(train_with_recovery, 4,
                        Scenario({"tp": 1, "replicas": 4}, 1, (fault(2, 3, "grad_sync", "hang"),), STEPS,
                                 heartbeat_timeout_s=heartbeat_timeout_s, timeout_s=20.0), timeout=200, store=True)
    assert set(results) == {0, 1, 3}
    assert_equivalent(results)
    for rank, res in results.items():
        detected = res["noticed"][0] - res["fired"][2]
        assert detected <= heartbeat_timeout_s + 1.0, f"rank {rank} saw the hang after {detected:.2f} s"


def test_own_error_ends_that_rank_at_once_and_its_peers_recover_without_it():
    # Rank 3 runs out of memory in its backward: its own error, not the wire's. It ends at once (no recovery, which
    # would wait for a dead peer that does not exist), and its peers recover without it within the heartbeat timeout
    # plus 2 s, to the failure-free weights.
    heartbeat_timeout_s = 3.0
    ntp = {"tp": 2, "replicas": 3, "min_tp": 1}
    results = run_ranks(train_with_recovery, 6, Scenario(ntp, 1, (fault(3, 3, "backward", "oom"),), STEPS,
                                                         heartbeat_timeout_s=heartbeat_timeout_s, timeout_s=20.0),
                        timeout=200, store=True)
    assert set(results) == {0, 1, 2, 4, 5}
    assert_equivalent(results)
    assert_lossless_and_minimal(results, (2, 1, 2))
    for rank, res in results.items():
        detected = res["noticed"][0] - res["fired"][3]
        assert detected <= heartbeat_timeout_s + 2.0, f"rank {rank} saw the loss after {detected:.2f} s"


@pytest.mark.parametrize("phase, stage", [("backward", 2), ("optimizer", 1), ("in_optimizer", 1)])
@pytest.mark.long  # .ci/run: its long stage (and the nccl_model stage where its file runs); README suite under 10 min
def test_stalled_training_thread_is_found_hung_within_hang_timeout_plus_2s_and_recovered(phase, stage):
    # Rank 3's training thread blocks for good while its heartbeat goes on beating (a wedged kernel, a deadlock in its
    # own code): its beats say nothing, its progress does. Its peers wait on it (in the model's TP all-reduce, in
    # DeepSpeed's reduction or its step's all-gather, at the votes) and declare it hung once its progress has stood
    # still for hang_timeout_s; it is fenced and killed, and they recover to the failure-free weights. A peer blocked
    # inside DeepSpeed's collectives waits too, so it is not taken for hung (the job would lose more than rank 3).
    # 6 s: well above any stretch of a healthy rank's own work here (each rank warns of its own at half the timeout,
    # with its stack). At 3 s one CI run saw a healthy rank judged hung before the first step: its store clients took
    # 3.4 s to connect outside a wait (now a wait, `Recovery.__init__`).
    assert_hung_rank_3_found(phase, stage, "stall")


def _recovery_watching_rebuilt_shards(rank, world_size, scenario):
    """`train_with_recovery`, noting the dtype and device of every shard a recovery builds."""
    from ntp_ds.recovery import install

    built, real = [], install.empty_shard

    def spy(*a, **k):
        module = real(*a, **k)
        built.append(sorted({f"{p.dtype} {p.device.type}" for p in module.parameters()}))
        return module

    install.empty_shard = spy
    result = training.train_with_recovery(rank, world_size, scenario)
    result["built"] = built
    return result


def _max_difference(results) -> float:
    reference = dict(train_reference("adamw", GLOBAL_BATCH, STEPS).named_parameters())
    full = next(r["full"] for r in results.values() if r["full"] is not None)
    return max((t.float() - reference[n].detach()).abs().max().item() for n, t in full.items())


def test_bf16_recovery_rebuilds_shards_on_the_device_in_bf16():
    # The survivors of the degraded replica build their new shard where it trains, in the dtype it trains in: kept
    # units never go through fp32 host memory. bf16 cannot equal the fp32 reference; the recovered run must stay
    # as close to it as the failure-free bf16 run does.
    scenario = Scenario({"tp": 2, "replicas": 2, "min_tp": 1}, 1, (), STEPS, timeout_s=20.0, bf16=True)
    train = _recovery_watching_rebuilt_shards
    clean = run_ranks(train, 4, scenario, timeout=200, store=True)
    crashed = dataclasses.replace(scenario, faults=(fault(3, 3, "backward"),))
    results = run_ranks(train, 4, crashed, timeout=200, store=True)
    assert set(results) == {0, 1, 2}
    assert_lossless_and_minimal(results, (2, 1))
    device = "cuda" if os.environ.get("NTP_TEST_DEVICE") == "cuda" else "cpu"
    built = [b for r in (0, 1, 2) for b in results[r]["built"]]
    assert built and all(b == [f"torch.bfloat16 {device}"] for b in built), built
    recovered, failure_free = _max_difference(results), _max_difference(clean)
    print(f"max abs difference from the fp32 reference: recovered {recovered:.3g}, failure-free {failure_free:.3g}")
    assert recovered <= 2 * failure_free + 1e-3


def test_death_at_the_new_generation_s_rendezvous_is_detected_within_heartbeat_timeout_plus_a_second():
    # Rank 0 hangs (SIGSTOP) as the survivors of rank 4's crash meet for the next generation. They watch their
    # liveness while they wait for each other, so the attempt fails within the heartbeat timeout (the process group's
    # own rendezvous would wait timeout_s, 20 s here) and the recovery starts again without rank 0.
    heartbeat_timeout_s = 3.0
    ntp = {"tp": 3, "replicas": 2, "min_tp": 1}
    faults = (fault(4, 2, "forward"), fault(0, 2, "rendezvous", "hang"))
    results = run_ranks(train_with_recovery, 6, Scenario(ntp, 1, faults, STEPS, heartbeat_timeout_s=heartbeat_timeout_s,
                                                         timeout_s=20.0), timeout=200, store=True)
    assert set(results) == {1, 2, 3, 5}
    assert_equivalent(results)
    assert all(e["lossless"] for copies in events_of(results) for e in copies)
    for rank, res in results.items():
        assert res["failed_attempts"], f"rank {rank} never saw the rendezvous fail"
        detected = res["failed_attempts"][0] - res["fired"][0]
        print(f"rank {rank} left the rendezvous {detected:.2f} s after the hang")
        assert detected <= heartbeat_timeout_s + 1.0, f"rank {rank} left the rendezvous {detected:.2f} s after the hang"


def test_overlapped_copies_report_their_real_freshness():
    # With redundancy_overlap the copies of step k travel during step k + 1. A crash late in step k + 1 finds them
    # complete: lossless and equal to the failure-free run. A crash as step k + 1 starts may beat its owner's copy:
    # recovery must then say it is not lossless, and whenever it says lossless the weights must be exact.
    late = run((2, 2, 2), 1, [fault(3, 3, "grad_sync")], redundancy_overlap=True)
    assert_equivalent(late)
    assert_lossless_and_minimal(late, (2, 1, 2))
    early = run((2, 2, 2), 1, [fault(3, 3, "forward")], redundancy_overlap=True)
    assert all(r["global_steps"] == STEPS for r in early.values())
    verdicts = {e["lossless"] for copies in events_of(early) for e in copies}
    assert len(verdicts) == 1, "ranks disagree on lossless"
    if verdicts == {True}:
        assert_equivalent(early)


def test_copies_in_host_memory_through_small_staging_buffers():
    # Copies kept in host memory arrive in pieces of at most bucket_size elements through two staging buffers;
    # a lost anchor's state comes back from them exactly.
    ntp = {"tp": 2, "replicas": 3, "min_tp": 1, "redundancy_on_host": True, "bucket_size": 3000}
    results = run_ranks(train_with_recovery, 6, Scenario(ntp, 2, (fault(3, 3, "backward"),), STEPS), timeout=200,
                        store=True)
    assert_equivalent(results)
    assert_lossless_and_minimal(results, (2, 1, 2))
    optimizer_bytes = {e["optimizer_bytes_moved"] for copies in events_of(results) for e in copies}
    assert optimizer_bytes and min(optimizer_bytes) > 0, "the lost partition must come back from a copy"


@pytest.mark.long  # .ci/run: its long stage and the nccl_model stage
def test_host_copies_travelling_with_the_next_step_come_back_whole_or_from_the_step_before():
    # Host-memory copies with redundancy_overlap travel piece by piece during the next step's micro-batches. Rank 3
    # dies in step 3's backward pass, its copies of step 2 perhaps still on the way: the survivors keep the whole
    # ones, and with the previous copies kept the job is whole either way (from step 2's copies, or rolled back to
    # step 1's). Equal to the failure-free run, lossless.
    results = run((2, 2, 2), 1, [fault(3, 3, "backward")], redundancy=2, redundancy_keep_previous=True,
                  redundancy_on_host=True, redundancy_overlap=True, bucket_size=3000)
    assert_equivalent(results)
    assert_lossless_and_minimal(results, (2, 1, 2))
    print("rolled back:", {e["rolled_back"] for copies in events_of(results) for e in copies})


def test_anchor_lost_while_its_parameters_stream_to_the_contributor():
    # (2, 2, 1): two anchor replicas, so the contributor receives its parameters bucket by bucket during its next
    # forward. Rank 0 dies as that forward starts: the contributor's buckets from it never arrive, it still holds
    # the previous step's values for those units, and recovery must fetch them afresh from the other anchor replica.
    ntp = {"tp": 2, "replicas": 3, "degrees": (2, 2, 1), "min_tp": 1, "bucket_size": 500}
    results = run_ranks(train_with_recovery, 5, Scenario(ntp, 1, (fault(0, 3, "forward"),), STEPS), timeout=200,
                        store=True)
    assert set(results) == {1, 2, 3, 4}
    assert_equivalent(results)
    (event, *_), = events_of(results)
    assert event["lossless"]
    # More than the lost shard moved: the contributor's stale units came again from the surviving anchor replica.
    assert event["bytes_moved"] - event["kv_rereplicated_bytes"] > event["lost_shard_bytes"]


@pytest.mark.parametrize("victim, phase, what", [
    # Anchor rank 0 dies as step 3's forward starts: the contributor's receives of its parameter buckets are cut
    # (its units of those buckets are stale, fetched again from the other anchor replica).
    (0, "forward", "param_buckets"),
    # The contributor dies as step 3's copies set off: every anchor's batch of copies (its sends to the contributor,
    # its receive of another anchor's copy) is cut, so each drops the copy of a live owner (sent afresh after the
    # recovery; the owner's state is its own).
    (4, "refresh", "copies"),
])
def test_transfers_cut_by_the_abort_are_refused_and_fetched_again(victim, phase, what):
    # (2, 2, 1). Under NCCL the abort ends every receive still pending as if it had completed, its buffer holding
    # part of the message at most (nccl_model: some chunks, poison elsewhere). Nothing of it may be kept: the run ends
    # equal to the failure-free one, lossless, and the event says what was refused. gloo ends such receives with an
    # error, so nothing is refused there.
    ntp = {"tp": 2, "replicas": 3, "degrees": (2, 2, 1), "min_tp": 1, "bucket_size": 500}
    results = run_ranks(train_with_recovery, 5, Scenario(ntp, 1, (fault(victim, 3, phase),), STEPS, zero_redundancy=2),
                        timeout=200, store=True)
    assert set(results) == {0, 1, 2, 3, 4} - {victim}
    assert_equivalent(results)
    (copies,) = events_of(results)
    assert all(e["lossless"] for e in copies)
    assert len({tuple(sorted(e["refused"].items())) for e in copies}) == 1, "ranks disagree on what was refused"
    refused = copies[0]["refused"]
    print("refused:", refused, [e["rank_refused"] for e in copies])
    if os.environ.get("NTP_TEST_BACKEND") == "nccl_model":
        assert refused[what] > 0, refused
    else:
        assert refused == {"param_buckets": 0, "copies": 0, "grads": 0}, refused
    if what == "param_buckets":  # the refused units came again: more than the lost shard moved
        assert copies[0]["bytes_moved"] - copies[0]["kv_rereplicated_bytes"] > copies[0]["lost_shard_bytes"]


@pytest.mark.long  # .ci/run: on gloo in the long stage, and in the nccl_model stage (README suite under 15 minutes)
def test_second_failure_in_the_same_replica():
    results = run((3, 3), 1, [fault(4, 2, "forward"), fault(5, 4, "backward")])
    assert_equivalent(results)
    assert_lossless_and_minimal(results, (3, 1))
    assert len(events_of(results)) == 2


@pytest.mark.long  # .ci/run: on gloo in the long stage, and in the nccl_model stage (README suite under 15 minutes)
@pytest.mark.parametrize("phase", ["recovery", "transfer"])
def test_failures_in_two_replicas_one_during_recovery(phase):
    # Rank 0 dies while the survivors recover from rank 4 (once the new membership is agreed, or while the lost units
    # move): both replicas end at TP 2 with different layouts, so the anchors' optimizer state is re-sliced across a
    # layout change.
    results = run((3, 3), 2, [fault(4, 2, "forward"), fault(0, 2, phase)])
    assert set(results) == {1, 2, 3, 5}
    assert_equivalent(results)
    assert all(e["lossless"] for copies in events_of(results) for e in copies)
    assert all(tuple(r["degrees"]) == (2, 2) for r in results.values())


@pytest.mark.long  # .ci/run: on gloo in the long stage, and in the nccl_model stage
def test_a_rank_lost_as_the_new_communicators_are_created_costs_a_bounded_wait():
    # Rank 0 dies once the survivors of rank 4's death have met for the new generation, before its communicators
    # exist. Its family peers in replica 1 (ranks 3 and 5) create theirs with it at their first op. A blocking
    # creation would wait for it for ever, out of any abort's reach (nccl_model: Deadlock); created non-blocking,
    # it gives up after timeout_s and the recovery starts again without rank 0.
    results = run((3, 3), 1, [fault(4, 2, "forward"), fault(0, 2, "groups")])
    assert set(results) == {1, 2, 3, 5}
    assert_equivalent(results)
    assert all(tuple(r["degrees"]) == (2, 2) for r in results.values())


@pytest.mark.parametrize("degrees,victim,kept", [((2, 2), 3, 6), ((2, 2, 2), 5, 8)])
@pytest.mark.long  # .ci/run: its long stage (and the nccl_model stage where its file runs); README suite under 10 min
def test_replicas_that_lost_nothing_keep_their_finished_backward_and_share_the_lost_samples(degrees, victim, kept):
    # The healthy replicas' backward of step 3 outlasts the detection (they begin its last micro-batch once the death
    # is declared): their gradients are whole when the reduction would start, so they keep them and, with the hit
    # replica's survivor, run only the hit replica's samples of the step again. ZeRO 1 reduces at the boundary.
    ntp = {"tp": max(degrees), "replicas": len(degrees), "min_tp": 1}
    scenario = Scenario(ntp, 1, (fault(victim, 3, "backward"),), STEPS, reduce_after_verdict=3)
    results = run_ranks(train_with_recovery, sum(degrees), scenario, timeout=200, store=True)
    assert_equivalent(results)
    (copies,) = events_of(results)
    print(f"samples_kept={copies[0]['samples_kept']} engines_rebuilt={copies[0]['engines_rebuilt']}")
    assert {e["samples_kept"] for e in copies} == {kept}
    assert copies[0]["engines_rebuilt"] == 1  # the hit replica's survivor alone
    # Every rank of a healthy replica says which step's gradients it carries (a loop's loss counts them), until the
    # step ends; the hit replica's survivor carries none.
    assert {r: res["kept_grads_steps"] for r, res in results.items()} == \
        {r: [3 if r // 2 != victim // 2 else None] for r in results}


def test_loss_of_a_whole_replica_holding_rank_0():
    results = run((2, 2, 2), 1, [fault(0, 3, "forward"), fault(1, 3, "forward")])
    assert set(results) == {2, 3, 4, 5}
    assert_equivalent(results)
    assert all(tuple(r["degrees"]) == (2, 2) for r in results.values())
    assert all(e["lossless"] for copies in events_of(results) for e in copies)


def test_without_redundancy_recovery_says_it_is_not_lossless():
    results = run((2, 2), 1, [fault(3, 3, "forward")], redundancy=0)
    assert set(results) == {0, 1, 2}
    assert all(r["global_steps"] == STEPS for r in results.values())
    assert not any(e["lossless"] for copies in events_of(results) for e in copies)


def test_no_replica_left_stops_and_writes_the_last_good_state(tmp_path):
    # Both replicas lose TP rank 1 at step 2; the survivors (TP rank 0 of each) cannot train at min_tp=2. Between
    # them they hold only TP rank 0's units, so no full state can be written: the message must say so.
    results = run((2, 2), 1, [fault(1, 2, "forward"), fault(3, 2, "forward")], min_tp=2,
                  last_good_dir=str(tmp_path / "lost"))
    assert set(results) == {0, 2}
    for res in results.values():
        assert "every replica is below min_tp=2" in res["stopped"]
        assert "no last good state was written" in res["stopped"]
    # Losing TP rank 0 of one replica and TP rank 1 of the other leaves every unit on some survivor: the last
    # completed step's weights are written and equal the failure-free run after one step.
    results = run((2, 2), 1, [fault(0, 2, "forward"), fault(3, 2, "forward")], min_tp=2,
                  last_good_dir=str(tmp_path / "good"))
    assert set(results) == {1, 2}
    assert all("the last good state is in" in r["stopped"] for r in results.values())
    import transformers

    saved = dict(transformers.LlamaForCausalLM.from_pretrained(tmp_path / "good").named_parameters())
    reference = dict(train_reference("adamw", GLOBAL_BATCH, 1).named_parameters())
    for name, tensor in reference.items():
        assert (saved[name].detach() - tensor.detach()).abs().max().item() <= 1e-4, name


MATRIX = list(itertools.product([(3, 3), (2, 2, 2)], [0, 1, 2], ["crash", "hang"],
                                ["forward", "backward", "grad_sync", "optimizer"]))


@pytest.mark.matrix
@pytest.mark.parametrize("degrees, stage, kind, phase", MATRIX,
                         ids=[f"{'x'.join(map(str, c[0]))}-zero{c[1]}-{c[2]}-{c[3]}" for c in MATRIX])
def test_full_matrix(degrees, stage, kind, phase):
    if os.environ.get("NTP_FULL_MATRIX") != "1":
        pytest.fail("set NTP_FULL_MATRIX=1 to run the full matrix (48 runs, about 4 minutes on 2 cores)")
    victim = sum(degrees) - 2
    results = run(degrees, stage, [fault(victim, 3, phase, kind)])
    assert_equivalent(results)
    assert all(e["lossless"] for copies in events_of(results) for e in copies)
