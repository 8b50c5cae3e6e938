"""Run a function on N local processes joined by gloo, with a hard time limit: a hang fails, never blocks."""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import queue
import socket
import time
import traceback


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _child(fn, rank, world_size, port, args, results):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_WORLD_SIZE=str(world_size), OMP_NUM_THREADS="1")
    if os.environ.get("NTP_TEST_DEVICE", "cpu") == "cpu":
        os.environ["DS_ACCELERATOR"] = "cpu"
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    try:
        import torch
        torch.set_num_threads(1)
        # Plain pickle bytes: torch's queue reducers share tensors through the child, which is about to exit.
        results.put((rank, "ok", pickle.dumps(fn(rank, world_size, *args))))
    except BaseException:  # report every failure to the parent, which owns the verdict
        results.put((rank, "error", traceback.format_exc()))


def run_ranks(fn, world_size: int, *args, timeout: float = 180.0) -> list:
    """Run `fn(rank, world_size, *args)` in `world_size` processes; return their results in rank order.

    `fn` must be importable (module level). Raises if any rank fails, or if all have not finished within `timeout`
    seconds, in which case every process is killed.
    """
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_child, args=(fn, r, world_size, port, args, results), daemon=True)
             for r in range(world_size)]
    for p in procs:
        p.start()
    out, deadline = {}, time.monotonic() + timeout
    try:
        while len(out) < world_size:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"ranks {sorted(set(range(world_size)) - set(out))} did not finish in {timeout}s")
            try:
                rank, status, value = results.get(timeout=min(left, 1.0))
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0) and r not in out]
                if dead:
                    raise RuntimeError(f"ranks {dead} exited with codes {[procs[r].exitcode for r in dead]}")
                continue
            if status == "error":
                raise RuntimeError(f"rank {rank} failed:\n{value}")
            out[rank] = pickle.loads(value)
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
    return [out[r] for r in range(world_size)]
