"""Start-up time of `ntp-ds train recipe=cpu_demo`: from the command's start to the end of its first step.

Runs the demo recipe (`fault=none`, a few steps: what comes after the first step does not matter here) with the
workers forked from a launcher that imported torch, DeepSpeed and ntp_ds once (`launcher.fork=true`, the default)
and with each worker a fresh interpreter that imports them itself (`launcher.fork=false`), alternating the two so
that a machine shared with other jobs weighs on both alike. The first step's end is the wall time of the first
record in metrics.jsonl; the workers' own figure (`startup_s` in summary.json: from a worker's start to its
trainer being ready) is printed beside it. The last line reads
`startup_s=<median, forked workers> fresh_interpreters_s=<median> speedup=<ratio>`.

    python benchmarks/startup.py --repeats 3
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def time_to_first_step(run_dir: Path, fork: bool, steps: int, timeout_s: float) -> tuple[float, float]:
    """Run the demo once; return (seconds from the command's start to the end of step 1, the workers' startup_s)."""
    command = [sys.executable, "-m", "ntp_ds.cli", "train", "recipe=cpu_demo", "fault=none", f"train.steps={steps}",
               "logging.progress=false", "logging.wandb.mode=offline", f"launcher.fork={str(fork).lower()}",
               f"hydra.run.dir={run_dir}"]
    started = time.time()
    result = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s)
    if result.returncode != 0:
        raise SystemExit(f"startup: the demo failed (exit {result.returncode}):\n{result.stderr[-3000:]}")
    with open(run_dir / "metrics.jsonl") as f:
        first = json.loads(f.readline())
    summary = json.loads((run_dir / "summary.json").read_text())
    return first["time"] - started, summary["startup_s"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=2, help="runs of each way (default: 2)")
    parser.add_argument("--steps", type=int, default=3, help="train.steps of each run (default: 3)")
    parser.add_argument("--timeout-s", type=float, default=300.0, help="limit on one run (default: 300)")
    args = parser.parse_args(argv)
    figures: dict[bool, list[float]] = {True: [], False: []}
    root = Path(tempfile.mkdtemp(prefix="ntp_startup_"))
    try:
        for i in range(args.repeats):
            for fork in (True, False):
                run_dir = root / f"{'forked' if fork else 'fresh'}{i}"
                total, worker = time_to_first_step(run_dir, fork, args.steps, args.timeout_s)
                figures[fork].append(total)
                print(f"run {i + 1} {'forked workers    ' if fork else 'fresh interpreters'}: first step "
                      f"{total:.2f} s after the command started (workers' startup_s {worker:.2f})", flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    forked, fresh = statistics.median(figures[True]), statistics.median(figures[False])
    print(f"startup_s={forked:.2f} fresh_interpreters_s={fresh:.2f} speedup={fresh / forked:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
