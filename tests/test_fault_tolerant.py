"""Fault tolerance in the caller's own loop: `ntp_ds.initialize(..., ntp={"fault_tolerance": ...})` and a
DeepSpeed-style loop over `train_steps`, `attempt` and `micro_batches`, judged by final state: after a lost GPU the
weights equal one process training the unsharded model on the same samples."""

import functools

import pytest

from ntp_ds.engine import ConfigError
from ntp_ds.testing.spawn import run_ranks
from tests.helpers.training import assert_equivalent

STEPS, GLOBAL_BATCH, MICRO = 5, 12, 2


def user_loop(rank, world_size, ntp: dict, stage: int, steps: int, faults: list, joins: dict | None = None,
              own_loss: bool = False, reduce_after_verdict: int | None = None):
    """A user's script: their model, DeepSpeed config and dataset; the loop reads like DeepSpeed's. `joins`: the
    step from which each joiner (started with NTP_JOIN, as a launcher starts a repaired GPU's worker) trains;
    `own_loss`: the script computes its own loss (a per-token mean cross-entropy) from `engine.logits(batch)`;
    `reduce_after_verdict`: a step whose last backward every rank that reaches it begins only once a peer's failure
    is declared (as `tests.helpers.training.train_with_recovery` does)."""
    import os

    import torch.nn.functional as F

    import ntp_ds
    from ntp_ds.comm import wire
    from tests.helpers.training import (_await_join_requests, dataset, deepspeed_config, full_model, host_shards,
                                        tiny_config)

    joining = bool(os.environ.get("NTP_JOIN"))
    if joining:
        os.environ["NTP_JOIN_STEP"] = str(joins[rank])  # what the launcher tells a replacement
    model = full_model(tiny_config())
    seen, kept = [], []
    engine = ntp_ds.initialize(model=model, config=deepspeed_config("adamw", stage, GLOBAL_BATCH, MICRO),
                               ntp={**ntp, "fault_tolerance": {"heartbeat_timeout_s": 2.0, "faults": faults}},
                               on_event=lambda kind, step, fields: seen.append((kind, step, fields.get("dead")))
                               or kept.append(fields.get("samples_kept")))
    if reduce_after_verdict is not None:
        check = engine.injector.check

        def hold(step, phase):
            if phase == "grad_sync" and step == reduce_after_verdict:
                wire.verdict(12.0)
            check(step, phase)

        engine.injector.check = engine.engine.on_phase = hold  # (the handle hooks it to each engine it holds)
    data = dataset(model.config)
    first_engine = engine.engine
    if joins and not joining:  # when a joiner is taken in depends on the step it asked for, not on its start-up
        _await_join_requests(engine.store, len(joins))
    attempts = []
    for step in engine.train_steps(steps):
        attempts.append(step)
        with engine.attempt(step):
            for batch in engine.micro_batches(data, seed=1):
                if own_loss:
                    logits = engine.logits(batch)
                    labels = batch["labels"].to(logits.device)
                    loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100)
                else:
                    loss = engine(batch)
                engine.backward(loss)
                engine.step()
    result = {"replica": engine.ntp_groups.replica, "tp_rank": engine.ntp_groups.tp_rank,
              "layout": engine.ntp_groups.layout, "shards": host_shards(engine.module),
              "full": engine.consolidated_state_dict(), "global_steps": engine.global_steps,
              "degrees": tuple(engine.ntp_groups.topology.degrees), "events": seen, "attempts": attempts,
              "engine_replaced": engine.engine is not first_engine,
              "samples": [part.samples for part in engine.batch_plan.replicas], "samples_kept": kept}
    engine.close()
    return result


def test_a_crash_in_the_users_loop_is_recovered_and_ends_equal_to_the_failure_free_run():
    faults = [{"rank": 3, "step": 3, "phase": "backward", "kind": "crash"}]
    results = run_ranks(user_loop, 4, {"tp": 2, "replicas": 2}, 1, STEPS, faults, timeout=200, store=True)
    assert sorted(results) == [0, 1, 2]
    assert_equivalent(results, GLOBAL_BATCH, STEPS)
    for rank, res in results.items():
        assert res["degrees"] == (2, 1)
        assert res["events"] == [("recovery", 2, [3])]  # after 2 completed steps, rank 3 lost
        assert res["attempts"] == [0, 1, 2, 2, 3, 4]  # step index 2 (the third step) ran twice
        # The same handle throughout. Replica 0's anchors keep their engine (its ZeRO partitions re-cut in place);
        # rank 2's replica falls to TP 1, and the handle holds its new engine.
        assert res["engine_replaced"] == (rank == 2)


