"""Straggler-aware batch planning: the pure re-plan (balance, hysteresis, lockstep) and, end to end, a run with one
replica slowed on purpose whose plan moves samples away from it while its weights stay the failure-free run's."""

import itertools
import json
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ntp_ds.batch import plan_batch
from ntp_ds.batch.straggler import (StepCost, fit_costs, predict_step_s, rebalance, replica_micro_times,
                                    replica_step_times, summarise_micro_batches)


def _costs(per_sample):
    """Costs of replicas with no fixed cost per micro-batch: a time per sample each."""
    return [StepCost(0.0, c) for c in per_sample]


# -- pure planning -------------------------------------------------------------------------------------------------
def _best_by_enumeration(costs, total, micro, lockstep):
    """The least slowest-replica work over every split of `total` (each replica at least 1), the lockstep replicas
    sharing the count their largest share needs, and at least that many samples each."""
    best = math.inf
    for cut in itertools.combinations(range(1, total), len(costs) - 1):
        samples = [b - a for a, b in zip((0, *cut), (*cut, total))]
        counts = [math.ceil(n / micro) for n in samples]
        shared = max((counts[a] for a in lockstep), default=0)
        if any(samples[a] < shared for a in lockstep):
            continue
        for a in lockstep:
            counts[a] = shared
        best = min(best, max(c.step_s(m, n) for c, m, n in zip(costs, counts, samples)))
    return best


@settings(max_examples=150, deadline=None)
@given(st.integers(2, 3), st.integers(1, 5), st.integers(1, 4), st.data())
def test_the_replan_is_the_least_slowest_replica_over_every_split(replicas, share, micro, data):
    """Against enumeration of every split: the re-plan's predicted step is the least there is, counting each
    micro-batch's fixed cost and the lockstep replicas' shared count; when no re-plan comes back, the current plan is
    it."""
    lockstep = tuple(sorted(data.draw(st.sets(st.integers(0, replicas - 1)))))
    costs = [StepCost(data.draw(st.floats(0.0, 0.05)), data.draw(st.floats(0.001, 0.1))) for _ in range(replicas)]
    plan = plan_batch((1.0,) * replicas, share * replicas, micro, "preserve_global_batch", lockstep=lockstep)
    best = _best_by_enumeration(costs, share * replicas, micro, lockstep)
    replan = rebalance(plan, costs, micro, lockstep, threshold=0.0)
    if replan is None:
        assert predict_step_s(plan, costs) <= best * (1 + 1e-9)
    else:
        assert replan.after_s == pytest.approx(best, rel=1e-9)
        assert predict_step_s(replan.plan, costs) == replan.after_s


def test_a_slow_replica_gives_samples_to_its_peers_and_lockstep_replicas_keep_one_micro_batch_count():
    plan = plan_batch((1.0,) * 3, 24, 4, "preserve_global_batch", lockstep=(0, 1, 2))
    replan = rebalance(plan, _costs([0.01, 0.01, 0.015]), micro_batch=4, lockstep=(0, 1, 2))
    samples = [p.samples for p in replan.plan.replicas]
    assert sum(samples) == 24 and samples[2] < 8 < min(samples[0], samples[1])
    assert len({p.micro_steps for p in replan.plan.replicas}) == 1
    assert max(s for p in replan.plan.replicas for s in p.micro_sizes) <= 4
    assert [p.offset for p in replan.plan.replicas] == [0, samples[0], samples[0] + samples[1]]
    assert replan.after_s < 0.95 * replan.before_s and replan.before_s == pytest.approx(0.12)


