"""Turn a failure into the next generation's engine: detect, agree, regroup, reshard, re-slice, resume.

Everything happens in the surviving processes, from memory. Survivors snapshot their state (parameters, optimizer
fragments, the copies they keep for their buddies), agree on the dead through the store, tear down the old process
group, join a fresh one on the generation's store prefix, and build the new topology's engine: parameters come from
the units each rank already held plus exactly the missing units pulled from a peer replica; optimizer fragments are
re-sliced for the new anchors' ZeRO partitions from their live holders or, for a dead holder, its buddy's copy.
"""

from __future__ import annotations

import gc
import logging
import math
import time
import traceback
from dataclasses import dataclass, field

import torch

from ntp_ds.comm import wire
from ntp_ds.comm.exchange import Side, UnitExchange
from ntp_ds.control.heartbeat import (Heartbeat, LivenessMonitor, LivenessReader, mark_exited, poll_liveness,
                                      request_fence)
from ntp_ds.control.membership import BarrierWait, Membership, barrier, replica_membership
from ntp_ds.engine.config import ConfigError
from ntp_ds.engine.engine import write_hf_index, write_hf_shard
from ntp_ds.engine.initialize import JobSpec, build_engine, join_world
from ntp_ds.layout import ShardLayout, Topology
from ntp_ds.layout import units as U
from ntp_ds.layout.sharding import gather_units, packed_numel, scatter_units
from ntp_ds.models import CausalLMShard, empty_shard
from ntp_ds.recovery.plan import plan_last_good, plan_unit_moves, rereplicated_moves
from ntp_ds.recovery.reslice import reslice

log = logging.getLogger("ntp_ds.recovery")


class RecoveryImpossible(RuntimeError):
    """Training cannot go on in memory: no replica is left, or some parameter has no copy on any survivor."""


class NoReplicaLeft(RecoveryImpossible):
    """Every replica fell below `min_tp`."""


class QuiescedExit(SystemExit):
    """This rank leaves the job (its replica was dropped, or its own device failed)."""


@dataclass
class RecoveryOutcome:
    engine: object
    event: dict = field(default_factory=dict)


