"""Costs measured by the engine, for ``ntp-ds simulate calibrate=RUN_DIR`` (or a table file).

A training run directory holds ``metrics.jsonl`` (one record per step: ``step``, ``step_time_s``,
``tp_degree/replica_<i>``) and ``events.jsonl`` (``recovery`` records with ``failure_to_step_s``,
and ``rejoin`` records with ``rejoin_s`` where the engine writes them).  From them this module
builds a :class:`Calibration`:

* ``healthy_tp`` - the largest replica degree in the run;
* ``step_seconds`` - median step time of the steps run under each set of replica degrees, keyed
  by the smallest degree present (the first step and the steps of a recovery are left out);
* ``recovery_seconds`` - median failure-to-next-completed-step time over the recoveries;
* ``rejoin_seconds`` - median rejoin pause, when the run has one.

The same fields in a YAML or JSON file (``step_seconds`` as ``{degree: seconds}``) make a table
file.  The simulator uses the ratio ``step_seconds[t'] / step_seconds[t]`` as the step-time ratio
of a replica at the fraction ``t'/t`` of its degree (interpolated in ``t'/t``, and ``t/t'`` times
the lowest measured ratio's excess below it), and the measured pauses as the job-wide stops.
"""
from __future__ import annotations

import json
import statistics
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .config import ConfigError

FIELD = "calibrate"


@dataclass(frozen=True)
class Calibration:
    healthy_tp: int
    step_seconds: dict[int, float]
    recovery_seconds: float | None = None
    rejoin_seconds: float | None = None
    steps: dict[int, int] = field(default_factory=dict)   # steps measured per degree
    source: str = ""

    def ratios(self) -> dict[float, float]:
        """Measured step-time ratio by degree fraction ``t'/t`` (1.0 -> 1.0)."""
        base = self.step_seconds[self.healthy_tp]
        return {d / self.healthy_tp: s / base for d, s in sorted(self.step_seconds.items())}

    def slowdown(self, x: float) -> float:
        """Step-time ratio of a replica at fraction ``x`` of its degree."""
        r = self.ratios()
        xs = np.array(sorted(r))
        ys = np.array([r[k] for k in xs])
        if x >= xs[0]:
            return float(np.interp(x, xs, ys))
        return float(ys[0] * xs[0] / x)

    def to_dict(self) -> dict:
        return {"healthy_tp": self.healthy_tp,
                "step_seconds": {int(k): float(v) for k, v in sorted(self.step_seconds.items())},
                "recovery_seconds": self.recovery_seconds, "rejoin_seconds": self.rejoin_seconds,
                "steps": {int(k): int(v) for k, v in sorted(self.steps.items())},
                "source": self.source}


def _read_jsonl(path: Path) -> list[dict]:
    out = []
    if not path.is_file():
        return out
    for n, line in enumerate(path.read_text().splitlines(), start=1):
        if line.strip():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                raise ConfigError(FIELD, str(path), f"line {n} is not JSON") from None
    return out


def from_run(run_dir: Path) -> Calibration:
    metrics = _read_jsonl(run_dir / "metrics.jsonl")
    if not metrics:
        raise ConfigError(FIELD, str(run_dir), "no metrics.jsonl records with step_time_s")
    events = _read_jsonl(run_dir / "events.jsonl")
    recovery_steps = {int(e.get("step", -1)) for e in events if e.get("event") == "recovery"}
    by_degree: dict[int, list[float]] = {}
    healthy = 0
    for m in metrics:
        degrees = [v for k, v in m.items() if k.startswith("tp_degree/replica_") and v]
        if "step_time_s" not in m or not degrees:
            continue
        healthy = max(healthy, max(degrees))
        if m.get("step", 0) <= 1 or m.get("step") in recovery_steps:
            continue
        by_degree.setdefault(int(min(degrees)), []).append(float(m["step_time_s"]))
    if healthy not in by_degree:
        raise ConfigError(FIELD, str(run_dir), "no healthy steps (all replicas at full degree) "
                                               "with step_time_s and tp_degree/replica_<i>")
    rec = [float(e["failure_to_step_s"]) for e in events
           if e.get("event") == "recovery" and e.get("failure_to_step_s") is not None]
    rej = [float(e["rejoin_s"]) for e in events
           if e.get("event") == "rejoin" and e.get("rejoin_s") is not None]
    return Calibration(
        healthy_tp=healthy,
        step_seconds={d: statistics.median(v) for d, v in by_degree.items()},
        recovery_seconds=statistics.median(rec) if rec else None,
        rejoin_seconds=statistics.median(rej) if rej else None,
        steps={d: len(v) for d, v in by_degree.items()}, source=str(run_dir))


def from_table(path: Path) -> Calibration:
    import yaml

    try:
        data = yaml.safe_load(path.read_text())
    except Exception as exc:
        raise ConfigError(FIELD, str(path), f"cannot read: {str(exc).splitlines()[0]}") from None
    if not isinstance(data, dict) or not isinstance(data.get("step_seconds"), dict):
        raise ConfigError(FIELD, str(path), "needs a mapping with step_seconds: {degree: seconds}")
    try:
        steps = {int(k): float(v) for k, v in data["step_seconds"].items()}
        healthy = int(data.get("healthy_tp") or max(steps))
        rec = data.get("recovery_seconds")
        rej = data.get("rejoin_seconds")
        cal = Calibration(healthy_tp=healthy, step_seconds=steps,
                          recovery_seconds=None if rec is None else float(rec),
                          rejoin_seconds=None if rej is None else float(rej),
                          steps={int(k): int(v) for k, v in (data.get("steps") or {}).items()},
                          source=str(path))
    except (TypeError, ValueError) as exc:
        raise ConfigError(FIELD, str(path), f"bad value: {exc}") from None
    return cal


def load(source: str) -> Calibration:
    """A calibration from a run directory or a YAML/JSON table file."""
    path = Path(source).expanduser()
    if path.is_dir():
        cal = from_run(path)
    elif path.is_file():
        cal = from_table(path)
    else:
        raise ConfigError(FIELD, source, "no such run directory or table file")
    if cal.healthy_tp not in cal.step_seconds:
        raise ConfigError(FIELD, source, f"step_seconds has no entry for healthy_tp={cal.healthy_tp}")
    if any(not (s > 0) for s in cal.step_seconds.values()):
        raise ConfigError(FIELD, source, "step_seconds must all be > 0")
    for name in ("recovery_seconds", "rejoin_seconds"):
        v = getattr(cal, name)
        if v is not None and not v >= 0:
            raise ConfigError(FIELD, source, f"{name} must be >= 0")
    return cal