def test_a_move_that_the_shared_micro_batch_count_eats_is_not_taken():
    """150 ms fixed per micro-batch, 30 ms per sample, one anchor 1.5x slower: 8 samples each fill 2 micro-batches of
    4, so any move adds a third micro-batch to every anchor, and none shortens the step (0.81 s). A time-per-sample
    view (67.5 and 101 ms per sample) would move to (9, 9, 6) and make the step 0.945 s."""
    plan = plan_batch((1.0,) * 3, 24, 4, "preserve_global_batch", lockstep=(0, 1, 2))
    costs = [StepCost(0.15, 0.03), StepCost(0.15, 0.03), StepCost(0.225, 0.045)]
    assert predict_step_s(plan, costs) == pytest.approx(0.81)
    assert rebalance(plan, costs, 4, (0, 1, 2), threshold=0.0) is None
    per_sample = rebalance(plan, _costs([0.0675, 0.0675, 0.10125]), 4, (0, 1, 2))
    assert [p.samples for p in per_sample.plan.replicas] == [9, 9, 6]
    assert predict_step_s(per_sample.plan, costs) == pytest.approx(0.945)
    # With a small fixed cost (7 ms against 19 ms per sample) the third micro-batch pays: (9, 9, 6).
    fast, slow = StepCost(0.007, 0.019), StepCost(0.0105, 0.0285)
    replan = rebalance(plan, [fast, fast, slow], 4, (0, 1, 2))
    assert [p.samples for p in replan.plan.replicas] == [9, 9, 6]
    assert [p.micro_steps for p in replan.plan.replicas] == [3, 3, 3]
    assert replan.before_s / replan.after_s == pytest.approx(0.249 / 0.2025)


def test_without_lockstep_the_slow_replica_sheds_micro_batches_with_its_samples():
    """The costs of the test above under ZeRO 0 or 1 (no lockstep): the slow replica's 6 samples take 2
    micro-batches while its peers' 9 take 3, and the step falls from 0.81 to 0.72 s."""
    plan = plan_batch((1.0,) * 3, 24, 4, "preserve_global_batch")
    costs = [StepCost(0.15, 0.03), StepCost(0.15, 0.03), StepCost(0.225, 0.045)]
    replan = rebalance(plan, costs, 4, threshold=0.0)
    assert [p.samples for p in replan.plan.replicas] == [9, 9, 6]
    assert [p.micro_steps for p in replan.plan.replicas] == [3, 3, 2]
    assert replan.before_s == pytest.approx(0.81) and replan.after_s == pytest.approx(0.72)


@given(st.integers(2, 5), st.integers(1, 12), st.integers(1, 4), st.data())
def test_every_replan_is_a_valid_plan_of_the_same_global_batch(replicas, share, micro, data):
    lockstep = tuple(sorted(data.draw(st.sets(st.integers(0, replicas - 1), min_size=1))))
    costs = [StepCost(data.draw(st.floats(0.0, 0.1)), data.draw(st.floats(0.001, 1.0))) for _ in range(replicas)]
    plan = plan_batch((1.0,) * replicas, share * replicas, micro, "preserve_global_batch", lockstep=lockstep)
    replan = rebalance(plan, costs, micro, lockstep, threshold=0.0)
    if replan is None:
        return
    parts = replan.plan.replicas
    assert replan.plan.global_samples == plan.global_samples and replan.after_s < replan.before_s
    assert len({parts[a].micro_steps for a in lockstep}) == 1
    assert all(1 <= size <= micro for p in parts for size in p.micro_sizes)
    assert [p.offset for p in parts] == [sum(q.samples for q in parts[:r]) for r in range(replicas)]


def test_a_plan_the_lockstep_replicas_shared_count_cannot_hold_is_not_taken():
    plan = plan_batch((1.0, 1.0), 4, 1, "preserve_global_batch", lockstep=(0, 1))
    assert [p.micro_sizes for p in plan.replicas] == [(1, 1), (1, 1)]
    assert rebalance(plan, _costs([0.01, 0.1]), micro_batch=1, lockstep=(0, 1)) is None


def test_replicas_outside_lockstep_get_their_own_micro_batch_count():
    plan = plan_batch((1.0, 1.0, 2.0), 21, 2, "preserve_global_batch", lockstep=(0, 1))
    replan = rebalance(plan, _costs([0.01, 0.03, 0.02]), micro_batch=2, lockstep=(0, 1))
    parts = replan.plan.replicas
    assert parts[0].micro_steps == parts[1].micro_steps and parts[1].samples >= parts[1].micro_steps
    assert parts[2].micro_steps == math.ceil(parts[2].samples / 2)


@settings(max_examples=200)
@given(st.integers(2, 6), st.integers(1, 8), st.lists(st.floats(-1.0, 1.0), min_size=6, max_size=6),
       st.floats(0.02, 0.2), st.floats(0.0, 2.0))
def test_no_flapping_under_noisy_equal_times(replicas, share, noise, threshold, ratio):
    """Equal replicas measured with noise well inside the threshold keep their plan."""
    plan = plan_batch((1.0,) * replicas, share * replicas, 2, "preserve_global_batch",
                      lockstep=tuple(range(replicas)))
    speeds = [0.01 * (1 + threshold / 4 * noise[r]) for r in range(replicas)]
    costs = [StepCost(ratio * k, k) for k in speeds]
    assert rebalance(plan, costs, 2, tuple(range(replicas)), threshold=threshold) is None


