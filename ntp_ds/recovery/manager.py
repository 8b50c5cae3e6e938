"""Turn a failure into the next generation's engine: detect, agree, regroup, reshard, re-slice, resume.

Everything happens in the surviving processes, from memory. Survivors snapshot their state (parameters, optimizer
fragments, the copies they keep for their buddies), agree on the dead through the store, tear down the old process
group, join a fresh one on the generation's store prefix, and build the new topology's engine: parameters come from
the units each rank already held plus exactly the missing units pulled from a peer replica; optimizer fragments are
re-sliced for the new anchors' ZeRO partitions from their live holders or, for a dead holder, its buddy's copy.
"""

from __future__ import annotations

import hashlib
import logging
import time
import traceback
from array import array
from dataclasses import dataclass, field

import torch

from ntp_ds.comm import wire
from ntp_ds.comm.exchange import Side, UnitExchange, assemble_whole
from ntp_ds.comm.groups import (adopt, count_communicators, discard_unused, keepable, mark_communicators,
                                ring_neighbours, role_of)
from ntp_ds.control.heartbeat import (Heartbeat, LivenessMonitor, LivenessReader, mark_exited,
                                      read_exits, request_fence)
from ntp_ds.control.joins import (JoinFailed, JoinPlan, JoinRequest, JoinRequests, admit, await_decision,
                                  await_verdict, fingerprint, propose_join, read_join_plan, refuse, request_join)
from ntp_ds.control.membership import BarrierWait, Membership, MembershipChange, barrier, replica_membership
from ntp_ds.engine.config import ConfigError
from ntp_ds.engine.copies import release_cached_host_memory
from ntp_ds.engine.engine import Snapshot
from ntp_ds.engine.fragments import fragment_addresses, params_from_masters
from ntp_ds.engine.initialize import JobSpec, build_engine, build_topology, join_world, rebind_engine
from ntp_ds.engine.recut import recuttable
from ntp_ds.layout import Topology, plan_gradient_sync, plan_whole_tensors
from ntp_ds.layout import units as U
from ntp_ds.layout.sharding import gather_units, packed_numel, scatter_units
from ntp_ds.models import CausalLMShard, empty_shard
from ntp_ds.models.checkpoint import write_whole_tensors
from ntp_ds.recovery.keep import close_hit, depart, departed, keep, positions, suspects
from ntp_ds.recovery.placement import Placement
from ntp_ds.recovery.plan import (collector_paused, keeps_place, old_ranks, plan_unit_moves, rebalanced_moves,
                                  rereplicated_moves)
from ntp_ds.recovery.reslice import reslice
from ntp_ds.recovery.rollback import offered, roll_back

log = logging.getLogger("ntp_ds.recovery")


JOIN_ATTEMPTS = 3
"""Boundaries a joiner asks for before it gives up, when failures keep taking them."""


class RecoveryImpossible(RuntimeError):
    """Training cannot go on in memory: no replica is left, or some parameter has no copy on any survivor."""


def failed_on_the_way(error: BaseException) -> bool:
    """Whether `error`, raised while a recovery or a grow was under way, is a failure to start it again from: a
    member lost meanwhile (the recovery's own checks raise RuntimeError), a failure of the wire, or anything that
    fails once a peer has been declared dead (`wire.is_wire_failure`: DeepSpeed's own calls assert on a world the
    abort thread has aborted). Never `RecoveryImpossible`."""
    if isinstance(error, RecoveryImpossible):
        return False
    return isinstance(error, (RuntimeError, TimeoutError, ConnectionError)) or wire.is_wire_failure(error)


class NoReplicaLeft(RecoveryImpossible):
    """Every replica fell below `min_tp`."""


class QuiescedExit(SystemExit):
    """This rank leaves the job (its replica was dropped, or its own device failed)."""


@dataclass
class RecoveryOutcome:
    engine: object
    event: dict = field(default_factory=dict)


