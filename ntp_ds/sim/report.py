"""CSV files, PNG plots and text tables for a :class:`SimResult`."""
from __future__ import annotations

import csv
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from .engine import SimResult  # noqa: E402
from .policies import POLICIES  # noqa: E402

LABELS = {"dp_drop": "DP-DROP", "ntp": "NTP", "ntp_pw": "NTP-PW",
          "ckpt_restart": "Checkpoint-restart"}
COLORS = {"dp_drop": "tab:red", "ntp": "tab:blue", "ntp_pw": "tab:green",
          "ckpt_restart": "tab:gray"}
STYLES = ["-", "--", ":", "-."]
GOODPUT_FIELDS = ("policy", "goodput", "mean_capacity", "interruptions", "downtime_hours",
                  "lost_work_hours", "spare_domains_needed", "mean_extra_power", "max_power")


def _fmt(x) -> str:
    if isinstance(x, float):
        return f"{x:.6g}"
    return str(x)


def _write(path: Path, header, rows) -> None:
    with path.open("w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(header)
        for row in rows:
            w.writerow([_fmt(v) for v in row])


def write_csvs(result: SimResult, out: Path) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / n for n in ("loss_vs_failures.csv", "spares.csv", "goodput.csv",
                               "timeline.csv")]
    _write(paths[0], ("policy", "tp", "failed_fraction", "throughput_loss"),
           ((r.policy, r.tp, r.failed_fraction, r.throughput_loss)
            for r in result.loss_vs_failures))
    _write(paths[1], ("policy", "spare_domains_needed"),
           ((p, result.outcomes[p].spare_domains_needed) for p in POLICIES))
    _write(paths[2], GOODPUT_FIELDS,
           ([getattr(result.outcomes[p], f) for f in GOODPUT_FIELDS] for p in POLICIES))
    hours = result.timeline_hours[:-1]
    _write(paths[3], ("hour",) + POLICIES,
           zip(hours, *(result.timeline[p] for p in POLICIES)))
    return paths


# --------------------------------------------------------------------------
# plots

def _loss_axes(ax, result: SimResult, tp: int) -> None:
    """Loss vs failed fraction at one TP degree; log x, log-linear y."""
    for p in POLICIES:
        rows = [r for r in result.loss_vs_failures
                if r.policy == p and r.tp == tp and r.failed_fraction > 0]
        x = np.array([r.failed_fraction for r in rows]) * 100
        y = np.array([r.throughput_loss for r in rows]) * 100
        ax.plot(x, y, "-", color=COLORS[p], marker="o", markersize=3, label=LABELS[p])
    if any(r.failed_fraction > 0 for r in result.loss_vs_failures):
        ax.set_xscale("log")
    ax.set_yscale("symlog", linthresh=0.1)
    ax.set_ylim(0, 100)
    ax.set_xlabel("failed GPUs (%)")
    ax.set_ylabel("throughput loss (%)")
    ax.grid(alpha=0.3, which="both")


