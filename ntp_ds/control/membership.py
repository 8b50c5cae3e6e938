"""Membership agreement: survivors report failures, one decision per generation is committed, all adopt it.

Protocol (keys in the launcher's store; ranks are launch ranks, stable across generations):
1. A rank that sees peers die claims each death once (`membership/{g}/dead/{r}`, a counter: the first claimant
   wins) and files a `FailureReport` of the deaths it claimed, if any, as entry i of `membership/{g}/reports` (keys
   `membership/{g}/reports/{i}`, i counted by `membership/{g}/reports/count`), where g is its generation. Then it
   acknowledges, for the deaths it claimed (the dead cannot) and for itself: the acknowledgements are a barrier over
   the members (`membership/{g}/acks`, `BarrierWait`'s tree of counters), which ends once every member not reported
   dead has acknowledged. So a failure seen by every survivor costs each of them a few counter updates, on counters
   of at most `BARRIER_FANOUT` writers, and the reports every rank reads number the deaths, not the survivors.
   With a node store (`NodeLocal`, under `ntp-ds launch`), a rank acknowledges in its node's store, and each node
   is acknowledged in the job's store once, for all its members (`Membership._close_nodes`): by a rank of it once
   every member has acknowledged there or is dead in a report read, or, for a node whose every member is dead, by
   a reporter that knows it. With a rack level above the nodes (`NodeLocal.rack`), a node is acknowledged in its
   rack's store and each rack once in the job's store (`Membership._close_nodes`). A generation with a joiner (on no
   node) acknowledges rank by rank.
2. Every rank that learns of a failure (its own report, or `pending()`) calls `await_decision(g)`. A rank that filed
   a report proposes the union of all reports with `compare_set` on `decision/{g}` once the acknowledgements have
   ended or reports have been visible to it for `settle_s`; a rank that filed none proposes only if no decision has
   come within twice that (the reporters died on the way). The first writer wins, every later proposer reads back
   the winner's bytes, so all ranks hold the same `MembershipChange` to generation g + 1.
3. Each survivor `confirm`s: it adopts the change, then meets the other survivors at a barrier that names only
   survivors, so nobody waits on a dead rank.
A report or decision of an older generation is ignored; every wait is bounded and raises a TimeoutError subclass
naming what it waited for.

With a node store, the node's ranks also share their reads of the job's store while they wait (the counters, the
reports, the decision: `NodeLocal.read`), so that a poll costs the job's store one request per node.

Waiting ranks watch, they do not re-read: every report and every commit bumps one counter,
`membership/{g}/events`, and a waiter reads the decision and the reports it has not read yet only when that counter
has moved (each report is an entry of its own, read once per rank: a rank's reads per failure grow with the number
of reports, not with that number times the number of times the counter moved). Polls of
the counter and of barriers back off from `poll_s` to `max_poll_s` while nothing changes. By default that ceiling
grows with the number of waiters (`poll_ceiling`): all of them together poll at most POLL_RATE_PER_S times a second
once backed off, so a barrier of a few ranks ends within 10 ms of its last arrival and one of thousands does not
flood the store.
"""

from __future__ import annotations

import bisect
import functools
import json
import operator
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import chain

from ntp_ds.control.keys import decision_key, membership_key
from ntp_ds.control.node_local import SHARED_AGE_S, NodeLocal, present_values


class StaleGeneration(ValueError):
    """A call named a generation older than the caller's current one."""


class Evicted(RuntimeError):
    """This rank was declared dead by the committed decision: it must leave the job."""


class MembershipTimeout(TimeoutError):
    """No decision was committed within the bound."""


class BarrierTimeout(TimeoutError):
    """Not every expected rank reached the barrier within the bound; `missing` names those that did not."""

    def __init__(self, name: str, missing: frozenset[int], timeout_s: float):
        super().__init__(f"barrier {name!r}: ranks {sorted(missing)} did not arrive within {timeout_s}s")
        self.name, self.missing, self.timeout_s = name, missing, timeout_s


@dataclass(frozen=True)
class MembershipChange:
    """The committed move to `generation`: who died, who goes on (sorted launch ranks = new global rank order)."""

    generation: int
    dead: frozenset[int]
    survivors: tuple[int, ...]
    detection_s: float
    """Largest detection latency among the dead: for each, the shortest silence any reporter had observed (its last
    sign of life to the report, on the reporter's own monotonic clock; never a difference of two hosts' clocks)."""
    reason: str
    detected_at: tuple[tuple[int, float], ...] = ()
    """(rank, wall time it was first reported dead), for each dead rank."""

    def __post_init__(self):
        if self.generation < 1:
            raise ValueError(f"generation={self.generation} of a change must be at least 1")
        if not self.dead.isdisjoint(self.survivors):
            raise ValueError(f"ranks {sorted(self.dead & set(self.survivors))} are both dead and surviving")
        if not _strictly_increasing(self.survivors):
            raise ValueError(f"survivors={self.survivors} must be sorted and distinct")

    def new_rank(self, rank: int) -> int:
        """Return the global rank of survivor `rank` in the new generation's process groups."""
        return self.survivors.index(rank)

    def encode(self) -> str:
        """JSON; the survivors as runs of consecutive ranks, so the decision every rank reads grows with the number
        of deaths and joins, not with the world."""
        return json.dumps({"generation": self.generation, "dead": sorted(self.dead),
                           "survivor_runs": _runs(self.survivors), "detection_s": self.detection_s,
                           "reason": self.reason, "detected_at": self.detected_at}, sort_keys=True)

    @classmethod
    def decode(cls, raw: bytes | str) -> MembershipChange:
        d = json.loads(raw)
        survivors = tuple(chain.from_iterable(range(first, last + 1) for first, last in d["survivor_runs"]))
        return cls(d["generation"], frozenset(d["dead"]), survivors, d["detection_s"], d["reason"],
                   tuple((int(r), float(t)) for r, t in d["detected_at"]))


@functools.lru_cache(maxsize=4)
def _decoded_change(raw: str) -> MembershipChange:
    """A decision, decoded once per process (immutable: the ranks of a process that read it share it)."""
    return MembershipChange.decode(raw)


