"""One rank's recovery at the job sizes the product is for, on shapes alone: planning time and memory, store load,
per-step control bytes.

For each world size W (70B-shaped Llama, TP 8, W / 8 replicas, ZeRO 1 with one buddy copy; TP rank 3 of replica 5
dies) it measures:

- plan: one rank's recovery planning, the pure functions `Recovery._attempt`, `_install` and `reslice` call from the
  agreed membership to the state moves (`replica_membership`, `Placement.after_loss`, `roll_back`, the
  `old_rank_of` map `_install` builds, `plan_unit_moves` and its re-replicated and rebalanced moves, `JobSpec.plan`,
  `exchange_families` (the groups its exchanges will run on; the largest family's size is printed), the layout
  rule's addresses `_rule_holds` checks, `StateIndex.from_layouts`, `plan_incoming`, `plan_outgoing`,
  `count_lost_state`), for three roles: a rank of a healthy replica, a survivor of the degraded replica and the buddy
  of the dead rank. The collectives' results (the gathered offers) are built before the clock starts, as the wire
  would hand them over. Each case runs in a fresh interpreter: its time and peak RSS (VmHWM, not inherited) are
  its own; a case that runs past `--plan-timeout-s` is reported as exceeding that bound.
- store: the store operations and bytes one rank issues per failure, counted by a wrapper around a real HashStore
  (`MeteredStore`). Running W watchers is infeasible here at these sizes (2 cores), so this is a SAMPLE: a few ranks
  (the three roles and a spread of others) run the real code paths, each in its own threads with its real peer set
  (TP group, data-parallel group, buddies): its `Heartbeat` (beats, peer polls through the per-node
  `LivenessReader`, the alarm thread), `request_fence` for a peer found dead, and the training thread's part of
  `Recovery._attempt` (`Detector.detect`, `request_fence`, `Detector.agree`: the report, the decision and the
  watched confirm, `Detector.arrive`, the done barrier), against a store pre-populated as the other ranks of a W-rank
  job leave it: every rank's beat and every node's liveness key (real `NodePublisher`), every watcher registered
  for alarms, the dead rank marked exited by its launcher (real `mark_exited`, which raises the alarm), the other
  survivors' failure reports (each survivor reports when detection beats the settle window, which the alarms make
  the case) and their arrivals at the three barriers. Only the sampled ranks' calls are counted per rank, over
  WINDOW_S from the crash (or to the end of the rank's failure path, if later): the heartbeat's calls follow its
  clock, so every size counts them over the same time (`path_s`: the failure path's seconds; `window`: the seconds
  counted). The sampled heartbeats run with `heartbeat_timeout_s` and the reader's `stale_s` at WATCH_BOUND_S: the
  pre-populated beats and node keys do not move (no W workers beat here), and a shorter bound would declare every
  watched peer dead.
- step control bytes: the payload bytes `NTPEngine.step`'s two `wire.vote`s and the Trainer's `wire.sum_counts` hand
  to the collective (measured by recording the real functions' calls to `wire.all_reduce`), and, derived by formula
  (labelled so), the bytes a ring all-reduce sends per rank for that payload: 2 (W - 1) / W x payload.

    python benchmarks/scale.py [--sizes 4096,32768,100000] [--quick] [--plan-timeout-s 300] [--store-timeout-s 300]

The last line reads `plan_s_100k=... plan_rss_mb_100k=... store_ops_per_failure_per_rank=...
step_control_bytes_per_rank=...` (plan figures: the worst role at W = 100,000, or `>bound`/`n/a` when not measured).
"""

from __future__ import annotations

import argparse
import bisect
import json
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch.distributed as dist  # noqa: E402

from ntp_ds.comm import wire  # noqa: E402
from ntp_ds.comm.groups import ring_neighbours  # noqa: E402
from ntp_ds.control.heartbeat import Heartbeat  # noqa: E402
from ntp_ds.control.keys import barrier_key, heartbeat_key  # noqa: E402
from ntp_ds.control.liveness import Beat, LivenessMonitor  # noqa: E402
from ntp_ds.control.liveness_store import (ALARM_BUCKET, LivenessReader, NodePublisher, alarm_bucket,  # noqa: E402
                                           mark_exited, prepare_store, register_alarm_watcher, request_fence)