class Recovery:
    """One rank's live recovery and growth. `rank` is its launch rank, which never changes; the global rank does.

    A running member passes its engine; a joiner (`Recovery.join`) starts without one and gets it from the members.
    """

    def __init__(self, engine, store, rank: int, *, heartbeat_interval_s: float = 0.5,
                 heartbeat_timeout_s: float = 3.0, hang_timeout_s: float | None = None, settle_s: float = 0.3,
                 last_good_dir=None,
                 job: JobSpec | None = None, members: tuple[int, ...] | None = None, generation: int = 0):
        self.job: JobSpec = engine.job if engine is not None else job
        if self.job.ds_config.get("bf16", {}).get("enabled") and not self.job.zero_stage:
            raise ConfigError("zero_optimization.stage=0 with bf16.enabled=true: live recovery cannot read that "
                              "optimizer's fp32 masters; use stage 1 or 2")
        self.engine, self.store, self.rank = engine, store, rank
        self.last_good_dir = last_good_dir
        """Where the survivors write the last good weights (HF form) when no replica can go on."""
        self.members = tuple(range(engine.ntp_groups.topology.world_size)) if members is None else tuple(members)
        """Launch ranks of the generation's members, in global-rank order."""
        self.membership = Membership(store, rank, self.members, generation, settle_s=settle_s)
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.heartbeat_interval_s = heartbeat_interval_s
        self._kept_here: list[str] = []
        """Roles of the groups this rank kept in the recovery or grow under way (the event's `kept_here`)."""
        self._held = None
        """A member's engine during a recovery or a grow (detached from the old generation's groups): kept if this
        rank keeps its place (`rebind`), else released once that is known."""
        self._candidates: list = []
        """Groups a recovery may keep (`keep.keep`), from its start to its first attempt's teardown."""
        self.declared: dict[int, str] = {}
        """Members of this generation that this rank's heartbeat declared dead, with why: a hung peer still beats,
        so only this verdict names it."""
        # Connecting the heartbeat's store clients waits on the store's server: seconds when a whole job connects at
        # once (seen here: 3.4 s on a loaded 2-core machine), and not this rank's own work, so neither a hang nor a
        # silence. A peer still connecting when this rank starts watching has not beaten yet: it gets the job's
        # collective bound on top of the heartbeat timeout for its first beat (CI saw rank 0 declared dead at start).
        self.first_beat_timeout_s = heartbeat_timeout_s + self.job.ntp.timeout_s
        self.monitor = LivenessMonitor((), heartbeat_timeout_s)
        """What this rank saw of the peers whose beats it judges during a recovery (a bounded set: those its heartbeat
        watched); every other member's death reaches it through the exit and fence logs and the reports."""
        self.reader = LivenessReader.from_env(store)
        with wire.waiting():
            # Departures are asked from the training thread and, under NCCL, the abort thread: a client of their own.
            departures = store.clone()
            wire.on_departure(lambda group: departed(departures, self.membership.generation, group))
            beat_store = store.clone()
            # A peer that beats but makes no training progress while this rank waits on it is hung (hang_timeout_s).
            self.heartbeat = Heartbeat(beat_store, rank, heartbeat_interval_s,
                                       monitor=LivenessMonitor((), heartbeat_timeout_s, hang_timeout_s=hang_timeout_s,
                                                               first_beat_timeout_s=self.first_beat_timeout_s),
                                       on_dead=self._peers_dead, reader=LivenessReader.from_env(beat_store),
                                       progress=wire.progress)
            if engine is not None:
                self._watch(self._peers(engine))
            self.heartbeat.start()
        self.events: list[dict] = []
        self.failed_attempts: list[float] = []
        """Wall times at which recovery attempts failed (a rank died during the recovery itself)."""
        self.placement = Placement.initial(build_topology(self.job.units(), self.job.ntp))
        """Which configured replica and healthy TP slot each member holds: where joiners go."""
        self.joins = JoinRequests(store)
        self._expected: list[int] = []
        """Steps from which scheduled repairs' replacements train (`expect_joiners`)."""
        self.fingerprint = job_fingerprint(self.job)
        """What a joiner's configuration must match."""
        self.on_phase = lambda step, phase: None
        """Called with phase "recovery" once the new membership is agreed, "rendezvous" as the survivors meet for
        the new generation, "groups" as its communicators are about to be created (its members all met) and
        "transfer" as the lost units move: the fault-injection seams."""

    def _phase(self, step: int, phase: str) -> None:
        """A phase point of a recovery: this rank's own work for the heartbeat's progress, then the seam. The rest
        of a recovery counts as waiting (agreement, rendezvous and transfers wait on peers; a member's stall is not
        judged by progress there, the recovery's own bounds end it)."""
        with wire.working():
            self.on_phase(step, phase)

    def close(self, finished: bool = False) -> None:
        """Stop beating; with `finished` (the run is over, or stopped), global rank 0 also refuses the joiners still
        waiting."""
        if finished and self.members and self.members[0] == self.rank:
            try:
                self._refuse_all("the job ended before it could take this worker in")
            except Exception as e:  # the store may be gone with the job: the joiners' own bound ends their wait
                log.warning("could not answer the joiners still waiting: %s", e)
        self.heartbeat.stop()

    def _watch(self, peers) -> None:
        """Watch `peers`' beats from now on (the heartbeat's thread, and `_detect` after a failure); of every other
        member, a fence request."""
        self.heartbeat.watch(sorted(set(peers) - {self.rank}), set(self.members) - {self.rank})

    def _peers(self, engine) -> list[int]:
        """Launch ranks of the workers this rank watches (`NTPEngine.watched_peers`: those it exchanges data with,
        of its data-parallel group its two ring neighbours)."""
        return sorted(self.members[r] for r in engine.watched_peers())

    def _peers_dead(self, ranks: frozenset[int], wall: float) -> None:
        """From the heartbeat thread: a peer went silent or exited. Ask its launcher to stop it for good (its
        connections then close, which ends every gloo wait on it) and end this rank's waits on the wire (under
        NCCL this aborts the communicators)."""
        ranks = ranks & frozenset(self.members)
        if not ranks:  # a verdict on a generation this rank has already left (its dead are not members any more)
            return
        monitor = self.heartbeat.monitor
        judged = monitor.dead() | monitor.hung()  # the rest: fenced at another peer's request
        reason = "; ".join(monitor.reason(r) if r in judged else f"rank {r} declared dead by a peer"
                           for r in sorted(ranks))
        self.declared.update((r, reason) for r in ranks)
        log.warning("rank %d: %s", self.rank, reason)
        try:
            request_fence(self.heartbeat.store, ranks, reason)
        finally:
            wire.peer_failed(reason, suspects=self._suspects(ranks), arrival_s=self.heartbeat_timeout_s)

    def _suspects(self, dead) -> list[int] | None:
        """`keep.suspects` of `dead` (launch ranks), from the heartbeat's thread; None when the topology is not at hand
        (a recovery under way): then every group is suspect."""
        members, engine = self.members, self.engine
        try:
            return suspects(engine.ntp_groups.topology, members, dead)
        except (AttributeError, ValueError, IndexError, TypeError):
            return None

    def leave(self, reason: str) -> None:
        """Quiesce: tell the others this rank is gone, stop beating and exit cleanly (code 0)."""
        mark_exited(self.store, self.rank, reason)
        self.close()
        raise QuiescedExit(0)

    # -- the whole recovery -------------------------------------------------------------------------------------
    def recover(self, error: BaseException) -> RecoveryOutcome:
        """Recover from `error` (a failed collective or peer); retried if a rank fails during recovery itself."""
        with wire.waiting(), collector_paused():
            outcome = self._recover(error)
        release_cached_host_memory()  # the old engine's and the snapshot's pinned copies, unreferenced now
        return outcome

    def _recover(self, error: BaseException) -> RecoveryOutcome:
        if self.engine is None:  # an earlier recovery or grow gave up half way: there is no state to carry on from
            raise RecoveryImpossible(f"rank {self.rank}: no engine to recover ({type(error).__name__}: {error}); an "
                                     "earlier recovery did not complete")
        failed_at = time.monotonic()
        mark_communicators()  # what exists now and is still in use after the recovery was kept
        depart(self.store, self.membership.generation)
        if wire.is_nccl():
            # Abort first: the snapshot and the engine's release synchronise with the device, which must not wait
            # on a kernel blocked on the dead peer. Transfers not confirmed by now are lost with the communicators.
            # Only the groups without a suspect are spared (when the watcher named the dead), for `keep.keep`.
            wire.peer_failed(f"recovering from {type(error).__name__}: {error}")
            self._candidates = keepable(wire.arrive())
        else:
            self._candidates = keepable(torch.distributed.distributed_c10d._world.pg_map)
        snapshot = self.engine.snapshot()
        old_members = self.members
        traceback.clear_frames(error.__traceback__)
        error.__traceback__ = error.__context__ = error.__cause__ = None
        self._hold_engine()
        return self._recover_from(snapshot, old_members, error, failed_at)

    def _hold_engine(self) -> None:
        """Detach the engine from the generation's groups (`NTPEngine.detach`) and hold it until the new topology
        says whether this rank keeps it."""
        self.engine.detach()
        self._held, self.engine = self.engine, None

    def _release_held(self) -> None:
        if self._held is not None:
            self._held.release()
            self._held = None

    def _recover_from(self, snapshot, old_members, error, failed_at) -> RecoveryOutcome:
        for attempt in range(len(self.members)):
            try:
                return self._attempt(snapshot, old_members, error, failed_at)
            except Exception as again:
                if not failed_on_the_way(again):
                    raise
                self.failed_attempts.append(time.time())
                snapshot.whole_grads = False  # what an attempt took of them is gone with it
                log.warning("rank %d: recovery attempt %d failed (%s); retrying", self.rank, attempt + 1, again)
                error = again
        raise RecoveryImpossible(f"rank {self.rank}: recovery did not converge after {len(self.members)} attempts "
                                 f"(the last failed with: {error})")

    def _attempt(self, snapshot, old_members, error, failed_at) -> RecoveryOutcome:
        t0 = time.monotonic()
        traffic_before = wire.traffic()
        silent = self.heartbeat.silences()  # how long each watched peer has shown no sign of life, on this host's clock
        # The old generation's peers are judged by the detection below, not the watcher, from what it saw of them
        # (a retry finds the watcher idle, and keeps the monitor of the attempt before).
        seen = self.heartbeat.watch([])
        if seen.ranks:
            self.monitor = seen
        # Closing our connections fails every collective a live peer still waits on with us, so it joins the
        # recovery at once instead of at its process-group timeout (gloo closes them once unreferenced; NCCL
        # communicators are aborted first). The groups that may be kept stay open until `keep.keep` decides (a peer
        # waiting in one of them stops once a member has departed: `keep.depart`); only the first attempt keeps any.
        candidates, self._candidates = self._candidates, []
        if self._held is not None:  # an attempt before this one may have rebound it to its groups
            self._held.detach()
        discard_unused()
        wire.teardown(keep=candidates)
        dead, reason = self._detect(error)
        candidates = close_hit(candidates, snapshot.topology, old_members, dead)
        request_fence(self.store, dead, reason)  # a hung rank is stopped by its launcher before it can come back
        generation = self.membership.generation
        self.membership.report_failure(generation, dead, time.time(), reason,
                                       {r: silent[r] for r in dead if r in silent})
        # A survivor blocked in a collective with a hung peer arrives only after its process-group timeout.
        bound = 2 * self.job.ntp.timeout_s + self.heartbeat_timeout_s
        change = self.membership.await_decision(generation, bound)
        self._confirm(change, bound)
        t_agreed = time.monotonic()

        self._phase(snapshot.global_steps + 1, "recovery")
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
            self._release_held()
            self.leave(f"replica below min_tp={self.job.ntp.min_tp}")
        new_topology = plan.topology(drop)
        placement = self.placement.after_loss(plan.lost, drop)

        kept = keep(self.store, self.rank, candidates, old_members, new_members, new_topology,
                    plan_gradient_sync(new_topology), change.generation, self.job.ntp.timeout_s)
        self._kept_here = sorted(role_of(g) for g in kept)
        self._phase(snapshot.global_steps + 1, "rendezvous")
        self._regroup(change.generation, new_members, kept, old_members)
        snapshot = self._share_context(snapshot, frozenset(old_members.index(g) for g in gone))
        t_regrouped = time.monotonic()
        rebuilt = [r for r in plan.degraded if r not in drop]
        event = {"dead": sorted(gone), "dropped_replicas": list(drop), "detection_s": change.detection_s,
                 "snapshot_s": t0 - failed_at, "agreement_s": t_agreed - t0,
                 "regroup_s": t_regrouped - t_agreed, "reason": change.reason}
        engine, event = self._install(snapshot, old_members, change.generation, new_topology, new_members, placement,
                                      {old_members.index(g) for g in gone}, traffic_before, event)
        event["lost_shard_bytes"] = _lost_shard_bytes(snapshot.topology, old_members, gone, rebuilt, engine)
        event["reshard_s"] = time.monotonic() - t_regrouped
        log.warning("rank %d: recovered to generation %d, TP degrees %s -> %s", self.rank, change.generation,
                    event["degrees_before"], event["degrees_after"])
        self.events.append(event)
        return RecoveryOutcome(engine, event)

    def _regroup(self, generation: int, members: tuple[int, ...], kept=(), old_members=()) -> None:
        """Meet the new generation's members and join its process group; carry the `kept` groups (of the
        generation of `old_members`) into it."""
        self._arrive(generation, members)
        self.members = members  # first: a late verdict on the old generation's dead must not break the new one
        self.declared = {}
        join_world(self.job.ntp, self.store, generation, members.index(self.rank), len(members))
        if kept:
            new_rank = positions(members)
            adopt(kept, {r: new_rank[old_members[r]] for g in kept
                         for r in torch.distributed.get_process_group_ranks(g)})
        # Until the new engine is built (and its peers are known), a death must still end this rank's waits: on
        # NCCL nothing else does (no error, no timeout). Its ring neighbours among the members watch each member
        # meanwhile, and a death they see reaches every other member as a fence request.
        self._watch(ring_neighbours(list(members), self.rank))

    def _share_context(self, snapshot, dead: frozenset = frozenset()):
        """Every member's stale units, and what a joiner lacks (the old topology, steps, learning-rate state) from
        the lowest rank that held an optimizer; return the snapshot completed with it."""
        whole = (snapshot is not None and snapshot.whole_grads and self._held is not None
                 and recuttable(self._held.optimizer))
        mine = {"stale": snapshot.stale if snapshot is not None else {}, "whole": whole,
                "lr": snapshot is not None and snapshot.lr_state is not None, **offered(snapshot)}
        gathered = wire.all_gather_object(mine)
        rolled_back = snapshot is not None and roll_back(self.job.buddies(snapshot.topology), gathered, dead)
        if rolled_back:
            snapshot.global_steps, snapshot.global_samples, snapshot.lr_state, target = snapshot.before_step
            # Serve only the copies of the step rolled back to (the newest such of each owner).
            snapshot.held = {o: c for copies in (snapshot.previous, snapshot.held) for o, c in copies.items()
                             if c.step == target}
        src = next((i for i, g in enumerate(gathered) if g["lr"]), None)
        if src is None:
            src = next(i for i, g in enumerate(gathered) if g["held"])
        me = self.members.index(self.rank)
        context = None
        if me == src:
            context = {"topology": snapshot.topology, "placement": self.placement, "lr_state": snapshot.lr_state,
                       "global_steps": snapshot.global_steps, "global_samples": snapshot.global_samples}
        context = wire.broadcast_object(context, src)
        if snapshot is None:
            snapshot = Snapshot(topology=context["topology"], rank=None, params={}, fragments={}, keys=(),
                                optimizer_step=0, held={}, global_steps=context["global_steps"],
                                global_samples=context["global_samples"], mid_step=False, stale={}, lr_state=None)
            self.placement = context["placement"]
        snapshot.stale_by_rank = {i: g["stale"] for i, g in enumerate(gathered)}
        snapshot.whole_by_rank = {i: g["whole"] for i, g in enumerate(gathered)}
        snapshot.rolled_back = rolled_back
        snapshot.any_mid_step = any(g["mid_step"] for g in gathered)
        snapshot.carried_lr = context["lr_state"]
        return snapshot

    def _install(self, snapshot, old_members, generation, new_topology, new_members, placement, dead_owners,
                 traffic_before, event) -> tuple:
        """Build the new generation's engine: parameters from the units held plus the missing ones pulled from their
        holders, optimizer state re-sliced from live fragments and copies; measure what was installed."""
        old_rank_of = old_ranks(old_members, new_members)
        try:
            moves = plan_unit_moves(snapshot.topology, new_topology, old_rank_of, snapshot.stale_by_rank)
        except LookupError as e:
            raise RecoveryImpossible(f"{e}: every replica lost it (ranks {sorted(set(old_members) - set(new_members))} "
                                     f"died); restart from the last checkpoint") from None
        moved = {}
        rereplicated = rereplicated_moves(snapshot.topology, new_topology, old_rank_of, moves)
        rebalanced = rebalanced_moves(snapshot.topology, new_topology, old_rank_of, moves)
        me = new_members.index(self.rank)
        held = self._held
        grads = held.take_grads() if held is not None else {}
        self._phase(snapshot.global_steps + 1, "groups")
        if held is None or not (recuttable(held.optimizer) and keeps_place(snapshot.topology, snapshot.rank,
                                                                           new_topology, me)
                                and not any(m.dst == me for m in moves)):
            self._release_held()
            engine = build_engine(self.job, new_topology,
                                  lambda groups: self._reshard(groups, snapshot, moves, moved, rereplicated,
                                                               rebalanced),
                                  self.store, resharded=True)
        else:
            engine = rebind_engine(self.job, new_topology, held, lambda groups: self._serve(
                held, groups, snapshot, moves, moved))
        engines_built = int(engine is not held)
        created, kept = count_communicators()
        state = reslice(engine, snapshot, dead_owners, own=not snapshot.rolled_back)
        if snapshot.params_from_masters:
            params_from_masters(engine)
            engine.sync_parameters()
        engine.global_steps, engine.global_samples = snapshot.global_steps, snapshot.global_samples
        restore_learning_rate(engine, snapshot.carried_lr)
        kept_samples = self._resume(engine, snapshot, new_topology, old_rank_of, moves, grads)
        # Before any optimizer step there is no state to copy (the first step sends it, layout included). The new
        # layout's copies travel during the step that follows, off the recovery's critical path, and are awaited
        # before its optimizer step: a failure before they land is recovered as not lossless.
        if wire.sum_counts([len(engine.optimizer_keys())])[0]:
            engine.refresh_copies(overlap=True)
        # Lossless is what was installed: every element of every new fragment written, all of one step (the last
        # committed one after a roll-back), with intact payloads. Before the first step the fallback (the parameter,
        # zero moments) is the exact state: nothing is lost, unless that first step was half applied.
        whole = ((state["covered"] == state["wanted"] and state["checksums_ok"] and state["fresh"])
                 or (snapshot.global_steps == 0 and not snapshot.params_from_masters))
        received = _received_by_kind(wire.traffic_since(traffic_before))
        totals = wire.sum_counts([moved.get("bytes", 0), moved.get("kv_rereplicated", 0), state["bytes_received"],
                                  state["restored_bytes"], int(whole), moved.get("rebalanced", 0),
                                  state["lost_bytes"], engines_built, created, kept,
                                  snapshot.refused.get("param_buckets", 0), len(snapshot.refused.get("copies", ())),
                                  int(bool(snapshot.refused.get("grads")))] + list(received.values()))
        self._watch(self._peers(engine))
        barrier(self.store, f"recovery/{generation}/done/{_digest(new_members)}", self.rank, new_members,
                self.job.ntp.timeout_s)
        self.engine, self.placement, self._held = engine, placement, None
        event = {"generation": generation, **event,
                 "degrees_before": list(snapshot.topology.degrees), "degrees_after": list(new_topology.degrees),
                 "bytes_moved": int(totals[0]), "kv_rereplicated_bytes": int(totals[1]),
                 "rebalanced_bytes": int(totals[5]),
                 "rank_bytes_received": moved.get("bytes", 0), "optimizer_bytes_moved": int(totals[2]),
                 "optimizer_bytes_restored": int(totals[3]), "lost_optimizer_bytes": int(totals[6]),
                 "state_index": state["state_index"],
                 "engines_rebuilt": int(totals[7]), "communicators_created": int(totals[8]),
                 "communicators_kept": int(totals[9]), "kept_here": self._kept_here,
                 "rank_state_elements": {k: state[k] for k in ("wanted", "kept", "from_copies", "received")}
                 | {"keepable": _keepable(snapshot, engine) if not engines_built else None},
                 "traffic_bytes": dict(zip(received, map(int, totals[13:]))), "rolled_back": snapshot.rolled_back,
                 "refused": {"param_buckets": int(totals[10]), "copies": int(totals[11]), "grads": int(totals[12])},
                 "rank_refused": snapshot.refused,
                 "samples_kept": kept_samples,
                 "lossless": int(totals[4]) == len(new_members)}
        return engine, event

    def _resume(self, engine, snapshot, new_topology, old_rank_of, moves, grads) -> int:
        """Where replicas that lost nothing hold the interrupted step's gradients whole on every rank, and every rank
        of theirs keeps its engine, keep those gradients and run only the rest of the step: the other replicas'
        samples spread over all of them (`JobSpec.resume_plan`). Decided alike on every rank from what each one
        told (`_share_context`). Return the samples kept (0: the whole step is run again)."""
        old = snapshot.topology
        if (snapshot.rolled_back or snapshot.any_mid_step or snapshot.batch_plan is None
                or len(new_topology.layouts) != len(old.layouts)):
            return 0
        destinations = {m.dst for m in moves}
        old_sync, new_sync = plan_gradient_sync(old), plan_gradient_sync(new_topology)

        def keeps(replica: int) -> bool:
            """An anchor before and after with the same layout (so each rank keeps its place, as `keeps_place`
            says), every rank of it the same worker at the same TP index, none receiving a unit, all whole."""
            if (new_topology.layouts[replica] != old.layouts[replica] or not old_sync.is_anchor(replica)
                    or not new_sync.is_anchor(replica)):
                return False
            return all(snapshot.whole_by_rank.get(i) and i not in destinations and i in old_rank_of
                       and old.locate(old_rank_of[i]) == new_topology.locate(i)
                       for i in new_topology.rank_range(replica))

        kept = tuple(r for r in range(len(new_topology.layouts)) if keeps(r))
        plan = self.job.resume_plan(new_topology, snapshot.batch_plan, kept) if kept else None
        if plan is None:
            return 0
        mine = engine.ntp_groups.replica in kept
        if mine and not grads:
            raise RecoveryImpossible(f"rank {self.rank}: told its gradients were whole but holds none")
        scale = len(new_sync.anchors) / len(old_sync.anchors)
        engine.resume(plan, grads if mine else {}, scale)
        return plan.kept

    # -- growing back -------------------------------------------------------------------------------------------
    def at_boundary(self, completed: int, last_step: int | None = None) -> RecoveryOutcome | None:
        """After step `completed`: admit due joiners (global rank 0 plans it, while a step is left for them after
        the next one, `last_step` being the run's last) and grow if this is the planned boundary; return the grown
        engine's outcome, or None (one store request per rank while nobody joins)."""
        generation = self.membership.generation
        if self.members.index(self.rank) == 0 and (last_step is None or completed + 2 <= last_step):
            self._await_expected_joiners(completed)
            self._plan_joins(generation, completed)
        plan = read_join_plan(self.store, generation)
        if plan is None or plan.after != completed or not plan.joiners:
            return None
        return self.grow(plan)

    def expect_joiners(self, steps) -> None:
        """Scheduled repairs: a replacement worker trains from each of these steps (1-based). Global rank 0 holds the
        boundary at which it plans a step's joins until as many join requests as repairs due by then have arrived,
        so a repair takes effect at its step however long the replacement takes to start; the hold is bounded by
        half the job's collective bound (the other members wait in the next step meanwhile), after which the
        repair waits for a later boundary."""
        self._expected = sorted(int(s) for s in steps)

    def _await_expected_joiners(self, completed: int) -> None:
        due = sum(1 for s in self._expected if s <= completed + 2)
        if not due or len(self.joins.read()) >= due:
            return
        deadline = time.monotonic() + self.job.ntp.timeout_s / 2
        with wire.waiting():
            while len(self.joins.read()) < due:
                if time.monotonic() > deadline:
                    log.warning("rank %d: %d repair(s) due by step %d, but only %d join request(s) arrived within "
                                "%.0f s; going on", self.rank, due, completed + 2, len(self.joins.read()),
                                self.job.ntp.timeout_s / 2)
                    self._expected = [s for s in self._expected if s > completed + 2]
                    return
                time.sleep(0.05)

    def _refuse_all(self, reason: str) -> None:
        for request in self.joins.pending(self.membership.generation + 1, self.members):
            refuse(self.store, request.rank, self._unfit(request) or f"rank {request.rank}: {reason}")

    def _unfit(self, request: JoinRequest) -> str | None:
        """Why `request` can never be taken in, or None."""
        if request.fingerprint != self.fingerprint:
            return (f"rank {request.rank} runs another job configuration (fingerprint {request.fingerprint}, the "
                    f"job's is {self.fingerprint}): the same model, DeepSpeed and parallel configs are required to "
                    f"join")
        if request.rank in self.members:
            return f"rank {request.rank} is already a member of the job"
        return None

    def _plan_joins(self, generation: int, completed: int) -> None:
        pending = self.joins.pending(generation, self.members)
        if not pending or read_join_plan(self.store, generation) is not None:
            return
        gone = read_exits(self.store)  # a joiner that failed its join, or died waiting, is not planned again
        pending = [r for r in pending if r.rank not in gone]
        if not pending:
            return
        due, refused, walls = [], {}, {}
        for request in pending:
            if (why := self._unfit(request)) is not None:
                refused[request.rank] = why
            elif request.not_before <= completed + 2:  # it trains from step completed + 2 on
                due.append(request.rank)
                walls[request.rank] = request.wall
        _, members, unseated = self.placement.grow(self.members, tuple(sorted(due)), self.job.ntp.min_tp)
        for rank in unseated:
            refused[rank] = (f"rank {rank}: no replica has a free place (every replica is at its configured TP "
                             f"degree, and too few joiners to bring back a dropped replica at min_tp="
                             f"{self.job.ntp.min_tp})")
        for rank, why in refused.items():
            refuse(self.store, rank, why)
        seated = tuple(r for r in sorted(due) if r not in unseated)
        if seated:
            plan = propose_join(self.store, JoinPlan(generation, completed + 1, seated, self.members, members,
                                                     tuple(walls[r] for r in seated)))
            admit(self.store, plan)

    def grow(self, plan: JoinPlan) -> RecoveryOutcome:
        """Take `plan.joiners` in at this boundary: commit the grown membership, hand the joiners their units and
        optimizer state from memory, and return the new engine. A failure on the way (a joiner dies) falls back to
        a recovery from the state held at the boundary."""
        with wire.waiting(), collector_paused():
            outcome = self._grow_from_boundary(plan)
        release_cached_host_memory()
        return outcome

    def _grow_from_boundary(self, plan: JoinPlan) -> RecoveryOutcome:
        # What is in flight completes first, while every peer is alive and before anything is committed: the
        # teardown aborts the communicators under NCCL, which would drop an anchor's parameter bucket still queued
        # for a contributor, and leave the contributor waiting for it for ever. A failure here is a step's failure.
        self.engine.quiesce()
        t0 = time.monotonic()
        traffic_before = wire.traffic()
        generation = self.membership.generation
        change = MembershipChange(generation + 1, frozenset(), tuple(sorted(plan.members)), 0.0, _joined(plan))
        committed = self.membership.commit(change)
        if committed != change:  # a failure was reported first: recover from it (its joiners are planned again)
            raise RuntimeError(f"a failure was reported at the join boundary: {committed.reason}")
        mark_communicators()
        snapshot, old_members = self.engine.snapshot(), self.members
        self._hold_engine()
        self.membership.adopt(change)
        try:
            return self._grow(snapshot, plan, t0, traffic_before)
        except Exception as error:
            if not failed_on_the_way(error):
                raise
            log.warning("rank %d: growing to generation %d failed (%s); recovering without the joiners", self.rank,
                        change.generation, error)
            return self._recover_from(snapshot, old_members, error, time.monotonic())

    def _grow(self, snapshot, plan: JoinPlan, t0: float, traffic_before) -> RecoveryOutcome:
        """Both sides of a grow, from the new generation's rendezvous on: members pass their boundary snapshot, a
        joiner None (it learns the old topology from the members)."""
        generation = plan.generation + 1
        # A member keeps the groups the grown topology builds again with the same members (those of replicas the
        # joiners do not enter): at a step boundary they are idle, and `keep.keep` checks it. A joiner holds none.
        candidates = keepable(torch.distributed.distributed_c10d._world.pg_map) if snapshot is not None else []
        wire.teardown(keep=candidates)
        kept = []
        if snapshot is not None:
            placement, members, _ = self.placement.grow(plan.members_before, plan.joiners, self.job.ntp.min_tp)
            grown = placement.topology(self.placement, snapshot.topology)
            kept = keep(self.store, self.rank, candidates, plan.members_before, plan.members, grown,
                        plan_gradient_sync(grown), generation, self.job.ntp.timeout_s)
        self._kept_here = sorted(role_of(g) for g in kept)
        self._regroup(generation, plan.members, kept, plan.members_before)
        snapshot = self._share_context(snapshot)
        placement, members, _ = self.placement.grow(plan.members_before, plan.joiners, self.job.ntp.min_tp)
        if members != plan.members:
            raise RecoveryImpossible(f"the join plan seats {plan.members}, this rank's placement {members}")
        topology = placement.topology(self.placement, snapshot.topology)
        t_regrouped = time.monotonic()
        event = {"joined": list(plan.joiners), "reason": _joined(plan), "regroup_s": t_regrouped - t0,
                 "requested_wall": list(plan.requested_wall)}
        engine, event = self._install(snapshot, plan.members_before, generation, topology, plan.members, placement,
                                      set(), traffic_before, event)
        event["joiner_shard_bytes"] = _joiner_shard_bytes(topology, plan.members, plan.joiners, engine)
        event["reshard_s"] = time.monotonic() - t_regrouped
        event["grow_s"] = time.monotonic() - t0
        log.warning("rank %d: grew to generation %d with rank(s) %s, TP degrees %s -> %s", self.rank, generation,
                    ", ".join(map(str, plan.joiners)), event["degrees_before"], event["degrees_after"])
        self.events.append(event)
        return RecoveryOutcome(engine, event)

    @classmethod
    def join(cls, job: JobSpec, store, rank: int, *, not_before: int = 0, timeout_s: float = 600.0, node: int = 0,
             on_phase=None, **kwargs) -> Recovery:
        """Ask the running job on `store` to take launch rank `rank` in from step `not_before` on; wait (at most
        `timeout_s`) to be admitted, then receive this rank's shard and optimizer state from the members. Return
        the Recovery, whose `engine` is ready for the next step. Raise JoinRefused with the job's reason."""
        deadline = time.monotonic() + timeout_s
        # Beat while waiting: the members see this rank alive when they plan and when they meet it.
        heartbeat = Heartbeat(store.clone(), rank, kwargs.get("heartbeat_interval_s", 0.5)).start()
        try:
            request_join(store, JoinRequest(rank, job_fingerprint(job), not_before, node, time.time()))
            newer_than = -1
            for attempt in range(JOIN_ATTEMPTS):
                plan = await_verdict(store, rank, max(0.0, deadline - time.monotonic()), newer_than=newer_than)
                change = await_decision(store, plan.generation, max(0.0, deadline - time.monotonic()))
                if rank in change.survivors:
                    break
                # A failure took the boundary the plan named (the members recovered instead): global rank 0 plans
                # this joiner again in the next generation.
                log.warning("rank %d: generation %d went to a recovery (%s); waiting to be planned again", rank,
                            change.generation, change.reason)
                newer_than = plan.generation
            else:
                raise JoinFailed(f"rank {rank}: {JOIN_ATTEMPTS} boundaries planned for this joiner went to "
                                 f"recoveries instead")
        finally:
            heartbeat.stop()
        recovery = cls(None, store, rank, job=job, members=plan.members, generation=plan.generation + 1, **kwargs)
        if on_phase is not None:
            recovery.on_phase = on_phase
        try:
            with wire.waiting():
                recovery._grow(None, plan, time.monotonic(), wire.traffic())
        except Exception as error:
            if not (isinstance(error, RecoveryImpossible) or failed_on_the_way(error)):
                raise
            # The members recover without this rank from the state they held at the boundary: say it is gone.
            mark_exited(store, rank, f"join failed: {error}")
            recovery.close()
            wire.teardown()
            raise JoinFailed(f"rank {rank} was admitted into generation {plan.generation + 1} but could not take "
                             f"its place ({' '.join(str(error).split())[:300]}); the job went on without it") from None
        return recovery


    def _save_last_good(self, snapshot, change) -> str:
        """Write the survivors' shards of the last completed step as a sharded HF directory: each survivor
        assembles and writes about 1/n of the tensors (never the whole model), the lowest writes the index."""
        if self.last_good_dir is None:
            return "no last_good_dir to write the last good state to"
        survivors = change.survivors
        me = survivors.index(self.rank)
        position = {m: i for i, m in enumerate(self.members)}
        holders = [position[r] for r in survivors]
        model = empty_shard(self.job.model_config, device="meta")
        specs = {n: s for n, (s, _) in model.param_specs().items()}
        shapes = {n: shape for n, (_, shape) in model.param_specs().items()}
        try:
            writer, moves = plan_whole_tensors(snapshot.topology, holders, specs, shapes)
        except LookupError as missing:  # every survivor computes the same plan, so all stop here alike
            return f"{missing}, so no last good state was written"
        join_world(self.job.ntp, self.store, change.generation, me, len(survivors))
        wire.open_for_batches(None)  # the moves run on the default group (the job ends here)
        replica, tp = snapshot.topology.locate(snapshot.rank)
        full = assemble_whole(moves, writer, me, list(range(len(survivors))), specs, shapes,
                              Side(snapshot.topology.layouts[replica], tp), snapshot.params, self.job.ntp.bucket_size,
                              wire.device_of(), "last_good")
        write_whole_tensors(self.last_good_dir, self.job.model_config, {n: t.cpu() for n, t in full.items()}, me,
                            writer, shapes)
        wire.barrier()
        wire.teardown()
        return f"the last good state is in {self.last_good_dir}"

    def _arrive(self, generation: int, members) -> None:
        """Meet the new generation's members before joining its process group, watching their liveness: a member
        that dies or hangs on the way is found within the heartbeat timeout and this attempt fails (the recovery
        then starts again without it), where the process group's own rendezvous would wait for its store timeout."""
        others = set(members) - {self.rank}
        self.monitor = LivenessMonitor(ring_neighbours(list(members), self.rank), self.heartbeat_timeout_s,
                                       first_beat_timeout_s=self.first_beat_timeout_s)
        wait = BarrierWait(self.store, f"recovery/{generation}/arrive/{_digest(members)}", self.rank, members,
                           self.job.ntp.timeout_s)
        while (pause := wait.poll()) is not None:
            dead, reasons = self._poll_dead(others)
            if dead:
                self.declared.update(reasons)  # the next attempt's detection starts from them
                raise RuntimeError(f"rank(s) {sorted(dead)} died before generation {generation}'s rendezvous: "
                                   + "; ".join(reasons[r] for r in sorted(dead)))
            time.sleep(pause)

    def _poll_dead(self, among) -> tuple[frozenset[int], dict[int, str]]:
        """One read of the store (the watched peers' beats, the exit and fence logs): which of `among` are dead, and
        why. Beats are judged for the monitor's ranks only (bounded); an exit or a fence request counts for anyone."""
        view = self.reader.read(self.monitor.ranks, fences=True)
        self.monitor.observe(view.beats, view.exited)
        reasons = {r: f"rank {r} declared dead by a peer ({why})" for r, why in view.fences.items()}
        reasons.update((r, f"rank {r} exited ({why})") for r, why in view.exited.items())
        reasons.update((r, self.monitor.reason(r)) for r in self.monitor.dead())
        dead = frozenset(r for r in reasons if r in among)  # (`among`, a set, may hold the whole job: not copied)
        return dead, {r: reasons[r] for r in dead}

    # -- detection ----------------------------------------------------------------------------------------------
    def _confirm(self, change, bound: float) -> None:
        """`Membership.confirm`, watching the survivors meanwhile: one that is found dead (the decision missed its
        death: nobody had reported it yet) ends this attempt at once, not at the barrier's bound."""
        wait = self.membership.confirm_wait(change, bound)
        if wait is None:  # a stale change: the membership has moved past it
            return
        others = set(change.survivors) - {self.rank}
        while (pause := wait.poll()) is not None:
            dead, reasons = self._poll_dead(others)
            if dead:
                self.declared.update(reasons)  # the next attempt reports them in the generation just adopted
                raise RuntimeError(f"rank(s) {sorted(dead)} died before the survivors confirmed generation "
                                   f"{change.generation}: " + "; ".join(reasons[r] for r in sorted(dead)))
            time.sleep(pause)

    def _detect(self, error: BaseException) -> tuple[frozenset[int], str]:
        """Find the dead members of the membership's generation: marked exited, fenced or reported by a peer, or,
        of the peers this rank watches (`self.monitor`: what its heartbeat saw of them), silent past the heartbeat
        timeout.

        A watched peer silent for half the timeout is judged before the answer is given (dead, or beating again):
        peers that died together (a node) are then reported together, not one generation after another."""
        deadline = time.monotonic() + 2 * self.heartbeat_timeout_s + self.job.ntp.timeout_s
        pause = 0.05
        members = set(self.membership.members)  # after a failed confirm, the generation it adopted
        seen = self.monitor
        seen.retain(members - {self.rank})
        dead, reasons = frozenset(), {}
        while time.monotonic() < deadline:
            dead, reasons = self._poll_dead(members)
            reported = {r for rep in self.membership.reports(self.membership.generation) for r in rep.ranks}
            dead |= (reported | set(self.declared)) & members
            suspects = [r for r in seen.ranks if r not in dead and seen.silent_for(r) > self.heartbeat_timeout_s / 2]
            if dead and not suspects:
                break
            time.sleep(pause)  # backs off to a beat interval (not while a suspect waits): every survivor polls here
            pause = 0.05 if suspects else min(2 * pause, max(0.05, self.heartbeat_interval_s))
        if not dead:
            raise error
        return dead, "; ".join(self.declared.get(r) or reasons.get(r) or f"rank {r} reported dead by a peer"
                               for r in sorted(dead))

    # -- parameters ---------------------------------------------------------------------------------------------
    def _reshard(self, groups, snapshot, moves, moved: dict, rereplicated=(), rebalanced=()) -> CausalLMShard:
        """Build this rank's new shard: keep the units it held, pull the missing ones from their holders. The shard is
        built on the data device in the parameters' dtype, so kept units never leave the device."""
        module = empty_shard(self.job.model_config, groups.layout, groups.tp_rank, groups.tp_group,
                             device=wire.device_of(), dtype=parameter_dtype(self.job.ds_config))
        spec_shapes = module.param_specs()
        specs = {n: s for n, (s, _) in spec_shapes.items()}
        full_shapes = {n: shape for n, (_, shape) in spec_shapes.items()}
        new_params = dict(module.named_parameters())
        if snapshot.rank is None:  # a joiner holds nothing yet: it only receives
            old_layout, old_tp = groups.layout, groups.tp_rank
        else:
            old_replica, old_tp = snapshot.topology.locate(snapshot.rank)
            old_layout = snapshot.topology.layouts[old_replica]
        with torch.no_grad():
            for name, spec in specs.items():
                if snapshot.rank is None:
                    continue
                keep = U.intersect(old_layout.owned(spec.kind, old_tp), groups.layout.owned(spec.kind, groups.tp_rank))
                keep = U.subtract(keep, snapshot.stale.get(spec.kind, ()))  # fetched afresh with the moves
                if keep:
                    buf = gather_units(snapshot.params[name], spec, old_layout, old_tp, keep)
                    scatter_units(new_params[name].data, buf, spec, groups.layout, groups.tp_rank, keep)
            self._phase(snapshot.global_steps + 1, "transfer")  # its peers are blocked in this exchange with it
            moved["bytes"] = self._exchange_units(moves, groups, snapshot, old_layout, old_tp, specs, full_shapes,
                                                  new_params)
        width = parameter_dtype(self.job.ds_config).itemsize
        for key, extra in (("kv_rereplicated", rereplicated), ("rebalanced", rebalanced)):
            moved[key] = sum(packed_numel(specs[n], tuple(new_params[n].shape), m.units) * width
                             for m in extra if m.dst == groups.rank for n in specs if specs[n].kind == m.kind)
        return module

    def _serve(self, engine, groups, snapshot, moves, moved: dict) -> None:
        """The unit exchange of a rank that keeps its shard (`keeps_place`): it lacks nothing, so it only sends."""
        old_replica, old_tp = snapshot.topology.locate(snapshot.rank)
        with torch.no_grad():
            self._phase(snapshot.global_steps + 1, "transfer")  # its peers are blocked in this exchange with it
            moved["bytes"] = self._exchange_units(moves, groups, snapshot, snapshot.topology.layouts[old_replica],
                                                  old_tp, engine.param_specs, engine.full_shapes,
                                                  engine.named_shards())
        moved["kv_rereplicated"] = moved["rebalanced"] = 0

    def _exchange_units(self, moves, groups, snapshot, old_layout, old_tp, specs, full_shapes, new_params) -> int:
        """Pull the missing units: senders pack them out of their old layout, receivers unpack into the new one."""
        exchange = UnitExchange(moves, groups.rank, specs, full_shapes, Side(old_layout, old_tp),
                                Side(groups.layout, groups.tp_rank), self.job.ntp.bucket_size)
        dtype = parameter_dtype(self.job.ds_config)
        return exchange.run(snapshot.params, {n: p.data for n, p in new_params.items()}, dtype=dtype,
                            device=wire.device_of(), op="reshard")


