"""Turn a failure into the next generation's engine, and a step boundary into a grown one: the phases in order.

Everything happens in the surviving processes, from memory. Survivors snapshot their state (parameters, optimizer
fragments, the copies they keep for their buddies), find and agree on the dead (`detect`), tear down the old
process group keeping the groups that stay whole (`keep`), meet on the generation's store prefix, tell each other
what they hold (`handoff`), and build the new generation's engine (`install`); joiners are planned by global rank 0
(`admit`); when no replica is left the survivors write the last good weights (`last_good`). The event of each
recovery or grow is measured on the way (`report`).
"""

from __future__ import annotations

import dataclasses
import logging
import time
import traceback

import torch

from ntp_ds.comm import wire
from ntp_ds.comm.groups import keepable, mark_communicators, prepare_backend, role_of
from ntp_ds.control.joins import JoinFailed, JoinPlan, read_join_plan
from ntp_ds.control.liveness_store import LivenessReader, mark_exited, request_fence
from ntp_ds.control.membership import BarrierTimeout, Membership, MembershipChange
from ntp_ds.control.node_store import node_local
from ntp_ds.control.store import forget_generation
from ntp_ds.engine.copies import release_cached_host_memory
from ntp_ds.engine.initialize import JobSpec, build_topology, join_world
from ntp_ds.layout import plan_gradient_sync
from ntp_ds.layout.domains import failure_domain
from ntp_ds.layout.generation import Generation
from ntp_ds.recovery import report
from ntp_ds.recovery.report import RecoveryOutcome
from ntp_ds.recovery.admit import Admission, await_admission, join_failed
from ntp_ds.recovery.detect import Detector, decision_settle_s, first_beat_timeout
from ntp_ds.recovery.errors import NoReplicaLeft, QuiescedExit, RecoveryImpossible, failed_on_the_way
from ntp_ds.recovery.handoff import hand_off
from ntp_ds.recovery.install import Change, install, parameter_dtype, require_masters
from ntp_ds.recovery.keep import carry, close_hit, depart, keep, tear_down
from ntp_ds.recovery.last_good import save_last_good
from ntp_ds.recovery.plan import collector_paused, old_ranks
from ntp_ds.recovery.watch import Watch

__all__ = ["JoinFailed", "NoReplicaLeft", "QuiescedExit", "Recovery", "RecoveryImpossible", "RecoveryOutcome"]

log = logging.getLogger("ntp_ds.recovery")


