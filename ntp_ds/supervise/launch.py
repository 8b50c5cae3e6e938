"""`ntp-ds launch`: start this node's workers, host the job's store, and keep the survivors running when one dies.

Unlike the `deepspeed` launcher (which kills every sibling when one worker fails) and `torchrun` (which restarts them
all), this launcher lets the other workers go on, so a job can train through the loss of a GPU. It hosts the
job's TCPStore in its own process (node 0's launcher), never in a training rank, so losing rank 0 does not lose the
store; workers find it in `NTP_STORE=HOST:PORT`.

Every exit is recorded in the store (`record_exit`: an abnormal one as a fence request too), so the survivors learn of
a death at once. A worker stopped by SIGSTOP (a hang) never exits: once every other worker has, it is killed. As
often as its workers beat, and at once after an exit, the launcher publishes its node's liveness (`node/{node}`: its
workers' latest beats and exits), which the workers' watchers read instead of one key per peer. It hosts a small
store of the node's own (`NTP_NODE_STORE`), where its workers beat, where the recovery's barriers over the whole
generation meet first, and where, as often, it copies the keys their watchers poll from the job's store
(`ntp_ds.control.node_store`): between failures a node costs the job's store two requests a period, not a few per
worker; the copy's fence counter also tells it which of its workers to stop.

Each worker gets RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK (the node), NTP_STORE, MASTER_ADDR and
MASTER_PORT (for the default env:// rendezvous), NTP_NODE_SIZE (ranks per node: node keys are published),
NTP_NODE_STORE (the node's own store; not for a joiner),
NTP_RACK_SIZE with `--rack-size` (nodes per rack), and NTP_RUN_DIR when a run directory is given.

Exit status: 0 when at least one worker finished successfully (exit 0), the others' deaths being printed; else the
status of the first worker that failed (128 + N for signal N); 2 for a usage mistake; 128 + N when stopped by
signal N (SIGINT: 130, SIGTERM: 143). With several nodes, each node's launcher judges only its own workers.

Growing back: with `--join --store HOST:PORT` the launcher starts workers that join the job running on that store
(a repaired or spare node): each gets a fresh launch rank and NTP_JOIN=1, asks the job for a place, and is taken in at
a step boundary (`ntp_ds.control.joins`). A `repair` fault (in the run's `fault.faults`, or sent with `ntp-ds inject
--kind repair`) makes this launcher start a replacement for its worker that died, joining from the repair's step.

SIGINT and SIGTERM: the first is passed to every worker (an `ntp_ds.train` worker then stops cleanly at a step
every rank agrees on); workers still running `--grace-s` later are killed, and so are they at a second signal.
"""

from __future__ import annotations

import argparse
import math
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from ntp_ds.control.keys import LAUNCH_RANKS_KEY, MASTER_ADDR_KEY, MASTER_PORT_KEY
from ntp_ds.envs import (DS_ACCELERATOR, LOCAL_WORLD_SIZE, NODE_SIZE_ENV, NODE_STORE_ENV, OMP_NUM_THREADS,
                         RACK_SIZE_ENV, RACK_STORE_ENV, RUN_DIR_ENV)
from ntp_ds.supervise.stop import DUPLICATE_S, SIGNALS

PROG = "ntp-ds launch"
_VALUED = ("--nproc-per-node", "--nnodes", "--node-rank", "--store", "--run-dir", "--grace-s", "--rack-size")