TRAFFIC_KINDS = {"parameters": ("reshard", "param_sync"), "optimizer": ("reslice",),
                 "redundancy": ("copy_data", "copy_piece", "copy_layout"),
                 "objects": ("all_gather_object", "gather_object", "broadcast_object")}
"""How recovery's measured traffic is reported: call names of the wire layer by kind; the rest is "control"."""


def _keepable(snapshot, engine) -> int:
    """Elements of a kept engine's new fragments that its old ones held (the same shard, so the same coordinates):
    what it installs from itself; none after a roll-back, which serves only the copies."""
    if snapshot.rolled_back:
        return 0
    new = fragment_addresses(engine)
    return sum(max(0, min(old.start + old.numel, start + numel) - max(old.start, start))
               for name, old in snapshot.fragments.items() if name in new for start, numel in [new[name]])


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


def _joined(plan: JoinPlan) -> str:
    return f"rank{'s' if len(plan.joiners) > 1 else ''} {', '.join(map(str, plan.joiners))} joined"


def _digest(members) -> str:
    """A short name for a member list: ranks that expect different members never share a barrier (a joiner
    admitted at a boundary that a failure took instead waits at its own, and fails on the dead rank it names).
    Hashed as 8-byte integers: a member list is W long, and this is on every survivor's recovery path."""
    return hashlib.sha256(array("q", members).tobytes()).hexdigest()[:12]


