"""`ntp-ds report RUN_DIR`: a goodput timeline PNG and a summary table of a training run.

The timeline has three panels over the training step: throughput against the failure-free rate, the TP degree of
every replica, and goodput with the active GPU fraction; failures, recoveries and resumptions are marked. Damaged
lines of the records are skipped with a warning that says which; a resumed run is shown segment by segment.

`--against OTHER_RUN` also overlays the loss curves of the two runs (typically a faulted run and the failure-free
run of the same config), marks each recovery, and prints the largest absolute loss difference at the steps both
ran. The loss compared is `global_loss`, over the whole global batch: under `batch_policy: preserve_global_batch` a
recovery changes nothing of the training, and the curves coincide up to floating-point reduction order. (`loss`,
the writer's replica's share of the batch, is used only for runs that did not record `global_loss`.)
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

from ntp_ds.goodput import BUCKETS
from ntp_ds.run.records import read_run

PROG = "ntp-ds report"
TIMELINE = "goodput_timeline.png"
LOSS_OVERLAY = "loss_overlay.png"
"""Written next to the timeline by `--against`."""
# Step s covers the x interval (s - 1, s]: a failure and its recovery happen inside the step they interrupt.
MARKERS = {"failure": ("tab:red", "-", "failure", 0.6), "recovery": ("tab:green", "--", "recovery", 0.3),
           "join": ("tab:cyan", "-.", "join", 0.0), "run_resumed": ("tab:gray", ":", "resumed", 0.0)}


def _replica_keys(metrics: list[dict]) -> list[str]:
    keys = {k for m in metrics for k in m if k.startswith("tp_degree/replica_")}
    return sorted(keys, key=lambda k: int(k.rsplit("_", 1)[1]))


def summary_table(metrics: list[dict], events: list[dict], summary: dict, run_dir: Path) -> str:
    """The run at a glance, as aligned `name  value` rows."""
    parts = segments(metrics, events)
    metrics = latest_per_step(metrics)
    last = metrics[-1] if metrics else {}
    first = metrics[0] if metrics else {}
    s = summary or {"steps": len(metrics), "goodput": last.get("goodput", 0.0),
                    "tokens_per_s": last.get("tokens_per_s", 0.0), "throughput_ratio": last.get("throughput_ratio", 0.0),
                    "failure_free_tokens_per_s": last.get("failure_free_tokens_per_s", 0.0),
                    "active_gpu_fraction": last.get("active_gpu_fraction", 0.0),
                    "allocated_gpus": last.get("allocated_gpus", 0)}
    keys = _replica_keys(metrics)
    start = [first.get(k, 0) for k in keys]
    end = [last.get(k, 0) for k in keys]
    counts: dict[str, int] = {}
    for e in events:
        counts[e.get("event", "?")] = counts.get(e.get("event", "?"), 0) + 1
    status = "unfinished (no readable summary.json)"
    if summary:
        status = summary.get("status", "finished")
        if "stopped_by" in summary:
            status += f" by {summary['stopped_by']} after step {summary.get('last_step')}"
    rows = [("run", str(run_dir)), ("status", status),
            ("steps", str(summary.get("last_step", s.get("steps", len(metrics)))))]
    if len(parts) > 1:
        rows += [(f"segment {i}", text) for i, text in enumerate(parts, 1)]
    if "wall_s" in s:
        rows.append(("wall time" if len(parts) <= 1 else "wall time (last segment)", f"{s['wall_s']:.2f} s (+ {s.get('startup_s', 0.0):.1f} s start-up, not counted)"))
    rows += [("goodput", f"{s.get('goodput', 0.0):.3f}"),
             ("of failure-free", (f"{s.get('throughput_ratio', 0.0):.2f} (the time it would have taken without its "
                                  f"failures, over its time)" if "failure_free_s" in s else
                                  f"{s.get('throughput_ratio', 0.0):.2f} (the last step's rate over the failure-free)")),
             ("tokens/s", f"{s.get('tokens_per_s', 0.0):.0f} (failure-free steps "
                          f"{s.get('failure_free_tokens_per_s', 0.0):.0f})"),
             ("active GPUs", f"{100 * s.get('active_gpu_fraction', 0.0):.0f}% of {s.get('allocated_gpus', 0)}"),
             ("TP degrees", f"{start} -> {end}"),
             ("recoveries", str(counts.get("recovery", 0))), ("joins", str(counts.get("join", 0)))]
    if any(f"time/{b}_s" in s for b in BUCKETS):
        rows.append(("time split", "  ".join(f"{b} {100 * s.get(f'share/{b}', 0.0):.1f}%" for b in BUCKETS)))
    for e in events:
        if e.get("event") == "recovery":
            rows.append((f"  at step {e.get('step')}", _recovery_row(e)))
        elif e.get("event") == "join":
            rows.append((f"  join at step {e.get('step')}", _join_row(e)))
        elif e.get("event") == "replan":
            rows.append((f"  re-plan at step {e.get('step')}",
                         f"samples per replica {e.get('samples_before')} -> {e.get('samples_after')} (predicted step "
                         f"{e.get('predicted_step_s_before', 0.0):.3f} -> {e.get('predicted_step_s_after', 0.0):.3f} s)"))
        elif e.get("event") == "run_stopped" and len(parts) <= 1:
            rows.append(("stopped", f"at step {e.get('step')}: {e.get('reason', '')}"))
    if "final_loss" in s:
        rows.append(("final loss", f"{s['final_loss']:.4f}"))
    if s.get("final_weights"):
        rows.append(("final weights", str(s["final_weights"])))
    width = max(len(name) for name, _ in rows)
    return "\n".join(f"{name:<{width}}  {value}" for name, value in rows)


def segments(metrics: list[dict], events: list[dict]) -> list[str]:
    """One line per run segment: a run resumed from its checkpoint (`existing_run=resume`) has one per start."""
    starts = sorted((e for e in events if e.get("event") in ("run_start", "run_resumed")),
                    key=lambda e: e.get("time", 0.0))
    out = []
    for i, start in enumerate(starts):
        until = starts[i + 1].get("time", float("inf")) if i + 1 < len(starts) else float("inf")
        inside = [r for r in metrics + events if start.get("time", 0.0) <= r.get("time", 0.0) < until]
        steps = [r["step"] for r in inside if "event" not in r]
        ends = [r for r in inside if r.get("event") in ("run_end", "run_stopped")]
        how = ("finished" if ends[-1]["event"] == "run_end" else ends[-1].get("reason", "stopped")) if ends \
            else "no end recorded"
        span = f"steps {min(steps)}-{max(steps)}" if steps else "no step"
        resumed = f" (resumed from the checkpoint of step {start.get('step')})" \
            if start.get("event") == "run_resumed" else ""
        out.append(f"{span}{resumed}, {how}")
    return out


def latest_per_step(metrics: list[dict]) -> list[dict]:
    """The last record of every step, in step order (a resumed run may have recorded steps past its checkpoint
    before it stopped; the later segment's records replace them)."""
    latest: dict = {}
    for m in sorted(metrics, key=lambda m: m.get("time", 0.0)):
        latest[m["step"]] = m
    return [latest[k] for k in sorted(latest)]


def _join_row(e: dict) -> str:
    """One join: degrees, and the time from the step boundary to the next completed step."""
    text = f"TP {e.get('degrees_before')} -> {e.get('degrees_after')}"
    if "boundary_to_step_s" in e:
        text += f", {e['boundary_to_step_s']:.2f} s from the boundary to the next step"
    return text


def _recovery_row(e: dict) -> str:
    """One recovery: degrees, time to the next completed step, bytes moved against the lost shard, lossless."""
    parts = [f"{e.get('degrees_before')} -> {e.get('degrees_after')}"]
    if "failure_to_step_s" in e:
        parts.append(f"{e['failure_to_step_s']:.2f} s from the failure to the next step")
    else:
        parts.append(f"{e.get('detection_s', 0.0) + e.get('recovery_s', 0.0):.2f} s detection + recovery")
    if "bytes_moved" in e:
        parts.append(f"{e['bytes_moved']} B moved (lost shard {e.get('lost_shard_bytes', 0)} B)")
    if "lossless" in e:
        parts.append("lossless" if e["lossless"] else "not lossless")
    return ", ".join(parts)


def plot_timeline(metrics: list[dict], events: list[dict], path: Path, title: str = "") -> Path:
    """Draw the three-panel goodput timeline to `path`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [m["step"] for m in metrics]
    fig, (ax_tp, ax_deg, ax_gp) = plt.subplots(3, 1, figsize=(9, 8), sharex=True, constrained_layout=True)
    ax_tp.plot(steps, [m.get("tokens_per_s", 0.0) for m in metrics], label="tokens/s", color="tab:blue")
    ax_tp.plot(steps, [m.get("failure_free_tokens_per_s", 0.0) for m in metrics], label="failure-free",
               color="tab:blue", linestyle="--", alpha=0.5)
    ax_tp.set_ylabel("tokens/s")
    ax_ratio = ax_tp.twinx()
    ax_ratio.plot(steps, [m.get("throughput_ratio", 0.0) for m in metrics], color="tab:orange", alpha=0.7,
                  label="ratio")
    ax_ratio.set_ylabel("ratio to failure-free")
    ax_ratio.set_ylim(0, max([1.2] + [1.05 * m.get("throughput_ratio", 0.0) for m in metrics]))
    keys = _replica_keys(metrics)
    for i, key in enumerate(keys):
        offset = (i - (len(keys) - 1) / 2) * 0.04  # keep equal degrees apart
        ax_deg.step(steps, [m.get(key, 0) + offset for m in metrics], where="post",
                    label=f"replica {key.rsplit('_', 1)[1]}")
    top = max([1] + [m.get(k, 0) for m in metrics for k in keys])
    ax_deg.set_ylim(-0.3, top + 0.5)
    ax_deg.yaxis.get_major_locator().set_params(integer=True)
    ax_deg.set_ylabel("TP degree")
    ax_deg.legend(loc="lower left", fontsize="small", ncol=min(len(keys), 4) or 1)
    ax_gp.plot(steps, [m.get("goodput", 0.0) for m in metrics], label="goodput (cumulative)", color="tab:purple")
    ax_gp.plot(steps, [m.get("step_goodput", 0.0) for m in metrics], label="goodput (step)", color="tab:purple",
               alpha=0.4)
    ax_gp.plot(steps, [m.get("active_gpu_fraction", 0.0) for m in metrics], label="active GPU fraction",
               color="tab:green")
    ax_gp.set_ylim(0, 1.05)
    ax_gp.set_xlabel("step")
    ax_gp.set_ylabel("fraction")
    labelled = set()
    for e in events:
        if e.get("event") not in MARKERS:
            continue
        color, style, label, before = MARKERS[e["event"]]
        for ax in (ax_tp, ax_deg, ax_gp):
            ax.axvline(e.get("step", 0) - before, color=color, linestyle=style, alpha=0.8,
                       label=label if ax is ax_gp and label not in labelled else None)
        labelled.add(label)
    ax_gp.legend(loc="lower left", fontsize="small")
    lines, labels = ax_tp.get_legend_handles_labels()
    lines2, labels2 = ax_ratio.get_legend_handles_labels()
    ax_tp.legend(lines + lines2, labels + labels2, loc="lower left", fontsize="small")
    fig.suptitle(title or "goodput timeline")
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def loss_key(*runs: list[dict]) -> str:
    """The loss to compare runs on: `global_loss` (over the whole global batch) when every run recorded it, else
    `loss` (over the writer's replica's share of the batch, which a recovery changes)."""
    has = [any(isinstance(m.get("global_loss"), (int, float)) for m in metrics) for metrics in runs]
    return "global_loss" if all(has) else "loss"


def _losses(metrics: list[dict], key: str) -> dict[int, float]:
    return {m["step"]: m[key] for m in latest_per_step(metrics) if isinstance(m.get(key), (int, float))}


def loss_difference(metrics: list[dict], other: list[dict], key: str = "loss") -> tuple[float, int | None, int]:
    """Compare the `key` losses of two runs at the steps both recorded (their latest record of each step).

    Return (largest absolute difference, the step where it is, number of common steps); (nan, None, 0) when the runs
    share no step with a loss.
    """
    a, b = _losses(metrics, key), _losses(other, key)
    common = sorted(set(a) & set(b))
    if not common:
        return math.nan, None, 0
    step = max(common, key=lambda s: abs(a[s] - b[s]))
    return abs(a[step] - b[step]), step, len(common)


def plot_loss_overlay(runs: list[tuple[str, list[dict], list[dict]]], path: Path, title: str = "",
                      key: str = "loss") -> Path:
    """Draw the `key` loss curves of `runs` ((label, metrics, events) each) on one axis, marking their failures
    and recoveries, to `path`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4.5), constrained_layout=True)
    styles = [dict(color="tab:blue", linewidth=2.2, alpha=0.8), dict(color="tab:orange", linewidth=1.2,
                                                                     linestyle="--", marker=".", markersize=4)]
    labelled = set()
    for (label, metrics, events), style in zip(runs, styles):
        losses = _losses(metrics, key)
        ax.plot(list(losses), list(losses.values()), label=label, **style)
        for e in events:
            if e.get("event") not in ("failure", "recovery", "join"):
                continue
            color, line, name, before = MARKERS[e["event"]]
            name = f"{name} ({label})"
            ax.axvline(e.get("step", 0) - before, color=color if style is styles[0] else "tab:olive",
                       linestyle=line, alpha=0.8, label=name if name not in labelled else None)
            labelled.add(name)
    ax.set_xlabel("step")
    ax.set_ylabel("loss over the global batch" if key == "global_loss" else "loss (writer's replica)")
    ax.legend(loc="upper right", fontsize="small")
    ax.set_title(title or "loss")
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _read_against(run_dir: Path) -> tuple[list[dict], list[dict]] | str:
    """The metrics and events of the `--against` run, or the one-line error that says why there are none."""
    if not run_dir.is_dir():
        return f"--against={str(run_dir)!r} is not a directory"
    warnings: list[str] = []
    metrics, events, _ = read_run(run_dir, warnings)
    for warning in warnings:
        print(f"{PROG}: warning: --against: {warning}", file=sys.stderr)
    if not metrics:
        return f"--against={str(run_dir)!r} holds no step in metrics.jsonl"
    return metrics, events


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=PROG, description="Draw a run's goodput timeline and print its summary.",
                                     epilog="Example: ntp-ds report outputs/2026-01-01/12-00-00")
    parser.add_argument("run_dir", help="run directory of `ntp-ds train` (holds metrics.jsonl)")
    parser.add_argument("--out", help=f"PNG path (default: RUN_DIR/{TIMELINE})")
    parser.add_argument("--against", metavar="OTHER_RUN",
                        help=f"another run directory (e.g. the failure-free run): overlay both loss curves in "
                             f"{LOSS_OVERLAY} next to the timeline and print their largest loss difference")
    args = parser.parse_args(argv)
    run_dir = Path(args.run_dir)
    if not run_dir.is_dir():
        print(f"{PROG}: error: RUN_DIR={str(run_dir)!r} is not a directory", file=sys.stderr)
        return 2
    against = _read_against(Path(args.against)) if args.against else None
    if isinstance(against, str):
        print(f"{PROG}: error: {against}", file=sys.stderr)
        return 2
    warnings: list[str] = []
    metrics, events, summary = read_run(run_dir, warnings)
    for warning in warnings:
        print(f"{PROG}: warning: {warning}", file=sys.stderr)
    if not metrics:
        print(f"{PROG}: error: RUN_DIR={str(run_dir)!r} holds no step in metrics.jsonl (not a run directory, or the "
              f"run stopped before its first step)", file=sys.stderr)
        return 2
    out = Path(args.out) if args.out else run_dir / TIMELINE
    try:
        plot_timeline(latest_per_step(metrics), events, out, title=f"{run_dir.name}: {summary.get('model', '')}".rstrip(": "))
    except OSError as e:
        print(f"{PROG}: error: --out={str(out)!r}: {e.strerror or e}", file=sys.stderr)
        return 2
    print(summary_table(metrics, events, summary, run_dir))
    print(f"timeline: {out}")
    if against is not None:
        other = Path(args.against)
        overlay = out.parent / LOSS_OVERLAY
        key = loss_key(metrics, against[0])
        try:
            plot_loss_overlay([(run_dir.name, metrics, events), (other.name, *against)], overlay,
                              title=f"{key}: {run_dir.name} against {other.name}", key=key)
        except OSError as e:
            print(f"{PROG}: error: {overlay}: {e.strerror or e}", file=sys.stderr)
            return 2
        print(f"loss overlay: {overlay}")
        largest, step, common = loss_difference(metrics, against[0], key)
        if common:
            print(f"largest |{key} difference| against {other}: {largest:.3g} at step {step} "
                  f"({common} common steps)")
        else:
            print(f"largest |{key} difference| against {other}: none (the runs share no step)")
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
