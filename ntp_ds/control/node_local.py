"""A node's ranks share their reads of the job's store: one of them reads, the others take its copy.

In a recovery every rank of a node reads the same things from the job's store at about the same moment: the exit and
fence logs' new entries after an alarm, the reports, the decision's counters while it is awaited, the decision once
it is there. `NodeLocal.read` makes that one read per node: the first rank of the node to want a set of keys that its
node's store holds no fresh enough copy of claims the read (a counter of the node's store), reads the job's store and
leaves the values there with the time it began to read them; its node-mates wait for that copy, on their own machine.

What a copy may be, and what it may not: a copy of keys that change (a counter) is taken only while it is at most
`max_age_s` old, the pause a poller would have slept anyway, so a poll through the node sees what a poll of its own
would have seen a moment earlier, never a value older than its own previous poll. A copy of keys that never change
once written (a log entry, a report, a decision) is taken for good once it holds them. A claimer that dies before it
leaves its copy costs its node-mates `CLAIM_WAIT_S`, after which each reads the job's store itself; a node store that
fails makes every read a direct one. A read that must see a write made just before it by another rank of another
node (the rank that ends the acknowledgements commits their union) does not go through here.

Without a node store (another launcher, a joiner) there is no `NodeLocal`: every rank reads the job's store.

A level above the node (`NodeLocal.rack`: the rack's store, which the launcher of the rack's first node hosts where
the launcher knows the racks) takes the same role for the rack's nodes: a barrier counts a node's arrival there and
reaches the job's store once per rack (`membership.BarrierWait`), and a node's claimer of a read of keys that never
change takes the rack's copy where one holds them all. The rack's hosts do not share a clock, so only such copies
are shared there (their age does not matter): an absence, or a counter, is read by each node itself.
"""

from __future__ import annotations

import bisect
import hashlib
import json
import logging
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

log = logging.getLogger("ntp_ds.control.heartbeat")

SHARED_AGE_S = 0.05
"""Oldest copy a read that wants the news (a fast poll, an alarm's, a recovery's, a report's look at the decision)
takes from a node-mate's read of the same keys instead of reading the job's store itself."""
CLAIM_WAIT_S = 0.5
"""Longest wait of a rank for the copy a node-mate claimed (one read of the job's store on the same node's behalf):
past it, the rank reads the job's store itself."""
COPY_POLL_S = 0.002
"""Pause between two looks at the node's store for a claimed copy (the node's store is on the machine)."""
_ABSENT = "\x00"


