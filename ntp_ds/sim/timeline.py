"""Event-driven cluster state over a run: failures, repairs, spare swaps.

The engine replays failure events in time order and keeps, per GPU, how many
active events hold it down; per TP group, how many of its GPUs are down; per
replica, the worst stage's count ``K``; and a histogram of replicas per
``K``.  Every state change appends one row to the history, so the history has
O(events) rows whatever the cluster size, and each policy's throughput follows
from the histogram rows (see ``policies``).

Spare domains: when a domain gets its first failure and a spare is free, the
spare takes the domain's place after ``swap_hours``; the broken hardware
leaves the job (its events stop counting) and returns to the spare pool once
all of its failures are repaired.  With no spare free the domain queues.
"""
from __future__ import annotations

import heapq
import sys
from collections import deque
from dataclasses import dataclass

import numpy as np

from .cluster import Layout
from .failures import SW, FailureEvents

_REPAIR, _SWAP, _RETURN, _IDLE, _FAIL = 0, 1, 2, 3, 4   # order of same-time handling


@dataclass(frozen=True)
class History:
    """Piecewise-constant state: row ``i`` holds on ``[time[i], time[i+1])``."""

    time: np.ndarray          # (M,) hours, non-decreasing, time[0] == 0
    hist: np.ndarray          # (M, t+1) replicas per worst-stage failed count
    bad_domains: np.ndarray   # (M,) domains in the job with a down GPU
    down_gpus: np.ndarray     # (M,) GPUs in the job that are down
    duration: float
    # replica transitions (for stalls, restarts and rejoins)
    trans_time: np.ndarray    # (X,) hours
    trans_event: np.ndarray   # (X,) index of the failure event
    trans_old: np.ndarray     # (X,) K before
    trans_new: np.ndarray     # (X,) K after
    swaps: int
    trans_fail: np.ndarray = None   # (X,) True when a failure caused it, False for a rejoin
    repair_wait_hours: float = 0.0  # total time repairs waited for a repair slot
    idle_spare_failures: int = 0
    hot_swaps: int = 0

    @property
    def dt(self) -> np.ndarray:
        return np.diff(np.append(self.time, self.duration))


