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
RUN_CONFIG = "config.json"
"""The composed config of the run (of its latest segment when resumed), written by the writer at the start."""
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


def read_jsonl(path: Path, key: str, warnings: list[str] | None = None) -> list[dict]:
    """Read a JSON-lines file of records that each carry `key`, skipping damaged lines (a torn last line of a run
    killed mid-write, or a file damaged later); say what was skipped in `warnings`, when given."""
    if not path.is_file():
        return []
    out, damaged = [], []
    for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            record = None
        if isinstance(record, dict) and key in record:
            out.append(record)
        else:
            damaged.append(number)
    if damaged and warnings is not None:
        shown = ", ".join(map(str, damaged[:5])) + (", ..." if len(damaged) > 5 else "")
        warnings.append(f"{path.name}: skipped {len(damaged)} damaged line{'s' if len(damaged) > 1 else ''} "
                        f"(line{'s' if len(damaged) > 1 else ''} {shown} of {number}); the rest is read")
    return out


def read_summary(path: Path, warnings: list[str] | None = None) -> dict:
    """Read summary.json; {} when there is none, or when it is damaged (said in `warnings`, when given)."""
    if not path.is_file():
        return {}
    try:
        summary = json.loads(path.read_text(errors="replace"))
        if isinstance(summary, dict):
            return summary
        problem = "not a JSON object"
    except json.JSONDecodeError as e:
        problem = str(e)
    if warnings is not None:
        warnings.append(f"{path.name} is damaged ({problem}); the run is read as unfinished")
    return {}


def read_run(run_dir: Path, warnings: list[str] | None = None) -> tuple[list[dict], list[dict], dict]:
    """Return (metrics, events, summary) of a run directory; summary is {} for a run that did not finish. What
    had to be skipped as damaged is described in `warnings`, when given."""
    return (read_jsonl(run_dir / METRICS, "step", warnings), read_jsonl(run_dir / EVENTS, "event", warnings),
            read_summary(run_dir / SUMMARY, warnings))