class Recovery:
    """One rank's live recovery and growth. `rank` is its launch rank, which never changes; the global rank does.

    A running member passes its engine; a joiner (`Recovery.join`) starts without one and gets it from the members.
    """

    def __init__(self, engine, store, rank: int, *, heartbeat_interval_s: float = 0.5,
                 heartbeat_timeout_s: float = 3.0, hang_timeout_s: float | None = None, settle_s: float | None = None,
                 last_good_dir=None, job: JobSpec | None = None, generation: Generation | None = None):
        self.job: JobSpec = require_masters(engine.job if engine is not None else job)
        self.engine, self.store, self.rank = engine, store, rank
        self.last_good_dir = last_good_dir
        """Where the survivors write the last good weights (HF form) when no replica can go on."""
        self.generation = generation or Generation.initial(build_topology(self.job.units(), self.job.ntp),
                                                              racks=self.job.racks)
        """Who is where: the members (launch ranks, in global-rank order), their topology and places."""
        if settle_s is None:
            settle_s = decision_settle_s(heartbeat_timeout_s, heartbeat_interval_s)
        node = node_local()  # (`ntp-ds launch`'s node store: the generation's barriers meet there first)
        self.membership = Membership(store, rank, self.members, self.generation.number, settle_s=settle_s, node=node)
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self._kept_here: list[str] = []
        """Roles of the groups this rank kept in the recovery or grow under way (the event's `kept_here`)."""
        self._held = None
        """A member's engine during a recovery or a grow (detached from the old generation's groups): kept if this
        rank keeps its place (`rebind`), else released once that is known."""
        self._candidates: list = []
        """Groups a recovery may keep (`keep.keep`), from its start to its first attempt's teardown."""
        first_beat_timeout_s = first_beat_timeout(heartbeat_timeout_s, self.job.ntp.timeout_s)
        reader = LivenessReader.from_env(store, mirror=node and node.store)
        domain_of = failure_domain(self.job.racks, reader.node_size)
        self.detector = Detector(reader, heartbeat_timeout_s=heartbeat_timeout_s,
                                 heartbeat_interval_s=heartbeat_interval_s, first_beat_timeout_s=first_beat_timeout_s,
                                 collective_timeout_s=self.job.ntp.timeout_s, node=node, domain_of=domain_of)
        self.watch = Watch(store, rank, interval_s=heartbeat_interval_s, timeout_s=heartbeat_timeout_s,
                           hang_timeout_s=hang_timeout_s, first_beat_timeout_s=first_beat_timeout_s,
                           generation=lambda: self.membership.generation, members=lambda: self.members,
                           engine=lambda: self.engine, declared=self.detector.declared, report=self._report,
                           domain_of=domain_of)
        self.heartbeat = self.watch.heartbeat
        self.watch.start()
        self.events: list[dict] = []
        self.failed_attempts: list[float] = []
        """Wall times at which recovery attempts failed (a rank died during the recovery itself)."""
        self.admission = Admission(store, rank, self.job)
        self.on_phase = lambda step, phase: None
        """Called with phase "recovery" once the new membership is agreed, "rendezvous" as the survivors meet for
        the new generation, "groups" as its communicators are about to be created (its members all met) and
        "transfer" as the lost units move: the fault-injection seams."""

    def _report(self, dead: frozenset[int], wall: float, reason: str, silent: dict[int, float],
                fenced: frozenset[int] = frozenset()) -> None:
        """The watch's early report of a verdict (`Watch.report`), in the membership's generation."""
        membership = self.membership
        membership.report_failure(membership.generation, dead, wall, reason, silent, fenced)

    @property
    def members(self) -> tuple[int, ...]:
        """Launch ranks of the generation's members, in global-rank order."""
        return self.generation.members

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
            self.admission.refuse_all(self.generation, "the job ended before it could take this worker in")
        self.heartbeat.stop()

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
        traceback.clear_frames(error.__traceback__)
        error.__traceback__ = error.__context__ = error.__cause__ = None
        self._hold_engine()
        return self._recover_from(snapshot, self.generation, error, failed_at)

    def _hold_engine(self) -> None:
        """Detach the engine from the generation's groups (`NTPEngine.detach`) and hold it until the new topology
        says whether this rank keeps it."""
        self.engine.detach()
        self._held, self.engine = self.engine, None

    def _release_held(self) -> None:
        if self._held is not None:
            self._held.release()
            self._held = None

    def _recover_from(self, snapshot, before: Generation, error, failed_at) -> RecoveryOutcome:
        for attempt in range(len(self.members)):
            try:
                return self._attempt(snapshot, before, error, failed_at)
            except Exception as again:
                if not failed_on_the_way(again):
                    raise
                self.failed_attempts.append(time.time())
                if isinstance(again, BarrierTimeout) and again.missing:  # who never came is dead: stop it for good
                    request_fence(self.store, self.detector.missed(again), f"{again} (seen by rank {self.rank})")
                snapshot = dataclasses.replace(snapshot, whole_grads=False)  # an attempt took them with it
                log.warning("rank %d: recovery attempt %d failed (%s); retrying", self.rank, attempt + 1, again)
                error = again
        raise RecoveryImpossible(f"rank {self.rank}: recovery did not converge after {len(self.members)} attempts "
                                 f"(the last failed with: {error})")

    def _attempt(self, snapshot, before: Generation, error, failed_at) -> RecoveryOutcome:
        t0, traffic_before = time.monotonic(), wire.traffic()
        silent = self.heartbeat.silences()  # how long each watched peer has shown no sign of life, on this host's clock
        # The old generation's peers are judged by the detection below, not the watcher, from what it saw of them
        # (a retry finds the watcher idle, and keeps the monitor of the attempt before).
        seen = self.heartbeat.watch([])
        if seen.ranks:
            self.detector.monitor = seen
        candidates, self._candidates = self._candidates, []  # only the first attempt keeps any
        tear_down(candidates, self._held)
        dead, reason = self.detector.detect(self.membership, error)
        candidates = close_hit(candidates, snapshot.topology, before.members, dead)
        # A hung rank is stopped by its launcher before it can come back (each with its own reason).
        request_fence(self.store, (fence := self.detector.to_fence()), fence)
        change = self.detector.agree(self.membership, dead, reason, silent)
        t_agreed = time.monotonic()

        self._phase(snapshot.global_steps + 1, "recovery")
        gone = set(before.members) - set(change.survivors)
        loss = before.after_loss(gone, self.job.ntp.min_tp, change.generation)
        after = loss.after
        if after is None:
            saved = save_last_good(self.job, self.store, self.rank, before.members, change.survivors,
                                   change.generation, snapshot, self.last_good_dir)
            raise NoReplicaLeft(f"every replica is below min_tp={self.job.ntp.min_tp} after losing ranks "
                                f"{sorted(gone)}; {saved}")
        if self.rank not in after.members:
            log.warning("rank %d: replica dropped (below min_tp=%d); leaving", self.rank, self.job.ntp.min_tp)
            self._release_held()
            self.leave(f"replica below min_tp={self.job.ntp.min_tp}")
        kept = keep(self.store, self.rank, candidates, before.members, after.members, after.topology,
                    plan_gradient_sync(after.topology), change.generation, self.job.ntp.timeout_s)
        self._phase(snapshot.global_steps + 1, "rendezvous")
        dead_ranks = frozenset(before.members.index(g) for g in gone)
        snapshot, handoff = self._regroup(after, kept, before, snapshot, dead_ranks)
        t_regrouped = time.monotonic()
        event = {"dead": sorted(gone), "dropped_replicas": list(loss.dropped), "detection_s": change.detection_s,
                 "snapshot_s": t0 - failed_at, "agreement_s": t_agreed - t0,
                 "regroup_s": t_regrouped - t_agreed, "reason": change.reason}
        engine, event = self._install(Change(snapshot, handoff, before, after, dead_ranks), traffic_before, event)
        event["lost_shard_bytes"] = report.lost_shard_bytes(snapshot.topology, before.members, gone, loss.rebuilt,
                                                            engine)
        event["reshard_s"] = time.monotonic() - t_regrouped
        log.warning("rank %d: recovered to generation %d, TP degrees %s -> %s", self.rank, change.generation,
                    event["degrees_before"], event["degrees_after"])
        self.events.append(event)
        return RecoveryOutcome(engine, event)

    def _regroup(self, after: Generation, kept, before: Generation | None, snapshot, dead=frozenset()):
        """Meet the new generation's members and join its process group, carrying the `kept` groups (of `before`)
        into it; then hand off (`handoff.hand_off`). Return the snapshot to install from and the hand-off. A joiner
        has neither `before` nor a snapshot."""
        self._kept_here = sorted(role_of(g) for g in kept)
        self.detector.arrive(self.store, self.rank, after.number, after.members)
        self.generation = after  # first: a late verdict on the old generation's dead must not break the new one
        self.detector.declared.clear()
        join_world(self.job.ntp, self.store, after.number, after.members.index(self.rank), len(after.members))
        carry(kept, before.members if before is not None else (), after.members)
        self.watch.watch_ring()
        survivors = frozenset(old_ranks(before.members, after.members).values()) if before is not None else frozenset()
        return hand_off(self.job, snapshot, before, held=self._held, dead=dead, survivors=survivors,
                        rank_index=after.members.index(self.rank))

    def _install(self, change: Change, traffic_before, event: dict) -> tuple:
        """Install the new generation's engine (`install.install`), watch its peers, and meet its members once every
        one of them has; return it and `event` completed with what was installed."""
        engine, installed = install(self.job, self.store, self.rank, change, held=self._held,
                                    release=self._release_held, on_phase=self._phase, kept_here=self._kept_here,
                                    traffic_before=traffic_before)
        self.watch.watch_engine(engine)
        self.detector.finish(self.store, self.rank, change.after.number, change.after.members,
                             self.job.ntp.timeout_s)
        if change.after.members[0] == self.rank and change.after.number >= 2:
            forget_generation(self.store, change.after.number - 2)  # the store keeps the last two generations
        self.engine, self._held = engine, None
        return engine, {"generation": installed.pop("generation"), **event, **installed}

    # -- growing back -------------------------------------------------------------------------------------------
    def at_boundary(self, completed: int, last_step: int | None = None) -> RecoveryOutcome | None:
        """After step `completed`: admit due joiners (global rank 0 plans them for the next boundary, while a step
        is left for them after it, `last_step` being the run's last, and raises the engine's `join_notice` for the
        next step's commit vote) and grow if the step just committed announced joiners; return the grown engine's
        outcome, or None. While nobody joins, no rank but global rank 0 touches the store here."""
        if self.members.index(self.rank) == 0:
            planned = self.admission.at_boundary(self.generation, completed, last_step)
            self.engine.join_notice = bool(planned and planned.joiners and planned.after == completed + 1)
        if not self.engine.join_announced:
            return None
        plan = read_join_plan(self.store, self.membership.generation)
        if plan is None or plan.after != completed or not plan.joiners:
            return None
        return self.grow(plan)

    def expect_joiners(self, steps) -> None:
        """Scheduled repairs: a replacement worker trains from each of these steps (1-based; `Admission.expected`
        says how global rank 0 holds the boundary for them)."""
        self.admission.expected = sorted(int(s) for s in steps)

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
        t0, traffic_before = time.monotonic(), wire.traffic()
        change = MembershipChange(self.membership.generation + 1, frozenset(), tuple(sorted(plan.members)), 0.0,
                                  report.joined(plan.joiners))
        committed = self.membership.commit(change)
        if committed != change:  # a failure was reported first: recover from it (its joiners are planned again)
            raise RuntimeError(f"a failure was reported at the join boundary: {committed.reason}")
        mark_communicators()
        snapshot, before = self.engine.snapshot(), self.generation
        self._hold_engine()
        self.membership.adopt(change)
        try:
            return self._grow(snapshot, plan, t0, traffic_before)
        except Exception as error:
            if not failed_on_the_way(error):
                raise
            log.warning("rank %d: growing to generation %d failed (%s); recovering without the joiners", self.rank,
                        change.generation, error)
            return self._recover_from(snapshot, before, error, time.monotonic())

    def _grow(self, snapshot, plan: JoinPlan, t0: float, traffic_before) -> RecoveryOutcome:
        """Both sides of a grow, from the new generation's rendezvous on: members pass their boundary snapshot, a
        joiner None (it learns the old generation from the members)."""
        number = plan.generation + 1
        # A member keeps the groups the grown topology builds again with the same members (those of replicas the
        # joiners do not enter): at a step boundary they are idle, and `keep.keep` checks it. A joiner holds none.
        candidates = keepable(torch.distributed.distributed_c10d._world.pg_map) if snapshot is not None else []
        wire.teardown(keep=candidates)
        kept, before = [], None
        if snapshot is not None:
            before = self.generation
            grown, _ = before.after_join(plan.joiners, self.job.ntp.min_tp, number)
            kept = keep(self.store, self.rank, candidates, plan.members_before, plan.members, grown.topology,
                        plan_gradient_sync(grown.topology), number, self.job.ntp.timeout_s)
        # Every side meets as the plan seats the members; the places follow from the hand-off's old generation.
        snapshot, handoff = self._regroup(Generation.unplaced(number, plan.members), kept, before, snapshot)
        grown, _ = handoff.before.after_join(plan.joiners, self.job.ntp.min_tp, number)
        if grown.members != plan.members:
            raise RecoveryImpossible(f"the join plan seats {plan.members}, this rank's placement {grown.members}")
        self.generation, t_regrouped = grown, time.monotonic()
        event = {"joined": list(plan.joiners), "reason": report.joined(plan.joiners), "regroup_s": t_regrouped - t0,
                 "requested_wall": list(plan.requested_wall)}
        engine, event = self._install(Change(snapshot, handoff, handoff.before, grown), traffic_before, event)
        width = parameter_dtype(self.job.ds_config).itemsize
        event.update(joiner_shard_bytes=report.joiner_shard_bytes(grown.topology, plan.members, plan.joiners, engine,
                                                                  width),
                     reshard_s=time.monotonic() - t_regrouped, grow_s=time.monotonic() - t0)
        log.warning("rank %d: grew to generation %d with rank(s) %s, TP degrees %s -> %s", self.rank, number,
                    ", ".join(map(str, plan.joiners)), event["degrees_before"], event["degrees_after"])
        self.events.append(event)
        return RecoveryOutcome(engine, event)

    @classmethod
    def join(cls, job: JobSpec, store, rank: int, *, not_before: int = 0, timeout_s: float = 600.0, node: int = 0,
             on_phase=None, **kwargs) -> Recovery:
        """Ask the running job on `store` to take launch rank `rank` in from step `not_before` on; wait (at most
        `timeout_s`) to be admitted, then receive this rank's shard and optimizer state from the members. Return
        the Recovery, whose `engine` is ready for the next step. Raise JoinRefused with the job's reason."""
        prepare_backend(job.ntp.timeout_s)  # its first call imports DeepSpeed's ops (0.3 s here): not while the
        # members wait for this joiner in the new world's rendezvous
        plan = await_admission(job, store, rank, not_before=not_before, timeout_s=timeout_s, node=node,
                               heartbeat_interval_s=kwargs.get("heartbeat_interval_s", 0.5))
        recovery = cls(None, store, rank, job=job, generation=Generation.unplaced(plan.generation + 1, plan.members),
                       **kwargs)
        recovery.on_phase = on_phase or recovery.on_phase
        try:
            with wire.waiting():
                recovery._grow(None, plan, time.monotonic(), wire.traffic())
        except Exception as error:
            if not (isinstance(error, RecoveryImpossible) or failed_on_the_way(error)):
                raise
            recovery.close()
            wire.teardown()
            raise join_failed(store, rank, plan, error) from None
        return recovery
