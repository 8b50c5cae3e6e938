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
from collections import deque
from dataclasses import dataclass

import numpy as np

from .cluster import Layout
from .failures import FailureEvents

_REPAIR, _SWAP, _RETURN, _FAIL = 0, 1, 2, 3   # order of same-time handling


@dataclass(frozen=True)
class History:
    """Piecewise-constant state: row ``i`` holds on ``[time[i], time[i+1])``."""

    time: np.ndarray          # (M,) hours, non-decreasing, time[0] == 0
    hist: np.ndarray          # (M, t+1) replicas per worst-stage failed count
    bad_domains: np.ndarray   # (M,) domains in the job with a down GPU
    down_gpus: np.ndarray     # (M,) GPUs in the job that are down
    duration: float
    # replica transitions caused by failure events (for stalls/restarts)
    trans_time: np.ndarray    # (X,) hours
    trans_event: np.ndarray   # (X,) index of the failure event
    trans_old: np.ndarray     # (X,) K before
    trans_new: np.ndarray     # (X,) K after
    swaps: int

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


def replay(events: FailureEvents, layout: Layout, duration_h: float,
           spare_domains: int = 0, swap_hours: float = 0.0) -> History:
    st = _State(layout)
    S = layout.domain_size
    heap: list = []
    for i in range(len(events)):
        heapq.heappush(heap, (float(events.time[i]), _FAIL, i))
    active: list[set] = [set() for _ in range(layout.num_domains)]
    pending = np.zeros(layout.num_domains, dtype=bool)
    waiting: deque = deque()
    pool = spare_domains
    swaps = 0

    times, hists, bads, downs = [0.0], [st.hist.copy()], [0], [0]
    tt, te, to, tn = [], [], [], []

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

    while heap:
        now, kind, x = heapq.heappop(heap)
        if now >= duration_h:
            break
        if kind == _FAIL:
            first, size = int(events.first[x]), int(events.size[x])
            d = first // S
            trans: list = []
            st.apply(first, size, +1, trans)
            active[d].add(x)
            heapq.heappush(heap, (now + float(events.repair[x]), _REPAIR, x))
            for old, new in trans:
                tt.append(now), te.append(x), to.append(old), tn.append(new)
            if spare_domains > 0 and not pending[d] and d not in waiting:
                if pool > 0:
                    start_swap(d, now)
                else:
                    waiting.append(d)
        elif kind == _REPAIR:
            d = int(events.first[x]) // S
            if x in active[d]:
                active[d].discard(x)
                st.apply(int(events.first[x]), int(events.size[x]), -1, None)
        elif kind == _SWAP:
            d = x
            pending[d] = False
            if active[d]:
                back = max(float(events.time[e] + events.repair[e]) for e in active[d])
                for e in sorted(active[d]):
                    st.apply(int(events.first[e]), int(events.size[e]), -1, None)
                active[d].clear()
                swaps += 1
                heapq.heappush(heap, (max(back, now), _RETURN, d))
            else:
                pool += 1
                serve(now)
        else:  # _RETURN: repaired hardware becomes a spare again
            pool += 1
            serve(now)
        times.append(now)
        hists.append(st.hist.copy())
        bads.append(st.bad)
        downs.append(st.down_total)

    return History(time=np.asarray(times), hist=np.asarray(hists),
                   bad_domains=np.asarray(bads), down_gpus=np.asarray(downs),
                   duration=float(duration_h),
                   trans_time=np.asarray(tt, dtype=float),
                   trans_event=np.asarray(te, dtype=np.int64),
                   trans_old=np.asarray(to, dtype=np.int64),
                   trans_new=np.asarray(tn, dtype=np.int64), swaps=swaps)


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