class Recovery:
    """One rank's live recovery. `rank` is its launch rank, which never changes; the global rank does."""

    def __init__(self, engine, store, rank: int, *, heartbeat_interval_s: float = 0.5,
                 heartbeat_timeout_s: float = 3.0, settle_s: float = 0.3, last_good_dir=None):
        ds = engine.job.ds_config
        if ds.get("bf16", {}).get("enabled") and not ds.get("zero_optimization", {}).get("stage", 0):
            raise ConfigError("zero_optimization.stage=0 with bf16.enabled=true: live recovery cannot read that "
                              "optimizer's fp32 masters; use stage 1 or 2")
        self.engine, self.store, self.rank = engine, store, rank
        self.last_good_dir = last_good_dir
        """Where the survivors write the last good weights (HF form) when no replica can go on."""
        self.members = tuple(range(engine.ntp_groups.topology.world_size))
        self.membership = Membership(store, rank, self.members, settle_s=settle_s)
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.heartbeat_interval_s = heartbeat_interval_s
        self.monitor = LivenessMonitor(self.members, heartbeat_timeout_s)
        self.reader = LivenessReader.from_env(store)
        beat_store = store.clone()
        self.heartbeat = Heartbeat(beat_store, rank, heartbeat_interval_s,
                                   monitor=LivenessMonitor((), heartbeat_timeout_s), on_dead=self._peers_dead,
                                   reader=LivenessReader.from_env(beat_store))
        self.heartbeat.watch(self._peers(engine), set(self.members) - {rank})
        self.heartbeat.start()
        self.events: list[dict] = []
        self.failed_attempts: list[float] = []
        """Wall times at which recovery attempts failed (a rank died during the recovery itself)."""
        self.job: JobSpec = engine.job
        self.on_phase = lambda step, phase: None
        """Called with phase "recovery" once the new membership is agreed, "rendezvous" as the survivors meet for
        the new generation and "transfer" as the lost units move: the fault-injection seams."""

    def close(self) -> None:
        self.heartbeat.stop()

    def _peers(self, engine) -> list[int]:
        """Launch ranks of the workers this rank exchanges data with: the ones whose hang would block it."""
        return sorted(self.members[r] for r in engine.peers())

    def _peers_dead(self, ranks: frozenset[int], wall: float) -> None:
        """From the heartbeat thread: a peer went silent or exited. Ask its launcher to stop it for good (its
        connections then close, which ends every gloo wait on it) and end this rank's waits on the wire (under
        NCCL this aborts the communicators)."""
        watched = set(self.heartbeat.monitor.ranks)
        reason = "; ".join(self.heartbeat.monitor.reason(r) if r in watched else f"rank {r} declared dead by a peer"
                           for r in sorted(ranks))
        log.warning("rank %d: %s", self.rank, reason)
        try:
            request_fence(self.heartbeat.store, ranks, reason)
        finally:
            wire.peer_failed(reason)

    def leave(self, reason: str) -> None:
        """Quiesce: tell the others this rank is gone, stop beating and exit cleanly (code 0)."""
        mark_exited(self.store, self.rank, reason)
        self.close()
        raise QuiescedExit(0)

    # -- the whole recovery -------------------------------------------------------------------------------------
    def recover(self, error: BaseException) -> RecoveryOutcome:
        """Recover from `error` (a failed collective or peer); retried if a rank fails during recovery itself."""
        failed_at = time.time()
        snapshot = self.engine.snapshot()
        old_members = self.members
        traceback.clear_frames(error.__traceback__)
        error.__traceback__ = error.__context__ = error.__cause__ = None
        self.engine.release()
        self.engine = None
        for attempt in range(len(self.members)):
            try:
                return self._attempt(snapshot, old_members, error, failed_at)
            except (RuntimeError, TimeoutError, ConnectionError) as again:
                if isinstance(again, RecoveryImpossible):
                    raise
                self.failed_attempts.append(time.time())
                log.warning("rank %d: recovery attempt %d failed (%s); retrying", self.rank, attempt + 1, again)
                error = again
        raise RuntimeError(f"rank {self.rank}: recovery did not converge after {len(self.members)} attempts")

    def _attempt(self, snapshot, old_members, error, failed_at) -> RecoveryOutcome:
        t0 = time.time()
        traffic_before = wire.traffic()
        self.heartbeat.watch([])  # the old generation's peers are judged by the detection below, not the watcher
        # Closing our connections fails every collective a live peer still waits on with us, so it joins the
        # recovery at once instead of at its process-group timeout (gloo closes them once unreferenced; NCCL
        # communicators are aborted first).
        wire.teardown()
        gc.collect()
        dead, reason = self._detect(error)
        request_fence(self.store, dead, reason)  # a hung rank is stopped by its launcher before it can come back
        generation = self.membership.generation
        self.membership.report_failure(generation, dead, time.time(), reason,
                                       {r: self.monitor.last_seen(r) for r in dead})
        # A survivor blocked in a collective with a hung peer arrives only after its process-group timeout.
        bound = 2 * self.job.ntp.timeout_s + self.heartbeat_timeout_s
        change = self.membership.await_decision(generation, bound)
        self.membership.confirm(change, bound)
        t_agreed = time.time()

        self.on_phase(snapshot.global_steps + 1, "recovery")
        gone = set(old_members) - set(change.survivors)
        plan = replica_membership(snapshot.topology, gone, old_members)
        drop = plan.below(self.job.ntp.min_tp)
        new_members = plan.ranks(drop)
        if not new_members:
            saved = self._save_last_good(snapshot, change)
            raise NoReplicaLeft(f"every replica is below min_tp={self.job.ntp.min_tp} after losing ranks "
                                f"{sorted(gone)}; {saved}")
        if self.rank not in new_members:
            log.warning("rank %d: replica dropped (below min_tp=%d); leaving", self.rank, self.job.ntp.min_tp)
            self.leave(f"replica below min_tp={self.job.ntp.min_tp}")
        new_topology = plan.topology(drop)

        self.on_phase(snapshot.global_steps + 1, "rendezvous")
        self._arrive(change.generation, new_members)
        join_world(self.job.ntp, self.store, change.generation, new_members.index(self.rank), len(new_members))
        self.members = new_members
        self.monitor.retain(new_members)
        self.heartbeat.watch([])  # peers are known once the new engine is built
        t_regrouped = time.time()

        old_rank_of = {i: old_members.index(m) for i, m in enumerate(new_members)}
        stale = dict(enumerate(wire.all_gather_object(snapshot.stale)))
        try:
            moves = plan_unit_moves(snapshot.topology, new_topology, old_rank_of, stale)
        except LookupError as e:
            raise RecoveryImpossible(f"{e}: every replica lost it (ranks {sorted(gone)} died); restart from the last "
                                     f"checkpoint") from None
        moved = {}
        rereplicated = rereplicated_moves(snapshot.topology, new_topology, old_rank_of, moves)
        engine = build_engine(self.job, new_topology,
                              lambda groups: self._reshard(groups, snapshot, moves, moved, rereplicated), self.store)
        dead_owners = {old_members.index(g) for g in gone}
        state = reslice(engine, snapshot, dead_owners)
        engine.global_steps, engine.global_samples = snapshot.global_steps, snapshot.global_samples
        # Before any optimizer step there is no state to copy (the first step sends it, layout included).
        if wire.sum_counts([len(engine.optimizer_keys())])[0]:
            engine.refresh_copies()
        # Lossless is what was installed: every element of every new fragment written, from a copy of the last step,
        # with intact payloads; a rank that died inside the optimizer left that step half done. Before the first
        # step the fallback (the parameter, zero moments) is the exact state: nothing is lost.
        whole = ((state["covered"] == state["wanted"] and state["checksums_ok"] and state["fresh"]
                  and not snapshot.mid_step) or snapshot.global_steps == 0)
        received = _received_by_kind(wire.traffic_since(traffic_before))
        totals = wire.sum_counts([moved.get("bytes", 0), moved.get("kv_rereplicated", 0), state["bytes_received"],
                                  state["restored_bytes"], int(whole)] + list(received.values()))
        self.heartbeat.watch(self._peers(engine), set(new_members) - {self.rank})
        barrier(self.store, f"recovery/{change.generation}/done", self.rank, new_members, self.job.ntp.timeout_s)
        t_done = time.time()

        rebuilt = [r for r in plan.degraded if r not in drop]
        lost_bytes = _lost_shard_bytes(snapshot.topology, old_members, gone, rebuilt, engine)
        event = {
            "generation": change.generation, "dead": sorted(gone), "dropped_replicas": list(drop),
            "degrees_before": list(snapshot.topology.degrees), "degrees_after": list(new_topology.degrees),
            "detection_s": change.detection_s, "failure_to_detection_s": t0 - failed_at,
            "agreement_s": t_agreed - t0, "regroup_s": t_regrouped - t_agreed, "reshard_s": t_done - t_regrouped,
            "bytes_moved": int(totals[0]), "lost_shard_bytes": lost_bytes,
            "kv_rereplicated_bytes": int(totals[1]), "rank_bytes_received": moved.get("bytes", 0),
            "optimizer_bytes_moved": int(totals[2]),
            "optimizer_bytes_restored": int(totals[3]), "lost_optimizer_bytes": state["lost_bytes"],
            "traffic_bytes": dict(zip(received, map(int, totals[5:]))),
            "lossless": int(totals[4]) == len(new_members),
            "reason": change.reason,
        }
        self.engine = engine
        self.events.append(event)
        log.warning("rank %d: recovered to generation %d, TP degrees %s -> %s", self.rank, change.generation,
                    event["degrees_before"], event["degrees_after"])
        return RecoveryOutcome(engine, event)

    def _save_last_good(self, snapshot, change) -> str:
        """Write the survivors' shards of the last completed step as a sharded HF directory: each survivor
        assembles and writes about 1/n of the tensors (never the whole model), the lowest writes the index."""
        if self.last_good_dir is None:
            return "no last_good_dir to write the last good state to"
        survivors = change.survivors
        me = survivors.index(self.rank)
        holders = [self.members.index(r) for r in survivors]
        model = empty_shard(self.job.model_config, device="meta")
        specs = {n: s for n, (s, _) in model.param_specs().items()}
        shapes = {n: shape for n, (_, shape) in model.param_specs().items()}
        try:
            writer, moves = plan_last_good(snapshot.topology, holders, specs, shapes)
        except LookupError as missing:  # every survivor computes the same plan, so all stop here alike
            return f"{missing}, so no last good state was written"
        join_world(self.job.ntp, self.store, change.generation, me, len(survivors))
        replica, tp = snapshot.topology.locate(snapshot.rank)
        unsharded = Side(ShardLayout.balanced(self.job.model_config.units(), 1), 0)
        device = wire.device_of()
        full = {n: torch.empty(shapes[n], device=device) for n, w in writer.items() if w == me}
        params = {n: t.float() for n, t in snapshot.params.items()}
        with torch.no_grad():
            for m in moves:
                if m.src == me and m.dst == me:
                    buf = gather_units(params[m.name], specs[m.name], snapshot.topology.layouts[replica], tp, m.units)
                    scatter_units(full[m.name], buf, specs[m.name], unsharded.layout, 0, m.units)
            UnitExchange(moves, me, specs, shapes, Side(snapshot.topology.layouts[replica], tp), unsharded,
                         self.job.ntp.bucket_size).run(params, full, dtype=torch.float32, device=device,
                                                       op="last_good")
        files = {w: i for i, w in enumerate(sorted(set(writer.values())))}
        name_of = {w: f"model-{i + 1:05d}-of-{len(files):05d}.safetensors" for w, i in files.items()}
        if full:
            write_hf_shard(self.last_good_dir, {n: t.cpu() for n, t in full.items()}, name_of[me])
        if me == 0:
            write_hf_index(self.last_good_dir, self.job.model_config, {n: name_of[w] for n, w in writer.items()},
                           sum(math.prod(s) * 4 for s in shapes.values()))
        wire.barrier()
        wire.teardown()
        return f"the last good state is in {self.last_good_dir}"

    def _arrive(self, generation: int, members) -> None:
        """Meet the new generation's members before joining its process group, watching their liveness: a member
        that dies or hangs on the way is found within the heartbeat timeout and this attempt fails (the recovery
        then starts again without it), where the process group's own rendezvous would wait for its store timeout."""
        others = set(members) - {self.rank}
        wait = BarrierWait(self.store, f"recovery/{generation}/arrive", self.rank, members, self.job.ntp.timeout_s)
        while (pause := wait.poll()) is not None:
            dead = poll_liveness(self.store, self.monitor, self.reader) & others
            if dead:
                raise RuntimeError(f"rank(s) {sorted(dead)} died before generation {generation}'s rendezvous: "
                                   + "; ".join(self.monitor.reason(r) for r in sorted(dead)))
            time.sleep(pause)

    # -- detection ----------------------------------------------------------------------------------------------
    def _detect(self, error: BaseException) -> tuple[frozenset[int], str]:
        """Find the dead members: marked exited, silent past the heartbeat timeout, or reported by a peer."""
        deadline = time.monotonic() + 2 * self.heartbeat_timeout_s + self.job.ntp.timeout_s
        pause = 0.05
        while time.monotonic() < deadline:
            dead = poll_liveness(self.store, self.monitor, self.reader) & set(self.members)
            reported = {r for rep in self.membership.reports(self.membership.generation) for r in rep.ranks}
            dead |= reported & set(self.members)
            if dead:
                return frozenset(dead), "; ".join(self.monitor.reason(r) for r in sorted(dead)) or str(error)
            time.sleep(pause)  # backs off to a beat interval: every survivor polls here at once
            pause = min(2 * pause, max(0.05, self.heartbeat_interval_s))
        raise error

    # -- parameters ---------------------------------------------------------------------------------------------
    def _reshard(self, groups, snapshot, moves, moved: dict, rereplicated=()) -> CausalLMShard:
        """Build this rank's new shard: keep the units it held, pull the missing ones from their holders."""
        module = empty_shard(self.job.model_config, groups.layout, groups.tp_rank, groups.tp_group)
        spec_shapes = module.param_specs()
        specs = {n: s for n, (s, _) in spec_shapes.items()}
        full_shapes = {n: shape for n, (_, shape) in spec_shapes.items()}
        new_params = dict(module.named_parameters())
        old_replica, old_tp = snapshot.topology.locate(snapshot.rank)
        old_layout = snapshot.topology.layouts[old_replica]
        with torch.no_grad():
            for name, spec in specs.items():
                keep = U.intersect(old_layout.owned(spec.kind, old_tp), groups.layout.owned(spec.kind, groups.tp_rank))
                keep = U.subtract(keep, snapshot.stale.get(spec.kind, ()))  # fetched afresh with the moves
                if keep:
                    buf = gather_units(snapshot.params[name].float(), spec, old_layout, old_tp, keep)
                    scatter_units(new_params[name].data, buf, spec, groups.layout, groups.tp_rank, keep)
            self.on_phase(snapshot.global_steps + 1, "transfer")  # its peers are blocked in this exchange with it
            moved["bytes"] = self._exchange_units(moves, groups, snapshot, old_layout, old_tp, specs, full_shapes,
                                                  new_params)
        width = next(iter(snapshot.params.values())).element_size()
        moved["kv_rereplicated"] = sum(packed_numel(specs[n], tuple(new_params[n].shape), m.units) * width
                                       for m in rereplicated if m.dst == groups.rank
                                       for n in specs if specs[n].kind == m.kind)
        return module

    def _exchange_units(self, moves, groups, snapshot, old_layout, old_tp, specs, full_shapes, new_params) -> int:
        """Pull the missing units: senders pack them out of their old layout, receivers unpack into the new one."""
        exchange = UnitExchange(moves, groups.rank, specs, full_shapes, Side(old_layout, old_tp),
                                Side(groups.layout, groups.tp_rank), self.job.ntp.bucket_size)
        dtype = next(iter(snapshot.params.values())).dtype
        return exchange.run(snapshot.params, {n: p.data for n, p in new_params.items()}, dtype=dtype,
                            device=wire.device_of(), op="reshard")


