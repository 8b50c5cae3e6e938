"""Admission of joiners: global rank 0 plans who joins at which boundary; a joiner waits until it is admitted.

Global rank 0 reads the pending join requests at a step boundary, refuses those that can never be taken in (another
job's configuration, no free place) and proposes a `JoinPlan` for the rest, which every member reads at the next
boundary (`read_join_plan`). Scheduled repairs hold the planning boundary until their replacements have asked.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from ntp_ds.comm import wire
from ntp_ds.control.heartbeat import Heartbeat
from ntp_ds.control.joins import (JoinFailed, JoinPlan, JoinRequest, JoinRequests, admit, await_decision,
                                  await_verdict, fingerprint, propose_join, read_join_plan, refuse, request_join)
from ntp_ds.control.liveness_store import mark_exited, read_exits
from ntp_ds.engine.initialize import JobSpec
from ntp_ds.layout.generation import Generation

log = logging.getLogger("ntp_ds.recovery")

JOIN_ATTEMPTS = 3
"""Boundaries a joiner asks for before it gives up, when failures keep taking them."""


def job_fingerprint(job: JobSpec) -> str:
    """What a joiner must share with the job: the model, the DeepSpeed config and the parallel config (the control
    tree's fanout included: every member of a generation must build the same tree)."""
    return fingerprint(job.model_config, job.ds_config, job.ntp.replica_degrees, job.ntp.min_tp,
                       job.ntp.zero_redundancy, job.ntp.batch_policy, job.ntp.control_fanout)


class Admission:
    """Global rank 0's side of joins: which pending requests are due, refused or seated at a boundary."""

    def __init__(self, store, rank: int, job: JobSpec, *, clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] = time.sleep):
        self.store, self.rank, self.job = store, rank, job
        self.requests = JoinRequests(store)
        self.fingerprint = job_fingerprint(job)
        self.expected: list[int] = []
        """Steps (1-based) from which scheduled repairs' replacements train (`Recovery.expect_joiners`). Global rank 0
        holds the boundary at which it plans a step's joins until as many join requests as repairs due by then have
        arrived, so a repair takes effect at its step however long the replacement takes to start; the hold is
        bounded by half the job's collective bound (the other members wait in the next step meanwhile), after which
        the repair waits for a later boundary."""
        self.planned: JoinPlan | None = None
        """The plan in force that this rank proposed or found (one per generation at most)."""
        self.clock, self.sleep = clock, sleep

    def unfit(self, request: JoinRequest, members) -> str | None:
        """Why `request` can never be taken in, or None."""
        if request.fingerprint != self.fingerprint:
            return (f"rank {request.rank} runs another job configuration (fingerprint {request.fingerprint}, the "
                    f"job's is {self.fingerprint}): the same model, DeepSpeed and parallel configs are required to "
                    f"join")
        if request.rank in members:
            return f"rank {request.rank} is already a member of the job"
        return None

    def refuse_all(self, generation: Generation, reason: str) -> None:
        """Refuse every joiner still waiting (the job ends)."""
        try:
            for request in self.requests.pending(generation.number + 1, generation.members):
                refuse(self.store, request.rank,
                       self.unfit(request, generation.members) or f"rank {request.rank}: {reason}")
        except Exception as e:  # the store may be gone with the job: the joiners' own bound ends their wait
            log.warning("could not answer the joiners still waiting: %s", e)

    def await_expected(self, completed: int) -> None:
        """Hold the boundary after step `completed` until as many join requests as repairs due by the step after
        the next have arrived, at most half the job's collective bound (the other members wait in the next step
        meanwhile); after it, the repairs wait for a later boundary."""
        due = sum(1 for s in self.expected if s <= completed + 2)
        if not due or len(self.requests.read()) >= due:
            return
        bound = self.job.ntp.timeout_s / 2
        deadline = self.clock() + bound
        with wire.waiting():
            while len(self.requests.read()) < due:
                if self.clock() > deadline:
                    log.warning("rank %d: %d repair(s) due by step %d, but only %d join request(s) arrived within "
                                "%.0f s; going on", self.rank, due, completed + 2, len(self.requests.read()), bound)
                    self.expected = [s for s in self.expected if s > completed + 2]
                    return
                self.sleep(0.05)

    def at_boundary(self, generation: Generation, completed: int, last_step: int | None) -> JoinPlan | None:
        """After step `completed`, while a step is left for joiners after the next one (`last_step`: the run's
        last): hold for the repairs due, then plan. Return the plan in force for `generation`, or None."""
        if last_step is None or completed + 2 <= last_step:
            self.await_expected(completed)
            self.plan(generation, completed)
        planned = self.planned
        return planned if planned is not None and planned.generation == generation.number else None

    def plan(self, generation: Generation, completed: int) -> JoinPlan | None:
        """Refuse the unfit requests and seat the due ones (they train from step `completed + 2` on): propose and
        admit the plan, once per generation. Return the plan proposed, or None."""
        pending = self.requests.pending(generation.number, generation.members)
        if not pending:
            return None
        if (found := read_join_plan(self.store, generation.number)) is not None:
            self.planned = found
            return None
        gone = read_exits(self.store)  # a joiner that failed its join, or died waiting, is not planned again
        pending = [r for r in pending if r.rank not in gone]
        if not pending:
            return None
        due, refused, walls = [], {}, {}
        for request in pending:
            if (why := self.unfit(request, generation.members)) is not None:
                refused[request.rank] = why
            elif request.not_before <= completed + 2:
                due.append(request.rank)
                walls[request.rank] = request.wall
        grown, unseated = generation.after_join(tuple(sorted(due)), self.job.ntp.min_tp, generation.number + 1)
        for rank in unseated:
            refused[rank] = (f"rank {rank}: no replica has a free place (every replica is at its configured TP "
                             f"degree, and too few joiners to bring back a dropped replica at min_tp="
                             f"{self.job.ntp.min_tp})")
        for rank, why in refused.items():
            refuse(self.store, rank, why)
        seated = tuple(r for r in sorted(due) if r not in unseated)
        if not seated:
            return None
        plan = self.planned = propose_join(self.store, JoinPlan(generation.number, completed + 1, seated,
                                                                generation.members, grown.members,
                                                                tuple(walls[r] for r in seated)))
        admit(self.store, plan)
        return plan


