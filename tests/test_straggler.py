"""Straggler-aware batch planning: the pure re-plan (balance, hysteresis, anchors) and, end to end, a run with one
replica slowed on purpose whose plan moves samples away from it while its weights stay the failure-free run's."""

import json
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ntp_ds.batch import BatchError, plan_batch
from ntp_ds.batch.straggler import balance_samples, per_sample_estimate, rebalance, replica_step_times


# -- pure planning -------------------------------------------------------------------------------------------------
@given(st.lists(st.floats(0.01, 10.0), min_size=1, max_size=6), st.integers(0, 60))
def test_balanced_samples_are_whole_complete_and_minimise_the_slowest(costs, extra):
    total = len(costs) + extra
    samples = balance_samples(costs, total)
    assert sum(samples) == total and min(samples) >= 1
    slowest = max(c * n for c, n in zip(costs, samples))
    # No single sample moved from the slowest replica to another shortens the step: the split is min-max optimal.
    i = max(range(len(costs)), key=lambda r: costs[r] * samples[r])
    if samples[i] > 1:
        for j in range(len(costs)):
            if j != i:
                assert costs[j] * (samples[j] + 1) >= slowest - 1e-12


def test_balance_respects_floors_and_refuses_too_few_samples():
    assert balance_samples([1.0, 10.0], 6, floors=[1, 3]) == [3, 3]
    with pytest.raises(BatchError):
        balance_samples([1.0, 1.0], 3, floors=[2, 2])


def test_a_slow_replica_gives_samples_to_its_peers_and_anchors_keep_one_micro_batch_count():
    plan = plan_batch((1, 1, 1), 1, 24, 4, "preserve_global_batch", anchors=(0, 1, 2))
    replan = rebalance(plan, [0.01, 0.01, 0.015], micro_batch=4, anchors=(0, 1, 2))
    samples = [p.samples for p in replan.plan.replicas]
    assert sum(samples) == 24 and samples[2] < 8 < min(samples[0], samples[1])
    assert len({p.micro_steps for p in replan.plan.replicas}) == 1
    assert max(s for p in replan.plan.replicas for s in p.micro_sizes) <= 4
    assert [p.offset for p in replan.plan.replicas] == [0, samples[0], samples[0] + samples[1]]
    assert replan.after_s < 0.95 * replan.before_s and replan.before_s == pytest.approx(0.12)


@given(st.integers(2, 5), st.integers(1, 12), st.integers(1, 4), st.data())
def test_every_replan_is_a_valid_plan_of_the_same_global_batch(replicas, share, micro, data):
    anchors = tuple(sorted(data.draw(st.sets(st.integers(0, replicas - 1), min_size=1))))
    costs = data.draw(st.lists(st.floats(0.001, 1.0), min_size=replicas, max_size=replicas))
    plan = plan_batch((1,) * replicas, 1, share * replicas, micro, "preserve_global_batch", anchors=anchors)
    replan = rebalance(plan, costs, micro, anchors, threshold=0.0)
    if replan is None:
        return
    parts = replan.plan.replicas
    assert replan.plan.global_samples == plan.global_samples and replan.after_s < replan.before_s
    assert len({parts[a].micro_steps for a in anchors}) == 1
    assert all(1 <= size <= micro for p in parts for size in p.micro_sizes)
    assert [p.offset for p in parts] == [sum(q.samples for q in parts[:r]) for r in range(replicas)]


def test_a_plan_the_anchors_shared_count_cannot_hold_is_not_taken():
    plan = plan_batch((1, 1), 1, 4, 1, "preserve_global_batch", anchors=(0, 1))
    assert [p.micro_sizes for p in plan.replicas] == [(1, 1), (1, 1)]
    assert rebalance(plan, [0.01, 0.1], micro_batch=1, anchors=(0, 1)) is None


def test_contributors_get_their_own_micro_batch_count():
    plan = plan_batch((2, 2, 1), 2, 21, 2, "preserve_global_batch", anchors=(0, 1))
    replan = rebalance(plan, [0.01, 0.03, 0.02], micro_batch=2, anchors=(0, 1))
    parts = replan.plan.replicas
    assert parts[0].micro_steps == parts[1].micro_steps and parts[1].samples >= parts[1].micro_steps
    assert parts[2].micro_steps == math.ceil(parts[2].samples / 2)


@settings(max_examples=200)
@given(st.integers(2, 6), st.integers(1, 8), st.lists(st.floats(-1.0, 1.0), min_size=6, max_size=6),
       st.floats(0.02, 0.2))
