"""The run directory, checked before any worker starts: it must be a writable directory, and one that already holds
a run is refused unless `existing_run` says to resume it or to overwrite it.

A directory holds a run when it has any of the records or weights a run writes (metrics.jsonl, events.jsonl,
summary.json, final/, checkpoints/). `resume` needs a DeepSpeed checkpoint there (`checkpoints/latest`) written by
the same TP degrees and short of `train.steps`; `overwrite` deletes only what runs write, never other files.
Every refusal is a `ConfigError` whose one line names the setting at fault.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

from ntp_ds.engine.config import ConfigError
from ntp_ds.engine.checkpoint import TOPOLOGY_FILE
from ntp_ds.envs import RUN_DIR_ENV
from ntp_ds.run.config import ModelConfig
from ntp_ds.run.records import CHECKPOINTS, EVENTS, FINAL_WEIGHTS, LAST_GOOD, METRICS, RUN_CONFIG, SUMMARY

RUN_MARKS = (METRICS, EVENTS, SUMMARY, FINAL_WEIGHTS, CHECKPOINTS)
"""Entries that show a directory holds a run."""
RUN_OUTPUTS = RUN_MARKS + (RUN_CONFIG, LAST_GOOD, "logs", "wandb", "goodput_timeline.png")
"""Everything a run (and its report) writes into its directory: what `overwrite` deletes."""


KEPT_ON_RESUME = ("seed", "model", "data", "optim.name", "parallel.zero_stage", "train.precision",
                  "train.global_batch", "train.micro_batch")
"""Settings a resumed run must share with the run it continues: they shape its checkpoint, its data or its
numbers (the rest, such as train.steps, the failure bounds or logging, may change)."""


@dataclass(frozen=True)
class Checkpoint:
    """The checkpoint a resumed run starts from."""

    path: Path
    step: int
    degrees: list


def check_run_dir(run_dir: str | Path, existing_run: str, degrees, steps: int, *, config: dict | None = None,
                  create: bool = True) -> Checkpoint | None:
    """Check `run_dir` for a run of TP degrees `degrees` and `steps` steps; return the checkpoint to resume from.

    `config`: the new run's config (`RunConfig.to_dict()`), compared on KEPT_ON_RESUME with the run it resumes.

    `create`: make the directory (and probe that it takes a file) now, so an unwritable place is found before any
    worker starts.
    """
    path = Path(run_dir).expanduser().absolute()
    where = f"run_dir={str(run_dir)!r}"
    if path.exists() and not path.is_dir():
        raise ConfigError(f"{where} is a file, not a directory; choose another run_dir")
    for parent in path.parents:
        if parent.exists():
            if not parent.is_dir():
                raise ConfigError(f"{where}: {parent} is a file, not a directory; choose another run_dir")
            break
    if create:
        try:
            path.mkdir(parents=True, exist_ok=True)
            with tempfile.NamedTemporaryFile(dir=path, prefix=".ntp-write-probe-"):
                pass
        except OSError as e:
            raise ConfigError(f"{where} is not writable ({e.strerror or e}); choose another run_dir") from None
    held = describe_run(path)
    if existing_run == "resume":
        if held is None:
            raise ConfigError(f"existing_run=resume: {where} holds no run to resume")
        point = _resume_point(path, where, list(degrees), steps)
        if config is not None:
            _check_kept(path, where, config)
        return point
    if held is not None and existing_run != "overwrite":
        raise ConfigError(f"{where} already holds a run ({held}); pass existing_run=resume to continue it or "
                          f"existing_run=overwrite to replace it, or choose another run_dir")
    return None


def describe_run(path: Path) -> str | None:
    """What run `path` holds, in a few words, or None when it holds none."""
    if not path.is_dir() or not any((path / name).exists() for name in RUN_MARKS):
        return None
    try:
        summary = json.loads((path / SUMMARY).read_text())
        return f"{summary.get('status', 'finished')} at step {summary.get('last_step', summary.get('steps', '?'))}"
    except (OSError, ValueError, AttributeError):
        return "unfinished: no summary.json" if not (path / SUMMARY).exists() else "damaged summary.json"


def _resume_point(path: Path, where: str, degrees: list, steps: int) -> Checkpoint:
    ckpt = path / CHECKPOINTS
    try:
        tag = (ckpt / "latest").read_text().strip()
        meta = json.loads((ckpt / tag / TOPOLOGY_FILE).read_text())
        step, written_by = int(meta["global_steps"]), list(meta["degrees"])
    except (OSError, ValueError, KeyError, TypeError):
        raise ConfigError(f"existing_run=resume: {where} holds no readable checkpoint to resume from "
                          f"({CHECKPOINTS}/latest); pass existing_run=overwrite to start it again") from None
    if written_by != degrees:
        raise ConfigError(f"existing_run=resume: the checkpoint of step {step} in {where} was written by TP degrees "
                          f"{written_by}, this config gives {degrees}; set parallel.degrees={written_by}")
    if step >= steps:
        raise ConfigError(f"existing_run=resume: the run in {where} has already completed step {step} of "
                          f"train.steps={steps}; raise train.steps to train further")
    return Checkpoint(ckpt, step, written_by)


def _check_kept(path: Path, where: str, config: dict) -> None:
    """Refuse a resume whose settings differ from the earlier run's on KEPT_ON_RESUME (when it wrote its config)."""
    try:
        earlier = json.loads((path / RUN_CONFIG).read_text())
    except (OSError, ValueError):
        return  # a run that did not write its config: only the checkpoint's own checks apply
    for dotted in KEPT_ON_RESUME:
        old, new = _lookup(earlier, dotted), _lookup(config, dotted)
        if dotted == "model" and isinstance(old, dict):  # a config.json written before the model schema listed
            old = {**asdict(ModelConfig()), **old}      # every LlamaConfig field
        if old != new:
            raise ConfigError(f"existing_run=resume: {dotted}={json.dumps(new)} differs from the run in {where} "
                              f"({json.dumps(old)}); a resumed run keeps {', '.join(KEPT_ON_RESUME)}")


def _lookup(data, dotted: str):
    for part in dotted.split("."):
        data = data.get(part) if isinstance(data, dict) else None
    return data


def clear_run(run_dir: str | Path) -> None:
    """Delete what a run wrote into `run_dir` (for `existing_run=overwrite`); other files stay."""
    path = Path(run_dir)
    for name in RUN_OUTPUTS:
        target = path / name
        if target.is_dir() and not target.is_symlink():
            shutil.rmtree(target, ignore_errors=True)
        else:
            try:
                target.unlink()
            except FileNotFoundError:
                pass
    for probe in path.glob(".ntp-write-probe-*"):
        probe.unlink(missing_ok=True)


def run_dir_of(cfg) -> str:
    """The run directory the workers will use: the launcher's NTP_RUN_DIR, else the config's."""
    return os.environ.get(RUN_DIR_ENV) or cfg.run_dir
