"""Joining a running job: a new worker asks through the store, the members admit it at a step boundary.

Protocol (keys in the job's store; ranks are launch ranks, which a joiner gets fresh from its launcher):
1. The joiner appends a `JoinRequest` to `join/requests`: its rank, the fingerprint of its job configuration and the
   first step it may train (`not_before`: a repaired GPU comes back at a scheduled step, a spare at once).
2. After every completed step s, global rank 0 of the running generation g reads the requests (one request while
   none is new) and, for those due, commits a `JoinPlan` to `join/plan/{g}`: grow once step s + 1 is complete. A
   joiner admitted at a boundary that a failure took instead (the members recovered) is planned again in the next
   generation; it waits for that newer admission. As
   with a stop (`ntp_ds.control.job`), no rank can have completed s + 1 yet, so every member meets the plan at the
   same boundary. A joiner whose configuration differs, or that has no place to go, gets a refusal instead.
3. Each member reads `join/plan/{g}` after every step (one request); at the planned boundary they commit the grown
   membership as generation g + 1 and rebuild with the joiners (`ntp_ds.recovery.Recovery.grow`).
4. The joiner waits for its verdict (`join/verdict/{rank}`): admitted into generation g + 1 (then it meets the
   members at that generation's rendezvous), or refused with the reason, which it prints before exiting.
Every wait is bounded. A joiner that dies before or during the rebuild is a failure like any other: the members
recover without it from the state they held at the boundary.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import chain

from ntp_ds.control.keys import JOIN_EVENTS_KEY as EVENTS_KEY
from ntp_ds.control.keys import JOIN_REQUESTS_KEY as REQUESTS_KEY
from ntp_ds.control.keys import join_plan_key as plan_key
from ntp_ds.control.keys import join_verdict_key as verdict_key


class JoinRefused(RuntimeError):
    """The running job refused this joiner; the message says why."""


class JoinFailed(RuntimeError):
    """The joiner was admitted but could not complete the rebuild (a member died, or a transfer failed); the members
    went on without it, and it may ask again."""


class JoinTimeout(TimeoutError):
    """No verdict reached the joiner within its bound."""


@dataclass(frozen=True)
class JoinRequest:
    """Launch rank `rank` asks to join from step `not_before` on, running the job configuration `fingerprint`."""

    rank: int
    fingerprint: str
    not_before: int
    node: int = 0
    wall: float = 0.0

    def encode(self) -> str:
        return json.dumps({"rank": self.rank, "fingerprint": self.fingerprint, "not_before": self.not_before,
                           "node": self.node, "wall": self.wall})

    @classmethod
    def decode(cls, raw: bytes | str) -> JoinRequest:
        d = json.loads(raw)
        return cls(int(d["rank"]), d["fingerprint"], int(d["not_before"]), int(d.get("node", 0)),
                   float(d.get("wall", 0.0)))


@dataclass(frozen=True)
class JoinPlan:
    """Generation `generation` grows by `joiners` once step `after` is complete; `members` is the new generation's
    launch ranks in global-rank order and `members_before` the old one's."""

    generation: int
    after: int
    joiners: tuple[int, ...]
    members_before: tuple[int, ...]
    members: tuple[int, ...]
    requested_wall: tuple[float, ...] = ()
    """Wall time (on each joiner's host) at which each joiner asked."""

    def encode(self) -> str:
        """JSON; both member lists as runs of consecutive ranks (`sequence_runs`), so the plan grows with the job's
        deaths and joins, not with the world (as a list, about 1.4 MB at 100,000 ranks: past etcd's request limit)."""
        return json.dumps({"generation": self.generation, "after": self.after, "joiners": list(self.joiners),
                           "members_before": sequence_runs(self.members_before),
                           "members": sequence_runs(self.members), "requested_wall": list(self.requested_wall)},
                          sort_keys=True)

    @classmethod
    def decode(cls, raw: bytes | str) -> JoinPlan:
        d = json.loads(raw)
        return cls(int(d["generation"]), int(d["after"]), tuple(d["joiners"]), from_runs(d["members_before"]),
                   from_runs(d["members"]), tuple(d.get("requested_wall", ())))


def sequence_runs(ranks: Sequence[int]) -> list[list[int]]:
    """`ranks` in their order as [first, last] runs of ranks rising by one: (0, 1, 7, 2, 3) -> [[0, 1], [7, 7],
    [2, 3]]. (Members in global-rank order are not sorted when a joiner takes a place in the middle.)"""
    out: list[list[int]] = []
    for r in ranks:
        if out and out[-1][1] + 1 == r:
            out[-1][1] = r
        else:
            out.append([r, r])
    return out


def from_runs(runs) -> tuple[int, ...]:
    return tuple(chain.from_iterable(range(first, last + 1) for first, last in runs))


