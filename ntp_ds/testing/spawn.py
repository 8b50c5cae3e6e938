"""Run a function on N local processes joined by gloo, with a hard time limit: a hang fails, never blocks.

With `store=True` the parent hosts the coordination store (as `ntp-ds launch` does), kills the children their
peers declared dead, marks every child that exits without a result as exited in it, and returns the results of the
ranks that finished (for failure tests). Tests and benchmarks share this spawner. Where the launcher would fork its
workers, ranks are forked from a server that imported the training stack once; `fresh=True` spawns them instead.
"""

from __future__ import annotations

import faulthandler
import multiprocessing as mp
import os
import pickle
import queue
import signal
import socket
import time
import traceback

from ntp_ds.envs import CUDA_VISIBLE_DEVICES, DS_ACCELERATOR, JOIN_ENV, STORE_ENV, TEST_DEVICE_ENV


def start_with_pipes(target, args_of: list[tuple], ready_s: float, what: str) -> tuple[list, list]:
    """Spawn one process per entry of `args_of`, each running `target(*args, conn)` with its end of a pipe, and wait
    (at most `ready_s` for all) until each has sent its first message, which says it is set up. Return the parent's
    ends and the processes (daemons: they die with this one)."""
    ctx = mp.get_context("spawn")
    pipes, procs = [], []
    for args in args_of:
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=target, args=(*args, child), daemon=True)
        proc.start()
        pipes.append(parent)
        procs.append(proc)
    bound = time.monotonic() + ready_s
    for conn in pipes:
        if not conn.poll(max(0.0, bound - time.monotonic())):
            raise TimeoutError(f"{what} did not set up within {ready_s:g} s")
        conn.recv()
    return pipes, procs


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _child(fn, rank, world_size, port, store_address, args, results, environ):
    os.environ.clear()  # the parent's environment now, as a spawned child would have it, not the fork server's
    os.environ.update(environ)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_WORLD_SIZE=str(world_size), OMP_NUM_THREADS="1")
    if rank >= world_size:  # a joiner: it asks the running job for a place instead of starting with it
        os.environ[JOIN_ENV] = "1"
    if store_address:
        os.environ[STORE_ENV] = store_address
    if os.environ.get(TEST_DEVICE_ENV, "cpu") == "cpu":
        os.environ[DS_ACCELERATOR] = "cpu"
        os.environ[CUDA_VISIBLE_DEVICES] = ""
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # the parent asks for every thread's stack at a timeout
    try:
        import torch

        from ntp_ds.testing import register_test_backend
        torch.set_num_threads(1)
        register_test_backend()
        # Plain pickle bytes: torch's queue reducers share tensors through the child, which is about to exit.
        results.put((rank, "ok", pickle.dumps(fn(rank, world_size, *args))))
    except SystemExit as e:
        results.put((rank, "exit", e.code))
    except BaseException:  # report every failure to the parent, which owns the verdict
        results.put((rank, "error", traceback.format_exc()))


def run_ranks(fn, world_size: int, *args, timeout: float = 180.0, store: bool = False,
              joiners: int = 0, fresh: bool = False) -> list | dict:
    """Run `fn(rank, world_size, *args)` in `world_size` processes, and in `joiners` more (ranks world_size and up,
    with `NTP_JOIN=1` in their environment) that join the running job through the store.

    Without `store`: return the results in rank order; raise if any rank fails. With `store`: return
    {rank: result} of the ranks that returned one; a rank that dies or exits is marked exited in the store and left
    out; a rank that raises still fails the run. Either way, all have to be done within `timeout` seconds, or every
    process is killed and TimeoutError raised. `fresh`: start fresh interpreters even where ranks may be forked
    (what a restarted job pays to start, for benchmarks that measure it).
    """
    ctx = mp.get_context("spawn") if fresh else _context()
    results = ctx.Queue()
    port = free_port()
    host, address = None, None
    if store:
        from ntp_ds.control.store import host_store

        host, address = host_store()
    if joiners and not store:
        raise ValueError("joiners need the coordination store (store=True)")
    total = world_size + joiners
    procs = [ctx.Process(target=_child, args=(fn, r, world_size, port, address, args, results, dict(os.environ)),
                         daemon=True)
             for r in range(total)]
    for p in procs:
        p.start()
    out, done, deadline = {}, set(), time.monotonic() + timeout
    try:
        while len(done) < total:
            left = deadline - time.monotonic()
            if left <= 0:
                _dump_stacks(procs, done)
                raise TimeoutError(f"ranks {sorted(set(range(total)) - done)} did not finish in {timeout}s")
            try:
                rank, status, value = results.get(timeout=min(left, 0.05))
            except queue.Empty:
                for r, p in enumerate(procs):
                    if r in done or p.exitcode is None:
                        continue
                    if not store and p.exitcode != 0:
                        raise RuntimeError(f"rank {r} exited with code {p.exitcode}")
                    if p.exitcode != 0:
                        from ntp_ds.control.liveness_store import record_exit

                        record_exit(host, r, f"exit code {p.exitcode}")
                        done.add(r)
                if store:
                    _fence(host, procs, done)
                if store and len(done) + _stopped(procs, done) >= total:
                    break
                continue
            done.add(rank)
            if status == "error":
                raise RuntimeError(f"rank {rank} failed:\n{value}")
            if status == "ok":
                out[rank] = pickle.loads(value)
    finally:
        for p in procs:
            if p.is_alive() and p.pid:
                try:
                    os.kill(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            p.join(timeout=5)
    if store:
        return out
    return [out[r] for r in range(world_size)]


def _dump_stacks(procs, done) -> None:
    """Have each rank still running write every thread's stack to its stderr (what a hang was waiting on), then give
    them a moment to write it before they are killed."""
    alive = [p for r, p in enumerate(procs) if r not in done and p.is_alive() and p.pid]
    for p in alive:
        try:
            os.kill(p.pid, signal.SIGUSR1)
        except ProcessLookupError:
            pass
    if alive:
        time.sleep(1.0)


def _context():
    """Where workers may be forked (the launcher's rule: Linux, no CUDA device), a fork server that has imported the
    training stack once, so that a child starts in milliseconds instead of importing torch and DeepSpeed again
    (about 3 s of CPU each); elsewhere, fresh interpreters."""
    from ntp_ds.supervise.forked import PRELOAD, can_fork

    if not can_fork():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(list(PRELOAD))
    return ctx


def _fence(store, procs, done) -> None:
    """Kill the children their peers declared dead, as `ntp-ds launch` does."""
    from ntp_ds.control.liveness_store import read_fences

    for r in read_fences(store):
        p = procs[r]
        if r not in done and p.is_alive() and p.pid:
            try:
                os.kill(p.pid, signal.SIGKILL)
            except ProcessLookupError:  # it ended meanwhile (a forked rank is reaped by the fork server, which
                pass  # tells `is_alive` only later)


def _stopped(procs, done) -> int:
    """Processes stopped by SIGSTOP (a hang injected on purpose) that have not finished."""
    count = 0
    for r, p in enumerate(procs):
        if r in done or p.pid is None:
            continue
        try:
            with open(f"/proc/{p.pid}/stat") as f:
                if f.read().split(")")[-1].split()[0] == "T":
                    count += 1
        except OSError:
            pass
    return count
