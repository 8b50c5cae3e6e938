"""A join's cost to the replicas that lost nothing: how long they stand at the boundary where a replacement comes in.

2 replicas x TP 2, a 17M-parameter Llama; rank 3 crashes in step K, its replacement trains from step J
(`tests.helpers.join_cost` says what is measured and how). The last line reads `join_stall_s=<longest stall of a
rank of replica 0> step_s=<its median step> join_stall_ratio=<stall / step> grow_s=<the members' grow, from the
event> joiner_start_s=<the joiner's start() to its engine, waiting for the boundary included>`: the target is a ratio
of at most 1 (the join costs the others at most one step).

    python benchmarks/join.py [--fail-step 3] [--join-step 6] [--steps 9]
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.helpers.join_cost import CRASH_RANK, measure, parse_args  # noqa: E402


def main(argv=None) -> int:
    args = parse_args(argv, __doc__.split("\n\n")[0])
    print(f"2 replicas x TP 2, hidden {args.hidden}, {args.layers} layers; rank {CRASH_RANK} crashes in step "
          f"{args.fail_step}, its replacement trains from step {args.join_step}", flush=True)
    m = measure(args)
    if not m["joined"]:
        raise SystemExit("the replacement was not taken in")
    print(f"replica 0 at the join's boundary: {m['stall_s'] + m['boundary_s']:.2f} s (a usual boundary "
          f"{m['boundary_s']:.3f} s); a step {m['step_s']:.2f} s; the members' grow {m['grow_s']:.2f} s; the "
          f"joiner's start to its engine {m['joiner_start_s']:.2f} s", flush=True)
    print(f"join_stall_s={m['stall_s']:.2f} step_s={m['step_s']:.2f} join_stall_ratio={m['stall_s'] / m['step_s']:.2f}"
          f" grow_s={m['grow_s']:.2f} joiner_start_s={m['joiner_start_s']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