def fingerprint(*parts) -> str:
    """A short digest of what a joiner must share with the job (model, DeepSpeed and NTP configs)."""
    text = json.dumps(parts, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def request_join(store, request: JoinRequest) -> None:
    store.append(REQUESTS_KEY, request.encode() + "\n")
    store.add(EVENTS_KEY, 1)


class JoinRequests:
    """Global rank 0's view of the requests: read only when their counter moved; a request refused, or whose rank
    became a member, is settled and never read again."""

    def __init__(self, store):
        self.store, self._seen, self._requests = store, 0, {}
        self._settled: set[int] = set()

    def read(self) -> list[JoinRequest]:
        events = self.store.add(EVENTS_KEY, 0)
        if events != self._seen:
            self._seen = events
            raw = self.store.get(REQUESTS_KEY).decode() if self.store.check([REQUESTS_KEY]) else ""
            self._requests = {r.rank: r for r in map(JoinRequest.decode, filter(None, raw.splitlines()))}
        return list(self._requests.values())

    def pending(self, generation: int, members) -> list[JoinRequest]:
        """The requests to plan in `generation`: never answered, or admitted at the boundary of an older generation
        that a recovery took instead (the joiner then waits for a newer admission)."""
        out = []
        for request in self.read():
            if request.rank in self._settled:
                continue
            if request.rank in members:
                self._settled.add(request.rank)
                continue
            key = verdict_key(request.rank)
            if not self.store.check([key]):
                out.append(request)
                continue
            verdict = json.loads(self.store.get(key))
            if "refused" in verdict:
                self._settled.add(request.rank)
            elif int(verdict["generation"]) < generation:
                out.append(request)
        return out


def propose_join(store, plan: JoinPlan) -> JoinPlan:
    """Commit `plan` for its generation unless one is committed already; return the plan in force."""
    committed = store.compare_set(plan_key(plan.generation), "", plan.encode())
    return JoinPlan.decode(committed)


def read_join_plan(store, generation: int) -> JoinPlan | None:
    key = plan_key(generation)
    return JoinPlan.decode(store.get(key)) if store.check([key]) else None


def refuse(store, rank: int, reason: str) -> None:
    store.set(verdict_key(rank), json.dumps({"refused": reason}))


def admit(store, plan: JoinPlan) -> None:
    for rank in plan.joiners:
        store.set(verdict_key(rank), json.dumps({"generation": plan.generation}))


def await_decision(store, generation: int, timeout_s: float, *, clock: Callable[[], float] = time.monotonic,
                   sleep: Callable[[float], None] = time.sleep, max_poll_s: float = 0.02):
    """Wait (bounded) for the membership decision that ends `generation` (the grown membership the members commit
    at the planned boundary, or a recovery's, if a failure came first). Polled every 20 ms: the members meet the
    joiner as soon as they have committed it, and wait for it at their rendezvous until it has seen the decision
    (at 0.5 s that wait was most of the members' stall at a join; a joiner is one of a few pollers)."""
    from ntp_ds.control.membership import MembershipChange, decision_key

    deadline, pause, key = clock() + timeout_s, min(0.05, max_poll_s), decision_key(generation)
    while not store.check([key]):
        if clock() >= deadline:
            raise JoinTimeout(f"the job did not reach the boundary that ends generation {generation} within "
                              f"{timeout_s:g} s")
        sleep(pause)
        pause = min(2 * pause, max_poll_s)
    return MembershipChange.decode(store.get(key))


def _answered(store, key: str, newer_than: int) -> bool:
    if not store.check([key]):
        return False
    verdict = json.loads(store.get(key))
    return "refused" in verdict or int(verdict["generation"]) > newer_than


def await_verdict(store, rank: int, timeout_s: float, *, newer_than: int = -1,
                  clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep,
                  max_poll_s: float = 0.5) -> JoinPlan:
    """Wait (bounded) for this joiner's verdict (an admission into a generation after `newer_than`); return the plan
    that admits it, raise JoinRefused or JoinTimeout."""
    deadline, pause, key = clock() + timeout_s, 0.05, verdict_key(rank)
    while not _answered(store, key, newer_than):
        if clock() >= deadline:
            raise JoinTimeout(f"rank {rank}: the running job did not admit or refuse this joiner within {timeout_s:g} s "
                              f"(is a job running on this store, and has it reached the join step?)")
        sleep(pause)
        pause = min(2 * pause, max_poll_s)
    verdict = json.loads(store.get(key))
    if "refused" in verdict:
        raise JoinRefused(verdict["refused"])
    plan = read_join_plan(store, int(verdict["generation"]))
    if plan is None or rank not in plan.joiners:
        raise JoinRefused(f"rank {rank}: admitted into generation {verdict['generation']}, whose plan does not name it")
    return plan
