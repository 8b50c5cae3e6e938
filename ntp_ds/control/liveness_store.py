"""Liveness in the store: what workers, launchers and watchers write there (beats, node keys, the exit and fence
logs, alarms) and how a watcher reads it (`LivenessReader`, `poll_liveness`).

Reading every peer's key every poll does not scale: at thousands of ranks the store would serve hundreds of millions
of reads per second at the worst moment, delaying healthy beats past the timeout. So the launcher of each node reads
its own workers' beats (one request) and publishes one key per node, `node/{n}` (`NodePublisher`); a watcher reads
the keys of the nodes its peers live on in one request (`LivenessReader`) and backs off while nothing is news. A
worker started without a launcher (no `NTP_NODE_SIZE`) is read per rank, and so is a node whose key has stopped
moving (its launcher is gone): per-node reads are an economy, never a second source of truth.

Backing off makes a quiet watcher slow to learn of a death, so every record of one (an abnormal exit, a fence
request) also raises an alarm (`raise_alarm`): it bumps the job's alarm epoch and sets, in one request, one key per
bucket of ALARM_BUCKET watchers (`alarm/{bucket}/{epoch}`, the buckets listed in `alarm/buckets`). Each watching
heartbeat has a thread blocked in the store's `wait` for its bucket's key of the next epoch, which wakes it to poll
at once. The store answers such a wait when the key is set (no polling), so a death reaches every rank in one store
round trip whatever the backoff, a raise costs O(W / ALARM_BUCKET) key writes, and a quiet job costs nothing but one
open wait per rank. A stopping heartbeat sets its bucket's key to end its own waiting thread (a thread still inside
the store's C++ call when the interpreter finalizes can abort the process); its bucket-mates wake too, see that the
epoch has not moved, and wait again, so a job's end costs each rank at most ALARM_BUCKET wakes.

Ranks here are launch ranks (the RANK a worker started with): they name a worker across every generation.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from datetime import timedelta

from ntp_ds.control.keys import (ALARM_BUCKETS_KEY, ALARM_EPOCH_KEY, EXITED_KEY, FENCE_KEY, NODE_MIRROR_KEY,
                                 RELAYED_EPOCH_KEY, alarm_key, alarm_watchers_key, fence_count_key, heartbeat_key,
                                 log_count_key, log_entry_key, node_key, relayed_alarm_key)
from ntp_ds.control.liveness import Beat, LivenessMonitor
from ntp_ds.control.node_local import SHARED_AGE_S, NodeLocal, present_values
from ntp_ds.control.node_store import PERIOD_S, MirrorView, launch_nodes, launcher_period_s, list_watched
from ntp_ds.envs import NODE_SIZE_ENV

log = logging.getLogger("ntp_ds.control.heartbeat")  # liveness logs under one name, whichever of its modules logs

ALARM_BUCKET = 32
"""Watching ranks per alarm key: rank r waits on the key of bucket r // ALARM_BUCKET. Larger buckets make a raise
cheaper (W / ALARM_BUCKET keys) and each stop wake more bucket-mates."""


NODE_PUBLISH_S = PERIOD_S
"""How often a launcher publishes its node's liveness key before its workers have said how often they beat
(`node_store.NodeMirror.period_s`)."""
NODE_STALE_S = 1.0
"""A node key unchanged for this long (its launcher is gone or hung) is bypassed: its ranks are read per rank. Two
launcher periods where the period is longer (`stale_after_s`)."""


def stale_after_s(nodes: int | None) -> float:
    """How long a node key (or the launcher's copy) of a job of `nodes` nodes may stand still before it is
    bypassed: two of its launchers' periods at the least."""
    return NODE_STALE_S if nodes is None else max(NODE_STALE_S, 2 * launcher_period_s(nodes))


def read_beats(store, ranks: Iterable[int]) -> dict[int, Beat]:
    """Read the latest beat of each rank that has beaten at least once (two store round trips when all have)."""
    ranks = list(ranks)
    keys = [heartbeat_key(r) for r in ranks]
    if not keys:
        return {}
    if (values := present_values(store, keys)) is not None:
        return {r: Beat.decode(v) for r, v in zip(ranks, values)}
    found = ((r, present_values(store, [k])) for r, k in zip(ranks, keys))
    return {r: Beat.decode(v[0]) for r, v in found if v is not None}


class JobLog:
    """One of the job's append-only logs (`EXITED_KEY`, `FENCE_KEY`) and one reader's place in it.

    Each entry is a key of its own (`log_entry_key`), numbered by the log's counter (`log_count_key`). A reader that
    polls reads the counter (in the same request as whatever else it reads: `catch_up`) and fetches only the entries
    it has not read, so a poll costs the same however old the job is and however many deaths it has seen. A whole log
    read at every poll, as before, grew with both."""

    def __init__(self, store, log: str):
        self.store, self.log = store, log
        self.entries: dict[int, str] = {}
        """Rank -> reason of every entry read so far (a rank's first entry counts)."""
        self._counted = 0
        self._unread: set[int] = set()
        """Entries counted but not read yet: counted by a writer that has not written them yet, or never will (it
        died between the two requests); each is looked for again at the next polls, and the entries after it are
        read meanwhile."""

    @property
    def count_key(self) -> str:
        return log_count_key(self.log)

    def catch_up(self, count: int) -> dict[int, str]:
        """Fetch the entries up to `count` (the counter as just read) not read yet, and return every entry read so
        far. An entry counted but not written yet is read at a later poll; the ones after it are read now."""
        catch_up((self, count))
        return self.entries

    def _wanted(self, count: int) -> dict[str, int]:
        """Count up to `count`; the keys of the entries not read yet, with their numbers."""
        if count > self._counted:
            self._unread.update(range(self._counted + 1, count + 1))
            self._counted = count
        return {log_entry_key(self.log, n): n for n in sorted(self._unread)}

    def _take(self, n: int, raw: bytes) -> None:
        rank, _, reason = raw.decode().partition(" ")
        self.entries.setdefault(int(rank), reason)
        self._unread.discard(n)

    def read(self) -> dict[int, str]:
        """One read of the counter, then the entries not read yet (see `catch_up`)."""
        return self.catch_up(int(self.store.add(self.count_key, 0)))


def catch_up(*logs: tuple[JobLog, int], node: NodeLocal | None = None) -> None:
    """Bring each (log, its counter as just read) up to date in two requests for all of them (one `check`, one
    `multi_get`) in the usual case where every counted entry is written: a death now files an exit and a fence
    entry together, which every reader then fetches at once. With `node`, once for the node's ranks (`NodeLocal.read`:
    entries never change once written)."""
    wanted = [(log, key, n) for log, count in logs for key, n in log._wanted(count).items()]
    if not wanted:
        return
    store = logs[0][0].store
    keys = [key for _, key, _ in wanted]
    values = (node.read(store, keys, SHARED_AGE_S, fixed=True, check=True) if node is not None
              else present_values(store, keys))
    if values is not None:
        found = zip(wanted, values)
    else:  # an entry counted by a writer that has not written it yet: read the others one by one
        found = [(w, raw[0]) for w in wanted if (raw := present_values(store, [w[1]])) is not None]
    for (log, _, n), raw in found:
        log._take(n, raw)


def file_entry(store, log: str, rank: int, reason: str) -> None:
    """File `RANK REASON` as the next entry of the job log `log`."""
    store.set(log_entry_key(log, store.add(log_count_key(log), 1)), f"{rank} {' '.join(reason.split())}")


def mark_exited(store, rank: int, reason: str, alarm: bool = True) -> None:
    """Record that worker `rank` has exited (the launcher saw it, or the worker is leaving on its own) and wake the
    watchers (`alarm=False`: a worker that finished the job, whose peers are finishing too)."""
    file_entry(store, EXITED_KEY, rank, reason)
    if alarm:
        raise_alarm(store)


def record_exit(store, rank: int, reason: str, abnormal: bool = True) -> None:
    """A launcher's record of its worker's exit: the exit, and for an abnormal one also a fence request, which wakes
    the watchers (one alarm) and tells every member at once, as a peer's fence of the dead worker would a moment
    later (each member reacts to the fence log, its watchers alone to the exits of the peers they watch)."""
    mark_exited(store, rank, reason, alarm=False)
    if abnormal:
        request_fence(store, [rank], reason)


def alarm_bucket(rank: int) -> int:
    """The alarm bucket of watching rank `rank`."""
    return rank // ALARM_BUCKET


def alarm_epoch(store, node: NodeLocal | None = None) -> int:
    """How many alarms the job has raised so far; with `node`, as read by a node-mate at most `SHARED_AGE_S` ago
    (`NodeLocal.read`: the node's ranks, woken together, read it once)."""
    if node is not None:
        return int(node.read(store, [ALARM_EPOCH_KEY], SHARED_AGE_S, create=True)[0])
    return int(store.add(ALARM_EPOCH_KEY, 0))


def register_alarm_watcher(store, rank: int) -> None:
    """List the bucket of `rank` among those an alarm wakes (once per bucket: the registry stays W / ALARM_BUCKET
    entries long)."""
    bucket = alarm_bucket(rank)
    if store.add(alarm_watchers_key(bucket), 1) == 1:
        store.append(ALARM_BUCKETS_KEY, f"{bucket} ")


def woken_epoch(store, key: str, seen: int, epoch: int, read: Callable[[], int]) -> int | None:
    """After a wait on alarm key `key` ended, with `epoch` read since: the epoch now, or None where it has not moved
    past `seen` (a waiter's stop set the key, not a raise: the key is cleared to wait again). A raise whose key write
    the delete undid has moved the epoch by the second `read`: the key is then written again for the other waiters."""
    if epoch != seen:
        return epoch
    store.delete_key(key)
    epoch = read()
    if epoch == seen:
        return None
    store.set(key, "1")
    return epoch


def raise_alarm(store) -> None:
    """Wake every watching heartbeat now: it polls its peers at once instead of at its backed-off pace. Call after
    the record that is news (an exit, a fence request), so a woken watcher reads it. The epoch moves first, so a
    watcher woken by its key always finds it moved; then one request sets the new epoch's key of every bucket."""
    epoch = store.add(ALARM_EPOCH_KEY, 1)
    if not store.check([ALARM_BUCKETS_KEY]):
        return
    buckets = sorted({int(b) for b in store.get(ALARM_BUCKETS_KEY).decode().split()})
    if buckets:
        store.multi_set([alarm_key(b, epoch) for b in buckets], ["1"] * len(buckets))


ALARM_WAIT_S = 3600.0
"""How long one wait for an alarm lasts before it is renewed. Long: the store client logs each wait that runs out
(a stopping waiter sets its own key to end the wait)."""


class AlarmRelay:
    """A launcher's relay of the job's alarms to its node: one waiter per node in the job's store, not one per rank.

    The relay registers its bucket (that of the node's first rank) and waits there for each next epoch, as a watcher
    would. On an alarm it reads the epoch, writes it into the node's store (`RELAYED_EPOCH_KEY`) and then sets the
    node's key of every epoch it had not relayed (`relayed_alarm_key`), on which its workers' alarm threads wait
    (`Heartbeat`'s `alarms_from`); then it pauses `pause_s()` (a fast poll's pause of its workers), so that the
    alarms of a node's or a rack's fences, raised one by one, cost it one wait and one read each few, not each. A
    node's ranks then cost the job's store one wait and one read per alarm in all, where each rank cost both, and
    an alarm's raise sets one key per bucket of the relays' (not the workers') buckets.

    Workers started by another launcher register and wait themselves (`Heartbeat`)."""

    def __init__(self, store, node_store, rank: int, pause_s=lambda: 0.0):
        self.store, self.node_store, self.rank, self.pause_s = store, node_store, rank, pause_s
        self.epoch: int | None = None
        self.relayed = 0
        """How many times the relay has woken its node (alarms coalesced in its pause count once)."""
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> AlarmRelay:
        """Register and write the epoch into the node's store (so a worker started next finds the relay), then
        relay in a daemon thread."""
        register_alarm_watcher(self.store, self.rank)
        self.epoch = alarm_epoch(self.store)
        self.node_store.set(RELAYED_EPOCH_KEY, str(self.epoch))
        clone = getattr(self.store, "clone", None)
        self._waiter = clone() if clone is not None else self.store  # (a blocked wait holds its client)
        self._thread = threading.Thread(target=self._run, name=f"ntp-alarm-relay-{self.rank}", daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        bucket = alarm_bucket(self.rank)
        while not self._stop.is_set():
            key = alarm_key(bucket, self.epoch + 1)
            try:
                store = self._waiter
                store.wait([key], timedelta(seconds=ALARM_WAIT_S))
                if self._stop.is_set():
                    return
                epoch = woken_epoch(store, key, self.epoch, alarm_epoch(store), lambda: alarm_epoch(store))
                if epoch is None:  # a bucket-mate's stop
                    continue
                self.node_store.set(RELAYED_EPOCH_KEY, str(epoch))  # first: a woken worker finds it moved
                fresh = range(self.epoch + 1, epoch + 1)
                self.node_store.multi_set([relayed_alarm_key(e) for e in fresh], ["1"] * len(fresh))
                self.epoch = epoch
                self.relayed += 1
                if self._stop.wait(self.pause_s()):
                    return
            except Exception as err:
                if "timeout" in str(err).lower():  # the wait ran out: renew it
                    continue
                log.warning("the launcher stops relaying alarms (its workers wait in the job's store): %s", err)
                try:  # the workers' alarm threads, woken on a relayed epoch that will not move, fall back
                    self.node_store.set(RELAYED_EPOCH_KEY, "-1")
                    self.node_store.set(relayed_alarm_key(self.epoch + 1), "gone")
                except Exception:
                    pass
                return

    def stop(self, timeout_s: float = 5.0) -> None:
        """End the relay: wake its own wait (its bucket-mates wake too, find no alarm and wait again)."""
        self._stop.set()
        if self._thread is None or not self._thread.is_alive():
            return
        try:
            self.store.set(alarm_key(alarm_bucket(self.rank), self.epoch + 1), "stop")
        except Exception as err:
            log.debug("the alarm relay could not end its wait: %s", err)
        self._thread.join(timeout_s)


def read_exits(store) -> dict[int, str]:
    """Return {rank: reason} of every worker marked as exited (the whole log: a reader that polls keeps a
    `JobLog`)."""
    return JobLog(store, EXITED_KEY).read()


def prepare_store(store) -> None:
    """Create the exit and fence logs' counters if absent, so a watcher can read them in the same request as node
    keys (a `multi_get` of a missing key would wait for it). Idempotent: every launcher calls it."""
    for log in (EXITED_KEY, FENCE_KEY):
        store.add(log_count_key(log), 0)


def request_fence(store, ranks: Iterable[int], reason: str | Mapping[int, str]) -> None:
    """Ask the launchers to stop workers `ranks` for good: their peers declared them dead (a hung worker must never
    come back into the job, and stopping it closes its connections, which ends every wait on it). `reason`: one for
    all, or each rank's own (a reason that names every dead rank, filed for each, would grow the log with the square
    of a rack's deaths).

    Only the first request for a rank is logged and raises the alarm: every peer that sees a death, and then every
    survivor's recovery, asks for its fence, and a line per request would grow the log (which every watcher reads) by
    the world size at each failure, an alarm per request cost the store survivors x watchers key writes.
    """
    news = False
    for rank in ranks:
        if store.add(fence_count_key(rank), 1) == 1:
            file_entry(store, FENCE_KEY, rank, reason if isinstance(reason, str) else reason[rank])
            news = True
    if news:
        raise_alarm(store)


def read_fences(store) -> dict[int, str]:
    """Return {rank: reason} of every worker some peer asked to be stopped (the whole log: a reader that polls keeps
    a `JobLog`)."""
    return JobLog(store, FENCE_KEY).read()


@dataclass(frozen=True)
class NodeLiveness:
    """What a node's launcher publishes: a sequence number that rises with every publication, the latest beat of each
    of its workers that has beaten, and those of its workers that have exited."""

    seq: int
    beats: dict[int, Beat]
    exited: dict[int, str]

    def encode(self) -> str:
        return json.dumps({"seq": self.seq, "beats": {str(r): b.fields() for r, b in self.beats.items()},
                           "exited": {str(r): why for r, why in self.exited.items()}}, separators=(",", ":"))

    @classmethod
    def decode(cls, raw: bytes | str) -> NodeLiveness:
        d = json.loads(raw)
        return cls(d["seq"], {int(r): Beat.from_fields(f) for r, f in d["beats"].items()},
                   {int(r): why for r, why in d["exited"].items()})


class NodePublisher:
    """A launcher's side of liveness: read its own workers' beats and publish them as one key, `node/{node}`.

    Two requests per publication however many workers the node runs (one once every worker has beaten); with
    `beats_from` (the node's own store, where the workers beat: `node_store`) one request to the job's store.
    """

    def __init__(self, store, node: int, ranks: Iterable[int], beats_from=None):
        self.store, self.node, self.ranks = store, node, tuple(ranks)
        self.beats_from = beats_from if beats_from is not None else store
        self.seq = 0
        self._all_beating = False

    def publish(self, exited: Mapping[int, str] | None = None) -> NodeLiveness:
        """Publish the latest beats of this node's workers and those of them known to have exited."""
        keys = [heartbeat_key(r) for r in self.ranks]
        if self._all_beating:  # keys are never deleted: once all exist, skip the existence check
            beats = {r: Beat.decode(v) for r, v in zip(self.ranks, self.beats_from.multi_get(keys))}
        else:
            beats = read_beats(self.beats_from, self.ranks)
            self._all_beating = len(beats) == len(self.ranks)
            if self.beats_from is not self.store and not self._all_beating:
                # A worker that beats to the job's store (a heartbeat built without the node's store): from there.
                beats.update(read_beats(self.store, [r for r in self.ranks if r not in beats]))
        self.seq += 1
        liveness = NodeLiveness(self.seq, beats, dict(exited or {}))
        self.store.set(node_key(self.node), liveness.encode())
        return liveness


# A copy and a node's key move once per launcher period, and a quiet watcher polls twice as often: what was decoded
# is decoded once per value (a copy holds every node its node's ranks watch, kilobytes of JSON). Read-only once made.
@functools.lru_cache(maxsize=4096)
def _decoded_node(raw: bytes | str) -> NodeLiveness:
    return NodeLiveness.decode(raw)


@functools.lru_cache(maxsize=64)
def _decoded_copy(raw: bytes) -> MirrorView:
    return MirrorView.decode(raw)


@dataclass(frozen=True)
class LivenessView:
    """One read of the store for a watcher: beats of the watched ranks, exits and fence requests."""

    beats: dict[int, Beat]
    exited: dict[int, str]
    fences: dict[int, str]


class LivenessReader:
    """Read what a watcher needs to judge `ranks`: per node when launchers publish node keys, per rank otherwise.

    With `node_size` (rank r lives on node r // node_size), one `multi_get` brings the keys of the nodes the ranks
    live on plus the exit and fence logs: the requests scale with the watcher's polls, not with its peers. A node
    whose key has not changed for `stale_s` on `clock` is read per rank instead, so a lost launcher never hides a
    live worker (nor keeps a dead one alive: its key stops, and so do the beats behind it).
    """

    def __init__(self, store, node_size: int | None = None, *, stale_s: float = NODE_STALE_S,
                 clock: Callable[[], float] = time.monotonic, mirror=None):
        if node_size is not None and node_size < 1:
            raise ValueError(f"node_size={node_size} must be a positive number of ranks per node (or None)")
        self.store, self.node_size, self.stale_s, self._clock = store, node_size, stale_s, clock
        self.period_s = stale_s / 2 if node_size is not None and stale_s > NODE_STALE_S else 0.0
        """How often a node key moves at the least where the job's store's budget made the launchers' period longer
        than the beat (`stale_after_s`); else 0 (a key moves as often as the workers beat)."""
        self.mirror = mirror if node_size is not None else None
        """A client of the node's store, whose copy of the node keys (`node_store.NodeMirror`) a read that is not
        `direct` takes instead of the job's store while the copy moves and holds every node wanted; None: none."""
        self.exits, self.fences = JobLog(store, EXITED_KEY), JobLog(store, FENCE_KEY)
        """This reader's place in the exit and fence logs: each poll fetches only their new entries."""
        self._seq: dict[int, tuple[int, float]] = {}  # node -> (seq, when it last changed)
        self._latest: dict[int, NodeLiveness] = {}  # node -> the newest of its keys read (a copy may be older)
        self._mirror_seq: tuple[int, float] | None = None  # the copy's (seq, when it last changed)
        self._present: set[str] = set()  # node keys seen to exist (never deleted)

    @classmethod
    def from_env(cls, store, env: Mapping[str, str] = os.environ, **kwargs) -> LivenessReader:
        """Read per node when the launcher said how many ranks each node runs (`NTP_NODE_SIZE`), else per rank."""
        size = env.get(NODE_SIZE_ENV)
        if size is not None and (not size.isdigit() or int(size) < 1):
            raise ValueError(f"{NODE_SIZE_ENV}={size!r} must be a positive integer (ranks per node)")
        kwargs.setdefault("stale_s", stale_after_s(launch_nodes(env)))
        return cls(store, int(size) if size else None, **kwargs)

    def want(self, rank: int, ranks: Iterable[int], interval_s: float, watcher: str = "heartbeat") -> None:
        """Tell the launcher's copy which nodes this reader (`keys.WATCHERS`) of worker `rank` watches from now on
        (`ranks`' nodes), and how often the worker beats."""
        if self.mirror is None:
            return
        try:
            list_watched(self.mirror, rank, {r // self.node_size for r in ranks}, interval_s, watcher)
        except Exception as err:  # the node's store is gone: the job's store serves
            log.warning("rank %d reads its peers from the job's store: its node's store failed (%s)", rank, err)
            self.mirror = None

    def read(self, ranks: Iterable[int], fences: bool = True, direct: bool = True) -> LivenessView:
        """Read the beats of `ranks`, every exit and (with `fences`; always when read per node) every fence request.
        Not `direct`: from the launcher's copy where it serves (see `mirror`). `direct`: from the job's store, in
        one read for the node's ranks that want the news within `SHARED_AGE_S` of each other (an alarm wakes them
        together): the nodes the launcher's copy lists (every node its ranks watch) and this reader's own."""
        ranks = sorted(set(ranks))
        if self.node_size is None:
            return self._per_rank(ranks, fences)
        nodes = sorted({r // self.node_size for r in ranks})
        copy = self._copy() if self.mirror is not None else None
        if not direct and copy is not None and (view := self._mirrored(copy, nodes, ranks)) is not None:
            return view
        counts = [self.exits.count_key, self.fences.count_key]
        keys = [node_key(n) for n in nodes] + counts
        if copy is not None:  # the node's union (copied nodes exist), read once for the node's ranks, its
            union = sorted(copy.nodes.keys() | set(nodes))  # existence too (not once per rank)
            values = self.shared().read(self.store, [node_key(n) for n in union] + counts, SHARED_AGE_S, check=True)
        else:
            values = self.store.multi_get(keys) if set(keys) <= self._present else present_values(self.store, keys)
        if values is None:  # a launcher has not published yet: read per rank meanwhile
            return self._per_rank(ranks, fences)
        self._present.update(keys)
        if copy is not None:
            raw = dict(zip(union, values))
            return self._view(ranks, nodes, [raw[n] for n in nodes], int(values[-2]), int(values[-1]))
        return self._view(ranks, nodes, values[:-2], int(values[-2]), int(values[-1]))

    def shared(self) -> NodeLocal | None:
        """The node's store, for the reads of the job's store its ranks make together; None: none (or it failed)."""
        return NodeLocal(self.mirror, self.node_size, clock=self._clock) if self.mirror is not None else None

    def _copy(self) -> MirrorView | None:
        """The launcher's copy in the node's store, or None: none yet, or the node's store failed (then the job's
        store serves from now on)."""
        try:
            raw = self.mirror.compare_set(NODE_MIRROR_KEY, "\0", "\0")  # (one request: the value, or "\0")
            return None if raw == b"\0" else _decoded_copy(raw)
        except Exception as err:
            log.warning("reading peers from the job's store: the node's store failed (%s)", err)
            self.mirror = None
            return None

    def _mirrored(self, copy: MirrorView, nodes: list[int], ranks: list[int]) -> LivenessView | None:
        """A read of the launcher's copy, or None where it does not serve: not moving for `stale_s`, or short of a
        node wanted (the launcher copies it from its next period on)."""
        now = self._clock()
        if self._mirror_seq is None or copy.seq != self._mirror_seq[0]:
            self._mirror_seq = (copy.seq, now)
        elif now - self._mirror_seq[1] > self.stale_s:
            return None
        if not set(nodes) <= copy.nodes.keys():
            return None
        return self._view(ranks, nodes, [copy.nodes[n] for n in nodes], copy.exits, copy.fences)

    def _view(self, ranks: list[int], nodes: list[int], raws, exits: int, fences: int) -> LivenessView:
        now, wanted = self._clock(), set(ranks)
        beats: dict[int, Beat] = {}
        catch_up((self.exits, exits), (self.fences, fences), node=self.shared())
        exited = dict(self.exits.entries)
        stale: list[int] = []
        for node, raw in zip(nodes, raws):
            liveness = _decoded_node(raw)
            latest = self._latest.get(node)
            if latest is not None and liveness.seq < latest.seq:  # a copy older than a key read before
                liveness = latest
            self._latest[node] = liveness
            seq, since = self._seq.get(node, (None, now))
            if seq != liveness.seq:
                self._seq[node] = (liveness.seq, now)
            elif now - since > self.stale_s:
                stale += [r for r in ranks if r // self.node_size == node]
            beats.update((r, b) for r, b in liveness.beats.items() if r in wanted)
            for rank, why in liveness.exited.items():
                exited.setdefault(rank, why)
        if stale:
            beats.update(read_beats(self.store, stale))
        return LivenessView(beats, exited, dict(self.fences.entries))

    def _per_rank(self, ranks: list[int], fences: bool) -> LivenessView:
        return LivenessView(read_beats(self.store, ranks), dict(self.exits.read()),
                            dict(self.fences.read()) if fences else {})


def poll_liveness(store, monitor: LivenessMonitor, reader: LivenessReader | None = None) -> frozenset[int]:
    """Read beats and exits from the store (through `reader`, else per rank) into `monitor`; return the ranks it now
    counts as dead."""
    view = (reader or LivenessReader(store)).read(monitor.ranks, fences=False)
    monitor.observe(view.beats, view.exited)
    return monitor.dead()


def outlive_peers(store, rank: int, world_size: int, heartbeat_timeout_s: float) -> None:
    """Keep hosting the store (rank `rank` of a job whose rank 0 hosts it) until every other rank of the launch has
    finished, exited or gone silent."""
    others = [r for r in range(world_size) if r != rank]
    monitor = LivenessMonitor(others, heartbeat_timeout_s)
    log.info("rank %d hosts the job's store: waiting for the other ranks to finish before exiting", rank)
    while poll_liveness(store, monitor) != set(others):
        time.sleep(heartbeat_timeout_s / 4)
