"""What a running job tells others through its store: its shape, its progress and a stop every rank agrees on.

- The writer publishes the job (`publish_job`: world size, train.steps) when training starts and its last
  completed step after every step (`publish_step`), so `ntp-ds inject` can check a fault against the running job.
- A stop request (SIGINT or SIGTERM) becomes one decision for every rank: the first rank that sees it at a step
  boundary proposes to stop after the *next* step (`propose_stop`, a compare-and-set: the first proposal wins).
  No rank can have completed that step yet (it needs the proposer's part of it), so every rank can stop there
  and all of them hold the same completed step.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from ntp_ds.control.keys import JOB_KEY, STEP_KEY, STOP_KEY


@dataclass(frozen=True)
class JobInfo:
    """A running job as its store describes it."""

    world_size: int
    steps: int
    """train.steps: the last step the job runs."""
    step: int
    """Last completed step (0 before the first)."""


@dataclass(frozen=True)
class StopDecision:
    """Every rank stops once it has completed step `after`; `signal` is the number of the signal that asked."""

    after: int
    signal: int


def publish_job(store, world_size: int, steps: int, step: int = 0) -> None:
    store.set(JOB_KEY, json.dumps({"world_size": world_size, "steps": steps}))
    publish_step(store, step)


def publish_step(store, step: int) -> None:
    store.set(STEP_KEY, str(step))


def read_job(store) -> JobInfo | None:
    """The job published in `store`, or None when no job has published itself there (yet)."""
    if not store.check([JOB_KEY]):
        return None
    info = json.loads(store.get(JOB_KEY))
    step = int(store.get(STEP_KEY)) if store.check([STEP_KEY]) else 0
    return JobInfo(int(info["world_size"]), int(info["steps"]), step)


def propose_stop(store, after: int, signal: int) -> StopDecision:
    """Propose to stop after step `after`; return the decision in force (the first proposal made)."""
    proposal = json.dumps({"after": after, "signal": signal})
    current = store.compare_set(STOP_KEY, "", proposal)
    return _decision(current)


def read_stop(store) -> StopDecision | None:
    """The stop decision, if a rank has proposed one."""
    return _decision(store.get(STOP_KEY)) if store.check([STOP_KEY]) else None


def _decision(raw: bytes | str) -> StopDecision:
    data = json.loads(raw)
    return StopDecision(int(data["after"]), int(data["signal"]))