def parameter_dtype(ds_config: dict) -> torch.dtype:
    """The dtype DeepSpeed trains the module's parameters in (what the members' shards hold)."""
    if ds_config.get("bf16", {}).get("enabled"):
        return torch.bfloat16
    if ds_config.get("fp16", {}).get("enabled"):
        return torch.float16
    return torch.float32


def job_fingerprint(job: JobSpec) -> str:
    """What a joiner must share with the job: the model, the DeepSpeed config and the parallel config (the control
    tree's fanout included: every member of a generation must build the same tree)."""
    return fingerprint(job.model_config, job.ds_config, job.ntp.replica_degrees, job.ntp.min_tp,
                       job.ntp.zero_redundancy, job.ntp.batch_policy, job.ntp.control_fanout)


def restore_learning_rate(engine, lr_state) -> None:
    """Put the learning-rate schedule where it was: a rebuilt engine starts its scheduler (and the optimizer's
    learning rates) from step 0, so a warm-up would start over after every recovery."""
    if lr_state is None or getattr(engine, "optimizer", None) is None:
        return
    scheduler_state, lrs = lr_state
    if engine.lr_scheduler is not None and scheduler_state is not None:
        engine.lr_scheduler.load_state_dict(scheduler_state)
    for group, lr in zip(engine.optimizer.param_groups, lrs):
        group["lr"] = lr


def _joiner_shard_bytes(topology: Topology, members, joiners, engine) -> int:
    """Parameter bytes of the joiners' new shards (each unit once per joiner)."""
    width = parameter_dtype(engine.job.ds_config).itemsize
    total = 0
    for rank in (members.index(j) for j in joiners):
        replica, tp = topology.locate(rank)
        lay = topology.layouts[replica]
        for name, spec in engine.param_specs.items():
            units = lay.owned(spec.kind, tp)
            if units:
                total += packed_numel(spec, engine.full_shapes[name], units) * width
    return total