def _smooth(series: np.ndarray, hours: np.ndarray, points: int = 120):
    k = max(1, series.size // points)
    n = series.size // k * k
    return hours[:n:k], series[:n].reshape(-1, k).mean(axis=1), (hours[1] - hours[0]) * k


def _timeline_axes(ax, result: SimResult) -> None:
    hours = result.timeline_hours
    for p in POLICIES:
        x, y, width = _smooth(result.timeline[p], hours)
        ax.step(x / 24.0, y * 100, where="post", color=COLORS[p],
                label=f"{LABELS[p]} ({result.outcomes[p].goodput * 100:.1f}%)")
    ax.set_xlabel("day")
    ax.set_ylabel(f"goodput, {width:g} h mean (%)")
    ax.grid(alpha=0.3)


def plot_all(result: SimResult, out: Path) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    tps = sorted({r.tp for r in result.loss_vs_failures})

    fig, axes = plt.subplots(1, len(tps), figsize=(4.2 * len(tps), 4), sharey=True,
                             squeeze=False)
    for ax, tp in zip(axes[0], tps):
        _loss_axes(ax, result, tp)
        ax.set_title(f"TP{tp}", fontsize=10)
        if ax is not axes[0][0]:
            ax.set_ylabel("")
    axes[0][0].legend(fontsize=7)
    fig.suptitle(f"Throughput loss vs failed GPUs ({result.layout})", fontsize=10)
    paths.append(out / "loss_vs_failures.png")
    fig.tight_layout()
    fig.savefig(paths[-1], dpi=120)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(7, 4))
    _timeline_axes(ax, result)
    ax.set_title(f"Goodput over {result.config.duration_days:g} days", fontsize=9)
    ax.legend(fontsize=7)
    paths.append(out / "goodput_timeline.png")
    fig.tight_layout()
    fig.savefig(paths[-1], dpi=120)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(5, 3.5))
    need = [result.outcomes[p].spare_domains_needed for p in POLICIES]
    bars = ax.bar([LABELS[p] for p in POLICIES], need, color=[COLORS[p] for p in POLICIES])
    ax.bar_label(bars)
    ax.set_ylabel("spare domains needed")
    ax.set_title("Spares for pause-free training at a fixed minibatch", fontsize=9)
    ax.tick_params(axis="x", labelsize=7)
    paths.append(out / "spares.png")
    fig.tight_layout()
    fig.savefig(paths[-1], dpi=120)
    plt.close(fig)

    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.2))
    main_tp = result.config.cluster.tp
    _loss_axes(a, result, main_tp if main_tp in tps else tps[-1])
    a.set_title(f"(a) Throughput loss vs failed GPUs, TP{main_tp}", fontsize=10)
    a.legend(fontsize=8)
    _timeline_axes(b, result)
    b.set_title(f"(b) Goodput over a {result.config.duration_days:g}-day run", fontsize=10)
    b.legend(fontsize=8)
    fig.suptitle(result.layout, fontsize=10)
    paths.append(out / "summary.png")
    fig.tight_layout()
    fig.savefig(paths[-1], dpi=120)
    plt.close(fig)
    return paths


def write_all(result: SimResult, out: Path | str) -> list[Path]:
    out = Path(out)
    return write_csvs(result, out) + plot_all(result, out)


# --------------------------------------------------------------------------
# tables

def table_rows(result: SimResult) -> list[list[str]]:
    tp = result.config.cluster.tp
    frac = result.failures.mean_failed_fraction
    fracs = sorted({r.failed_fraction for r in result.loss_vs_failures if r.tp == tp})
    near = min(fracs, key=lambda x: abs(x - frac)) if fracs else None
    rows = []
    for p in POLICIES:
        o = result.outcomes[p]
        loss = result.loss(p, tp, near) if near is not None else float("nan")
        rows.append([LABELS[p], f"{loss * 100:.2f}%", f"{(1 - o.mean_capacity) * 100:.2f}%",
                     f"{o.goodput * 100:.2f}%", str(o.interruptions),
                     f"{o.downtime_hours:.1f}", str(o.spare_domains_needed),
                     f"{o.max_power:.2f}"])
    header = ["policy", f"loss @ {near * 100 if near is not None else 0:g}% failed",
              "mean capacity loss", "goodput", "interruptions", "downtime h",
              "spare domains", "max power/TDP"]
    return [header] + rows


def text_table(result: SimResult) -> str:
    rows = table_rows(result)
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def markdown_table(result: SimResult) -> str:
    rows = table_rows(result)
    lines = ["| " + " | ".join(r) + " |" for r in rows]
    lines.insert(1, "|" + "|".join(["---"] * len(rows[0])) + "|")
    return "\n".join(lines)


def summary(result: SimResult) -> str:
    s, f = result.step, result.failures
    head = [
        result.layout,
        f"healthy step {s.step_s:.2f} s (compute {s.compute_s:.2f}, TP comm {s.tp_comm_s:.2f}, "
        f"DP all-reduce {s.dp_comm_s:.2f}), {s.tokens_per_s / 1e6:.2f}M tokens/s, "
        f"MFU {s.mfu * 100:.1f}%",
        f"{result.config.duration_days:g} days: {f.events} failure events "
        f"({f.hardware} hardware, {f.software} software), mean {f.mean_failed_fraction * 100:.3f}% "
        f"of GPUs down (peak {f.peak_failed_fraction * 100:.3f}%)",
    ]
    return "\n".join(head) + "\n\n" + text_table(result)