def test_no_flapping_under_noisy_equal_times(replicas, share, noise, threshold):
    """Equal replicas measured with noise well inside the threshold keep their plan."""
    plan = plan_batch((2,) * replicas, 2, share * replicas, 2, "preserve_global_batch",
                      anchors=tuple(range(replicas)))
    times = [0.01 * (1 + threshold / 4 * noise[r]) for r in range(replicas)]
    assert rebalance(plan, times, 2, tuple(range(replicas)), threshold=threshold) is None


@given(st.lists(st.floats(0.005, 0.05), min_size=2, max_size=5), st.integers(2, 10), st.floats(0.0, 0.2))
def test_a_replan_is_stable_once_the_times_are_what_it_predicted(costs, share, threshold):
    """Measured again under the new plan with unchanged speeds, the plan stays: no second move back and forth."""
    n = len(costs)
    plan = plan_batch((1,) * n, 1, share * n, 3, "preserve_global_batch")
    replan = rebalance(plan, costs, 3, threshold=threshold)
    if replan is not None:
        assert replan.plan.global_samples == plan.global_samples
        assert rebalance(replan.plan, costs, 3, threshold=threshold) is None


def test_replica_step_times_take_the_median_of_each_rank_and_the_slowest_rank():
    windows = [(0, [0.5, 0.1, 0.1]), (0, [0.2, 0.2, 0.3]), (1, [0.1, 0.12, 0.11])]
    assert replica_step_times(windows, 2) == (0.2, 0.11)


def test_one_noisy_window_does_not_move_the_estimate():
    history = [(0.01, 0.01, 0.015), (0.01, 0.03, 0.015), (0.01, 0.01, 0.016)]
    assert per_sample_estimate(history) == (0.01, 0.01, 0.015)
    assert per_sample_estimate(history[:1]) == history[0]


# -- the slow fault ------------------------------------------------------------------------------------------------
def test_slow_fault_validation_names_the_field():
    from ntp_ds.control.faults import Fault, FaultSchedule

    good = {"rank": 2, "step": 1, "phase": "forward", "kind": "slow", "factor": 1.5}
    assert FaultSchedule.from_config([good], 3).faults == (Fault(2, 1, "forward", "slow", 1.5),)
    assert Fault.decode(Fault(2, 1, "forward", "slow", 1.5).encode()).factor == 1.5
    assert "factor" not in json.loads(Fault(1, 1, "forward", "crash").encode())
    for item, message in [({**good, "factor": 0.5}, r"fault\.faults\[0\]\.factor=0\.5 must be a number of at least 1"),
                          ({k: v for k, v in good.items() if k != "factor"}, r"fault\.faults\[0\]\.factor is missing"),
                          ({**good, "kind": "crash"}, r"fault\.faults\[0\]\.factor=1\.5 applies only to kind slow")]:
        with pytest.raises(ValueError, match=message):
            FaultSchedule.from_config([item], 3)


def test_slow_fault_stretches_the_rank_from_its_step_on():
    from ntp_ds.control.faults import FaultInjector, FaultSchedule

    slept, fired = [], []
    schedule = FaultSchedule.from_config([{"rank": 0, "step": 2, "phase": "forward", "kind": "slow", "factor": 3}], 1)
    inj = FaultInjector(schedule, 0, fire=fired.append, sleep=slept.append)
    inj.check(1, "forward")
    assert inj.stretch(0.1) == 0 and slept == []
    inj.check(2, "forward")
    assert inj.stretch(0.1) == pytest.approx(0.2) and slept == [pytest.approx(0.2)] and fired == []


def test_inject_sends_a_slow_fault_with_its_factor_to_the_running_job(capsys):
    from ntp_ds.control import inject
    from ntp_ds.control.faults import FaultInjector, FaultSchedule
    from ntp_ds.control.job import publish_job
    from ntp_ds.control.store import host_store

    store, address = host_store(timeout_s=5.0)
    publish_job(store, world_size=3, steps=20)
    base = ["--store", address, "--rank", "2", "--step", "4", "--phase", "forward", "--kind", "slow", "--timeout-s", "5"]
    assert inject.main([*base, "--factor", "0.5"]) == inject.USAGE_ERROR
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--factor=0.5 must be a number of at least 1" in err, err
    assert inject.main([*base[:-4], "--kind", "crash", "--factor", "2", "--timeout-s", "5"]) == inject.USAGE_ERROR
    assert "--factor=2.0 applies only to kind slow" in capsys.readouterr().err
    assert inject.main([*base, "--factor", "2"]) == 0
    assert "sent fault 1: slow (x2) on rank 2" in capsys.readouterr().out
    slept = []
    injector = FaultInjector(FaultSchedule(), 2, store, sleep=slept.append, fire=lambda f: pytest.fail("fired"))
    injector.check(5, "forward")
    assert injector.slow_factor == 2.0 and injector.stretch(0.25) == 0.25 and slept == [0.25]