class _State:
    def __init__(self, layout: Layout):
        self.L = layout
        self.down = np.zeros(layout.num_gpus, dtype=np.int32)
        self.group = np.zeros(layout.num_groups, dtype=np.int32)
        self.repK = np.zeros(layout.num_replicas, dtype=np.int32)
        self.hist = np.zeros(layout.tp + 1, dtype=np.int64)
        self.hist[0] = layout.num_replicas
        self.dom_down = np.zeros(layout.num_domains, dtype=np.int32)
        self.bad = 0
        self.down_total = 0

    def replica_of_gpu(self, gpu: int) -> int:
        return gpu // self.L.tp // self.L.pp

    def apply(self, first: int, size: int, delta: int, trans: list | None) -> None:
        """Add ``delta`` (+1 fail / -1 clear) to GPUs ``[first, first+size)``."""
        L = self.L
        seg = self.down[first:first + size]
        if delta > 0:
            changed = np.flatnonzero(seg == 0)
            seg += 1
        else:
            seg -= 1
            changed = np.flatnonzero(seg == 0)
        n = changed.size
        if n == 0:
            return
        step = n if delta > 0 else -n
        d = first // L.domain_size
        before = self.dom_down[d]
        self.dom_down[d] += step
        self.bad += int(self.dom_down[d] > 0) - int(before > 0)
        self.down_total += step
        groups, counts = np.unique((first + changed) // L.tp, return_counts=True)
        self.group[groups] += counts if delta > 0 else -counts
        pp = L.pp
        for r in np.unique(groups // pp):
            old = int(self.repK[r])
            new = int(self.group[r * pp:(r + 1) * pp].max())
            if new != old:
                self.repK[r] = new
                self.hist[old] -= 1
                self.hist[new] += 1
                if trans is not None:
                    trans.append((old, new))


@dataclass(frozen=True)
class SpareSetup:
    """Spares and repair capacity for :func:`replay`."""

    domains: int = 0                 # spare domains in the pool
    swap_hours: float = 0.0          # delay before a spare domain takes a broken one's place
    hot_spares: int = 0              # spare GPUs inside each domain (events index physical slots)
    repair_slots: int = 0            # hardware repairs in progress at once; 0 = unlimited
    idle_time: np.ndarray | None = None     # candidate failure times of idle pool spares
    idle_repair: np.ndarray | None = None   # their repair hours
    idle_draw: np.ndarray | None = None     # uniform draws: a candidate hits if < pool/domains


def replay(events: FailureEvents, layout: Layout, duration_h: float,
           spare_domains: int = 0, swap_hours: float = 0.0,
           spares: SpareSetup | None = None, progress: bool = False) -> History:
    """Replay ``events`` over ``[0, duration_h)`` and record the cluster state after each change.

    Software events restart in place and never wait for a repair slot; hardware and power events
    queue for one of ``repair_slots`` repair crews when that is set.  With ``hot_spares`` an event
    indexes a physical slot of its domain (``domain_size + hot_spares`` per domain): a failed active
    GPU is replaced at once by a free hot spare of its domain, an idle hot spare can fail too, and a
    repaired GPU becomes a hot spare that fills the oldest hole.
    """
    sp = spares or SpareSetup(domains=spare_domains, swap_hours=swap_hours)
    spare_domains, swap_hours = sp.domains, sp.swap_hours
    st = _State(layout)
    S = layout.domain_size
    H = sp.hot_spares
    SP = S + H                         # physical slots per domain
    heap: list = []
    for i in range(len(events)):
        heapq.heappush(heap, (float(events.time[i]), _FAIL, i))
    if sp.idle_time is not None and spare_domains > 0:
        for j in range(sp.idle_time.size):
            heapq.heappush(heap, (float(sp.idle_time[j]), _IDLE, j))
    active: list[set] = [set() for _ in range(layout.num_domains)]
    away: dict[int, set] = {}          # swapped-out hardware: event -> its spare's return set
    pending = np.zeros(layout.num_domains, dtype=bool)
    waiting: deque = deque()
    pool = spare_domains
    swaps = idle_failures = hot_swaps = 0
    busy, queue, wait_h = 0, deque(), 0.0
    queued_at: dict[int, float] = {}
    free = np.full(layout.num_domains, H, dtype=np.int64)
    holes: list[deque] = [deque() for _ in range(layout.num_domains)] if H else []
    mode: dict[int, str] = {}
    taken: dict[int, int] = {}

    times, hists, bads, downs = [0.0], [st.hist.copy()], [0], [0]
    tt, te, to, tn, tf = [], [], [], [], []

    def record(trans: list, now: float, x: int, fail: bool) -> None:
        for old, new in trans:
            tt.append(now), te.append(x), to.append(old), tn.append(new), tf.append(fail)

    def start_swap(d: int, now: float) -> None:
        nonlocal pool
        pool -= 1
        pending[d] = True
        heapq.heappush(heap, (now + swap_hours, _SWAP, d))

    def serve(now: float) -> None:
        while pool > 0 and waiting:
            d = waiting.popleft()
            if active[d] and not pending[d]:
                start_swap(d, now)

    def start_repair(x: int, now: float) -> None:
        nonlocal busy
        busy += 1
        heapq.heappush(heap, (now + float(events.repair[x]), _REPAIR, x))

    def fill_holes(d: int, now: float) -> None:
        nonlocal hot_swaps
        while free[d] > 0 and holes[d]:
            y = holes[d].popleft()
            free[d] -= 1
            trans: list = []
            st.apply(int(taken[y]), 1, -1, trans)
            record(trans, now, y, False)
            mode[y] = "covered"
            hot_swaps += 1

    bar = None
    if progress:
        from tqdm import tqdm
        bar = tqdm(total=len(events), desc="replay", unit="failure", file=sys.stderr,
                   mininterval=1.0)

    while heap:
        now, kind, x = heapq.heappop(heap)
        if bar is not None and kind == _FAIL:
            bar.update(1)
        if now >= duration_h:
            break
        if kind == _FAIL:
            first, size = int(events.first[x]), int(events.size[x])
            hardware = int(events.kind[x]) != SW
            if hardware and sp.repair_slots and busy >= sp.repair_slots:
                queue.append(x)
                queued_at[x] = now
            elif hardware:
                start_repair(x, now)
            else:
                heapq.heappush(heap, (now + float(events.repair[x]), _REPAIR, x))
            trans: list = []
            if H:
                d, slot = first // SP, first % SP
                if size >= SP:
                    mode[x], taken[x] = "domain", int(free[d])
                    free[d] = 0
                    st.apply(d * S, S, +1, trans)
                elif slot >= S and free[d] > 0:
                    mode[x] = "spare"
                    free[d] -= 1
                else:
                    g = d * S + (slot if slot < S else (slot - S) % S)
                    taken[x] = g
                    if free[d] > 0:
                        free[d] -= 1
                        mode[x] = "covered"
                        hot_swaps += 1
                        k = int(st.repK[st.replica_of_gpu(g)])
                        trans.append((k, k))          # the group rebuilds with the spare
                    else:
                        mode[x] = "hole"
                        holes[d].append(x)
                        st.apply(g, 1, +1, trans)
                record(trans, now, x, True)
            else:
                d = first // S
                st.apply(first, size, +1, trans)
                active[d].add(x)
                record(trans, now, x, True)
                if spare_domains > 0 and not pending[d] and d not in waiting:
                    if pool > 0:
                        start_swap(d, now)
                    else:
                        waiting.append(d)
        elif kind == _REPAIR:
            if int(events.kind[x]) != SW:
                busy -= 1
                while queue and (not sp.repair_slots or busy < sp.repair_slots):
                    y = queue.popleft()
                    wait_h += now - queued_at.pop(y)
                    start_repair(y, now)
            if H:
                d = int(events.first[x]) // SP
                m = mode.pop(x)
                if m == "domain":
                    trans = []
                    st.apply(d * S, S, -1, trans)
                    record(trans, now, x, False)
                    free[d] += taken.pop(x)
                elif m == "hole" and x in holes[d]:
                    holes[d].remove(x)
                    trans = []
                    st.apply(int(taken.pop(x)), 1, -1, trans)
                    record(trans, now, x, False)
                else:                     # a spare or a replaced GPU: back as a hot spare
                    taken.pop(x, None)
                    free[d] += 1
                fill_holes(d, now)
            else:
                d = int(events.first[x]) // S
                if x in active[d]:
                    active[d].discard(x)
                    trans = []
                    st.apply(int(events.first[x]), int(events.size[x]), -1, trans)
                    record(trans, now, x, False)
                elif x in away:
                    group = away.pop(x)
                    group.discard(x)
                    if not group:             # the swapped-out hardware is whole again
                        pool += 1
                        serve(now)
        elif kind == _SWAP:
            d = x
            pending[d] = False
            if active[d]:
                group = set(active[d])
                trans = []
                for e in sorted(active[d]):
                    st.apply(int(events.first[e]), int(events.size[e]), -1, trans)
                    away[e] = group
                record(trans, now, -1, False)
                active[d].clear()
                swaps += 1
            else:
                pool += 1
                serve(now)
        elif kind == _IDLE:
            if pool > 0 and float(sp.idle_draw[x]) < pool / spare_domains:
                pool -= 1
                idle_failures += 1
                heapq.heappush(heap, (now + float(sp.idle_repair[x]), _RETURN, -1))
        else:  # _RETURN: a repaired idle spare becomes available again
            pool += 1
            serve(now)
        times.append(now)
        hists.append(st.hist.copy())
        bads.append(st.bad)
        downs.append(st.down_total)
    if bar is not None:
        bar.close()

    return History(time=np.asarray(times), hist=np.asarray(hists),
                   bad_domains=np.asarray(bads), down_gpus=np.asarray(downs),
                   duration=float(duration_h),
                   trans_time=np.asarray(tt, dtype=float),
                   trans_event=np.asarray(te, dtype=np.int64),
                   trans_old=np.asarray(to, dtype=np.int64),
                   trans_new=np.asarray(tn, dtype=np.int64), swaps=swaps,
                   trans_fail=np.asarray(tf, dtype=bool), repair_wait_hours=wait_h,
                   idle_spare_failures=idle_failures, hot_swaps=hot_swaps)


def time_quantile(values: np.ndarray, weights: np.ndarray, q: float) -> float:
    """Smallest value covering fraction ``q`` of the (positive) total weight."""
    values = np.asarray(values, dtype=float)
    weights = np.asarray(weights, dtype=float)
    keep = weights > 0
    if not np.any(keep):
        return float(values.max()) if values.size else 0.0
    values, weights = values[keep], weights[keep]
    if q >= 1.0:
        return float(values.max())
    order = np.argsort(values, kind="stable")
    cum = np.cumsum(weights[order])
    idx = int(np.searchsorted(cum, q * cum[-1] - 1e-12))
    return float(values[order][min(idx, values.size - 1)])


def integral(history: History, values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Knots and cumulative integral of a piecewise-constant series."""
    knots = np.append(history.time, history.duration)
    cum = np.concatenate([[0.0], np.cumsum(values * history.dt)])
    return knots, cum

