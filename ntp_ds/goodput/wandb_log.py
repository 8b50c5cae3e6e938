"""W&B logging of goodput metrics and recovery events; a no-op when `logging.wandb.mode=disabled`.

Every metric is plotted against the training step (`step`), so step metrics and recovery events, logged at
irregular points, share one x axis. Offline mode needs no network: the run lands in RUN_DIR/wandb/offline-run-*
and `wandb sync` uploads it later.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

log = logging.getLogger(__name__)

EVENT_PREFIX = "event/"


class WandbLogger:
    """The writer's W&B run."""

    def __init__(self, *, mode: str, project: str, entity: str | None, name: str, tags: list, run_dir: Path,
                 config: dict, run_id: str | None = None):
        """`run_id`: resume that run (a rank taking over from a writer that died), else start a new one."""
        self.run = None
        self._events: list[dict] = []
        if mode == "disabled":
            return
        os.environ.setdefault("WANDB_SILENT", "true")
        import wandb

        Path(run_dir).mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(project=project, entity=entity, name=name, tags=list(tags), config=config,
                              dir=str(run_dir), mode=mode, reinit="finish_previous",
                              id=run_id, resume="allow" if run_id else None,
                              settings=wandb.Settings(console="off", silent=True, disable_git=True,
                                                      x_disable_stats=True))
        self.run.define_metric("step")
        self.run.define_metric("*", step_metric="step")
        log.info("W&B run %s (%s) in %s", self.run.id, mode, Path(run_dir) / "wandb")

    @property
    def run_id(self) -> str | None:
        return self.run.id if self.run is not None else None

    @property
    def enabled(self) -> bool:
        return self.run is not None

    def log_step(self, metrics: dict) -> None:
        """Log one step's metrics; `metrics["step"]` is the x axis."""
        if self.run is not None:
            self.run.log({k: v for k, v in metrics.items() if isinstance(v, (int, float))})

    def log_event(self, event: dict) -> None:
        """Log a recovery (or other) event: its numeric fields as `event/NAME` at the event's step."""
        self._events.append(event)
        if self.run is None:
            return
        values = {f"{EVENT_PREFIX}{k}": v for k, v in event.items()
                  if isinstance(v, (int, float)) and not isinstance(v, bool) and k != "step"}
        values[f"{EVENT_PREFIX}count"] = len(self._events)
        self.run.log({"step": event.get("step", 0), **values})

    def finish(self, summary: dict) -> None:
        """Write the run summary and the table of events, then close the run."""
        if self.run is None:
            return
        import wandb

        if self._events:
            columns = sorted({k for e in self._events for k in e})
            rows = [[_cell(e.get(c)) for c in columns] for e in self._events]
            self.run.log({"step": summary.get("steps", 0), "events": wandb.Table(columns=columns, data=rows)})
        self.run.summary.update({k: v for k, v in summary.items() if isinstance(v, (int, float, str))})
        self.run.finish()
        self.run = None

    def close(self) -> None:
        """Close the run without a summary (its writer leaves; another rank resumes the run)."""
        if self.run is not None:
            self.run.finish()
            self.run = None

    def abort(self) -> None:
        """Close the run of a failed job (exit code 1) so its files are complete."""
        if self.run is not None:
            self.run.finish(exit_code=1)
            self.run = None


def _cell(value):
    return value if isinstance(value, (int, float, str)) or value is None else str(value)