USAGE = f"""usage: {PROG} [--nproc-per-node N] [--nnodes N --node-rank I --store HOST:PORT] [--rack-size K]
                     [--join --store HOST:PORT] [--run-dir DIR] [--grace-s S] (-m MODULE | SCRIPT) [ARGS ...]

Start N worker processes on this node (python -m MODULE ARGS, or python SCRIPT ARGS) and wait for them.
A worker that dies is reported (rank, exit code or signal); the others keep running.

  --nproc-per-node N   workers on this node (default: 1)
  --nnodes N           nodes in the job (default: 1); ranks are node_rank * N + local rank
  --node-rank I        this node's index (default: 0); node 0 hosts the store (not an etcd one)
  --store HOST:PORT    the job's store: node 0 listens on PORT, the others connect (required with --nnodes > 1;
                       default on one node: 127.0.0.1 and a free port)
  --store etcd://HOST:PORT[,HOST:PORT...][/JOB]
                       or an etcd v3 cluster that every node reaches (keys under /ntp_ds/JOB/, JOB defaults to
                       `job` and must be unused): the job outlives any one etcd member and node 0 itself
  --rack-size K        K contiguous nodes form a rack (nodes 0..K-1 the first): copies of each replica's state
                       and its watchers are placed in other racks, so that a rack lost whole loses no state
                       and is seen at once (passed to the workers as NTP_RACK_SIZE; default: racks unknown)
  --join               start workers that join the job running on --store (a repaired or spare node); they are
                       taken in at a step boundary and receive their shards from the running workers' memory
  --run-dir DIR        passed to the workers as NTP_RUN_DIR
  --grace-s S          seconds workers get to stop cleanly after a SIGINT or SIGTERM to the launcher (finish the
                       step in flight, write weights and summary), then they are killed (default: 60)

Example: {PROG} --nproc-per-node 4 -m ntp_ds.train recipe=cpu_demo
Exit status: 0 if at least one worker finished successfully, else the first failure's status; 2 for bad usage;
128 + N when stopped by signal N (a second signal kills the workers at once).
"""


COMPACT_PERIOD_S = 10.0
"""How often each launcher on an etcd store asks whether the cluster's history is due for compaction (one read;
`EtcdStore.compact_if_due`)."""


class LaunchError(Exception):
    """A usage mistake; the message is one line that names the option."""


