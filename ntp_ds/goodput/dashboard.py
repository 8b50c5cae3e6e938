"""The W&B goodput dashboard as code: a `wandb-workspaces` Workspace whose panels plot the keys the trainer logs.

    python -m ntp_ds.goodput.dashboard                                      # list its sections, panels and keys
    python -m ntp_ds.goodput.dashboard --push --entity TEAM --project ntp-ds # save it as a W&B workspace view

Building the workspace needs no network; saving it needs a W&B login. Every panel plots against `step`, the x axis
`WandbLogger` defines for step metrics and recovery events alike.
"""

from __future__ import annotations

import argparse
import sys
import warnings

with warnings.catch_warnings():  # the library still declares pydantic v1-style validators
    warnings.simplefilter("ignore", DeprecationWarning)
    import wandb_workspaces.reports.v2 as wr
    import wandb_workspaces.workspaces as ws

NAME = "ntp-ds goodput"
X_AXIS = "step"
MAX_REPLICAS = 8


def _line(title: str, y: list[str], **kw) -> wr.LinePlot:
    return wr.LinePlot(title=title, x=X_AXIS, y=y, **kw)


def build_workspace(entity: str, project: str, replicas: int = MAX_REPLICAS, name: str = NAME) -> ws.Workspace:
    """The dashboard's workspace view; `replicas` sets how many `tp_degree/replica_N` series the TP panel plots."""
    sections = [
        ws.Section(name="Goodput", is_open=True, panels=[
            _line("Goodput (cumulative and per step)", ["goodput", "step_goodput"], range_y=(0, 1)),
            _line("Tokens per second against the failure-free rate", ["tokens_per_s", "failure_free_tokens_per_s"]),
            _line("Throughput ratio", ["throughput_ratio"], range_y=(0, None)),
            wr.ScalarChart(title="Run goodput", metric="goodput"),
        ]),
        ws.Section(name="Topology", is_open=True, panels=[
            _line("TP degree per replica (0: dropped)", [f"tp_degree/replica_{r}" for r in range(replicas)],
                  range_y=(0, None)),
            _line("Active against allocated GPUs", ["active_gpus", "allocated_gpus"], range_y=(0, None)),
            _line("Active GPU fraction", ["active_gpu_fraction"], range_y=(0, 1)),
        ]),
        ws.Section(name="Recovery", is_open=True, panels=[
            _line("Recovery time split", ["event/detection_s", "event/recovery_s", "event/redone_s"],
                  plot_type="stacked-area"),
            _line("Failure to the next completed step", ["event/failure_to_step_s"]),
            _line("Bytes moved against the lost shard", ["event/bytes_moved", "event/lost_shard_bytes"]),
            _line("Recovery events", ["event/count"]),
        ]),
        ws.Section(name="Training", is_open=True, panels=[
            _line("Loss", ["loss"]),
            _line("Step time split", ["step_time_s", "time/compute_s", "time/comm_wait_s", "time/other_s"]),
        ]),
    ]
    return ws.Workspace(entity=entity, project=project, name=name, sections=sections,
                        settings=ws.WorkspaceSettings(x_axis=X_AXIS))


def panel_keys(panel) -> list[str]:
    """The metric keys a panel plots (its y series, or a scalar chart's metric)."""
    if isinstance(panel, wr.LinePlot):
        return [str(y) for y in panel.y]
    if isinstance(panel, wr.ScalarChart):
        return [str(panel.metric)]
    raise TypeError(f"panel {type(panel).__name__} has no known keys")


def plotted_keys(workspace: ws.Workspace) -> set[str]:
    """Every metric key a panel of the workspace plots, x axes included."""
    keys = {X_AXIS}
    for section in workspace.sections:
        for panel in section.panels:
            keys.update(panel_keys(panel))
            if isinstance(panel, wr.LinePlot):
                keys.add(str(panel.x))
    return keys


def describe(workspace: ws.Workspace) -> str:
    lines = [f"{workspace.name} ({workspace.entity}/{workspace.project}), x axis {X_AXIS}"]
    for section in workspace.sections:
        lines.append(f"  {section.name}")
        lines += [f"    {panel.title}: {', '.join(panel_keys(panel))}" for panel in section.panels]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ntp_ds.goodput.dashboard", description=__doc__.splitlines()[0])
    parser.add_argument("--push", action="store_true", help="save the workspace as a W&B view (needs a login)")
    parser.add_argument("--entity", help="W&B entity (needed by --push)")
    parser.add_argument("--project", default="ntp-ds", help="W&B project (default: ntp-ds)")
    parser.add_argument("--replicas", type=int, default=MAX_REPLICAS,
                        help=f"replicas the TP-degree panel plots (default: {MAX_REPLICAS})")
    parser.add_argument("--name", default=NAME, help=f"name of the view (default: {NAME!r})")
    args = parser.parse_args(argv)
    if args.replicas < 1:
        print(f"dashboard: error: --replicas={args.replicas} must be a positive integer", file=sys.stderr)
        return 2
    if args.push and not args.entity:
        print("dashboard: error: --push needs --entity", file=sys.stderr)
        return 2
    workspace = build_workspace(args.entity or "ENTITY", args.project, args.replicas, args.name)
    if not args.push:
        print(describe(workspace))
        return 0
    try:
        workspace.save()
    except Exception as e:  # no login, no network, no such entity or project
        text = str(e).strip().splitlines()
        print(f"dashboard: error: saving the view to {args.entity}/{args.project} failed: "
              f"{type(e).__name__}: {text[0] if text else ''}", file=sys.stderr)
        return 1
    print(workspace.url)
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
