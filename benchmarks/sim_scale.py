"""Time the cluster-scale simulator on the paper's evaluation setting.

Runs ``ntp_ds.sim.run`` on ``recipe=paper_eval`` (32,768 GPUs in NVL32
domains, 30 simulated days, the full loss sweep, one seed) pinned to one
thread per process and prints ``sim_seconds=<median seconds>`` (target: under
2 s).  Then runs 100,000 GPUs (3,125 NVL32 domains, one 16K-token sequence
per replica) over 90 days with 16 seeds in ``--workers`` processes and prints
``sim_seconds_100k_16seeds=<seconds>`` last (target: under 60 s on two cores).

    python benchmarks/sim_scale.py [--repeat N] [--gpus N] [--days D] [--workers W]
                                   [--skip-100k] [overrides...]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(var, "1")

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ntp_ds.sim import run, run_seeds  # noqa: E402
from ntp_ds.sim.runspec import load_config  # noqa: E402


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--gpus", type=int, default=None, help="override cluster.num_gpus")
    ap.add_argument("--days", type=float, default=None, help="override duration_days")
    ap.add_argument("--workers", type=int, default=2, help="processes for the 16-seed run")
    ap.add_argument("--skip-100k", action="store_true", help="time only the 32K-GPU run")
    ap.add_argument("overrides", nargs="*", help="extra KEY=VALUE overrides")
    args = ap.parse_args(argv)
    over = ["recipe=paper_eval"] + list(args.overrides)
    if args.gpus is not None:
        over.append(f"sim.cluster.num_gpus={args.gpus}")
    if args.days is not None:
        over.append(f"sim.duration_days={args.days}")
    cfg, _ = load_config(over)
    times = []
    for _ in range(max(1, args.repeat)):
        start = time.perf_counter()
        result = run(cfg)
        times.append(time.perf_counter() - start)
    f = result.failures
    print(f"{result.layout}; {cfg.duration_days:g} days; {f.events} failure events; "
          f"{len(result.loss_vs_failures)} sweep points")
    print("runs: " + ", ".join(f"{t:.3f}s" for t in times))
    print(f"sim_seconds={statistics.median(times):.3f}")
    if args.skip_100k:
        return 0
    big, _ = load_config(["recipe=paper_eval", "sim.cluster.num_gpus=100000",
                          "sim.duration_days=90", "sim.model.tokens_per_batch=51200000"]
                         + list(args.overrides))
    start = time.perf_counter()
    ens = run_seeds(big, seeds=16, workers=args.workers, progress=False)
    seconds = time.perf_counter() - start
    ev = ens.failure("events")
    good = ens.outcome("ntp_pw", "goodput")
    print(f"{ens.first.layout}; 90 days; 16 seeds in {args.workers} processes; "
          f"{ev[0]:.0f} failure events per seed (median); NTP-PW goodput "
          f"{good[0] * 100:.2f}% [{good[1] * 100:.2f}, {good[2] * 100:.2f}]")
    print(f"sim_seconds_100k_16seeds={seconds:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
