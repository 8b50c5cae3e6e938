"""A run's records on disk: metrics.jsonl (one line per step), events.jsonl (one line per event), summary.json.

Rank 0 writes them and forwards the same records to W&B; the other ranks get a recorder that writes nothing. A rank
that takes over from a writer that died appends to the same files (`resume=True`) and replays them into its W&B run.
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
CHECKPOINTS = "checkpoints"
"""DeepSpeed checkpoints of the run (`global_stepN/` and `latest`), which `existing_run=resume` continues from."""
LAST_GOOD = "last_good"
"""Where the survivors write the last good weights when training cannot go on in memory."""


class RunRecorder:
    """Append step metrics and events as JSON lines, write the summary at the end; mirror them to W&B."""

    def __init__(self, run_dir: Path | None, wandb=None, wall=time.time, *, resume: bool = False):
        self.run_dir, self.wandb, self._wall = run_dir, wandb, wall
        self._metrics = self._events = None
        if run_dir is None:
            return
        run_dir.mkdir(parents=True, exist_ok=True)
        if resume and wandb is not None:
            metrics, events, _ = read_run(run_dir)
            for record in sorted(metrics + events, key=lambda r: r.get("time", 0.0)):
                if "event" in record:
                    wandb.log_event(record)
                else:
                    wandb.log_step({k: v for k, v in record.items() if k != "time"})
        self._metrics = _open_append(run_dir / METRICS)
        self._events = _open_append(run_dir / EVENTS)

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

    def hand_over(self) -> None:
        """Close the records of a writer that leaves the job; the rank taking its place resumes them."""
        if self.wandb is not None:
            self.wandb.close()
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


def _open_append(path: Path):
    """Open a JSON-lines file for appending, ending a line torn by a writer that was killed mid-write."""
    torn = path.is_file() and path.stat().st_size > 0 and not path.read_bytes().endswith(b"\n")
    f = open(path, "a", buffering=1)
    if torn:
        f.write("\n")
    return f


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
