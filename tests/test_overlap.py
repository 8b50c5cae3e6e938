"""The contributor's gradients stream into its anchor's backward: the anchor never waits for the contributor's
backward to end before its own starts, and the result still equals the failure-free reference."""

import time

from ntp_ds.batch.loader import GlobalBatchSampler, replica_micro_batches
from ntp_ds.testing.spawn import run_ranks
from tests.helpers.reference import assert_matches_reference, reference_init
from tests.helpers.training import dataset, deepspeed_config, full_model, host_shards, tiny_config, train_reference

STEPS, SLOW_S = 3, 0.4


def _timed_run(rank, world_size, ntp):
    import ntp_ds

    config = tiny_config()
    engine = ntp_ds.initialize(model=full_model(config), config=deepspeed_config("sgd", 1, 12, 2), ntp=ntp)
    model = engine.module
    started = []
    if engine.is_anchor:
        # The last module of the forward is the first of the backward: its pre-hook marks the backward's start.
        model.lm_head.register_full_backward_pre_hook(lambda m, g: started.append(time.time()))
    else:
        # Slow the contributor in its first layer, near the end of its backward.
        model.model.layers[0].register_full_backward_pre_hook(lambda m, g: time.sleep(SLOW_S))
    data, sampler = dataset(config), GlobalBatchSampler(256, seed=1)
    boundary_start, boundary_end = [], []
    for step in range(STEPS):
        for batch in replica_micro_batches(data, sampler, engine.batch_plan, engine.ntp_groups.replica, step):
            loss = engine(batch)
            boundary = engine.is_gradient_accumulation_boundary()
            n = len(started)
            engine.backward(loss)
            if boundary:
                boundary_start.append(started[n] if engine.is_anchor else None)
                boundary_end.append(time.time())
            engine.step()
    engine.close()
    return {"replica": engine.ntp_groups.replica, "tp_rank": engine.ntp_groups.tp_rank,
            "layout": engine.ntp_groups.layout, "anchor": engine.is_anchor,
            "shards": host_shards(model),
            "full": engine.consolidated_state_dict(), "global_samples": engine.batch_plan.global_samples,
            "start": boundary_start, "end": boundary_end}


def test_anchor_backward_starts_before_the_slowed_contributor_ends():
    reference_init.clear()
    reference_init.update({n: p.detach().clone() for n, p in full_model(tiny_config()).named_parameters()})
    ntp = {"tp": 3, "replicas": 2, "degrees": (3, 2), "bucket_size": 2000}
    results = run_ranks(_timed_run, 5, ntp, timeout=240)
    anchors = [r for r in results if r["anchor"]]
    contributors = [r for r in results if not r["anchor"]]
    for step in range(STEPS):
        contributor_end = min(r["end"][step] for r in contributors)
        for r in anchors:
            lead = contributor_end - r["start"][step]
            # The contributor sleeps SLOW_S in each micro-batch's backward; its last backward ends at least that
            # long after it began, while the anchor's starts without waiting for it.
            assert lead > SLOW_S / 2, f"step {step}: anchor backward began only {lead:.3f} s before the contributor's end"
    assert_matches_reference(results, train_reference("sgd", results[0]["global_samples"], STEPS), "sgd")
