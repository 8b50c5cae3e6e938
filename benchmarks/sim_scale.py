"""Time the cluster-scale simulator on the paper's evaluation setting.

Runs ``ntp_ds.sim.run`` on ``recipe=paper_eval`` (32,768 GPUs in NVL32
domains, 30 simulated days, the full loss sweep) pinned to one thread, and
prints ``sim_seconds=<median seconds>`` as its last line.  The target is
well under 10 s on one core.

    python benchmarks/sim_scale.py [--repeat N] [--gpus N] [--days D] [overrides...]
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

from ntp_ds.sim import run  # noqa: E402
from ntp_ds.sim.cli import load_config  # noqa: E402


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--gpus", type=int, default=None, help="override cluster.num_gpus")
    ap.add_argument("--days", type=float, default=None, help="override duration_days")
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
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