TRAFFIC_KINDS = {"parameters": ("reshard", "param_sync"), "optimizer": ("reslice",),
                 "redundancy": ("copy_data", "copy_piece", "copy_layout"),
                 "objects": ("all_gather_object", "gather_object", "broadcast_object")}
"""How recovery's measured traffic is reported: call names of the wire layer by kind; the rest is "control"."""


def _received_by_kind(traffic: dict[tuple[str, str], int]) -> dict[str, int]:
    """Bytes this rank received, per kind of traffic, from a reading of the wire's meter."""
    kind_of = {op: kind for kind, ops in TRAFFIC_KINDS.items() for op in ops}
    out = dict.fromkeys([*TRAFFIC_KINDS, "control"], 0)
    for (op, direction), n in traffic.items():
        if direction == "received":
            out[kind_of.get(op, "control")] += n
    return out


def _lost_shard_bytes(topology: Topology, members, gone, rebuilt, engine) -> int:
    """Parameter bytes the dead ranks of the rebuilt replicas held that no survivor of their replica holds (a unit
    two dead ranks shared, a GQA KV head, counts once)."""
    total = 0
    width = next(engine.module.parameters()).element_size()
    dead = {members.index(g) for g in gone}
    for replica in rebuilt:
        lay, ranks = topology.layouts[replica], topology.ranks_of(replica)
        for name, spec in engine.param_specs.items():
            lost = U.union(*(lay.owned(spec.kind, t) for t in range(lay.tp) if ranks[t] in dead))
            units = U.subtract(lost, U.union(*(lay.owned(spec.kind, t) for t in range(lay.tp) if ranks[t] not in dead)))
            if units:
                total += packed_numel(spec, engine.full_shapes[name], units) * width
    return total
