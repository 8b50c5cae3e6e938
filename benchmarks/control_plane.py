"""Load the control plane's store with thousands of simulated workers and print its operation rate and verdicts.

Each size runs `ntp_ds.testing.liveness_load.run_load`: the workers of `--nodes` simulated nodes beat and watch
their peers through the real heartbeat code, each node's launcher publishes its node key, one worker hangs, its peers
report it and every other worker waits for the decision and confirms it through the real membership code. One line
per size, e.g.

    workers=4096 nodes=512 per_node=True store_ops_per_s=16130 peak_ops_per_s=29003 false_deaths=0 ...

Exit status 1 when a healthy worker was declared dead, a peer missed the hung one, or not every survivor decided and
confirmed within the run.

`--per-rank` runs the same job with watchers reading one key per peer, as they do without a launcher. The harness
runs in `--processes` processes beside the store's (each share of the nodes beats on one thread and watches on
another): when `worst_beat_lag_s` or `worst_watch_lag_s` grows, the harness, not the store, has run out of CPU;
`starved=` counts healthy workers whose beats the harness itself sent more than the timeout apart (rightly found
silent, so not counted as false deaths).

    python benchmarks/control_plane.py [--nodes 512 1024] [--workers-per-node 8] [--interval-s 1.0]
                                       [--timeout-s 3] [--duration-s 40] [--threads 4] [--processes 2] [--per-rank]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ntp_ds.testing.liveness_load import LoadSpec, run_load  # noqa: E402


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, nargs="+", default=[512])
    parser.add_argument("--workers-per-node", type=int, default=8)
    parser.add_argument("--interval-s", type=float, default=1.0)
    parser.add_argument("--timeout-s", type=float, default=3.0)
    parser.add_argument("--duration-s", type=float, default=40.0)
    parser.add_argument("--threads", type=int, default=4, help="shares of the nodes, each with two threads")
    parser.add_argument("--processes", type=int, default=2, help="processes the shares are spread over")
    parser.add_argument("--per-rank", action="store_true", help="watchers read one key per peer")
    args = parser.parse_args(argv)
    failed = False
    for nodes in args.nodes:
        result = run_load(LoadSpec(nodes, args.workers_per_node, args.interval_s, args.timeout_s, args.duration_s,
                                   args.threads, args.processes, per_node=not args.per_rank))
        print(result.line(), flush=True)
        failed |= (result.false_deaths > 0 or result.hung_found_by < result.hung_watchers
                   or len(result.decisions) != 1 or result.decided != result.spec.world_size - 1
                   or result.confirmed != result.spec.world_size - 1)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