@dataclass
class LaunchSpec:
    """What to start on this node and how it joins the job."""

    command: list[str]
    nproc_per_node: int = 1
    nnodes: int = 1
    node_rank: int = 0
    store: str | None = None
    run_dir: str | None = None
    grace_s: float = 60.0
    fork: bool = False
    """Fork the workers from this process, which imported what they need (`ntp_ds.supervise.forked`); `command` must
    then be `python -u -m MODULE ARGS`."""
    join: bool = False
    """Start workers that join the job running on `store` instead of starting one."""
    rack_size: int | None = None
    """Contiguous nodes per rack (`NTP_RACK_SIZE`); None: unknown."""
    repairs: dict = field(default_factory=dict)
    """Launch rank -> step: once that worker has died, start a replacement that joins from this step."""
    env: dict = field(default_factory=dict)
    """Set in every worker's environment last (a sentinel keeps its launcher's LOCAL_RANK this way)."""

    def __post_init__(self):
        if self.join and not self.store:
            raise LaunchError("--join needs --store HOST:PORT: the store of the running job to join")
        for name in ("nproc_per_node", "nnodes", "rack_size"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise LaunchError(f"--{name.replace('_', '-')}={getattr(self, name)} must be at least 1")
        if not 0 <= self.node_rank < self.nnodes:
            raise LaunchError(f"--node-rank={self.node_rank} must lie in 0..nnodes-1={self.nnodes - 1}")
        if self.nnodes > 1 and not self.store:
            raise LaunchError(f"--store is required with --nnodes={self.nnodes}: give HOST:PORT of node 0, or "
                              f"etcd://HOST:PORT[,HOST:PORT...][/JOB] of an etcd cluster")
        if self.store:
            from ntp_ds.control.address import validate_address

            try:
                validate_address(self.store)
            except ValueError as e:
                raise LaunchError(f"--store: {e}") from None

    @property
    def world_size(self) -> int:
        return self.nnodes * self.nproc_per_node


def split_argv(argv: list[str]) -> tuple[list[str], list[str]]:
    """Split `[launcher options] (-m MODULE | SCRIPT) [ARGS]` into the options and the worker command."""
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg in ("-m", "--module"):
            if i + 1 >= len(argv):
                raise LaunchError("-m needs a module name, e.g. -m ntp_ds.train")
            return argv[:i], [sys.executable, "-u", "-m", argv[i + 1], *argv[i + 2:]]
        if arg in _VALUED:
            i += 2
            continue
        if arg.startswith("-"):
            i += 1
            continue
        return argv[:i], [sys.executable, "-u", arg, *argv[i + 1:]]
    return argv, []


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def worker_env(spec: LaunchSpec, local_rank: int, store: str, master: tuple[str, int], base=os.environ,
               joining: tuple[int, int, int] | None = None, node_store: str | None = None,
               rack_store: str | None = None) -> dict:
    """The environment of one worker; `joining` = (launch rank, job world size, first step) for a joiner;
    `node_store`: the address of the node's own store (`control.node_store`), for a worker that is not a joiner;
    `rack_store`: its rack's (`node_store.share_rack_store`)."""
    env = dict(base)
    package_root = str(Path(__file__).resolve().parents[2])  # the folder that holds ntp_ds
    env["PYTHONPATH"] = os.pathsep.join([package_root] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    env.update(RANK=str(spec.node_rank * spec.nproc_per_node + local_rank), WORLD_SIZE=str(spec.world_size),
               LOCAL_RANK=str(local_rank), LOCAL_WORLD_SIZE=str(spec.nproc_per_node), GROUP_RANK=str(spec.node_rank),
               NTP_STORE=store, MASTER_ADDR=master[0], MASTER_PORT=str(master[1]),
               NTP_NODE_SIZE=str(spec.nproc_per_node))
    if joining is not None:
        rank, world, step = joining
        env.update(RANK=str(rank), WORLD_SIZE=str(world), NTP_JOIN="1", NTP_JOIN_STEP=str(step))
        env.pop(NODE_SIZE_ENV)  # its rank lies outside the node numbering: watchers read its beats per rank
    elif node_store is not None:
        env[NODE_STORE_ENV] = node_store
        if rack_store is not None:
            env[RACK_STORE_ENV] = rack_store
    if spec.rack_size is not None:
        env[RACK_SIZE_ENV] = str(spec.rack_size)
    if spec.run_dir:
        env[RUN_DIR_ENV] = str(Path(spec.run_dir).resolve())
    env.update(spec.env)
    env.setdefault(OMP_NUM_THREADS, str(max(1, (os.cpu_count() or 1) // int(env[LOCAL_WORLD_SIZE]))))
    set_cpu_accelerator(env)
    return env


def set_cpu_accelerator(env=os.environ) -> None:
    """Tell DeepSpeed to use its CPU accelerator where there is no GPU (it otherwise warns on every import)."""
    if DS_ACCELERATOR not in env:
        import torch

        if not torch.cuda.is_available():
            env[DS_ACCELERATOR] = "cpu"


def shell_status(code: int) -> int:
    """A child's return code as a shell reports it: a signal's death is 128 + the signal's number."""
    return 128 - code if code < 0 else code


def _describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exited with code {code}"


def _say(text: str) -> None:
    print(f"{PROG}: {text}", file=sys.stderr, flush=True)


def _rendezvous(spec: LaunchSpec):
    """Host (node 0) or reach the job's store; return it, its address and the env:// master address."""
    from ntp_ds.control.store import connect_store, host_store, is_etcd_address, parse_address

    if spec.store and is_etcd_address(spec.store):  # nobody hosts it: every node is a client of the cluster
        store = connect_store(spec.store, forks=True)
        if spec.node_rank == 0 and not spec.join:
            if held := store.num_keys():
                raise LaunchError(f"--store {spec.store}: this job's path in etcd already holds {held} keys of an "
                                  f"earlier job; give the job a path of its own (etcd://HOST:PORT,.../NAME)")
            master = (socket.getfqdn() if spec.nnodes > 1 else "127.0.0.1", _free_port())
            store.set(MASTER_ADDR_KEY, master[0])
            store.set(MASTER_PORT_KEY, str(master[1]))
            return store, spec.store, master
        return store, spec.store, (store.get(MASTER_ADDR_KEY).decode(), int(store.get(MASTER_PORT_KEY).decode()))
    if spec.node_rank == 0 and not spec.join:
        host, port = parse_address(spec.store) if spec.store else ("127.0.0.1", 0)
        store, address = host_store(port, host)
        master = (host, _free_port())
        store.set(MASTER_PORT_KEY, str(master[1]))
        return store, address, master
    store = connect_store(spec.store, forks=True)
    host, _ = parse_address(spec.store)
    return store, spec.store, (host, int(store.get(MASTER_PORT_KEY).decode()))


def launch(spec: LaunchSpec, poll_s: float = 0.1, finish=None) -> int:
    """Start the workers, wait for every one, report each exit; return the exit status described above, or what
    `finish(store, codes)` returns (called once every worker has exited, while this process still holds the store)
    if it returns a status."""
    from ntp_ds.control.keys import FENCE_KEY
    from ntp_ds.control.heartbeat import WATCHES_PER_BEAT
    from ntp_ds.control.liveness_store import (NODE_PUBLISH_S, AlarmRelay, JobLog, NodePublisher, prepare_store,
                                               record_exit)
    from ntp_ds.control.node_store import NodeMirror, host_node_store, share_rack_store

    store, address, master = _rendezvous(spec)
    fence_log = JobLog(store, FENCE_KEY)
    published_at, mirrored_at, compacted_at, exits = -math.inf, -math.inf, time.monotonic(), {}
    node_store = mirror = node_address = relay = rack_store = rack_address = None
    stop = _StopRequests()
    previous = {s: signal.signal(s, stop.receive) for s in SIGNALS}
    repairs = _Repairs(store, spec.repairs)
    try:
        if spec.join:
            world = _job_world_size(store)
            ranks = _fresh_ranks(store, world, spec.nproc_per_node)
            publisher = None
            _say(f"joining the job on {address} ({world} workers at launch) as ranks {', '.join(map(str, ranks))}: "
                 f"{' '.join(spec.command[1:])}")
            procs = {r: _start(spec, worker_env(spec, i, address, master, joining=(r, world, 0)))
                     for i, r in enumerate(ranks)}
        else:
            prepare_store(store)
            first = spec.node_rank * spec.nproc_per_node
            ranks = range(first, first + spec.nproc_per_node)
            node_store, node_address = host_node_store()
            if spec.rack_size is not None and spec.rack_size > 1 and spec.nnodes > 1:  # (a level above the node)
                rack_store, rack_address = share_rack_store(store, spec.node_rank, spec.rack_size, socket.getfqdn())
                _say(f"rack {spec.node_rank // spec.rack_size}'s store at {rack_address or '(none: not published)'}"
                     f"{' (hosted here)' if rack_store is not None else ''} ({RACK_STORE_ENV})")
            publisher = NodePublisher(store, spec.node_rank, ranks, beats_from=node_store)
            mirror = NodeMirror(store, node_store, ranks, nodes=spec.nnodes)
            # The job's alarms reach the node's workers through the node's store: one wait in the job's store per
            # node, not per worker (started before them: a worker waits on the relay it finds when it starts).
            relay = AlarmRelay(store, node_store, first,
                               pause_s=lambda: mirror.period_s / WATCHES_PER_BEAT).start()
            _say(f"store at {address} (NTP_STORE); starting ranks {first}-{first + spec.nproc_per_node - 1} of "
                 f"{spec.world_size}: {' '.join(spec.command[1:])}")
            procs = {first + i: _start(spec, worker_env(spec, i, address, master, node_store=node_address,
                                                        rack_store=rack_address))
                     for i in range(spec.nproc_per_node)}
        local = {r: i for i, r in enumerate(procs)}
        codes: dict[int, int] = {}
        while len(codes) < len(procs):
            left = {r: p for r, p in procs.items() if r not in codes}
            stop.act(left, spec.grace_s)
            for rank, proc in procs.items():
                if rank in codes or proc.poll() is None:
                    continue
                codes[rank] = proc.returncode
                reason = _describe_exit(proc.returncode)
                if proc.returncode != 0 and not stop.expected(proc.returncode):
                    going = not stop.signum and any(p.poll() is None for p in procs.values())
                    _say(f"rank {rank} {reason}" + ("; the other workers keep running" if going else ""))
                exits[rank] = reason
                published_at = -math.inf  # publish the exit now, not at the next period
                try:
                    record_exit(store, rank, reason, abnormal=proc.returncode != 0)
                except Exception as e:  # the store is ours; a failed write must not take the survivors down
                    _say(f"could not record rank {rank}'s exit in the store: {e}")
            if not stop.signum:
                for rank, step in repairs.due(codes):
                    world = spec.world_size if not spec.join else _job_world_size(store)
                    new, = _fresh_ranks(store, world, 1)
                    _say(f"rank {rank} repaired: starting rank {new} in its place, joining the job from step {step}")
                    local[new] = local[rank]
                    procs[new] = _start(spec, worker_env(spec, local[rank], address, master,
                                                         joining=(new, world, step)))
            if publisher is not None and time.monotonic() - published_at >= mirror.period_s:
                published_at = time.monotonic()
                try:
                    publisher.publish(exits)
                except Exception as e:  # retried at the next period; watchers read per rank meanwhile
                    _say(f"could not publish node {spec.node_rank}'s liveness: {e}")
            if hasattr(store, "compact_if_due") and time.monotonic() - compacted_at >= COMPACT_PERIOD_S:
                compacted_at = time.monotonic()
                try:
                    store.compact_if_due()
                except Exception as e:  # tried again at the next period
                    _say(f"could not compact the store's history: {e}")
            left = {r: p for r, p in procs.items() if r not in codes}
            if time.monotonic() - mirrored_at >= (NODE_PUBLISH_S if mirror is None else mirror.period_s):
                # the fence requests come with the copy's counters
                mirrored_at = time.monotonic()
                _fence(fence_log, left, _refresh(mirror))
            if codes and left and all(_stopped(p) for p in left.values()):
                # A worker stopped by SIGSTOP (a hang) never exits; once every other worker has, it is dead weight.
                _say(f"rank{'s' if len(left) > 1 else ''} {', '.join(map(str, sorted(left)))} stopped (SIGSTOP) while "
                     f"the others are done; killing {'them' if len(left) > 1 else 'it'}")
                for p in left.values():
                    p.kill()
            time.sleep(poll_s)
        if finish is not None and (status := finish(store, codes)) is not None:
            return status
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        if relay is not None:
            relay.stop()
    if stop.signum:
        clean = sorted(r for r, c in codes.items() if c == 0 or stop.expected(c))
        _say(f"stopped by {signal.Signals(stop.signum).name}: {len(clean)} of {len(codes)} workers stopped cleanly")
        return 128 + stop.signum
    ok = [r for r, c in codes.items() if c == 0]
    failed = {r: c for r, c in codes.items() if c != 0}
    if not failed:
        return 0
    _say(f"{len(ok)} of {len(codes)} workers finished successfully; "
         + ", ".join(f"rank {r} {_describe_exit(c)}" for r, c in sorted(failed.items())))
    return 0 if ok else shell_status(failed[min(failed)])


def _job_world_size(store, timeout_s: float = 60.0) -> int:
    """The world size the running job started with (its writer publishes it before the first step)."""
    from ntp_ds.control.job import read_job

    deadline = time.monotonic() + timeout_s
    while (job := read_job(store)) is None:
        if time.monotonic() > deadline:
            raise LaunchError(f"--join: no job has published itself on the store within {timeout_s:g} s")
        time.sleep(0.2)
    return job.world_size


def _fresh_ranks(store, world_size: int, n: int) -> list[int]:
    """`n` launch ranks no worker of the job ever had (joiners number from the job's world size up)."""
    end = store.add(LAUNCH_RANKS_KEY, n)
    return list(range(world_size + end - n, world_size + end))


class _Repairs:
    """The repairs this launcher owes: scheduled at launch (`LaunchSpec.repairs`) or sent to the job (`ntp-ds inject
    --kind repair`); each is due once its worker has died."""

    def __init__(self, store, scheduled: dict, poll_s: float = 0.5):
        self.store, self.waiting, self.poll_s = store, dict(scheduled), poll_s
        self._received, self._next = 0, 0.0
        self._done: set[int] = set()
        """Ranks already replaced: a repair of one, scheduled and also sent to the job, starts one replacement."""

    def due(self, codes: dict[int, int]) -> list[tuple[int, int]]:
        if time.monotonic() >= self._next:
            self._next = time.monotonic() + self.poll_s
            self._poll()
        out = [(rank, step) for rank, step in self.waiting.items() if rank in codes and codes[rank] != 0]
        for rank, _ in out:
            del self.waiting[rank]
            self._done.add(rank)
        return out

    def _poll(self) -> None:
        from ntp_ds.control.faults import FAULT_COUNT_KEY, Fault, fault_key

        try:
            count = self.store.add(FAULT_COUNT_KEY, 0)
            while self._received < count and self.store.check([fault_key(self._received + 1)]):
                self._received += 1
                fault = Fault.decode(self.store.get(fault_key(self._received)))
                if fault.kind == "repair" and fault.rank not in self._done:
                    self.waiting[fault.rank] = fault.step
        except Exception as e:  # the store is ours; retried at the next poll
            _say(f"could not read the faults sent to the job: {e}")


def _start(spec: LaunchSpec, env: dict):
    """Start one worker: a fresh interpreter, or a fork of this process (`spec.fork`)."""
    if spec.fork:
        from ntp_ds.supervise.forked import fork_worker

        return fork_worker(spec.command, env)
    return subprocess.Popen(spec.command, env=env)


def _refresh(mirror) -> int | None:
    """Copy the keys this node's watchers poll into its store (`NodeMirror`); return the fence log's counter as
    copied, or None (no copy: a joining launcher's node, or a failed one)."""
    if mirror is None:
        return None
    try:
        return mirror.refresh().fences
    except Exception as e:  # the store is ours; retried at the next period (watchers read the job's store meanwhile)
        _say(f"could not copy the keys this node's watchers poll: {e}")
        return None


def _fence(fence_log, running: dict, count: int | None = None) -> None:
    """Kill this node's workers that their peers declared dead (hung): a fenced worker never rejoins, and its
    closed connections end every wait on it at once. `fence_log`: this launcher's `JobLog` of the fence requests
    (each poll reads the new ones only); `count`: its counter as just read (else read here)."""
    try:
        fences = fence_log.read() if count is None else fence_log.catch_up(count)
    except Exception as e:  # the store is ours; a failed read is retried at the next poll
        _say(f"could not read the fence requests: {e}")
        return
    for rank in sorted(set(fences) & set(running)):
        _say(f"rank {rank} declared dead by its peers ({fences[rank]}); killing it")
        running[rank].kill()


def _stopped(proc) -> bool:
    """Whether a worker is stopped (state T in /proc; False where /proc is missing)."""
    try:
        with open(f"/proc/{proc.pid}/stat") as f:
            return f.read().rsplit(")", 1)[-1].split()[0] == "T"
    except OSError:
        return False


class _StopRequests:
    """SIGINT and SIGTERM to the launcher: the first is passed to every worker, which stop cleanly at a step they
    agree on (`ntp_ds.supervise.stop`) within `--grace-s`, else they are killed; a second one (at least DUPLICATE_S
    later: the same Ctrl-C reaches the launcher and its workers together) kills them at once."""

    def __init__(self, clock=time.monotonic):
        self.signum = 0
        self._clock = clock
        self._received: list[int] = []
        self._first_at = self._deadline = 0.0

    def receive(self, signum, _frame=None) -> None:
        """Signal handler: only record (acted on by the launcher's loop)."""
        self._received.append(signum)

    def expected(self, code: int) -> bool:
        """Whether a worker's exit status is that of a clean stop (for this signal, or another stop signal the
        worker received itself)."""
        return bool(self.signum) and code in {128 + s for s in SIGNALS}

    def act(self, running: dict, grace_s: float) -> None:
        """Pass new signals on to the running workers; kill them after the second signal or the grace period."""
        now = self._clock()
        while self._received:
            signum = self._received.pop(0)
            if not self.signum:
                self.signum, self._first_at, self._deadline = signum, now, now + grace_s
                _say(f"{signal.Signals(signum).name}: the workers stop after the step in flight (within --grace-s="
                     f"{grace_s:g} s); a second signal stops them at once")
                for p in running.values():
                    _send(p, signum)
            elif now - self._first_at >= DUPLICATE_S:
                _say(f"{signal.Signals(signum).name} again: killing the workers")
                self._kill(running)
        if self.signum and running and now > self._deadline:
            _say(f"the workers did not stop within --grace-s={grace_s:g} s; killing them")
            self._kill(running)

    def _kill(self, running: dict) -> None:
        for p in running.values():
            if p.poll() is None:
                p.kill()
        self._deadline = float("inf")


def _send(proc, signum: int) -> None:
    try:
        proc.send_signal(signum)
    except ProcessLookupError:
        pass


def parse_args(argv: list[str]) -> LaunchSpec:
    options, command = split_argv(argv)

    class Parser(argparse.ArgumentParser):
        def error(self, message):
            raise LaunchError(message)

    parser = Parser(prog=PROG, add_help=False)
    parser.add_argument("--nproc-per-node", type=int, default=1)
    parser.add_argument("--nnodes", type=int, default=1)
    parser.add_argument("--node-rank", type=int, default=0)
    parser.add_argument("--store")
    parser.add_argument("--run-dir")
    parser.add_argument("--grace-s", type=float, default=60.0)
    parser.add_argument("--join", action="store_true")
    parser.add_argument("--rack-size", type=int)
    args = parser.parse_args(options)
    if not command:
        raise LaunchError("nothing to launch: give -m MODULE or SCRIPT, e.g. -m ntp_ds.train recipe=cpu_demo")
    return LaunchSpec(command, args.nproc_per_node, args.nnodes, args.node_rank, args.store, args.run_dir,
                      args.grace_s, join=args.join, rack_size=args.rack_size)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(USAGE)
        return 0
    try:
        spec = parse_args(argv)
    except LaunchError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    return launch(spec)


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
