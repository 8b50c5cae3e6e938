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
