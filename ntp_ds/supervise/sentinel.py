"""A sentinel in front of each worker that a foreign launcher (`deepspeed`, `torchrun`) started.

Those launchers act on a worker's death: `deepspeed` kills every sibling when one exits non-zero, `torchrun` stops
(or restarts) them all. So under them the process the launcher started becomes a sentinel: it touches no device,
starts the training process again (the same command line, with `NTP_SENTINEL=child`), and supervises it as
`ntp-ds launch` supervises its workers (`ntp_ds.supervise.launch.launch`, one worker per "node"): it records the
worker's exit in the job's store, stops it when its peers declare it dead, starts a replacement that joins the job for a
`repair`, and passes SIGINT and SIGTERM on. Rank 0's sentinel hosts the job's store (at MASTER_PORT + 1), so
losing rank 0's worker loses neither the store nor the job. A sentinel exits only once the job is done, with status 0
when some rank finished the job, so the launcher never sees a failure it would act on. Only rank 0's sentinel judges
the job's end (every other rank finished, exited or gone silent) and publishes it (`JOB_OVER_KEY`); the others wait
for that one key, so a sentinel's wait costs the store one request per poll whatever the world size.

`NTP_SENTINEL=0` in the environment turns it off (the worker then trains in the launcher's process, and a crash
ends the job as the launcher decides).
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Mapping

from ntp_ds.control.keys import JOB_OVER_KEY, SENTINEL_DONE_KEY
from ntp_ds.envs import (LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT, RACK_SIZE_ENV, RANK, RUN_DIR_ENV,
                         SENTINEL_ENV, STORE_ENV, WORLD_SIZE)

OUTLIVE_TIMEOUT_S = 3.0
"""How long a peer may be silent before a sentinel waiting for the job's end counts it gone."""
POLL_S = 1.0
"""Pause between two checks of a sentinel waiting for the job's end."""
DONE_WAIT_S = 30.0
"""How long rank 0's sentinel keeps the store for the other sentinels after the job's end."""


def under_foreign_launcher(env: Mapping[str, str] = os.environ) -> bool:
    """Whether this process is a worker started by a launcher other than `ntp-ds launch` (no NTP_STORE), with the
    env:// rendezvous variables a sentinel needs, and no sentinel yet."""
    return (RANK in env and WORLD_SIZE in env and bool(env.get(MASTER_ADDR)) and bool(env.get(MASTER_PORT))
            and not env.get(STORE_ENV) and env.get(SENTINEL_ENV) not in ("0", "child"))


def become_sentinel(repairs: Mapping[int, int] | None = None, env: Mapping[str, str] = os.environ,
                    argv: list[str] | None = None) -> int:
    """Start this process's command line again as the worker and supervise it (see the module's docstring); return
    the sentinel's exit status once the job is done. `repairs`: launch rank -> step of the repairs scheduled at
    launch (repairs sent to the job's store are read too)."""
    from ntp_ds.supervise.launch import LaunchSpec, launch

    rank, world = int(env[RANK]), int(env[WORLD_SIZE])
    store = f"{env[MASTER_ADDR]}:{int(env[MASTER_PORT]) + 1}"
    local_world = env.get(LOCAL_WORLD_SIZE, "1")
    command = [sys.executable, *(sys.orig_argv[1:] if argv is None else argv)]
    spec = LaunchSpec(command, nproc_per_node=1, nnodes=world, node_rank=rank, store=store,
                      run_dir=env.get(RUN_DIR_ENV), repairs=dict(repairs or {}),
                      env={LOCAL_RANK: env.get(LOCAL_RANK, "0"), LOCAL_WORLD_SIZE: local_world,
                           SENTINEL_ENV: "child"},
                      rack_size=_rack_in_ranks(env, int(local_world)))
    return launch(spec, finish=lambda job_store, codes: _outlast(job_store, rank, world, codes))


def _rack_in_ranks(env, local_world: int) -> int | None:
    """A sentinel is the launcher of a node of one rank: the user's rack of `NTP_RACK_SIZE` real nodes is that
    many times the node's ranks of such nodes."""
    raw = env.get(RACK_SIZE_ENV)
    return int(raw) * local_world if raw and raw.isdigit() and int(raw) > 0 else None


def _outlast(store, rank: int, world: int, codes: dict[int, int], poll_s: float = POLL_S) -> int:
    """Wait for the job's end. Rank 0's sentinel, which hosts the store, judges it (every other launch rank finished,
    exited or silent), publishes it and waits (bounded) until the other sentinels are done with the store; the others
    wait for its verdict, bounded by the store's life (it ends with rank 0's sentinel, which ends once every worker
    has finished, exited or gone silent). Return 0 when some rank finished the job, else the status of this
    sentinel's first worker."""
    from ntp_ds.control.liveness_store import outlive_peers, read_exits
    from ntp_ds.supervise.launch import shell_status

    failed = {r: c for r, c in codes.items() if c != 0}
    try:
        if rank == 0:
            outlive_peers(store, rank, world, OUTLIVE_TIMEOUT_S)
            finished = any(reason == "finished" for reason in read_exits(store).values())
            store.set(JOB_OVER_KEY, "finished" if finished else "failed")
            deadline = time.monotonic() + DONE_WAIT_S
            while store.add(SENTINEL_DONE_KEY, 0) < world - 1 and time.monotonic() < deadline:
                time.sleep(0.1)
        else:
            while not store.check([JOB_OVER_KEY]):
                time.sleep(poll_s)
            finished = store.get(JOB_OVER_KEY) == b"finished"
            store.add(SENTINEL_DONE_KEY, 1)
    except Exception as e:  # the store went with rank 0's sentinel: judge by this rank's own worker
        print(f"ntp-ds sentinel: rank {rank}: the job's store is gone ({e})", file=sys.stderr, flush=True)
        finished = not failed
    return 0 if finished or not failed else shell_status(failed[min(failed)])