@dataclass(frozen=True)
class NodeLocal:
    """A node's own store (`control.node_store`: `ntp-ds launch` hosts one per node) and the ranks per node (rank r
    lives on node r // size): a barrier counts the node's arrivals there and reaches the job's store once per node
    (`membership.BarrierWait`), and the node's ranks share their reads of the job's store through it (`read`)."""

    store: object
    size: int
    launched: int | None = None
    """The launch's world size: ranks below it were started on nodes of `size` (rank r on node r // size), those
    from it on (joiners) on no node. None: unknown (the membership's acknowledgements then go rank by rank)."""
    clock: object = field(default=time.monotonic, compare=False)
    """A clock every process of the node shares (CLOCK_MONOTONIC is the machine's)."""
    sleep: object = field(default=time.sleep, compare=False)
    rack: NodeLocal | None = None
    """The level above: the rack's store and ranks per rack (`size`: rank r in rack r // size; `present_only`), or
    None (the launcher hosts no rack level); a rack's store that could not be reached is a level marked failed."""
    present_only: bool = False
    """A level whose processes share no clock (a rack's hosts): only copies of fixed keys holding all of them are
    taken from it, and nobody claims or waits there: a node's claimer that finds no such copy reads the job's store
    itself and leaves what it found for the rack's later readers (a wait for a rack-mate's read would hold the node's
    ranks for an answer that is mostly an absence: a decision not yet made)."""
    _failed: list = field(default_factory=list, compare=False, repr=False)
    """Not empty once a call to this level's store failed: a store that failed once is not asked again (a rack's
    store whose host is gone could make every call wait for its bound)."""

    @classmethod
    def for_rack(cls, store, size: int, launched: int | None) -> NodeLocal:
        """A rack's level: its store, `size` ranks per rack, copies taken across hosts that share no clock."""
        return cls(store, size, launched, clock=time.time, present_only=True)

    def rack_of(self, rank: int) -> NodeLocal | None:
        """The rack level `rank` meets in, or None (no rack level, or a rank on no node: a joiner)."""
        return self.rack if self.rack is not None and self.rack.on_node(rank) else None

    @property
    def usable(self) -> bool:
        return not self._failed

    def failed(self, err: BaseException) -> None:
        """Stop asking this level's store (see `_failed`)."""
        if not self._failed:
            self._failed.append(err)
            log.warning("the %s store failed (%s): its ranks go to the level below it from now on",
                        "rack's" if self.present_only else "node's", err)

    def span(self, ranks: Sequence[int], rank: int) -> tuple[int, int]:
        """The positions [lo, hi) in sorted `ranks` of the ranks on `rank`'s node (by bisection: O(log W)); launch
        ranks only (a job's last rack may have fewer nodes than the others: joiners' ranks follow it)."""
        first = rank // self.size * self.size
        end = first + self.size if self.launched is None else min(first + self.size, self.launched)
        return bisect.bisect_left(ranks, first), bisect.bisect_left(ranks, end)

    def on_node(self, rank: int) -> bool:
        """Whether `rank` was started on a node of this numbering (a joiner was not)."""
        return self.launched is not None and 0 <= rank < self.launched

    def read(self, job_store, keys: Sequence[str], max_age_s: float, *, fixed: bool = False,
             check: bool = False, create: bool = False) -> list[bytes] | None:
        """The values of `keys` in the job's store, read there once per node (see the module's docstring): a copy at
        most `max_age_s` old (finite: it bounds how long an absence is believed), or, with `fixed` (keys never
        rewritten once set), any copy that holds them.

        With `check`: None while some key is absent (a claimer checks before it reads, and its copy says so);
        with `create` (counters): absent ones are created at 0 first; with neither, every key must exist (a
        `multi_get` would wait for a missing one). Keys a copy has held are not checked again (none is deleted while
        its readers read it: a generation's keys go two generations later)."""
        keys = list(keys)
        if not keys:
            return []
        name = "share/" + hashlib.blake2b("\n".join(keys).encode(), digest_size=12).hexdigest()
        try:
            return self._read(job_store, keys, name, max_age_s, fixed, check, create)
        except Exception as err:  # the node's store is gone (or the job's failed this read): read the job's store
            if self.present_only:
                self.failed(err)
            else:
                log.warning("a shared read of the job's store failed (%s): read directly", err)
            return _direct(job_store, keys, check, create)

    def _read(self, job_store, keys, name, max_age_s, fixed, check, create):
        local, now = self.store, self.clock()
        copy = _decode(local.compare_set(name, _ABSENT, _ABSENT))
        if self._takes(copy, now, max_age_s, fixed):
            return copy[1]
        if self.present_only:  # no claims across hosts: read, and leave what was there for the rack's later readers
            values = _direct(job_store, keys, check, create)
            if values is not None:
                local.set(name, json.dumps([self.clock(), [v.decode("latin-1") for v in values]]))
            return values
        slot = math.floor(now / max_age_s) if max_age_s > 0 and math.isfinite(max_age_s) else 0
        claim = f"{name}/claim/{slot}"
        if int(local.add(claim, 1)) == 1:
            began = self.clock()
            seen = copy is not None and copy[1] is not None  # (keys once there stay: no need to check again)
            values = self._source(job_store, keys, max_age_s, fixed, check and not seen, create and not seen)
            local.set(name, json.dumps([began, None if values is None else [v.decode("latin-1") for v in values]]))
            if slot >= 2:  # (a claim is kept for its slot, so that a late node-mate of the slot does not read again)
                local.delete_key(f"{name}/claim/{slot - 2}")
            return values
        deadline = now + CLAIM_WAIT_S
        for _ in range(math.ceil(CLAIM_WAIT_S / COPY_POLL_S) + 1):  # a node-mate reads: wait for its copy here
            if self.clock() >= deadline:
                break
            self.sleep(COPY_POLL_S)
            copy = _decode(local.compare_set(name, _ABSENT, _ABSENT))
            if copy is not None and (copy[0] >= now - max_age_s or _fresh(copy, now, max_age_s, fixed)):
                return copy[1]
        return self._source(job_store, keys, max_age_s, fixed, check, create)

    def _takes(self, copy, now: float, max_age_s: float, fixed: bool) -> bool:
        if self.present_only:  # (no clock is shared: only what no age can spoil)
            return fixed and copy is not None and copy[1] is not None
        return _fresh(copy, now, max_age_s, fixed)

    def _source(self, job_store, keys, max_age_s, fixed, check, create):
        """The claimer's read: through the rack's copy for keys that never change once there, else the job's store."""
        if fixed and self.rack is not None and self.rack.usable and not create:
            return self.rack.read(job_store, keys, max_age_s, fixed=True, check=check)
        return _direct(job_store, keys, check, create)


def present_values(store, keys: Sequence[str]) -> list[bytes] | None:
    """The values of `keys`, or None while one of them does not exist (a `multi_get` would wait for it): one request
    for one key (a `compare_set` that writes nothing, as torch's stores and ours answer a key that does not exist
    with the expected value), two for several (`check`, `multi_get`)."""
    if len(keys) == 1:
        raw = store.compare_set(keys[0], _ABSENT, _ABSENT)
        return None if raw == _ABSENT.encode() else [raw if isinstance(raw, bytes) else bytes(raw)]
    if not store.check(list(keys)):
        return None
    return [v if isinstance(v, bytes) else bytes(v) for v in store.multi_get(list(keys))]


def _direct(job_store, keys: list[str], check: bool, create: bool = False) -> list[bytes] | None:
    if create:
        if len(keys) == 1:  # a counter: its value, created at 0 where absent, in one request
            return [str(int(job_store.add(keys[0], 0))).encode()]
        if not job_store.check(keys):
            for key in keys:
                job_store.add(key, 0)
    elif check:
        return present_values(job_store, keys)
    return [v if isinstance(v, bytes) else bytes(v) for v in job_store.multi_get(keys)]


def _decode(raw: bytes) -> tuple[float, list[bytes] | None] | None:
    """A copy as (the time its read began, its values or None where some key was absent); None: no copy yet."""
    if raw == _ABSENT.encode():
        return None
    began, values = json.loads(raw)
    return began, None if values is None else [v.encode("latin-1") for v in values]


def _fresh(copy, now: float, max_age_s: float, fixed: bool) -> bool:
    if copy is None:
        return False
    if fixed and copy[1] is not None:
        return True
    return now - copy[0] <= max_age_s
