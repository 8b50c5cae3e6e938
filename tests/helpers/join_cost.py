"""A join's cost to the replicas that lost nothing, measured on a real job (`benchmarks/join.py` prints it, and
`tests/test_join_stall.py` bounds it).

The job: 2 replicas x TP 2 (4 processes, gloo on CPU or NCCL on GPUs), the recovery benchmark's tiny Llama (about 17M
parameters). Launch rank 3 SIGKILLs itself in the backward of step K; the survivors recover (replica 1 at TP 1); a
replacement worker (launch rank 4) asks to train from step J and is taken in at the boundary after step J - 1:
replica 1 grows back to TP 2 around it.

Measured per rank of replica 0 (the replica that lost nothing): the time its loop spends between the end of one step
and the start of the next (`train_steps` takes joiners in there), at the join's boundary and at every other boundary
of the same run but the failure's. The stall is the join's boundary less the median other boundary; the step is the
replica's median step after the join (at the original degrees, the topology before the crash).
"""


from __future__ import annotations

import argparse
import os
import statistics
import time

from ntp_ds.testing.bench import add_job_args, deepspeed_config, llama_config
from ntp_ds.testing.spawn import run_ranks

WORLD, CRASH_RANK, JOINER = 4, 3, 4


def worker(rank, world_size, args):
    """One rank of the job (a joiner when NTP_JOIN is set): its step start and end times and its events."""
    from ntp_ds.batch.loader import GlobalBatchSampler, SyntheticTokens, replica_micro_batches
    from ntp_ds.control.faults import FaultSchedule
    from ntp_ds.control.store import connect_from_env
    from ntp_ds.engine.config import NTPConfig
    from ntp_ds.envs import JOIN_ENV, JOIN_STEP_ENV
    from ntp_ds.fault_tolerant import start

    if os.environ.get(JOIN_ENV):
        os.environ[JOIN_STEP_ENV] = str(args.join_step)
    config = llama_config(args)
    ntp = NTPConfig.from_any({"tp": args.tp, "replicas": args.replicas, "timeout_s": args.timeout_s,
                              "fault_tolerance": {"heartbeat_timeout_s": args.heartbeat_timeout_s,
                                                  "hang_timeout_s": None, "join_timeout_s": args.timeout}})
    faults = [{"rank": CRASH_RANK, "step": args.fail_step, "phase": "backward", "kind": "crash"}]
    store = connect_from_env(args.timeout_s)
    started = time.time()
    engine = start(config, deepspeed_config(args), ntp, store, FaultSchedule.from_config(faults, world_size + 1),
                   seq_len=args.seq, stop_on_signals=False)
    ready = time.time()
    data = SyntheticTokens(config.vocab_size, args.seq, size=4096, seed=0)
    sampler = GlobalBatchSampler(len(data), seed=0)
    begun, done = {}, {}
    for step in engine.train_steps(args.steps):
        begun[step + 1] = time.time()  # (again after a recovery: the step's last start counts)
        try:
            for batch in replica_micro_batches(data, sampler, engine.batch_plan, engine.ntp_groups.replica, step):
                engine.backward(engine(batch))
                engine.step()
        except (RuntimeError, TimeoutError, ConnectionError) as error:
            engine.recover(error)
            continue
        done[step + 1] = time.time()
    out = {"begun": begun, "done": done, "events": engine.recovery.events, "replica": engine.ntp_groups.replica,
           "start_s": ready - started}
    engine.close()
    return out


def measure(args) -> dict:
    """Run the job; return the join's stall on replica 0, its step time and the grow's figures."""
    out = run_ranks(worker, WORLD, args, timeout=args.timeout, store=True, joiners=1)
    healthy = [r for r in (0, 1) if r in out]
    if len(healthy) != 2 or JOINER not in out:
        raise RuntimeError(f"ranks {sorted(out)} finished; expected replica 0's two ranks and the joiner")
    j = args.join_step
    stalls, others, steps = [], [], []
    for r in healthy:
        begun, done = out[r]["begun"], out[r]["done"]
        boundaries = {s: begun[s] - done[s - 1] for s in begun if s - 1 in done}
        stalls.append(boundaries[j])
        others += [b for s, b in boundaries.items() if s not in (j, args.fail_step, args.fail_step + 1)]
        steps += [done[s] - begun[s] for s in done if s > j]
    usual = statistics.median(others)
    grown = [e for e in out[0]["events"] if e.get("joined")]
    return {"stall_s": max(stalls) - usual, "boundary_s": usual, "step_s": statistics.median(steps),
            "grow_s": grown[0]["grow_s"] if grown else None, "joiner_start_s": out[JOINER]["start_s"],
            "joined": bool(grown)}


def parse_args(argv=None, description: str | None = None) -> argparse.Namespace:
    """The job's flags (`benchmarks/join.py`'s command line); `parse_args([])`: the defaults."""
    parser = argparse.ArgumentParser(description=description)
    add_job_args(parser, hidden=512, layers=5, heads=8, kv_heads=4, vocab=1024, seq=64, micro=2, accum=4)
    parser.set_defaults(tp=2, replicas=2)
    parser.add_argument("--steps", type=int, default=9)
    parser.add_argument("--fail-step", type=int, default=3, help="step in whose backward rank 3 crashes")
    parser.add_argument("--join-step", type=int, default=6, help="the first step the replacement trains")
    parser.add_argument("--timeout-s", type=float, default=20.0, help="bound on every wait for a peer")
    parser.add_argument("--heartbeat-timeout-s", type=float, default=3.0)
    parser.add_argument("--timeout", type=float, default=300.0, help="hard limit on the multi-process run")
    args = parser.parse_args(argv)
    if (args.tp, args.replicas) != (2, 2):
        parser.error("the job is 2 replicas x TP 2 (--tp 2 --replicas 2)")
    if not 1 < args.fail_step < args.join_step - 1 or args.join_step + 1 >= args.steps:
        parser.error(f"need 1 < --fail-step < --join-step - 1 and --join-step + 1 < --steps; got {args.fail_step}, "
                     f"{args.join_step}, {args.steps}")
    return args