def _contains(ranks: Sequence[int], rank: int) -> bool:
    """Whether sorted `ranks` hold `rank` (by bisection: a member list is W long, the ranks asked about a few)."""
    i = bisect.bisect_left(ranks, rank)
    return i < len(ranks) and ranks[i] == rank


def _strictly_increasing(ranks: Sequence[int]) -> bool:
    """Whether `ranks` are sorted and distinct (a C loop: a member list is W long)."""
    return all(map(operator.lt, ranks, ranks[1:]))


def _sorted_distinct(ranks: Iterable[int]) -> tuple[int, ...]:
    """`ranks` sorted without repeats; a tuple or list already so (the usual member list) is checked, not sorted."""
    if isinstance(ranks, (tuple, list)) and _strictly_increasing(ranks):
        return tuple(ranks)
    return tuple(sorted(set(ranks)))


def _runs(ranks: Sequence[int]) -> list[list[int]]:
    """Sorted, distinct ranks as [first, last] runs of consecutive ones: (0, 1, 2, 4, 5) -> [[0, 2], [4, 5]].

    A stretch whose ends lie as far apart as it is long is one run; any other is halved. The cost grows with the
    runs (the deaths and joins) times log W, not with the W ranks: every survivor encodes its proposal."""
    out: list[list[int]] = []
    stack = [(0, len(ranks))] if ranks else []
    while stack:
        lo, hi = stack.pop()
        first, last = ranks[lo], ranks[hi - 1]
        if last - first == hi - 1 - lo:
            if out and out[-1][1] + 1 == first:
                out[-1][1] = last
            else:
                out.append([first, last])
        else:
            mid = (lo + hi) // 2
            stack += [(mid, hi), (lo, mid)]  # the lower half first: runs come out in order
    return out


@dataclass(frozen=True)
class FailureReport:
    """One rank's claim that `ranks` died: when it noticed (its wall clock, a record only), why, and for how long it
    had seen no sign of life from each (seconds on its own monotonic clock)."""

    reporter: int
    ranks: frozenset[int]
    detected_at: float
    reason: str
    silent_s: dict[int, float] = field(default_factory=dict)

    def encode(self) -> str:
        return json.dumps({"reporter": self.reporter, "ranks": sorted(self.ranks), "detected_at": self.detected_at,
                           "reason": self.reason, "silent_s": {str(r): t for r, t in self.silent_s.items()}})

    @classmethod
    def decode(cls, raw: bytes | str) -> FailureReport:
        d = json.loads(raw)
        return cls(d["reporter"], frozenset(d["ranks"]), d["detected_at"], d["reason"],
                   {int(r): t for r, t in d["silent_s"].items()})


def decide(generation: int, members: Sequence[int], reports: Sequence[FailureReport]) -> MembershipChange:
    """Merge the reports of `generation` into the change every survivor will adopt (pure; `members` sorted)."""
    members = members if isinstance(members, (list, tuple)) else list(members)
    dead = frozenset(r for rep in reports for r in rep.ranks if _contains(members, r))
    if not dead:
        raise ValueError(f"reports of generation {generation} name no current member as dead")
    first = {r: min(rep.detected_at for rep in reports if r in rep.ranks) for r in dead}
    silence = [min(rep.silent_s[r] for rep in reports if r in rep.silent_s) for r in dead
               if any(r in rep.silent_s for rep in reports)]
    latency = max((max(0.0, s) for s in silence), default=0.0)
    reasons = list(dict.fromkeys(rep.reason for rep in reports))
    survivors = list(members)
    for r in sorted(dead, reverse=True):  # members are sorted: remove the few dead in place, not rebuild W ranks
        del survivors[bisect.bisect_left(survivors, r)]
    return MembershipChange(generation + 1, dead, tuple(survivors), latency, "; ".join(reasons),
                            tuple(sorted(first.items())))




POLL_RATE_PER_S = 20_000
"""Polls per second the waiters of one barrier (or decision) send the store in all, once backed off."""
MIN_POLL_S = 0.01
"""The shortest pause between two polls of a waiting rank once it has backed off (a barrier of few ranks)."""


def poll_ceiling(waiters: int) -> float:
    """The longest pause between two polls of each of `waiters` ranks waiting on one key: long enough that they send
    POLL_RATE_PER_S polls a second in all (0.05 s at 1,024 ranks, 5 s at 100,000), and at least MIN_POLL_S. The end
    of a wait is seen that much after it happens: the price of polling, which only a wait the store answers avoids."""
    return max(MIN_POLL_S, waiters / POLL_RATE_PER_S)


def barrier(store, name: str, rank: int, ranks: Sequence[int], timeout_s: float, *, poll_s: float = 0.02,
            max_poll_s: float | None = None, clock: Callable[[], float] = time.monotonic,
            sleep: Callable[[float], None] = time.sleep, node: NodeLocal | None = None) -> None:
    """Wait until every rank in `ranks` has called this barrier `name`; raise BarrierTimeout after `timeout_s`.

    Polls the barrier's end (`BarrierWait`, through the node's store with `node`), pausing `poll_s` at first and
    twice as long after each poll up to `max_poll_s` (default: `poll_ceiling` of the barrier's size).
    """
    wait = BarrierWait(store, name, rank, ranks, timeout_s, poll_s=poll_s, max_poll_s=max_poll_s, clock=clock,
                       node=node)
    while (pause := wait.poll()) is not None:
        sleep(pause)


SETTLE_EXTENSIONS = 2
"""How many more settle windows a decision may wait, past its first, for reports of new deaths (`DecisionWait`)."""

BARRIER_FANOUT = 32
"""Most ranks that write one counter of a barrier (`BarrierWait`): arrivals are counted in a tree of counters of at
most this many writers each, not on one key that every member writes."""