from ntp_ds.control.membership import FailureReport, Membership, barrier, count_arrival  # noqa: E402
from ntp_ds.layout import Topology, plan_buddies, plan_gradient_sync  # noqa: E402
from ntp_ds.layout.generation import replica_membership  # noqa: E402
from ntp_ds.testing.shapes import llama_70b, shape_specs, zero_order  # noqa: E402

TP = 8
DEAD_REPLICA, DEAD_TP = 5, 3
DEAD = DEAD_REPLICA * TP + DEAD_TP
ROLES = ("healthy", "survivor", "buddy")
DEFAULT_SIZES = (4096, 32768, 100_000)
QUICK_SIZES = (512, 1024)
TARGETS = {"plan_s": 1.0, "plan_rss_mb": 500.0, "store_ops": 100}
SAMPLE_OTHERS = 5
"""Ranks sampled for the store load besides the three roles."""
WATCH_BOUND_S = 600.0
"""The sampled heartbeats' timeout and node-key staleness bound (see the module docstring): above the store case's
bound, since a window longer than it makes every watched peer look silent (at W = 100,000 a 60 s bound was passed
and the sampled ranks fenced ~1,100 healthy peers, which inflated their op counts)."""
WINDOW_S = 1.0
"""Seconds from the crash over which a sampled rank's store calls are counted (longer when its failure path takes
longer). Its heartbeat beats and polls on its own clock: a window of the same length at every size keeps that part of
the count from following how long the harness's failure path happens to run (its 8 ranks share one interpreter)."""