@pytest.mark.long  # .ci/run: its long stage (and the nccl_model stage where its file runs); README suite under 10 min
def test_the_users_loop_runs_only_the_rest_of_a_step_whose_backward_the_healthy_replica_finished():
    # The healthy replica's backward of step 3 outlasts the detection: it keeps its gradients, and the loop's next
    # `micro_batches` hands each replica its share of the hit replica's samples only (the user's own loss too).
    faults = [{"rank": 3, "step": 3, "phase": "backward", "kind": "crash"}]
    worker = functools.partial(user_loop, own_loss=True, reduce_after_verdict=3)
    results = run_ranks(worker, 4, {"tp": 2, "replicas": 2}, 1, STEPS, faults, timeout=200, store=True)
    assert sorted(results) == [0, 1, 2]
    assert_equivalent(results, GLOBAL_BATCH, STEPS)
    for res in results.values():
        assert res["events"] == [("recovery", 2, [3])]
        assert res["samples_kept"] == [GLOBAL_BATCH // 2]  # replica 0's half of the step
        assert res["attempts"] == [0, 1, 2, 2, 3, 4]


def test_a_repaired_gpu_joins_the_users_loop_between_steps_with_the_users_own_loss_function():
    faults = [{"rank": 3, "step": 2, "phase": "forward", "kind": "crash"}]
    results = run_ranks(user_loop, 4, {"tp": 2, "replicas": 2}, 1, STEPS, faults, {4: 4}, True, timeout=200,
                        store=True, joiners=1)
    assert sorted(results) == [0, 1, 2, 4]
    assert_equivalent(results, GLOBAL_BATCH, STEPS)
    assert all(res["degrees"] == (2, 2) for res in results.values())
    for rank in (0, 1, 2):
        assert [kind for kind, _, _ in results[rank]["events"]] == ["recovery", "join"]
    assert results[4]["attempts"][0] == 3, "the joiner trains from the step it asked for (index 3: step 4)"


def test_a_slow_replica_is_replanned_in_the_users_loop_and_the_replan_reaches_the_callback():
    faults = [{"rank": 3, "step": 1, "phase": "forward", "kind": "slow", "factor": 4}]
    ntp = {"tp": 2, "replicas": 2, "straggler": {"enabled": True, "every_steps": 2}}
    results = run_ranks(user_loop, 4, ntp, 1, STEPS, faults, timeout=200, store=True)
    assert_equivalent(results, GLOBAL_BATCH, STEPS)
    for res in results.values():
        replans = [step for kind, step, _ in res["events"] if kind == "replan"]
        assert replans and replans[0] == 2, res["events"]  # decided after the first window of 2 steps
        assert res["samples"][1] < res["samples"][0] and sum(res["samples"]) == GLOBAL_BATCH


def test_fault_tolerance_settings_are_checked_before_any_process_group(monkeypatch):
    import torch.distributed as dist

    import ntp_ds
    from tests.helpers.training import deepspeed_config, full_model, tiny_config

    monkeypatch.setenv("WORLD_SIZE", "2")
    cases = [({"heartbeat_interval_s": 5.0, "heartbeat_timeout_s": 2.0},
              r"ntp.fault_tolerance.heartbeat_interval_s=5.0 must be shorter than heartbeat_timeout_s=2.0"),
             ({"faults": [{"rank": 9, "step": 1, "phase": "forward"}]}, r"ntp.fault_tolerance.faults\[0\]"),
             ({"heartbeat": 1}, r"ntp.fault_tolerance.heartbeat is not a known setting")]
    for settings, message in cases:
        with pytest.raises(ConfigError, match=message):
            ntp_ds.initialize(model=full_model(tiny_config()), config=deepspeed_config("sgd", 1, 12, 2),
                              ntp={"tp": 2, "fault_tolerance": settings})
    assert not dist.is_initialized()


def test_a_timeout_too_short_for_a_big_jobs_launchers_is_named_before_any_process_group():
    from ntp_ds.engine.config import FaultToleranceConfig, check_launcher_period

    big = {"NTP_NODE_SIZE": "8", "WORLD_SIZE": "100000"}  # 12,500 nodes: the launchers publish every 1 s
    with pytest.raises(ConfigError, match=r"ntp.fault_tolerance.heartbeat_timeout_s=2.0 must be longer than two of "
                                          r"the launchers' periods: 12500 nodes publish their liveness every 1 s"):
        check_launcher_period(FaultToleranceConfig(heartbeat_timeout_s=2.0), env=big)
    check_launcher_period(FaultToleranceConfig(), env=big)  # the default 3 s outlasts two periods
    # A small job's launchers keep the workers' beat: only the interval's own rule applies there.
    check_launcher_period(FaultToleranceConfig(heartbeat_interval_s=0.5, heartbeat_timeout_s=0.9),
                          env={"NTP_NODE_SIZE": "8", "WORLD_SIZE": "1024"})