@given(st.lists(st.tuples(st.floats(0.0, 0.02), st.floats(0.005, 0.05)), min_size=2, max_size=5),
       st.integers(2, 10), st.floats(0.0, 0.2))
def test_a_replan_is_stable_once_the_times_are_what_it_predicted(costs, share, threshold):
    """Measured again under the new plan with unchanged speeds, the plan stays: no second move back and forth."""
    costs = [StepCost(*c) for c in costs]
    n = len(costs)
    plan = plan_batch((1.0,) * n, share * n, 3, "preserve_global_batch")
    replan = rebalance(plan, costs, 3, threshold=threshold)
    if replan is not None:
        assert replan.plan.global_samples == plan.global_samples
        assert rebalance(replan.plan, costs, 3, threshold=threshold) is None


def test_replica_step_times_take_the_median_of_each_rank_and_the_slowest_rank():
    windows = [(0, [0.5, 0.1, 0.1]), (0, [0.2, 0.2, 0.3]), (1, [0.1, 0.12, 0.11])]
    assert replica_step_times(windows, 2) == (0.2, 0.11)


# -- fitting the costs -------------------------------------------------------------------------------------------
def _window(costs, sizes, noise=()):
    """One window's micro-batch times per replica: each replica runs micro-batches of `sizes[r]`."""
    out = []
    for r, (cost, run) in enumerate(zip(costs, sizes)):
        extra = noise[r] if r < len(noise) else 1.0
        out.append(summarise_micro_batches([(s, extra * (cost.fixed_s + cost.per_sample_s * s)) for s in run]))
    return out


def test_micro_batch_times_are_summarised_per_size_and_per_replica_by_the_slowest_rank():
    summary = summarise_micro_batches([(4, 0.10), (3, 0.08), (4, 0.14), (4, 0.11)])
    assert summary == {3: (1, 0.08), 4: (3, 0.11)}
    times = replica_micro_times([(0, summary), (0, {4: (3, 0.12)}), (1, {2: (2, 0.05)})], 2)
    assert times == [{3: (1, 0.08), 4: (3, 0.12)}, {2: (2, 0.05)}]


@given(st.floats(0.0, 0.05), st.floats(0.005, 0.05), st.floats(1.0, 3.0))
def test_the_fit_recovers_fixed_and_per_sample_costs_from_two_sizes(fixed, per_sample, slow):
    """Replicas of one degree share the ratio of fixed to per-sample cost and differ by a speed: one window at
    micro-batches of 4, one at 3 and 3 and 2 (a re-plan), are enough to tell the two costs apart."""
    truth = [StepCost(fixed, per_sample), StepCost(fixed, per_sample), StepCost(slow * fixed, slow * per_sample)]
    history = [_window(truth, [[4, 4]] * 3), _window(truth, [[3, 3, 3], [3, 3, 3], [2, 2, 2]])]
    for got, want in zip(fit_costs(history, (1, 1, 1)), truth):
        # The ratio is searched on a grid of 1/50 of a sample's cost at these sizes: the fixed cost to within that.
        assert got.per_sample_s == pytest.approx(want.per_sample_s, rel=0.02, abs=1e-4)
        assert got.fixed_s == pytest.approx(want.fixed_s, abs=0.02 * want.per_sample_s + 1e-6)
        for count, samples in [(2, 8), (3, 6), (5, 20)]:
            assert got.step_s(count, samples) == pytest.approx(want.step_s(count, samples), rel=0.02)