class BarrierWait:
    """One rank's arrival at barrier `name` and its wait for the others, one poll at a time (`barrier` runs it to the
    end; a caller that multiplexes many waits calls `poll` itself).

    Arrivals are counted in a tree: rank i of the (sorted) barrier ranks adds one to its leaf's counter
    (`name/c/0/{i // 32}`); the arrival that fills a counter adds one to its parent's (`name/c/1/{i // 32**2}`), and
    so on; the arrival that fills the root sets `name/done`, which the waiters read. No counter has more than
    `BARRIER_FANOUT` writers, so on etcd, where a counter is a guarded transaction, writers no longer retry each
    other out by the thousand on one key; each rank still makes two writes (its own arrival mark, its leaf) and
    reads one key per poll. A rank that calls again is counted once (its mark, `name/{rank}`).

    With `node` (`NodeLocal`), a node's ranks meet in the node's store first: each marks and counts its arrival
    there, and the one whose arrival completes the node's count arrives for all of them in the job's store (its node's
    mark, `name/node/{n}`, and one add per leaf counter its node's ranks fall in, of their number); it alone polls the
    job's store for the end and copies it into the node's store, where its node-mates poll. A barrier then costs the
    job's store a few requests per node, not per rank. A barrier that runs past half its bound is slow: every rank still
    waiting marks its own arrival in the job's store then, so that a timeout (every rank's own, with or without a node
    store) names the ranks that never came, not their nodes; a rank that comes later than that after the others may
    be named with them. A closer that dies after arriving is a death its node-mates' watch sees (`Detector.watch`).

    With a rack level too (`NodeLocal.rack`), a node's closer arrives for its node in the rack's store (the node's
    mark, `name/node/{n}`, and its count added to the rack's), and the closer whose arrival completes the rack's count
    arrives for the rack in the job's store, polls the end there and copies it into the rack's store (`name/end`),
    where the rack's other closers poll. A rack's store can die while nodes of its rack live (its host's launcher is
    gone), so the rack's arrival in the job's store is claimed first (`name/rack/{k}`, by value): the rack's closer
    claims it as `rack` before it counts the rack; a closer that cannot reach the rack's store claims it as `nodes`.
    If `rack` stood, the rack's count was complete, the failed closer's node in it, and that closer polls the end in
    the job's store; if `nodes` stood, every node of the rack arrives on its own in the job's store (its node's mark
    keeps it from counting twice), the rack's closer tells its rack-mates so (`name/end` = `split`), and a rack-mate
    whose rack store fails does so by itself. From half the bound on, a rack's closers poll the job's store."""

    def __init__(self, store, name: str, rank: int, ranks: Sequence[int], timeout_s: float, *, poll_s: float = 0.02,
                 max_poll_s: float | None = None, clock: Callable[[], float] = time.monotonic,
                 fanout: int = BARRIER_FANOUT, node: NodeLocal | None = None):
        ranks = _sorted_distinct(ranks)
        if not _contains(ranks, rank):
            raise ValueError(f"rank {rank} is not among the barrier's ranks {list(ranks)}")
        self.store, self.name, self.ranks, self.timeout_s = store, name, ranks, timeout_s
        self.rank, self.node, self._fanout = rank, node, fanout
        self._rack: NodeLocal | None = None
        """The rack level where this rank polls the rack's store for the end (a node's closer), or copies it there
        (the rack's closer)."""
        self._rack_closer = False
        if max_poll_s is None:
            level = node if node is None or node.rack is None else node.rack
            max_poll_s = poll_ceiling(len(ranks) if level is None else -(-len(ranks) // level.size))
            poll_s = min(poll_s, max_poll_s)
        self._poll_s, self._max_poll_s, self._clock = poll_s, max(poll_s, max_poll_s), clock
        self.start = clock()
        self.deadline = self.start + timeout_s
        self._pause = poll_s
        self._marked = False
        if node is None:
            self.closer = True
            if store.add(f"{name}/{rank}", 1) == 1:  # count each rank once, even if it calls again
                count_arrival(store, name, bisect.bisect_left(ranks, rank), len(ranks), fanout)
        else:
            self.closer = self._arrive_on_node(fanout)

    def _arrive_on_node(self, fanout: int) -> bool:
        """Count this rank's arrival in its node's store; the arrival that completes the node's count arrives for the
        node in the job's store. Return whether this rank polls the job's store (it completed its node's count, or
        calls again after it was completed)."""
        local, name = self.node.store, self.name
        lo, hi = self.node.span(self.ranks, self.rank)
        if local.add(f"{name}/{self.rank}", 1) != 1:  # a second call: count it once; poll with the closer
            return int(local.add(f"{name}/count", 0)) >= hi - lo
        if int(local.add(f"{name}/count", 1)) < hi - lo:
            return False
        rack = self.node.rack_of(self.rank)
        if rack is not None:
            if rack.usable:
                try:
                    return self._arrive_in_rack(rack, lo, hi, fanout)
                except Exception as err:  # the rack's store failed: the job's store counts the node (see the class)
                    rack.failed(err)
            self._leave_rack(rack)
            return True
        self._arrive_node(lo, hi, fanout)
        return True

    def _leave_rack(self, rack: NodeLocal) -> None:
        """Stop waiting on the rack's store (it failed, or the barrier is slow): if the rack's arrival stands
        claimed as `rack`, this node was counted with it; else this node arrives on its own, and says so in the rack's
        store, where a rack-mate that can still reach it learns to do the same. Poll the job's store from now on."""
        self._rack, self.closer = None, True
        if self._claim_rack("nodes") == "rack":
            return
        try:  # (one write, even to a store that failed before: a rack-mate that can reach it need not wait)
            rack.store.set(f"{self.name}/end", "split")
        except Exception:  # (a rack-mate whose store fails too claims, and finds `nodes`; one that can reach it reads
            pass           # this; one that cannot, either, turns to the job's store at half the bound)
        self._arrive_node(*self.node.span(self.ranks, self.rank), self._fanout)

    def _arrive_node(self, lo: int, hi: int, fanout: int) -> None:
        """Arrive for this rank's node (the [lo, hi)-th barrier ranks) in the job's store, once."""
        count_node(self.store, self.name, self.rank // self.node.size, lo, hi, len(self.ranks), fanout)

    def _arrive_in_rack(self, rack: NodeLocal, lo: int, hi: int, fanout: int) -> bool:
        """Count this node's arrival in its rack's store; the one that completes the rack's count claims the rack's
        arrival in the job's store and makes it. Return whether this rank polls the job's store."""
        store, name = rack.store, self.name
        rlo, rhi = rack.span(self.ranks, self.rank)
        if int(store.add(f"{name}/node/{self.rank // self.node.size}", 1)) == 1:
            if int(store.add(f"{name}/count", hi - lo)) >= rhi - rlo:
                if self._claim_rack("rack") == "rack":
                    count_span(self.store, name, rlo, rhi, len(self.ranks), fanout)
                    self._rack, self._rack_closer = rack, True
                    return True
                store.set(f"{name}/end", "split")  # a rack-mate fell back: every node arrives on its own
                self._arrive_node(lo, hi, fanout)
                return True
        self._rack = rack
        return False

    def _claim_rack(self, how: str) -> str:
        return claim_rack(self.store, self.name, self.rank // self.node.rack.size, how)

    def _rack_end(self) -> bool:
        """Poll the rack's store for the end (a node's closer); on `split`, or once the rack's store fails, arrive as
        the class says and poll the job's store from then on. Return whether the barrier has ended."""
        rack = self._rack
        try:
            end = present_values(rack.store, [f"{self.name}/end"])
        except Exception as err:
            rack.failed(err)
            self._leave_rack(rack)
            return False
        if end is None:
            return False
        if end[0] == b"split":
            self._rack, self.closer = None, True
            self._arrive_node(*self.node.span(self.ranks, self.rank), self._fanout)
            return False
        return True

    def poll(self) -> float | None:
        """Poll once: return None once every rank has arrived, else the seconds to pause before the next poll.

        Raise BarrierTimeout, naming the ranks that never arrived, past the deadline.
        """
        done = f"{self.name}/done"
        if self.closer:
            if self.store.check([done]):
                if self._rack_closer:  # tell the rack-mates (a rack's store that failed: they poll the job's)
                    try:
                        self._rack.store.set(f"{self.name}/end", "done")
                    except Exception as err:
                        self._rack.failed(err)
                if self.node is not None:  # tell the node-mates
                    self.node.store.set(done, "1")
                return None
        elif self._rack is not None:
            if self._rack_end():
                self.node.store.set(done, "1")
                return None
        elif self.node.store.check([done]):
            return None
        now = self._clock()
        if self.node is not None and not self._marked and now - self.start >= self.timeout_s / 2:
            self.store.add(f"{self.name}/{self.rank}", 1)  # a slow barrier: mark my own arrival, to be told apart
            self._marked = True
            if self._rack is not None and not self._rack_closer:  # (a rack whose count never completes, or whose
                self._leave_rack(self._rack)                        # closer died, leaves no end in its store)
        if now >= self.deadline:
            if self.store.check([done]):  # (a closer that died after arriving: nobody copied the end)
                return None
            raise BarrierTimeout(self.name, missing_ranks(self.store, self.name, self.ranks, self._fanout),
                                 self.timeout_s)
        pause = min(self._pause, self.deadline - now)
        self._pause = min(2 * self._pause, self._max_poll_s)
        return pause


def claim_rack(store, name: str, rack: int, how: str) -> str:
    """Claim how rack `rack` arrives at barrier `name` in the job's store (`rack`: whole, by the closer that completed
    its count in the rack's store; `nodes`: node by node); return the claim that stands (the first one made)."""
    raw = store.compare_set(f"{name}/rack/{rack}", "", how)
    return raw.decode() if isinstance(raw, (bytes, bytearray)) else str(raw)


def count_node(store, name: str, node: int, lo: int, hi: int, n: int, fanout: int = BARRIER_FANOUT) -> bool:
    """Arrive for node `node` (the [lo, hi)-th of the `n` sorted ranks of barrier `name`) in the job's store, once
    (its mark, `name/node/{node}`); return whether this ended the barrier."""
    if int(store.add(f"{name}/node/{node}", 1)) == 1:  # (else a node-mate, a rack-mate or a reporter did)
        return count_span(store, name, lo, hi, n, fanout)
    return False


def missing_ranks(store, name: str, ranks: Sequence[int], fanout: int = BARRIER_FANOUT) -> frozenset[int]:
    """The ranks of barrier `name` (over sorted `ranks`) that have not arrived: found down its tree of counters
    (`count_arrival`), into the incomplete counters only, and there by each rank's own mark (a rank on a node whose
    count never completed marks itself in the job's store once the barrier is slow: `BarrierWait.poll`). Its reads
    grow with the missing ranks times the fanout and the tree's depth, not with the barrier's ranks: every rank of a
    barrier that times out asks."""
    widths = [len(ranks)]  # the counters' count below each level (the ranks below level 0)
    while widths[-1] > fanout:
        widths.append(-(-widths[-1] // fanout))
    missing: list[int] = []
    stack = [(len(widths) - 1, 0)]
    while stack:
        level, node = stack.pop()
        first = node * fanout
        size = min(fanout, widths[level] - first)
        if int(store.add(f"{name}/c/{level}/{node}", 0)) >= size:
            continue
        if level == 0:
            missing += (ranks[i] for i in range(first, first + size) if not store.check([f"{name}/{ranks[i]}"]))
        else:
            stack += ((level - 1, child) for child in range(first, first + size))
    return frozenset(missing)


def count_span(store, name: str, lo: int, hi: int, n: int, fanout: int = BARRIER_FANOUT) -> bool:
    """Count the arrival of the [lo, hi)-th of the `n` (sorted) ranks of barrier `name` at once (a node's: they span
    one leaf counter or two), one add per leaf; return whether this ended the barrier."""
    last = False
    for leaf in range(lo // fanout, (hi - 1) // fanout + 1):
        first, end = max(lo, leaf * fanout), min(hi, (leaf + 1) * fanout)
        last |= count_arrival(store, name, first, n, fanout, end - first)
    return last


def count_arrival(store, name: str, index: int, n: int, fanout: int = BARRIER_FANOUT, amount: int = 1) -> bool:
    """Count the arrival of the `index`-th of the `n` (sorted) ranks of barrier `name` in its tree of counters
    (see `BarrierWait`, which also marks the rank's own arrival first); `amount`: that many ranks from `index` on, all
    in its leaf (a node's, counted at once). Return whether this arrival was the last (it ended the barrier: exactly
    one arrival does)."""
    level, width = 0, n  # width: the counters' count below this level (the ranks at level 0)
    while True:
        node = index // fanout
        size = min(fanout, width - node * fanout)  # this counter's writers: the full ones below it
        if store.add(f"{name}/c/{level}/{node}", amount) < size:
            return False
        amount = 1
        if width <= fanout:  # the root is full: every rank has arrived
            store.set(f"{name}/done", "1")
            return True
        level, index, width = level + 1, node, -(-width // fanout)


class Membership:
    """One rank's view of the job's members, kept in agreement with every other survivor through the store."""

    def __init__(self, store, rank: int, members: Iterable[int], generation: int = 0, *, settle_s: float = 0.2,
                 poll_s: float = 0.02, max_poll_s: float | None = None, clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] = time.sleep, node: NodeLocal | None = None):
        self.store, self.rank = store, rank
        self.node = node
        """The node's own store, through which the survivors' barrier is met (`BarrierWait`); None: none."""
        self.members = _sorted_distinct(members)
        if not self.is_member(rank):
            raise ValueError(f"rank {rank} is not among members {list(self.members)}")
        self.generation = generation
        if max_poll_s is None:  # (a new generation's survivors wait on it as few more: the ceiling of the first)
            max_poll_s = poll_ceiling(len(self.members))
            poll_s = min(poll_s, max_poll_s)
        self.settle_s, self.poll_s, self.max_poll_s = settle_s, poll_s, max(poll_s, max_poll_s)
        self._clock, self._sleep = clock, sleep
        self._read: dict[int, list[FailureReport]] = {}
        """Generation -> the reports read so far, in filing order (entries never change once written)."""
        self._decided: dict[int, MembershipChange] = {}
        """Generation -> its committed decision, once read (a decision never changes once committed)."""
        self._reading = threading.Lock()
        self._reported: set[int] = set()
        """Generations in which this rank filed a report: its reporters commit the decision (`DecisionWait`)."""
        self._claims: dict[int, set[int]] = {}
        """Generation -> the deaths this rank claimed (its acknowledgements through the node count them)."""
        self._closed: dict[int, set[int]] = {}
        """Generation -> the nodes this rank has seen acknowledged, or acknowledged (`_close_nodes`)."""
        self._racked: dict[int, set[int]] = {}
        """Generation -> the nodes this rank acknowledged in its rack's store (`_ack_node`)."""
        self._unracked: set[int] = set()
        """Generations whose acknowledgements this rank's rack makes node by node (its store failed, or it split)."""

    def is_member(self, rank: int) -> bool:
        """Whether `rank` is a member of this rank's current generation (by bisection: members are W long)."""
        return _contains(self.members, rank)

    @staticmethod
    def _reports_key(generation: int) -> str:
        return membership_key(generation, "reports")

    @staticmethod
    def _events_key(generation: int) -> str:
        return membership_key(generation, "events")

    @staticmethod
    def _acks_key(generation: int) -> str:
        return membership_key(generation, "acks")

    @staticmethod
    def _decision_key(generation: int) -> str:
        return decision_key(generation)

    def _check_generation(self, generation: int) -> None:
        if generation < self.generation:
            raise StaleGeneration(f"generation={generation} is older than this rank's generation {self.generation}")
        if generation > self.generation:
            raise ValueError(f"generation={generation} is ahead of this rank's generation {self.generation}")

    def report_failure(self, generation: int, ranks: Iterable[int], detected_at: float, reason: str,
                       silent_s: Mapping[int, float] | None = None, fenced: Iterable[int] = ()) -> bool:
        """Propose that `ranks` died; return False if ignored (older generation, not members, already decided).
        `fenced`: those of them this rank knows of only from the fence log, whose fencer claims them (this rank
        acknowledges them, and claims them at its recovery's report, after reading the reports).

        A rank reported after the decision is not in it: once the change is adopted, report it again.
        """
        if generation < self.generation:
            return False
        self._check_generation(generation)
        ranks = frozenset(r for r in ranks if self.is_member(r))
        # (a node-mate's look at the decision will do: a report made after it is ignored, and made again next time)
        if not ranks or self.decision(generation, SHARED_AGE_S) is not None:
            return False
        # A death in a report read already is claimed: only the others are (a claim is a write to the dead rank's
        # key, which every survivor that learns of the death would otherwise make).
        known = {r for report in self._read.get(generation, ()) for r in report.ranks} | set(fenced)
        claimed = frozenset(r for r in sorted(ranks - known)
                            if self.store.add(membership_key(generation, f"dead/{r}"), 1) == 1)
        if claimed:  # deaths somebody else reported already add nothing to the union
            seen = {r: float(t) for r, t in (silent_s or {}).items() if r in claimed and t is not None}
            report = FailureReport(self.rank, claimed, float(detected_at), reason, seen)
            key = self._reports_key(generation)
            entry = self.store.add(f"{key}/count", 1)
            self.store.set(f"{key}/{entry}", report.encode())
            self.store.add(self._events_key(generation), 1)
            self._reported.add(generation)
        # After its report, so that an acknowledgement counts a complete view: the dead it claimed first (they
        # cannot acknowledge), then itself.
        if self._acknowledge_all(generation, claimed):
            # every report is in: commit now, whoever waits (a reporter may be busy in its step)
            self._commit(generation, self.reports(generation))
        return True

    def _acknowledge_all(self, generation: int, claimed: frozenset[int]) -> bool:
        """Acknowledge the dead this rank claimed and itself; return whether that ended the acknowledgements.

        Through the node (a `node` that knows the launch's numbering): this rank's acknowledgement is counted in its
        node's store, and a node is acknowledged in the job's store once, for all its members (`_close_nodes`). A
        generation with a joiner acknowledges rank by rank (`_acks_by_node`)."""
        node = self.node
        if not self._acks_by_node():
            return any([self._acknowledge(generation, rank) for rank in (*sorted(claimed), self.rank)])
        acks = self._acks_key(generation)
        if int(node.store.add(f"{acks}/{self.rank}", 1)) == 1:
            node.store.add(f"{acks}/count", 1)
        self._claims.setdefault(generation, set()).update(claimed)
        return self._close_nodes(generation)

    def _acks_by_node(self) -> bool:
        """Whether this generation's acknowledgements go through the nodes: every member was started on a node of
        the launch's numbering (a generation with a joiner acknowledges rank by rank, on every rank alike: a joiner
        knows no nodes, and a node's acknowledgement and a rank's own must never both count one member)."""
        node = self.node
        return (node is not None and node.launched is not None and node.on_node(self.members[0])
                and node.on_node(self.members[-1]))

    def _close_nodes(self, generation: int) -> bool:
        """Acknowledge in the job's store each node whose every member is accounted for, as this rank sees it: its
        own node once each member has acknowledged in the node's store or is dead in a report read (or claimed by
        this rank); and, for a rank that filed a report, a node all of whose members are dead so. Each node is
        acknowledged once (its mark, `acks/node/{n}`), for all its members at once (one add per leaf counter), so
        the acknowledgements cost the job's store a few requests per node, not two per rank. A member reported dead
        but alive, which also acknowledges, is counted once, with its node, as its claimant's acknowledgement would
        have counted it without a node. Return whether this ended the acknowledgements.

        With a rack level (`NodeLocal.rack`), a node of this rank's rack is acknowledged in the rack's store instead
        (its mark and its count there), by its own closer or, for a node all of whose members are dead, by any rank of
        the rack that knows it; the acknowledgement that completes the rack's count acknowledges the rack in the
        job's store, once its claim (`acks/rack/{k}`, by value, as `BarrierWait`'s) stands as `rack`. A node of
        another rack is left to that rack unless every member of that rack is dead (a rack lost whole): then a
        reporter claims it as `nodes` and acknowledges it node by node. A rack whose claim stands as `nodes` (its
        store failed for one of its ranks, or a reporter took it) is acknowledged node by node, each node's mark in
        the job's store keeping it from counting twice, and its ranks learn so from the rack's store (`acks/end`)."""
        node = self.node
        if not self._acks_by_node():
            return False
        acks, closed = self._acks_key(generation), self._closed.setdefault(generation, set())
        known = {r for report in self._read.get(generation, ()) for r in report.ranks} | self._claims.get(generation,
                                                                                                        set())
        own = self.rank // node.size
        rack = node.rack_of(self.rank)
        last = False
        nodes = {own}
        if generation in self._reported:
            nodes |= {r // node.size for r in known if node.on_node(r)}
        if rack is not None:
            nodes |= {r // node.size for r in known if node.on_node(r) and r // rack.size == self.rank // rack.size}
            last |= self._rack_split(generation, rack)
        for n in sorted(nodes - closed):
            lo, hi = node.span(self.members, n * node.size)
            dead = [r for r in self.members[lo:hi] if r in known]
            if n == own:
                if node.store.check([f"{acks}/closed"]):
                    closed.add(n)
                    continue
                acked = int(node.store.add(f"{acks}/count", 0))
                both = sum(1 for r in dead if node.store.check([f"{acks}/{r}"]))
                if acked + len(dead) - both < hi - lo:
                    continue
            elif len(dead) < hi - lo:
                continue
            elif rack is not None and n * node.size // rack.size != self.rank // rack.size:
                rlo, rhi = rack.span(self.members, n * node.size)  # (another rack's node: its rack's own, unless
                if any(r not in known for r in self.members[rlo:rhi]):  # that whole rack is dead)
                    continue
            closed.add(n)
            if n == own:
                node.store.set(f"{acks}/closed", "1")
            last |= self._ack_node(generation, n, lo, hi)
        return last

    def _ack_node(self, generation: int, n: int, lo: int, hi: int) -> bool:
        """Acknowledge node `n` (the [lo, hi)-th members): in this rank's rack's store where it is of this rank's
        rack and the rack acknowledges as one, else in the job's store (see `_close_nodes`)."""
        node, acks = self.node, self._acks_key(generation)
        rack = node.rack_of(self.rank)
        if rack is None:
            return self._ack_in_job(acks, n, lo, hi)
        k = n * node.size // rack.size
        if k == self.rank // rack.size and rack.usable and generation not in self._unracked:
            try:
                if int(rack.store.add(f"{acks}/node/{n}", 1)) != 1:
                    return False  # (a rack-mate acknowledged it there)
                self._racked.setdefault(generation, set()).add(n)
                rlo, rhi = rack.span(self.members, self.rank)
                if int(rack.store.add(f"{acks}/count", hi - lo)) < rhi - rlo:
                    return False
                if claim_rack(self.store, acks, k, "rack") == "rack":
                    return count_span(self.store, acks, rlo, rhi, len(self.members))
                return self._unrack(generation, rack)  # (a rank of the rack, or a reporter, claimed it `nodes`)
            except Exception as err:  # the rack's store failed: the rack goes node by node, unless counted whole
                rack.failed(err)
                return self._unrack(generation, rack, also=n)
        if claim_rack(self.store, acks, k, "nodes") == "rack":
            return False  # its rack's count was complete: counted with the rack
        return self._ack_in_job(acks, n, lo, hi)

    def _ack_in_job(self, acks: str, n: int, lo: int, hi: int) -> bool:
        return count_node(self.store, acks, n, lo, hi, len(self.members))

    def _unrack(self, generation: int, rack: NodeLocal, also: int | None = None) -> bool:
        """This rank's rack acknowledges node by node from now on (unless its claim stands as `rack`: then every node
        of it was counted with it): acknowledge in the job's store the nodes this rank acknowledged in the rack's
        store (and `also`), and tell the rack's ranks (`acks/end`)."""
        node, acks = self.node, self._acks_key(generation)
        self._unracked.add(generation)
        if claim_rack(self.store, acks, self.rank // rack.size, "nodes") == "rack":
            return False
        try:  # (one write, even to a store that failed before: its ranks that can reach it learn at once)
            rack.store.set(f"{acks}/end", "split")
        except Exception:
            pass
        last = False
        for n in sorted(self._racked.get(generation, set()) | ({also} if also is not None else set())):
            last |= self._ack_in_job(acks, n, *node.span(self.members, n * node.size))
        return last

    def _rack_split(self, generation: int, rack: NodeLocal) -> bool:
        """Whether this rank's rack went node by node (`acks/end` in its store, or its store failed): if so, and
        this rank acknowledged nodes there, acknowledge them in the job's store. Return whether that ended the
        acknowledgements."""
        if generation in self._unracked or not self._racked.get(generation):
            return False
        try:
            end = present_values(rack.store, [f"{self._acks_key(generation)}/end"]) if rack.usable else [b"split"]
        except Exception as err:
            rack.failed(err)
            end = [b"split"]
        if end is None or end[0] != b"split":
            return False
        return self._unrack(generation, rack)

    def _acknowledge(self, generation: int, rank: int) -> bool:
        """Count `rank` (once) in the acknowledgements of `generation`: a barrier over its members, whose end
        (`acks/done`) says every member not reported dead has acknowledged. Return whether this was the last one.
        Each member acknowledges after filing its report, so at the end every report is in the store, and the
        rank that ended it commits their union at once (one writer of the decision)."""
        acks = self._acks_key(generation)
        if self.store.add(f"{acks}/{rank}", 1) == 1:
            return count_arrival(self.store, acks, bisect.bisect_left(self.members, rank), len(self.members))
        return False

    def pending(self) -> bool:
        """Return whether some rank has reported a failure in the current generation (one store round trip)."""
        key = f"{self._reports_key(self.generation)}/count"  # (a waiter for the decision creates it at 0)
        count = present_values(self.store, [key])
        return count is not None and int(count[0]) > 0

    def reports(self, generation: int, max_age_s: float = 0.0, filed: int | None = None) -> list[FailureReport]:
        """Return the reports of `generation` visible in the store now. Only entries this rank has not read yet are
        fetched (one request when there are none): an entry counted but not written yet is read on a later call.
        `max_age_s` > 0: as seen by a read of the node's ranks at most that old (`NodeLocal.read`), not by one of
        this rank's own (a commit reads its own: it must hold every report filed before the acknowledgements
        ended). `filed`: their count, read already (with the counter that said a report came)."""
        with self._reading:  # (the watch's early report reads them too, from the heartbeat's thread)
            return self._reports(generation, self.node if max_age_s > 0 else None, max_age_s, filed)

    def _reports(self, generation: int, node: NodeLocal | None, max_age_s: float,
                 filed: int | None = None) -> list[FailureReport]:
        key = self._reports_key(generation)
        read = self._read.setdefault(generation, [])
        if filed is None and node is not None:
            count = node.read(self.store, [f"{key}/count"], max_age_s, check=True)
            if count is None:
                return list(read)
            filed = int(count[0])
        elif filed is None:
            if (count := present_values(self.store, [f"{key}/count"])) is None:
                return list(read)
            filed = int(count[0])
        keys = [f"{key}/{entry}" for entry in range(len(read) + 1, filed + 1)]
        raws = None
        if keys:  # the usual case: every counted entry written, two requests for all
            raws = (node.read(self.store, keys, max_age_s, fixed=True, check=True) if node is not None
                    else present_values(self.store, keys))
        if raws is not None:
            read += [FailureReport.decode(raw) for raw in raws]
        elif keys:
            for k in keys:
                if (raw := present_values(self.store, [k])) is None:
                    break  # its reporter has counted it and not written it yet
                read.append(FailureReport.decode(raw[0]))
        return list(read)

    def decision(self, generation: int, max_age_s: float = 0.0) -> MembershipChange | None:
        """Return the change committed for `generation`, or None if none is committed yet (never waits).
        `max_age_s` > 0: a node-mate's look at most that old, if it found none (`NodeLocal.read`)."""
        self._check_generation(generation)
        if generation in self._decided:
            return self._decided[generation]
        key = self._decision_key(generation)
        if max_age_s > 0 and self.node is not None:
            raw = self.node.read(self.store, [key], max_age_s, fixed=True, check=True)
            return None if raw is None else self._adopt_decision(generation, raw[0])
        raw = present_values(self.store, [key])
        return None if raw is None else self._adopt_decision(generation, raw[0])

    def _adopt_decision(self, generation: int, raw: bytes | str, proposed: MembershipChange | None = None,
                        sent: str | None = None) -> MembershipChange:
        """Decode (once per generation) and keep the decision committed for `generation`: `proposed` when `raw` is
        `sent`, its encoding (this rank's proposal won)."""
        if generation not in self._decided:
            raw = raw.decode() if isinstance(raw, bytes) else raw
            won = proposed is not None and raw == sent
            self._decided[generation] = proposed if won else _decoded_change(raw)
        return self._decided[generation]

    def _propose(self, generation: int, change: MembershipChange) -> MembershipChange:
        """Commit `change` for `generation` unless a decision is committed already; wake the waiters; return the
        decision in force."""
        sent = change.encode()
        committed = self.store.compare_set(self._decision_key(generation), "", sent)
        self.store.add(self._events_key(generation), 1)  # wake the waiters: the decision is there to read
        return self._adopt_decision(generation, committed, change, sent)

    def await_decision(self, generation: int, timeout_s: float) -> MembershipChange:
        """Return the change committed for `generation`, committing the reports' union if nobody has.

        Raise MembershipTimeout if no report appears within `timeout_s`.
        """
        wait = self.decision_wait(generation, timeout_s)
        while True:
            outcome = wait.poll()
            if isinstance(outcome, MembershipChange):
                return outcome
            self._sleep(outcome)

    def decision_wait(self, generation: int, timeout_s: float) -> DecisionWait:
        """`await_decision`, one poll at a time."""
        return DecisionWait(self, generation, timeout_s)

    def _commit(self, generation: int, reports: Sequence[FailureReport]) -> MembershipChange:
        return self._propose(generation, decide(generation, self.members, reports))

    def commit(self, change: MembershipChange) -> MembershipChange:
        """Commit `change` (a grown membership, decided without reports) for the current generation unless a
        decision is committed already; return the decision in force."""
        if change.generation != self.generation + 1:
            raise ValueError(f"change to generation {change.generation} does not follow generation {self.generation}")
        return self._propose(self.generation, change)

    def adopt(self, change: MembershipChange) -> None:
        """Move to `change`'s generation and members without the survivors' barrier (a grown membership meets at
        the new generation's rendezvous instead)."""
        self._enter(change)

    def _enter(self, change: MembershipChange) -> None:
        """Move to `change`'s generation and members, and forget what was read of the generations before the last
        (a call naming one raises StaleGeneration): a rank keeps two generations' decisions, W long each, not all."""
        self.generation, self.members = change.generation, change.survivors
        for old in [g for g in (*self._read, *self._decided, *self._reported, *self._claims, *self._closed,
                                *self._racked, *self._unracked) if g < change.generation - 1]:
            self._read.pop(old, None)
            self._decided.pop(old, None)
            self._reported.discard(old)
            self._claims.pop(old, None)
            self._closed.pop(old, None)
            self._racked.pop(old, None)
            self._unracked.discard(old)

    def confirm(self, change: MembershipChange, timeout_s: float) -> bool:
        """Adopt `change`, then wait (bounded) until every survivor has; return False for a stale change.

        Raise Evicted if this rank is among the dead, and BarrierTimeout naming the survivors that never arrived
        (they should be reported dead in the new generation, which this rank has already adopted).
        """
        wait = self.confirm_wait(change, timeout_s)
        if wait is None:
            return False
        while (pause := wait.poll()) is not None:
            self._sleep(pause)
        return True

    def confirm_wait(self, change: MembershipChange, timeout_s: float) -> BarrierWait | None:
        """Adopt `change` and arrive at the survivors' barrier; return the wait for the others (None for a stale
        change). `confirm` runs it to the end. Raise as `confirm` does."""
        if change.generation <= self.generation:
            return None
        if change.generation != self.generation + 1:
            raise ValueError(f"change to generation {change.generation} skips generations after {self.generation}")
        if change != self.decision(self.generation):
            raise ValueError(f"change to generation {change.generation} is not the committed decision")
        if self.rank in change.dead:
            raise Evicted(f"rank {self.rank} was declared dead in generation {change.generation}: {change.reason}")
        self._enter(change)
        return BarrierWait(self.store, membership_key(change.generation, "confirm"), self.rank, change.survivors,
                           timeout_s, poll_s=self.poll_s, max_poll_s=None if self.node else self.max_poll_s,
                           clock=self._clock, node=self.node)


class DecisionWait:
    """One rank's wait for the decision of `generation`, one poll at a time (`Membership.await_decision` runs it to
    the end; a caller that multiplexes many waits calls `poll` itself).

    Once every member not reported dead has acknowledged, the rank whose acknowledgement was the last commits the
    decision (`Membership.report_failure`), and every waiter reads it. Otherwise the ranks that filed a report commit
    it when the settle window has run out since they saw the first report; a rank that filed none commits only if
    no decision has come within twice the settle window (its reporters died on the way): the decision key has one
    writer, or as many as reports, not one per survivor, whose settle windows all ran out together.

    A report of new deaths (every report names one: `report_failure` files none for deaths reported already) starts
    the window again, for at most `SETTLE_EXTENSIONS` more windows: deaths at one moment (a rack) whose watchers'
    verdicts come spread out (a loaded host) join one decision, instead of a generation each, while a stream of
    deaths (1% of a job within a minute) cannot hold the decision for longer than that bound."""

    def __init__(self, membership: Membership, generation: int, timeout_s: float):
        membership._check_generation(generation)
        self.membership, self.generation, self.timeout_s = membership, generation, timeout_s
        self.deadline = membership._clock() + timeout_s
        self._first_seen: float | None = None
        self._seen, self._everyone, self._reports, self._pause = 0, False, [], membership.poll_s
        self._filed, self._news_at = 0, -float("inf")  # reports counted so far; when the count last moved
        self._look_again: float | None = None
        # The reports' count is read with the events (one request): the reports read when the events move are then
        # at least those the events announced, whoever's read of the node's ranks it was.
        self._counters = [membership._events_key(generation), f"{membership._acks_key(generation)}/done",
                          f"{membership._reports_key(generation)}/count"]
        if membership.node is None:  # (through the node: the node's first read creates them)
            for key in self._counters:  # both exist from here on, so one read fetches the two
                membership.store.add(key, 0)

    def poll(self) -> MembershipChange | float:
        """Poll once: return the committed change, or the seconds to pause before the next poll.

        Raise MembershipTimeout if no report has appeared by the deadline.
        """
        m, g = self.membership, self.generation
        # One request while nothing happens; with a node store, one per node (a read at most a pause old, see
        # `NodeLocal.read`): every rank of every node waits here at once.
        age = max(self._pause, MIN_POLL_S)
        values = (m.store.multi_get(self._counters) if m.node is None
                  else m.node.read(m.store, self._counters, age, create=True))
        events, everyone, filed = (int(v) for v in values)
        if filed > self._filed:  # a report of new deaths: the settle window starts again (see the class)
            self._filed, self._news_at = filed, m._clock()
        if events != self._seen:
            self._seen, self._pause = events, m.poll_s
            # A node-mate's look at the decision may have begun before the commit these events announce: once no
            # look from before this read can serve (an age later), look again.
            self._look_again = m._clock() + age if m.node is not None else None
            change = m.decision(g, age)
            if change is not None:
                return change
            self._reports = m.reports(g, age, filed)
            if not everyone and m._close_nodes(g):  # a report read makes a node's acknowledgement complete
                return m._commit(g, m.reports(g))
        elif self._look_again is not None and m._clock() > self._look_again:
            self._look_again = None
            if (change := m.decision(g, age)) is not None:
                return change
        now = m._clock()
        if everyone and not self._everyone:  # the decision is due now: look again soon
            self._everyone, self._pause = True, m.poll_s
        if self._reports:
            self._first_seen = now if self._first_seen is None else self._first_seen
            # (when every member has acknowledged, the last of them commits: `report_failure`; a rank that filed no
            # report waits twice as long: it commits only in place of reporters that died on the way)
            window = m.settle_s if g in m._reported else 2 * m.settle_s
            due = min(max(self._first_seen, self._news_at) + window,
                      self._first_seen + window + SETTLE_EXTENSIONS * m.settle_s, self.deadline)
            if now >= due:
                return m._commit(g, m.reports(g))  # (every report in the store now: read by this rank itself)
            wake = due
        elif now >= self.deadline:
            raise MembershipTimeout(f"no failure was reported in generation {g} within {self.timeout_s}s")
        else:
            wake = self.deadline
        if self._look_again is not None:
            wake = min(wake, self._look_again + MIN_POLL_S)
        pause = max(0.0, min(self._pause, wake - now))
        self._pause = min(2 * self._pause, m.max_poll_s)
        return pause
