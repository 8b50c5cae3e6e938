"""A run's records on disk: metrics.jsonl (one line per step), events.jsonl (one line per event), summary.json.

Rank 0 writes them and forwards the same records to W&B; the other ranks get a recorder that writes nothing.
`ntp-ds report` reads them back with `read_run`.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

METRICS = "metrics.jsonl"
EVENTS = "events.jsonl"
SUMMARY = "summary.json"
FINAL_WEIGHTS = "final"


class RunRecorder:
    """Append step metrics and events as JSON lines, write the summary at the end; mirror them to W&B."""

    def __init__(self, run_dir: Path | None, wandb=None, wall=time.time):
        self.run_dir, self.wandb, self._wall = run_dir, wandb, wall
        self._metrics = self._events = None
        if run_dir is not None:
            run_dir.mkdir(parents=True, exist_ok=True)
            self._metrics = open(run_dir / METRICS, "a", buffering=1)
            self._events = open(run_dir / EVENTS, "a", buffering=1)

    @property
    def active(self) -> bool:
        return self.run_dir is not None

    def step(self, metrics: dict) -> None:
        if not self.active:
            return
        self._metrics.write(json.dumps({"time": self._wall(), **metrics}) + "\n")
        if self.wandb is not None:
            self.wandb.log_step(metrics)

    def event(self, event: str, step: int, **fields) -> dict:
        """Record an event (`recovery`, `fault_skipped`, `run_start`, ...) at training step `step`."""
        record = {"time": self._wall(), "event": event, "step": step, **fields}
        if self.active:
            self._events.write(json.dumps(record, default=str) + "\n")
            if self.wandb is not None:
                self.wandb.log_event(record)
        return record

    def finish(self, summary: dict) -> None:
        if not self.active:
            return
        (self.run_dir / SUMMARY).write_text(json.dumps(summary, indent=2, default=str) + "\n")
        if self.wandb is not None:
            self.wandb.finish(summary)
        self.close()

    def abort(self) -> None:
        """Close the records of a run that failed, marking its W&B run as failed."""
        if self.wandb is not None:
            self.wandb.abort()
        self.close()

    def close(self) -> None:
        for f in (self._metrics, self._events):
            if f is not None and not f.closed:
                f.close()


def read_jsonl(path: Path) -> list[dict]:
    """Read a JSON-lines file, skipping a torn last line (a run killed mid-write)."""
    if not path.is_file():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out


def read_run(run_dir: Path) -> tuple[list[dict], list[dict], dict]:
    """Return (metrics, events, summary) of a run directory; summary is {} for a run that did not finish."""
    summary_path = run_dir / SUMMARY
    summary = json.loads(summary_path.read_text()) if summary_path.is_file() else {}
    return read_jsonl(run_dir / METRICS), read_jsonl(run_dir / EVENTS), summary