def test_one_size_only_gives_a_time_per_sample_and_a_replica_without_times_its_degree_s_median():
    truth = [StepCost(0.05, 0.03), StepCost(0.05, 0.03), StepCost(0.075, 0.045)]
    costs = fit_costs([_window(truth, [[4, 4]] * 3)], (1, 1, 1))
    assert [c.fixed_s for c in costs] == [0.0] * 3
    assert [c.per_sample_s for c in costs] == pytest.approx([0.0425, 0.0425, 0.06375])
    history = [_window(truth, [[4, 4], [3, 3], [2]]), _window(truth, [[3, 3], [3], [2]])]
    history[1][2] = {}
    costs = fit_costs(history, (2, 2, 1))
    # Replica 0 (TP 2) ran two sizes: the ratio of its degree is fitted, and holds for replica 1 (TP 2, one size);
    # replica 2, alone at TP 1 and at one size, gets a time per sample.
    assert costs[0].fixed_s == pytest.approx(0.05, rel=0.05) and costs[1].fixed_s == pytest.approx(0.05, rel=0.05)
    assert costs[2].fixed_s == 0.0 and costs[2].per_sample_s == pytest.approx(0.075 / 2 + 0.045)
    with pytest.raises(ValueError, match="every window of history must hold 3 replicas"):
        fit_costs([[{}, {}]], (1, 1, 1))


def test_one_noisy_window_does_not_move_the_speeds():
    truth = [StepCost(0.01, 0.02)] * 3
    sizes = [[4, 4], [3, 3, 3], [4, 4]]
    quiet = fit_costs([_window(truth, sizes), _window(truth, sizes), _window(truth, sizes)], (1, 1, 1))
    noisy = fit_costs([_window(truth, sizes), _window(truth, sizes, noise=(1.0, 3.0, 1.0)), _window(truth, sizes)],
                      (1, 1, 1))
    assert noisy[1].per_sample_s == pytest.approx(quiet[1].per_sample_s, rel=0.02)


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
# This tiny model at 16 tokens spends most of a micro-batch on fixed costs (about 2.8 ms against 0.4 ms per sample,
# fitted). Under ZeRO 2 the anchors share one micro-batch count, so with micro-batches of 4 a move that adds a
# micro-batch to every anchor costs more than it saves, and the planner rightly moves back once it has seen two sizes:
# there, micro-batches of up to 16 hold every replica's share in one, whatever the split. Under ZeRO 1 each replica
# runs its own count, and the slowed one sheds micro-batches with its samples.
COMMON = ("recipe=cpu_demo", "parallel.timeout_s=20", "train.steps=9", "data.seq_len=16", "logging=disabled",
          "logging.progress=false", "train.save_checkpoint=false")


@pytest.mark.long
@pytest.mark.parametrize("topology, slow_rank, slow_replica, base", [
    # 3 anchors at TP 1 under ZeRO 2: one shared micro-batch count.
    (("parallel.tp=1", "parallel.replicas=3", "train.global_batch=24", "parallel.zero_stage=2",
      "train.micro_batch=16"), 2, 2, [8, 8, 8]),
    # 3 anchors at TP 1 under ZeRO 1: each its own count, 2 micro-batches of 4 at launch.
    (("parallel.tp=1", "parallel.replicas=3", "train.global_batch=24", "parallel.zero_stage=1",
      "train.micro_batch=4"), 2, 2, [8, 8, 8]),
    # Replica 2 runs degraded at TP 1 as a contributor with its own count; launch rank 3 is in anchor replica 1.
    (("parallel.tp=2", "parallel.replicas=3", "parallel.degrees=[2,2,1]", "train.global_batch=30",
      "train.micro_batch=16"), 3, 1, [12, 12, 6]),
], ids=["tp1x3_zero2", "tp1x3_zero1_micro4", "tp2_tp2_tp1"])
def test_a_slowed_replica_gets_fewer_samples_and_the_weights_stay_the_failure_free_runs(
        tmp_path, topology, slow_rank, slow_replica, base):
    """Under preserve_global_batch one rank runs 4x slower from step 1. The planner moves samples away from its
    replica at a step boundary; the final weights equal the run without the fault or the re-plan."""
    from tests.helpers.cli import ntp_ds
    from tests.helpers.training import final_weights

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
    if "train.micro_batch=4" in topology:  # each replica its own count: the slowed one runs fewer micro-batches
        last = replans[-1]
        assert last["micro_batches_after"][slow_replica] < max(last["micro_batches_after"]), replans

    result = ntp_ds("train", *COMMON, *topology, "fault=none", f"hydra.run.dir={clean}", timeout=120)
    assert result.returncode == 0, result.stderr[-5000:]
    ours, reference = final_weights(slowed), final_weights(clean)
    assert ours.keys() == reference.keys()
    for name, tensor in reference.items():
        diff = (ours[name] - tensor).abs().max().item()
        assert diff <= 1e-4, f"{name}: max abs difference {diff:.3g} > 1e-4"