def test_straggler_config_errors_name_the_field():
    from ntp_ds.engine.config import ConfigError
    from ntp_ds.run.config import RunConfig

    for straggler, message in [({"threshold": 1.5}, r"parallel\.straggler\.threshold=1\.5 must be a fraction"),
                               ({"every_steps": 0}, r"parallel\.straggler\.every_steps=0 must be a positive"),
                               ({"often": 1}, r"parallel\.straggler\.often is not a known setting")]:
        with pytest.raises(ConfigError, match=message):
            RunConfig.from_dict({"parallel": {"straggler": straggler}}).validate()


# -- end to end: one replica slowed on purpose ---------------------------------------------------------------------
COMMON = ("recipe=cpu_demo", "parallel.timeout_s=20", "train.steps=9", "train.micro_batch=4", "data.seq_len=16",
          "logging=disabled", "logging.progress=false", "train.save_checkpoint=false")


@pytest.mark.parametrize("topology, slow_rank, slow_replica, base", [
    # 3 anchors at TP 1: one shared micro-batch count.
    (("parallel.tp=1", "parallel.replicas=3", "train.global_batch=24"), 2, 2, [8, 8, 8]),
    # Replica 2 runs degraded at TP 1 as a contributor with its own count; launch rank 3 is in anchor replica 1.
    (("parallel.tp=2", "parallel.replicas=3", "parallel.degrees=[2,2,1]", "train.global_batch=30"), 3, 1, [13, 12, 5]),
], ids=["tp1x3", "tp2_tp2_tp1"])
def test_a_slowed_replica_gets_fewer_samples_and_the_weights_stay_the_failure_free_runs(
        tmp_path, topology, slow_rank, slow_replica, base):
    """Under preserve_global_batch one rank runs 4x slower from step 1. The planner moves samples away from its
    replica at a step boundary; the final weights equal the run without the fault or the re-plan."""
    from safetensors.torch import load_file

    from tests.test_cli import ntp_ds

    slowed, clean = tmp_path / "slowed", tmp_path / "clean"
    result = ntp_ds("train", *COMMON, *topology,
                    f"fault.faults=[{{rank:{slow_rank},step:1,phase:forward,kind:slow,factor:4}}]",
                    "parallel.straggler.enabled=true", "parallel.straggler.every_steps=3", f"hydra.run.dir={slowed}",
                    timeout=120)
    assert result.returncode == 0, result.stderr[-5000:]
    assert f"injecting slow (x4) on rank {slow_rank} at step 1, phase forward" in result.stderr
    events = [json.loads(line) for line in (slowed / "events.jsonl").read_text().splitlines()]
    replans = [e for e in events if e["event"] == "replan"]
    assert replans, f"no re-plan: {events}"
    first = replans[0]
    assert first["step"] == 3 and first["samples_before"] == base and sum(first["samples_after"]) == sum(base)
    assert first["samples_after"][slow_replica] < base[slow_replica]
    assert first["step_work_s"][slow_replica] == max(first["step_work_s"])
    assert first["predicted_step_s_after"] < first["predicted_step_s_before"]
    metrics = [json.loads(line) for line in (slowed / "metrics.jsonl").read_text().splitlines()]
    assert [[m[f"samples/replica_{r}"] for r in range(3)] for m in metrics][:3] == [base] * 3
    assert metrics[-1][f"samples/replica_{slow_replica}"] < base[slow_replica], "the slow replica ends with less"

    result = ntp_ds("train", *COMMON, *topology, "fault=none", f"hydra.run.dir={clean}", timeout=120)
    assert result.returncode == 0, result.stderr[-5000:]
    ours, reference = load_file(slowed / "final" / "model.safetensors"), load_file(clean / "final" / "model.safetensors")
    assert ours.keys() == reference.keys()
    for name, tensor in reference.items():
        diff = (ours[name] - tensor).abs().max().item()
        assert diff <= 1e-4, f"{name}: max abs difference {diff:.3g} > 1e-4"
