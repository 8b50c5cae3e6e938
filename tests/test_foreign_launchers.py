"""`ntp-ds train` under the `deepspeed` launcher trains through a crash and its repair: each worker runs behind a
sentinel (`ntp_ds.supervise.sentinel`), so the launcher never sees the death, and rank 0's store outlives rank 0's
worker.
Judged by final state: the weights equal those of the failure-free run. Marker `launchers` (CI's second stage)."""

import pytest

from ntp_ds.run.records import read_run
from tests.helpers.cli import ntp_ds, run
from tests.helpers.training import final_weights

pytestmark = pytest.mark.launchers

COMMON = ["recipe=cpu_demo", "logging=disabled", "train.save_checkpoint=false"]


@pytest.fixture(scope="module")
def failure_free(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("clean") / "run"
    result = ntp_ds("train", *COMMON, "fault=none", f"hydra.run.dir={run_dir}", timeout=280)
    assert result.returncode == 0, result.stderr[-4000:]
    return final_weights(run_dir)


@pytest.mark.parametrize("rank", [3, 0])
def test_deepspeed_launcher_trains_the_demo_through_a_crash_and_its_repair(tmp_path, failure_free, rank):
    run_dir = tmp_path / "run"
    faults = f"fault.faults=[{{rank:{rank},step:10,phase:backward,kind:crash}},{{rank:{rank},step:20,kind:repair}}]"
    result = run(["deepspeed", "--num_gpus", "4", "--module", "ntp_ds.train", *COMMON, faults,
                  f"hydra.run.dir={run_dir}"], timeout=280)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    out = result.stdout + result.stderr
    degraded = "[1, 2]" if rank == 0 else "[2, 1]"  # rank 0 is in replica 0, rank 3 in replica 1
    assert f"from the loss of rank {rank}; TP degrees [2, 2] -> {degraded}" in out, out[-4000:]
    assert f"joined after step 19: TP degrees {degraded} -> [2, 2]" in out, out[-4000:]
    _, events, summary = read_run(run_dir)
    kinds = [e["event"] for e in events]
    assert kinds.count("recovery") == 1 and kinds.count("join") == 1, kinds
    join = next(e for e in events if e["event"] == "join")
    assert join["step"] == 19 and join["degrees_after"] == [2, 2], join
    assert summary["last_step"] == 30 and summary["status"] == "finished", summary
    weights = final_weights(run_dir)
    assert set(weights) == set(failure_free)
    for name, tensor in failure_free.items():
        diff = (weights[name] - tensor).abs().max().item()
        assert diff <= 1e-4, f"{name}: max abs difference {diff:.3g} from the failure-free run"
