"""Start `python -m ntp_ds.train` workers by forking a launcher that has imported the training code once.

Every worker needs torch, DeepSpeed, torch's compiler stack (a torch optimizer's constructor and DeepSpeed's
optimizer check import it) and ntp_ds: about 3 s of CPU each. Four fresh interpreters on a two-core machine
import all of it four times over, side by side. `preload` imports it once in the launcher, and `fork_worker`
starts each worker as a fork of it that runs `ntp_ds.train`'s `main` as `python -u -m ntp_ds.train ARGS` would.

A forked worker is made to look like a fresh process: it closes the descriptors it inherited, its standard streams
aside (as `subprocess` does: the launcher's store sockets must not outlive the launcher in its workers), takes the
worker environment, the default signal handlers and the thread count the environment asks for (the OpenMP runtime
read its settings when the launcher loaded it), and exits as an interpreter does (non-daemon threads joined, exit
handlers run). The launcher keeps a `ForkedWorker` per worker, with the parts of `subprocess.Popen` it uses.
"""

from __future__ import annotations

import atexit
import importlib
import os
import signal
import sys
import threading
import traceback

from ntp_ds.envs import OMP_NUM_THREADS

PRELOAD = ("torch", "torch._dynamo", "deepspeed", "deepspeed.runtime.zero.utils",
           "deepspeed.runtime.zero.muon.muon_optimizer", "ntp_ds", "ntp_ds.train", "ntp_ds.run.trainer",
           "ntp_ds.fault_tolerant", "ntp_ds.recovery.manager", "ntp_ds.control.job", "ntp_ds.control.heartbeat",
           "ntp_ds.goodput.wandb_log", "tqdm")
"""What a worker imports before its first step; a module missing from this build is skipped."""


def can_fork() -> bool:
    """Whether workers may be forked: on Linux (forking a process that loaded torch is unsafe on macOS) and without
    CUDA devices (once this process has asked the CUDA driver for its devices, a forked child cannot use CUDA)."""
    if not (sys.platform.startswith("linux") and hasattr(os, "fork")):
        return False
    import torch

    return not torch.cuda.is_available()


def preload(modules: tuple[str, ...] = PRELOAD) -> None:
    """Import what every worker needs, once, in the process the workers are forked from."""
    for name in modules:
        try:
            importlib.import_module(name)
        except ImportError:  # only a head start: a worker imports what it needs itself
            pass


class ForkedWorker:
    """A forked worker, as the launcher handles it (`poll`, `returncode`, `send_signal`, `kill`, `pid`)."""

    def __init__(self, pid: int):
        self.pid = pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        """Reap the worker if it exited; return its status as `Popen.poll` does (-N when killed by signal N)."""
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid == self.pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def send_signal(self, signum: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, signum)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def fork_worker(command: list[str], env: dict) -> ForkedWorker:
    """Fork a worker that runs `command` (`[python, -u, -m, ntp_ds.train, ARGS...]`) in environment `env`."""
    module, args = _module_command(command)
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid:
        return ForkedWorker(pid)
    code = 1
    try:
        _become_worker(env)
        code = _run(module, args)
    finally:
        os._exit(code)


def _module_command(command: list[str]) -> tuple[str, list[str]]:
    rest = command[2:] if command[1:2] == ["-u"] else command[1:]
    if len(rest) < 2 or rest[0] != "-m":
        raise ValueError(f"a forked worker runs `python -m MODULE ARGS`, not {command}")
    return rest[1], rest[2:]


def _become_worker(env: dict) -> None:
    """Shed what the worker inherited from the launcher but would not have as a fresh process."""
    keep = sorted({0, 1, 2} | {fd for fd in map(_fileno, (sys.stdin, sys.stdout, sys.stderr)) if fd is not None})
    for low, high in zip(keep, keep[1:] + [os.sysconf("SC_OPEN_MAX")]):
        os.closerange(low + 1, high)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.environ.clear()
    os.environ.update(env)
    threads = env.get(OMP_NUM_THREADS, "")
    if threads.isdigit() and int(threads) > 0:
        import torch

        torch.set_num_threads(int(threads))
    for stream in (sys.stdout, sys.stderr):  # as `python -u`
        stream.reconfigure(line_buffering=True, write_through=True)


def _fileno(stream) -> int | None:
    """The descriptor under a standard stream (which a test harness may have moved off 0, 1 and 2)."""
    try:
        return stream.fileno()
    except (AttributeError, OSError, ValueError):
        return None


def _run(module: str, args: list[str]) -> int:
    """Run `module.main(args)` and end as the interpreter would; return the exit status."""
    sys.argv = [module, *args]
    interrupted = False
    try:
        result = importlib.import_module(module).main(args)
        code = result if isinstance(result, int) else 0
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            code = e.code or 0
        else:
            print(e.code, file=sys.stderr)
            code = 1
    except KeyboardInterrupt:
        traceback.print_exc()
        code, interrupted = 1, True
    except BaseException:
        traceback.print_exc()
        code = 1
    for thread in threading.enumerate():
        if thread is not threading.current_thread() and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    if interrupted:  # exit killed by SIGINT, as the interpreter does after an uncaught KeyboardInterrupt
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    return code & 0xFF