def await_admission(job: JobSpec, store, rank: int, *, not_before: int, timeout_s: float, node: int,
                    heartbeat_interval_s: float) -> JoinPlan:
    """A joiner's side: ask the running job on `store` to take launch rank `rank` in from step `not_before` on, and
    wait (at most `timeout_s`, beating meanwhile so that the members see it alive) until a plan seats it in a
    generation the members adopted. Raise JoinRefused with the job's reason, or JoinFailed when failures took
    `JOIN_ATTEMPTS` boundaries planned for it."""
    deadline = time.monotonic() + timeout_s
    heartbeat = Heartbeat(store.clone(), rank, heartbeat_interval_s).start()
    try:
        request_join(store, JoinRequest(rank, job_fingerprint(job), not_before, node, time.time()))
        newer_than = -1
        for _ in range(JOIN_ATTEMPTS):
            plan = await_verdict(store, rank, max(0.0, deadline - time.monotonic()), newer_than=newer_than)
            change = await_decision(store, plan.generation, max(0.0, deadline - time.monotonic()))
            if rank in change.survivors:
                return plan
            # A failure took the boundary the plan named (the members recovered instead): global rank 0 plans
            # this joiner again in the next generation.
            log.warning("rank %d: generation %d went to a recovery (%s); waiting to be planned again", rank,
                        change.generation, change.reason)
            newer_than = plan.generation
        raise JoinFailed(f"rank {rank}: {JOIN_ATTEMPTS} boundaries planned for this joiner went to recoveries "
                         f"instead")
    finally:
        heartbeat.stop()


def join_failed(store, rank: int, plan: JoinPlan, error: BaseException) -> JoinFailed:
    """Say that joiner `rank`, admitted by `plan`, is gone (the members recover without it from the state they held
    at the boundary), and return the error that ends it."""
    mark_exited(store, rank, f"join failed: {error}")
    return JoinFailed(f"rank {rank} was admitted into generation {plan.generation + 1} but could not take its place "
                      f"({' '.join(str(error).split())[:300]}); the job went on without it")
