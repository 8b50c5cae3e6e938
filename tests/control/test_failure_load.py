"""The every-rank harness (`ntp_ds.testing.failure_load`, which `benchmarks/scale.py` runs at 1,024 and 4,096 ranks)
at its smallest job: 96 ranks (12 nodes of 8, racks of 4 nodes), one rack lost. Every survivor's control plane must
get through the detection, the agreement and the new generation's barriers (in as many attempts as it takes), and no
value a rank reads may be larger than about a kilobyte per dead rank (the decision's reasons): nothing it reads grows
with the world."""

import pytest

from ntp_ds.testing.failure_load import FailureSpec, run_failure


@pytest.mark.long
def test_every_rank_of_a_job_gets_through_a_rack_lost_whole():
    spec = FailureSpec(96, "rack", processes=2, timeout_s=60.0)
    r = run_failure(spec)
    assert r.errors == [] and r.through == r.survivors == 96 - 32, r.errors[:3]
    assert r.failure_req > 0 and r.steady_req_per_s > 0 and r.server_busy_s > 0
    assert r.largest_value < 1024 * len(spec.victims()), r.largest_value
    assert r.bootstrapped_groups > 0 and r.bootstrapped_members <= 96 - 32


@pytest.mark.long
def test_every_survivor_gets_through_deaths_that_keep_coming():
    # Six of 96 ranks die at random within 8 s (the `one_percent` scenario, denser): deaths land during the
    # recoveries of the ones before. Every survivor gets through to a generation without any of them, each recovery
    # in fewer attempts than the harness's bound (one more per death), and the generations a decision took were
    # built on the survivors' own watched peers.
    spec = FailureSpec(96, "one_percent", processes=2, timeout_s=60.0, deaths=6, spread_s=8.0, seed=3)
    r = run_failure(spec)
    assert r.errors == [] and r.through == r.survivors == 90, r.errors[:3]
    assert 1 <= r.generations <= 6 and r.attempts < spec.max_attempts, (r.generations, r.attempts)
    assert r.recoveries >= 1 and r.done_s is not None
    assert r.largest_value < 1024 * len(spec.victims()), (r.largest_value, r.largest_call)


def test_the_harness_keeps_how_long_its_own_loop_held_back_each_rank_s_beats_and_its_node_s_key():
    # A rank's beats sent 0.5 s apart but its node's key held back 3.5 s: silent past a 3 s timeout because of the
    # harness; its node-mate likewise; a rank of another node whose beats and key kept time is not.
    from types import SimpleNamespace

    from ntp_ds.testing.failure_load import _Share

    share = SimpleNamespace(held={}, _last_sent={}, spec=SimpleNamespace(tp=8))
    for t in (0.0, 0.5, 1.0, 1.5):
        for rank in (9, 10, 17):
            _Share._sent(share, rank, t)
    for t, node in ((0.0, 1), (1.0, 1), (4.5, 1), (0.0, 2), (1.0, 2), (2.0, 2)):
        _Share._sent(share, -1 - node, t)
    held = {r: _Share.held_back_s(share, r) for r in (9, 10, 17)}
    assert held == {9: 3.5, 10: 3.5, 17: 1.0}