# -- the job ------------------------------------------------------------------------------------------------------
def job_topology(world: int) -> Topology:
    if world % TP or world // TP <= DEAD_REPLICA + 1:
        raise ValueError(f"world size {world} must be a multiple of {TP} with more than {DEAD_REPLICA + 1} replicas")
    return Topology.from_degrees(llama_70b().units(), (TP,) * (world // TP))


def role_ranks(old: Topology) -> dict[str, int]:
    """Launch ranks of the three roles: a rank of a healthy replica far from the loss, a survivor of the degraded
    replica, the rank keeping the copy of the dead rank's ZeRO partition."""
    buddy = plan_buddies(old, plan_gradient_sync(old), 1, 1)[DEAD][0]
    return {"healthy": old.ranks_of(len(old.layouts) // 2)[0], "survivor": old.ranks_of(DEAD_REPLICA)[0],
            "buddy": buddy}


def job_spec(replicas: int):
    from ntp_ds.engine.config import NTPConfig
    from ntp_ds.engine.initialize import JobSpec

    ds_config = {"train_batch_size": 4 * replicas, "train_micro_batch_size_per_gpu": 1,
                 "gradient_accumulation_steps": 4, "zero_optimization": {"stage": 1}}
    return JobSpec(ds_config, NTPConfig(tp=TP, replicas=replicas), llama_70b())


def peak_rss_mb() -> float:
    """This interpreter's own peak resident memory (VmHWM, not inherited from a forking parent)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


# -- planning: one rank, one case per interpreter ------------------------------------------------------------------
def offered_steps(old: Topology, new: Topology, old_rank_of: dict[int, int], step: int = 1) -> list[dict]:
    """What recovery's state gather hands every rank: per new rank, {owner: step} of the fragments it can serve
    (its own as an old anchor, and the buddy copies it keeps)."""
    old_plan = plan_gradient_sync(old)
    copies_on: dict[int, list[int]] = {}
    for owner, holders in plan_buddies(old, old_plan, 1, 1).items():
        for h in holders:
            copies_on.setdefault(h, []).append(owner)
    out = []
    for new_rank in range(new.world_size):
        o = old_rank_of[new_rank]
        owners = ([o] if old_plan.is_anchor(old.locate(o)[0]) else []) + copies_on.get(o, [])
        out.append({"keys": ("exp_avg", "exp_avg_sq"), "steps": {w: step for w in owners}, "ok": True,
                    "orders": []})
    return out


def context_offers(old: Topology, gathered: list[dict]) -> list[dict]:
    """What `_share_context`'s gather hands every rank (`rollback.offered` of a member that committed step 1)."""
    return [{"held": True, "mid_step": False, "own_step": 1, "copies": g["steps"], "previous": {},
             "before_step": 0, "stale": {}, "lr": True} for g in gathered]


def plan_case(world: int, role: str) -> dict:
    """Plan rank `role`'s recovery from the loss of DEAD in a W-rank job; return its time, memory and plan sizes."""
    from ntp_ds.layout.generation import Placement
    from ntp_ds.recovery.plan import collector_paused

    config = llama_70b()
    specs, shapes = shape_specs(config)
    order = zero_order(specs)
    old = job_topology(world)
    me_launch = role_ranks(old)[role]
    job = job_spec(len(old.layouts))
    old_members = tuple(range(world))
    placement = Placement.initial(old)
    # What the wire hands this rank during the recovery (built before the clock starts, as received).
    survivors = tuple(r for r in old_members if r != DEAD)
    identity = {i: m for i, m in enumerate(survivors)}
    new_for_offers = replica_membership(old, {DEAD}, old_members).topology()
    gathered = offered_steps(old, new_for_offers, identity)
    shared = context_offers(old, gathered)
    setup_rss = peak_rss_mb()

    with collector_paused():  # as `Recovery.recover` holds it for the whole recovery
        return _timed_plan(world, role, config, specs, shapes, order, old, me_launch, job, old_members, placement,
                           gathered, shared, setup_rss)


def _timed_plan(world, role, config, specs, shapes, order, old, me_launch, job, old_members, placement, gathered,
                shared, setup_rss) -> dict:
    from ntp_ds.comm.groups import exchange_families
    from ntp_ds.layout.zero import anchor_addresses
    from ntp_ds.recovery.plan import old_ranks, plan_unit_moves, rebalanced_moves, rereplicated_moves
    from ntp_ds.recovery.reslice import StateIndex, count_lost_state, plan_incoming, plan_outgoing
    from ntp_ds.recovery.rollback import roll_back

    start = time.monotonic()
    gone = {DEAD}
    plan = replica_membership(old, gone, old_members)
    drop = plan.below(job.ntp.min_tp)
    new_members = plan.ranks(drop)
    new = plan.topology(drop)
    placement = placement.after_loss(plan.lost, drop)
    rolled_back = roll_back(job.buddies(old), shared, frozenset(old_members.index(g) for g in gone))
    t_membership = time.monotonic()
    # `Recovery._install`'s map from new global rank to old global rank (the same function).
    old_rank_of = old_ranks(old_members, new_members)
    t_rank_map = time.monotonic()
    moves = plan_unit_moves(old, new, old_rank_of, {})
    rereplicated = rereplicated_moves(old, new, old_rank_of, moves)
    rebalanced = rebalanced_moves(old, new, old_rank_of, moves)
    sync, batch = job.plan(new)
    me = new_members.index(me_launch)
    families = exchange_families(new, sync, me)  # the groups its exchanges run on (`build_exchange_families`)
    t_units = time.monotonic()
    my_old = old_rank_of[me]
    held = {o: anchor_addresses(order, old, o, specs, shapes) for o in gathered[me]["steps"]}  # `_rule_holds`
    index = StateIndex.from_layouts([g["steps"] for g in gathered], old, new, specs, shapes, order)
    incoming, wanted = plan_incoming(index, me) if sync.is_anchor(new.locate(me)[0]) else ([], [])
    outgoing = plan_outgoing(index, me, held)
    lost, restored = count_lost_state(index, me, {old_members.index(DEAD)}, {})
    end = time.monotonic()
    return {"world": world, "role": role, "rank": me_launch, "old_rank": my_old, "seconds": end - start,
            "rss_mb": peak_rss_mb(), "setup_rss_mb": setup_rss,
            "phases_s": {"membership": t_membership - start, "rank_map": t_rank_map - t_membership,
                         "units_and_batch": t_units - t_rank_map, "state": end - t_units},
            "unit_moves": len(moves), "rereplicated": len(rereplicated), "rebalanced": len(rebalanced),
            "incoming": len(incoming), "outgoing": len(outgoing), "lost_elements": lost,
            "rolled_back": rolled_back, "replicas_in_batch": len(batch.replicas),
            "largest_family": max((len(members) for _, members in families), default=0)}


# -- store load: a sample of ranks' real code paths -----------------------------------------------------------------
def _nbytes(value) -> int:
    if isinstance(value, (bytes, bytearray, str)):
        return len(value)
    if isinstance(value, (list, tuple)):
        return sum(_nbytes(v) for v in value)
    if isinstance(value, (int, float, bool)):
        return 8
    return 0


class MeteredStore:
    """A store client that forwards every call to `store` and counts, in `meter`, calls and bytes by call name
    (bytes of the keys and values sent; of the values returned). Clones share the meter."""

    def __init__(self, store, meter: Counter, lock: threading.Lock):
        self._store, self.meter, self._lock = store, meter, lock

    def clone(self) -> MeteredStore:
        return MeteredStore(self._store, self.meter, self._lock)

    def __getattr__(self, name):
        method = getattr(self._store, name)

        def metered(*args, **kwargs):
            out = method(*args, **kwargs)
            with self._lock:
                self.meter[("ops", name)] += 1
                self.meter[("sent", name)] += _nbytes([a for a in args if not hasattr(a, "total_seconds")])
                self.meter[("received", name)] += _nbytes(out)
            return out
        return metered


def peers(old: Topology, rank: int) -> list[int]:
    """`NTPEngine.watched_peers` of `rank` in a uniform topology: its TP group, its two ring neighbours in its
    data-parallel group (every anchor replica's rank at its TP index) and its buddies and owners (a uniform topology
    has no reshard partners)."""
    sync = plan_gradient_sync(old)
    replica, tp = old.locate(rank)
    buddies = plan_buddies(old, sync, 1, 1)
    owners = [o for o, holders in buddies.items() if rank in holders]
    dp = [old.ranks_of(a)[tp] for a in sync.anchors]
    out = set(old.ranks_of(replica)) | ring_neighbours(dp, rank) | set(buddies.get(rank, ()))
    return sorted((out | set(owners)) - {rank})


def populate(store, world: int, sample: set[int]) -> None:
    """Leave the store as a running W-rank job does before the crash: every rank beaten, every node published (the
    launchers' `node/{n}`), every other watcher registered for alarms."""
    prepare_store(store)
    now = time.time()
    for rank in range(world):
        store.set(heartbeat_key(rank), Beat(100, now, 1000, False).encode())
    for node in range(world // TP):
        NodePublisher(store, node, range(node * TP, (node + 1) * TP)).publish()
    for bucket in sorted({alarm_bucket(r) for r in range(world) if r not in sample}):
        register_alarm_watcher(store, bucket * ALARM_BUCKET)  # one watcher of each bucket (the others add nothing)


def others_after_crash(store, world: int, sample: set[int], survivors: tuple[int, ...], wall: float) -> None:
    """What the survivors outside the sample leave in the store, as `Membership.report_failure` files it: the first
    of them claimed the death and filed the one report, every one of them acknowledged; and their arrivals at the
    confirm, arrive and done barriers."""
    reason = f"rank {DEAD} exited (exit code -9)"
    others = [r for r in range(world) if r not in sample and r != DEAD]
    store.add(f"membership/0/dead/{DEAD}", 1)
    first = FailureReport(others[0], frozenset({DEAD}), wall, reason, {DEAD: 0.05})
    store.set("membership/0/reports/1", first.encode())
    store.add("membership/0/reports/count", 1)
    store.add("membership/0/events", 1)
    for r in (DEAD, *others):  # the claimant acknowledged for the dead rank, then every one of them for itself
        store.add(f"membership/0/acks/{r}", 1)
        count_arrival(store, "membership/0/acks", r, world)
    for name in ("membership/1/confirm", barrier_key(1, "arrive", survivors), barrier_key(1, "done", survivors)):
        for r in others:
            store.add(f"{name}/{r}", 1)
            count_arrival(store, name, bisect.bisect_left(survivors, r), len(survivors))


def sampled_rank(rank: int, store, world: int, watched: list[int], out: dict, timeout_s: float) -> None:
    """One rank's part of a failure on `store`: its heartbeat (beats, peer polls, alarms) runs throughout; its
    training thread runs `Recovery._attempt`'s store path until the done barrier."""
    from ntp_ds.recovery.detect import Detector

    members = tuple(range(world))
    reader = LivenessReader(store.clone(), TP, stale_s=WATCH_BOUND_S)

    def on_dead(ranks, wall):  # `Recovery._peers_dead`: fence the dead (the wire's abort is not part of the store)
        request_fence(out["heartbeat"].store, ranks, "declared dead by a peer")
        out.setdefault("declared", set()).update(ranks)

    heartbeat = out["heartbeat"] = Heartbeat(store.clone(), rank, 0.5, on_dead=on_dead, reader=reader,
                                             monitor=LivenessMonitor((), WATCH_BOUND_S))
    heartbeat.watch(watched, set(members) - {rank})
    heartbeat.start()
    out["ready"].set()
    if not out["go"].wait(timeout_s):
        raise TimeoutError("the crash was not staged in time")
    start = time.monotonic()
    detector = Detector(LivenessReader(store, TP, stale_s=WATCH_BOUND_S), heartbeat_timeout_s=WATCH_BOUND_S,
                        heartbeat_interval_s=0.5, first_beat_timeout_s=WATCH_BOUND_S, collective_timeout_s=timeout_s)
    membership = Membership(store, rank, members, 0, settle_s=0.3)
    detector.monitor = heartbeat.watch([])  # as `Recovery._attempt` does: the detection judges the watched peers
    dead, reason = detector.detect(membership, RuntimeError("Connection closed by peer"))
    request_fence(store, dead, reason)
    change = detector.agree(membership, dead, reason, {r: 0.05 for r in dead})
    detector.arrive(store, rank, change.generation, change.survivors)
    barrier(store, barrier_key(change.generation, "done", change.survivors), rank, change.survivors, timeout_s)
    out["seconds"] = time.monotonic() - start
    out["dead"] = sorted(dead)
    time.sleep(max(0.0, out["window_end"] - time.monotonic()))  # the heartbeat beats and polls on meanwhile
    out["window_s"] = time.monotonic() - (out["window_end"] - WINDOW_S)
    out["meter"] = Counter(store.meter)  # before the heartbeat's stop (not part of the failure)
    heartbeat.stop(5.0)


def store_case(world: int, timeout_s: float) -> dict:
    """Count the store calls and bytes of a sample of ranks through one failure of a W-rank job."""
    old = job_topology(world)
    roles = role_ranks(old)
    spread = [r for r in range(TP - 1, world, max(TP, world // SAMPLE_OTHERS)) if r != DEAD][:SAMPLE_OTHERS]
    sample = sorted(set(roles.values()) | set(spread))
    host = dist.HashStore()
    host.set_timeout(__import__("datetime").timedelta(seconds=timeout_s))
    lock = threading.Lock()
    job_meter = Counter()
    job_store = MeteredStore(host, job_meter, lock)
    setup = time.monotonic()
    populate(host, world, set(sample))
    outs, threads = {}, []
    for rank in sample:
        out = outs[rank] = {"ready": threading.Event(), "go": threading.Event()}
        client = MeteredStore(host, Counter(), threading.Lock())
        t = threading.Thread(target=_guarded, args=(sampled_rank, out, rank, client, world, peers(old, rank), out,
                                                    timeout_s), daemon=True, name=f"scale-rank-{rank}")
        threads.append(t)
        t.start()
    for rank in sample:
        if not outs[rank]["ready"].wait(timeout_s):
            raise TimeoutError(f"sampled rank {rank} did not start within {timeout_s}s")
    setup_s = time.monotonic() - setup
    time.sleep(0.6)  # a beat interval of steady state before the crash
    for rank in sample:
        out = outs[rank]
        client = out["heartbeat"].store
        with client._lock:
            client.meter.clear()
    crash = time.time()
    window_end = time.monotonic() + WINDOW_S
    mark_exited(job_store, DEAD, "exit code -9")  # the dead rank's launcher: an exit record and the alarm
    launcher = Counter(job_meter)
    others_after_crash(host, world, set(sample), tuple(r for r in range(world) if r != DEAD), crash)
    for rank in sample:
        outs[rank]["window_end"] = window_end
        outs[rank]["go"].set()
    deadline = time.monotonic() + timeout_s
    for t in threads:
        t.join(max(0.1, deadline - time.monotonic()))
    if any(t.is_alive() for t in threads):
        return {"world": world, "error": f"sampled ranks did not finish within {timeout_s}s"}
    errors = {r: o["error"] for r, o in outs.items() if "error" in o}
    if errors:
        return {"world": world, "error": f"rank(s) failed: {errors}"}
    per_rank = {}
    for rank in sample:
        meter = outs[rank]["meter"]
        role = next((name for name, r in roles.items() if r == rank), "other")
        per_rank[rank] = {"role": role, "peers": len(peers(old, rank)), "seconds": outs[rank]["seconds"],
                          "window_s": outs[rank]["window_s"],
                          "ops": sum(n for (k, _), n in meter.items() if k == "ops"),
                          "bytes": sum(n for (k, _), n in meter.items() if k != "ops"),
                          "by_op": {name: n for (k, name), n in meter.items() if k == "ops"},
                          "bytes_by_op": dict(sum((Counter({name: n}) for (k, name), n in meter.items()
                                                   if k != "ops"), Counter())),
                          "declared": sorted(outs[rank].get("declared", ()))}
    return {"world": world, "sample": sample, "setup_s": setup_s, "per_rank": per_rank,
            "launcher_ops": sum(n for (k, _), n in launcher.items() if k == "ops"),
            "launcher_bytes": sum(n for (k, _), n in launcher.items() if k != "ops")}


def _guarded(target, out: dict, *args) -> None:
    try:
        target(*args)
    except BaseException as err:  # reported by store_case: a failed sampled rank fails the case
        out["error"] = f"{type(err).__name__}: {err}"
        out["ready"].set()


# -- per-step control bytes ----------------------------------------------------------------------------------------
def step_control_calls(world: int, rank: int) -> list[tuple[str, str, int, int]]:
    """The control collectives rank `rank` of a W-rank job posts per step: `NTPEngine.step`'s ready and commit votes
    and the Trainer's global loss sum, through the real `wire.vote` and `wire.sum_counts` along the real control
    tree (`control_tree` at the default fanout), recorded as (name, "all_reduce" or "broadcast", group size,
    payload bytes) instead of posted."""
    from ntp_ds.comm.groups import CONTROL_FANOUT, control_tree

    recorded: list[tuple[str, str, int, int]] = []
    real = wire.all_reduce, wire.broadcast

    def recorder(kind):
        def record(tensor, *args):
            group, name = (args[0], args[-1]) if kind == "all_reduce" else (args[1], args[-1])
            recorded.append((name, kind, group, tensor.numel() * tensor.element_size()))
            return tensor
        return record

    tree = [wire.TreeGroup(len(members), members[0], top)  # the group stands in as its size: nothing is posted
            for members, top in control_tree(rank, world, CONTROL_FANOUT) if len(members) > 1]
    wire.all_reduce, wire.broadcast = recorder("all_reduce"), recorder("broadcast")
    wire.configure(30.0, None, tree)
    try:
        wire.vote(True, name="ready_vote")
        wire.vote(True, name="commit_vote")
        wire.sum_counts([0.0, 0.0])  # Trainer._global_loss: (loss sum, samples)
    finally:
        wire.all_reduce, wire.broadcast = real
        wire.configure(30.0, None)
    return recorded


def step_control(world: int) -> dict:
    """Per-step control figures of a W-rank job: the payload a rank contributes (measured), and for rank 0 (the
    tree's root, which posts the most) the collectives it posts (measured from the code path) and the hops a
    reduction crosses from leaf to leaf (FORMULA: a ring all-reduce of g ranks takes 2(g-1) hops, a broadcast g-1,
    level after level), against one ring all-reduce over the world (2(W-1))."""
    root = step_control_calls(world, 0)
    leaf = step_control_calls(world, world - 1)
    payload = {name: b for name, kind, _, b in root if kind == "all_reduce"}
    levels = sum(1 for name, kind, _, _ in root if name == "ready_vote" and kind == "all_reduce")
    sizes = [g for name, kind, g, _ in root if name == "ready_vote" and kind == "all_reduce"]
    hops = sum(2 * (g - 1) for g in sizes) + sum(g - 1 for g in sizes[:-1])
    return {"payload": payload, "payload_bytes": sum(payload.values()), "levels": levels, "largest_group": max(sizes),
            "root_calls": len(root), "leaf_calls": len(leaf), "root_bytes": sum(b for *_, b in root),
            "hops": hops, "ring_hops": 2 * (world - 1)}


# -- driver --------------------------------------------------------------------------------------------------------
def run_child(args: list[str], timeout_s: float) -> dict:
    """Run this file with `args` in a fresh interpreter (bounded by `timeout_s`); return its JSON line."""
    try:
        done = subprocess.run([sys.executable, __file__, *args], capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return {"exceeded_s": timeout_s}
    if done.returncode != 0:
        return {"error": done.stderr.strip().splitlines()[-1] if done.stderr.strip() else f"rc {done.returncode}"}
    return json.loads(done.stdout.strip().splitlines()[-1])


def fmt(value, unit: str = "", digits: int = 2) -> str:
    return f"{value:.{digits}f}{unit}" if isinstance(value, (int, float)) else str(value)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default=",".join(map(str, DEFAULT_SIZES)), help="comma-separated world sizes")
    parser.add_argument("--quick", action="store_true", help=f"smoke run at {QUICK_SIZES}")
    parser.add_argument("--plan-timeout-s", type=float, default=300.0, help="bound on one planning case")
    parser.add_argument("--store-timeout-s", type=float, default=300.0, help="bound on one store case")
    parser.add_argument("--plan-case", nargs=2, metavar=("WORLD", "ROLE"), help=argparse.SUPPRESS)
    parser.add_argument("--store-case", type=int, metavar="WORLD", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.plan_case:
        print(json.dumps(plan_case(int(args.plan_case[0]), args.plan_case[1])))
        return 0
    if args.store_case:
        print(json.dumps(store_case(args.store_case, args.store_timeout_s)))
        return 0
    sizes = QUICK_SIZES if args.quick else tuple(int(s) for s in args.sizes.split(",") if s.strip())
    summary = {}
    for world in sizes:
        job_topology(world)  # a bad size fails here, before any case runs
        print(f"\n== W={world} ({world // TP} replicas x TP {TP}; dead: launch rank {DEAD}) ==", flush=True)
        plans = {role: run_child(["--plan-case", str(world), role], args.plan_timeout_s) for role in ROLES}
        print(f"{'role':<9} {'rank':>7} {'plan_s':>10} {'rss_mb':>9} {'setup_mb':>9}  phases_s (membership / "
              f"rank_map / units+batch / state)      moves in/out  family", flush=True)
        for role, p in plans.items():
            if "seconds" not in p:
                why = f">{p['exceeded_s']:.0f}s (bound)" if "exceeded_s" in p else f"error: {p.get('error')}"
                print(f"{role:<9} {'-':>7} {why}", flush=True)
                continue
            ph = p["phases_s"]
            print(f"{role:<9} {p['rank']:>7} {p['seconds']:>10.3f} {p['rss_mb']:>9.0f} {p['setup_rss_mb']:>9.0f}  "
                  f"{ph['membership']:.3f} / {ph['rank_map']:.3f} / {ph['units_and_batch']:.3f} / {ph['state']:.3f}"
                  f"      {p['incoming']}/{p['outgoing']}  {p['largest_family']}", flush=True)
        store = run_child(["--store-case", str(world), "--store-timeout-s", str(args.store_timeout_s)],
                          args.store_timeout_s + 120)
        if "per_rank" in store:
            others = world - 1 - len(store["sample"])
            print(f"store (SAMPLE of {len(store['sample'])} ranks' real code paths; the other {others} "
                  f"survivors' records pre-populated; setup {store['setup_s']:.1f}s; the dead rank's launcher: "
                  f"{store['launcher_ops']} ops, {store['launcher_bytes']} B)", flush=True)
            print(f"{'rank':>7} {'role':<9} {'peers':>6} {'ops':>5} {'bytes':>12} {'path_s':>6} {'window':>6} "
                  f"{'fenced':>6}  ops by call", flush=True)
            for rank, r in sorted(store["per_rank"].items(), key=lambda kv: int(kv[0])):
                mix = " ".join(f"{k}={v}" for k, v in sorted(r["by_op"].items()))
                print(f"{rank:>7} {r['role']:<9} {r['peers']:>6} {r['ops']:>5} {r['bytes']:>12} {r['seconds']:>6.2f} "
                      f"{r['window_s']:>6.2f} {len(r['declared']):>6}  "
                      f"{mix}", flush=True)
            ops = max(r["ops"] for r in store["per_rank"].values())
            top = max(store["per_rank"].values(), key=lambda r: r["bytes"])
            heaviest = sorted(top["bytes_by_op"].items(), key=lambda kv: -kv[1])[:3]
            print(f"store_ops_per_failure_per_rank (max over the sample)={ops}; most bytes: {top['bytes']} "
                  f"({', '.join(f'{k}={v}' for k, v in heaviest)})", flush=True)
        else:
            ops = None
            why = store.get("error") or f"exceeded the {store.get('exceeded_s')} s bound"
            print(f"store: not measured ({why})", flush=True)
        ctl = step_control(world)
        print(f"step control per rank: payload {ctl['payload_bytes']} B {ctl['payload']} (measured, the rank's "
              f"contribution); along the control tree ({ctl['levels']} levels, groups of at most "
              f"{ctl['largest_group']}): the root posts {ctl['root_calls']} collectives of {ctl['root_bytes']} B in "
              f"all, the last rank {ctl['leaf_calls']} (measured from the code path); a reduction crosses "
              f"{ctl['hops']} hops leaf to leaf against {ctl['ring_hops']} for a ring over the world (FORMULA, "
              f"not measured)", flush=True)
        summary[world] = {"plans": plans, "store_ops": ops, "control": ctl}
    return report(summary)


def report(summary: dict) -> int:
    """Targets met or missed, then the last line."""
    print("\n== targets ==")
    ops_by_size = {w: s["store_ops"] for w, s in summary.items() if s["store_ops"] is not None}
    print(f"store_ops_per_failure_per_rank by size: {ops_by_size}")
    big = 100_000 if 100_000 in summary else None
    if big is not None:
        plans = summary[big]["plans"].values()
        exceeded = [p for p in plans if "seconds" not in p]
        plan_s = f">{exceeded[0]['exceeded_s']:.0f}" if exceeded and "exceeded_s" in exceeded[0] else (
            "n/a" if exceeded else f"{max(p['seconds'] for p in plans):.3f}")
        plan_mb = "n/a" if exceeded else f"{max(p['rss_mb'] for p in plans):.0f}"
    else:
        plan_s = plan_mb = "n/a"
    ops = ops_by_size[max(ops_by_size)] if ops_by_size else "n/a"
    by_size = {w: s["control"]["payload_bytes"] for w, s in summary.items()}
    payload_bytes = max(by_size.values()) if by_size else "n/a"
    spread = (max(ops_by_size.values()) / min(ops_by_size.values()) - 1) if ops_by_size else None
    print(f"plan_s_100k {plan_s} (target <= {TARGETS['plan_s']}); plan_rss_mb_100k {plan_mb} (target <= "
          f"{TARGETS['plan_rss_mb']:.0f}); store ops {ops} (target <= {TARGETS['store_ops']}), spread across sizes "
          f"{fmt(spread * 100 if spread is not None else None, '%', 0)} (target <= 20%); step control payload by "
          f"size {by_size} B (measured; target: the same at every size)")
    print(f"plan_s_100k={plan_s} plan_rss_mb_100k={plan_mb} store_ops_per_failure_per_rank={ops} "
          f"step_control_bytes_per_rank={payload_bytes}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
