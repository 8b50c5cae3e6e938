"""The W&B goodput dashboard as code: a panel spec kept at docs/wandb_dashboard.json, pushable as a saved view.

    python -m ntp_ds.goodput.dashboard --write docs/wandb_dashboard.json      # regenerate the committed spec
    python -m ntp_ds.goodput.dashboard --push --entity TEAM --project ntp-ds  # save it as a W&B workspace view

Pushing needs network, a W&B login and the `wandb-workspaces` package (`pip install "wandb[workspaces]"`).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

DEFAULT_PATH = Path("docs") / "wandb_dashboard.json"
MAX_REPLICAS = 8


def _line(title: str, y: list[str], description: str) -> dict:
    return {"type": "line", "title": title, "x": "step", "y": y, "description": description}


def dashboard_spec(replicas: int = MAX_REPLICAS) -> dict:
    """The panels, section by section; `replicas` sets how many `tp_degree/replica_N` series the TP panel plots."""
    tp_keys = [f"tp_degree/replica_{r}" for r in range(replicas)]
    return {
        "name": "ntp-ds goodput",
        "x_axis": "step",
        "sections": [
            {"name": "Goodput", "panels": [
                _line("Goodput", ["goodput", "step_goodput"],
                      "Productive model-update work / (wall time x GPUs allocated): cumulative and per step."),
                _line("Tokens per second", ["tokens_per_s", "failure_free_tokens_per_s"],
                      "Step throughput against the failure-free rate."),
                _line("Throughput ratio", ["throughput_ratio"], "tokens_per_s / failure_free_tokens_per_s."),
                {"type": "scalar", "title": "Run goodput", "metric": "goodput",
                 "description": "Goodput of the whole run (summary)."},
            ]},
            {"name": "Topology", "panels": [
                _line("TP degree per replica", tp_keys, "0 marks a dropped replica."),
                _line("Active GPUs", ["active_gpus", "allocated_gpus"], "GPUs doing work against GPUs held."),
                _line("Active GPU fraction", ["active_gpu_fraction"], "active_gpus / allocated_gpus."),
            ]},
            {"name": "Recovery", "panels": [
                _line("Recovery timings", ["event/detection_s", "event/recovery_s", "event/redone_s"],
                      "Per recovery event: failure detection, regroup and reshard, work redone."),
                _line("Recovery events", ["event/count"], "Events so far; the `events` table lists them."),
            ]},
            {"name": "Time breakdown", "panels": [
                _line("Step time split", ["step_time_s", "time/compute_s", "time/comm_wait_s", "time/other_s"],
                      "Wall time of a step: forward+backward, engine.step (sync, optimizer), the rest."),
                _line("Loss", ["loss"], "Mean next-token loss of rank 0's replica."),
            ]},
        ],
    }


def spec_json(spec: dict | None = None) -> str:
    return json.dumps(spec or dashboard_spec(), indent=2) + "\n"


def push(spec: dict, entity: str, project: str) -> str:
    """Save the spec as a W&B workspace view; return its URL."""
    try:
        import wandb_workspaces.reports.v2 as wr
        import wandb_workspaces.workspaces as ws
    except ImportError:
        raise RuntimeError('pushing a dashboard needs the wandb-workspaces package: pip install "wandb[workspaces]"'
                           ) from None

    def panel(p: dict):
        if p["type"] == "scalar":
            return wr.ScalarChart(title=p["title"], metric=p["metric"])
        return wr.LinePlot(title=p["title"], x=p["x"], y=list(p["y"]))

    sections = [ws.Section(name=s["name"], panels=[panel(p) for p in s["panels"]], is_open=True)
                for s in spec["sections"]]
    view = ws.Workspace(name=spec["name"], entity=entity, project=project, sections=sections)
    view.save()
    return view.url


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ntp_ds.goodput.dashboard", description=__doc__.splitlines()[0])
    parser.add_argument("--write", metavar="PATH", help=f"write the spec as JSON (e.g. {DEFAULT_PATH})")
    parser.add_argument("--push", action="store_true", help="save the spec as a W&B workspace view")
    parser.add_argument("--entity", help="W&B entity for --push")
    parser.add_argument("--project", default="ntp-ds", help="W&B project for --push (default: ntp-ds)")
    args = parser.parse_args(argv)
    spec = dashboard_spec()
    if args.write:
        Path(args.write).write_text(spec_json(spec))
        print(f"wrote {args.write}")
    if args.push:
        if not args.entity:
            print("dashboard: error: --push needs --entity", file=sys.stderr)
            return 2
        try:
            print(push(spec, args.entity, args.project))
        except RuntimeError as e:
            print(f"dashboard: error: {e}", file=sys.stderr)
            return 2
    if not (args.write or args.push):
        sys.stdout.write(spec_json(spec))
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
