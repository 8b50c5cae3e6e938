"""CSV files, PNG plots and text tables for a simulation over one or many seeds.

Every figure is the median over seeds; every CSV figure has ``_p5`` and ``_p95`` columns next
to it and every plot a 5th-95th percentile band (empty with one seed).
"""
from __future__ import annotations

import csv
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from .engine import SimResult  # noqa: E402
from .ensemble import BAND, FAILURE_FIELDS, OUTCOME_FIELDS, Ensemble  # noqa: E402
from .policies import POLICIES  # noqa: E402

LABELS = {"dp_drop": "DP-DROP", "ntp": "NTP", "ntp_pw": "NTP-PW",
          "ckpt_restart": "Checkpoint-restart"}
COLORS = {"dp_drop": "tab:red", "ntp": "tab:blue", "ntp_pw": "tab:green",
          "ckpt_restart": "tab:gray"}
GOODPUT_FIELDS = ("policy", "goodput", "mean_capacity", "interruptions", "downtime_hours",
                  "lost_work_hours", "spare_domains_needed", "mean_extra_power", "max_power")


def as_ensemble(result: SimResult | Ensemble) -> Ensemble:
    return result if isinstance(result, Ensemble) else Ensemble([result], result.wall_seconds)


def _fmt(x) -> str:
    if isinstance(x, (float, np.floating)):
        return f"{float(x):.6g}"
    return str(x)


def _write(path: Path, header, rows) -> None:
    with path.open("w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(header)
        for row in rows:
            w.writerow([_fmt(v) for v in row])


def write_csvs(result: SimResult | Ensemble, out: Path) -> list[Path]:
    ens = as_ensemble(result)
    out.mkdir(parents=True, exist_ok=True)
    names = ("loss_vs_failures.csv", "spares.csv", "goodput.csv", "timeline.csv", "levels.csv")
    paths = [out / n for n in names]
    _write(paths[0], ("policy", "tp", "failed_fraction", "throughput_loss",
                      "throughput_loss_p5", "throughput_loss_p95"), ens.loss_rows())
    _write(paths[1], ("policy", "spare_domains_needed", "seed_quantile", "per_seed_median",
                      "per_seed_p5", "per_seed_p95"),
           ((p, ens.spares_needed(p), ens.config.spares.seed_quantile,
             *ens.outcome(p, "spare_domains_needed")) for p in POLICIES))
    extra = [f for f in OUTCOME_FIELDS if f not in GOODPUT_FIELDS]
    header = list(GOODPUT_FIELDS) + extra + [f"{f}_{q}" for f in GOODPUT_FIELDS[1:] + tuple(extra)
                                             for q in ("p5", "p95")] + ["seeds"]
    rows = []
    for p in POLICIES:
        med = ens.median_outcome(p)
        row = [p] + [getattr(med, f) for f in GOODPUT_FIELDS[1:]] + [getattr(med, f) for f in extra]
        for f in GOODPUT_FIELDS[1:] + tuple(extra):
            _, lo, hi = ens.outcome(p, f)
            row += [lo, hi]
        rows.append(row + [len(ens.results)])
    _write(paths[2], header, rows)
    hours = ens.first.timeline_hours[:-1]
    cols, series = [], []
    for p in POLICIES:
        med, lo, hi = ens.timeline(p)
        series += [med]
        cols += [(f"{p}_p5", lo), (f"{p}_p95", hi)]
    _write(paths[3], ("hour",) + POLICIES + tuple(c for c, _ in cols),
           zip(hours, *series, *(v for _, v in cols)))
    _write(paths[4], ("degree", "batch_share", "step_time", "kept"), ens.first.levels)
    return paths


# --------------------------------------------------------------------------
# plots

def _loss_axes(ax, ens: Ensemble, tp: int) -> None:
    """Loss vs failed fraction at one TP degree; log x, log-linear y, 5-95% band."""
    rows = ens.loss_rows()
    for p in POLICIES:
        sel = [r for r in rows if r[0] == p and r[1] == tp and r[2] > 0]
        x = np.array([r[2] for r in sel]) * 100
        med, lo, hi = (np.array([r[i] for r in sel]) * 100 for i in (3, 4, 5))
        ax.plot(x, med, "-", color=COLORS[p], marker="o", markersize=3, label=LABELS[p])
        ax.fill_between(x, lo, hi, color=COLORS[p], alpha=0.2, linewidth=0)
    if any(r[2] > 0 for r in rows):
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


def _timeline_axes(ax, ens: Ensemble) -> None:
    hours = ens.first.timeline_hours
    for p in POLICIES:
        # the band of the smoothed series: smooth each seed, then take percentiles
        smooth = [_smooth(r.timeline[p], hours) for r in ens.results]
        x, width = smooth[0][0], smooth[0][2]
        stack = np.stack([sm[1] for sm in smooth])
        y = np.median(stack, axis=0)
        ylo, yhi = np.percentile(stack, BAND, axis=0)
        g = ens.outcome(p, "goodput")
        label = f"{LABELS[p]} ({g[0] * 100:.1f}%"
        label += f", {g[1] * 100:.1f}-{g[2] * 100:.1f})" if len(ens.results) > 1 else ")"
        ax.step(x / 24.0, y * 100, where="post", color=COLORS[p], label=label)
        ax.fill_between(x / 24.0, ylo * 100, yhi * 100, step="post", color=COLORS[p],
                        alpha=0.15, linewidth=0)
    ax.set_xlabel("day")
    ax.set_ylabel(f"goodput, {width:g} h mean (%)")
    ax.set_ylim(top=101)
    ax.grid(alpha=0.3)


def _title(ens: Ensemble) -> str:
    n = len(ens.results)
    return ens.first.layout + (f"; median and 5-95% band over {n} seeds" if n > 1 else "")


def plot_all(result: SimResult | Ensemble, out: Path) -> list[Path]:
    ens = as_ensemble(result)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    tps = sorted({r.tp for r in ens.first.loss_vs_failures})

    fig, axes = plt.subplots(1, len(tps), figsize=(4.2 * len(tps), 4), sharey=True,
                             squeeze=False)
    for ax, tp in zip(axes[0], tps):
        _loss_axes(ax, ens, tp)
        ax.set_title(f"TP{tp}", fontsize=10)
        if ax is not axes[0][0]:
            ax.set_ylabel("")
    axes[0][0].legend(fontsize=7)
    fig.suptitle(f"Throughput loss vs failed GPUs ({_title(ens)})", fontsize=9)
    paths.append(out / "loss_vs_failures.png")
    fig.tight_layout()
    fig.savefig(paths[-1], dpi=120)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(7, 4))
    _timeline_axes(ax, ens)
    ax.set_title(f"Goodput over {ens.config.duration_days:g} days ({_title(ens)})", fontsize=8)
    ax.legend(fontsize=7)
    paths.append(out / "goodput_timeline.png")
    fig.tight_layout()
    fig.savefig(paths[-1], dpi=120)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(5, 3.5))
    need = [ens.spares_needed(p) for p in POLICIES]
    med = np.array([ens.outcome(p, "spare_domains_needed") for p in POLICIES])
    bars = ax.bar([LABELS[p] for p in POLICIES], need, color=[COLORS[p] for p in POLICIES])
    ax.bar_label(bars)
    if len(ens.results) > 1:
        ax.errorbar(np.arange(len(POLICIES)), med[:, 0],
                    yerr=[med[:, 0] - med[:, 1], med[:, 2] - med[:, 0]], fmt="k.", capsize=3,
                    label="per-seed median, 5-95%")
        ax.legend(fontsize=7)
    ax.set_ylabel("spare domains needed")
    q = ens.config.spares.seed_quantile
    ax.set_title("Spares for pause-free training at a fixed minibatch"
                 + (f"\n(q{q:g} over {len(ens.results)} seeds)" if len(ens.results) > 1 else ""),
                 fontsize=9)
    ax.tick_params(axis="x", labelsize=7)
    paths.append(out / "spares.png")
    fig.tight_layout()
    fig.savefig(paths[-1], dpi=120)
    plt.close(fig)

    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.2))
    main_tp = ens.config.cluster.tp
    _loss_axes(a, ens, main_tp if main_tp in tps else tps[-1])
    a.set_title(f"(a) Throughput loss vs failed GPUs, TP{main_tp}", fontsize=10)
    a.legend(fontsize=8)
    _timeline_axes(b, ens)
    b.set_title(f"(b) Goodput over a {ens.config.duration_days:g}-day run", fontsize=10)
    b.legend(fontsize=8)
    fig.suptitle(_title(ens), fontsize=10)
    paths.append(out / "summary.png")
    fig.tight_layout()
    fig.savefig(paths[-1], dpi=120)
    plt.close(fig)
    return paths


def write_all(result: SimResult | Ensemble, out: Path | str) -> list[Path]:
    out = Path(out)
    ens = as_ensemble(result)
    paths = write_csvs(ens, out) + plot_all(ens, out)
    if ens.first.calibration is not None:
        import yaml

        paths.append(out / "calibration.yaml")
        paths[-1].write_text(yaml.safe_dump(ens.first.calibration, sort_keys=False))
    return paths


# --------------------------------------------------------------------------
# tables

def _pct(b: tuple[float, float, float], seeds: int, digits: int = 2) -> str:
    s = f"{b[0] * 100:.{digits}f}%"
    return s if seeds == 1 else s + f" [{b[1] * 100:.{digits}f}, {b[2] * 100:.{digits}f}]"


def _num(b: tuple[float, float, float], seeds: int, fmt: str = ".0f") -> str:
    s = f"{b[0]:{fmt}}"
    return s if seeds == 1 else s + f" [{b[1]:{fmt}}, {b[2]:{fmt}}]"


def table_rows(result: SimResult | Ensemble) -> list[list[str]]:
    ens = as_ensemble(result)
    n = len(ens.results)
    tp = ens.config.cluster.tp
    frac = ens.failure("mean_failed_fraction")[0]
    fracs = sorted({r.failed_fraction for r in ens.first.loss_vs_failures if r.tp == tp})
    near = min(fracs, key=lambda x: abs(x - frac)) if fracs else None
    rows = []
    for p in POLICIES:
        loss = ens.loss(p, tp, near) if near is not None else (float("nan"),) * 3
        cap = ens.outcome(p, "mean_capacity")
        rows.append([LABELS[p], _pct(loss, n), _pct((1 - cap[0], 1 - cap[2], 1 - cap[1]), n),
                     _pct(ens.outcome(p, "goodput"), n), _num(ens.outcome(p, "interruptions"), n),
                     _num(ens.outcome(p, "downtime_hours"), n, ".1f"),
                     str(ens.spares_needed(p)), f"{ens.outcome(p, 'max_power')[0]:.2f}"])
    spare_head = "spare domains" + (f" (q{ens.config.spares.seed_quantile:g})" if n > 1 else "")
    header = ["policy", f"loss @ {near * 100 if near is not None else 0:g}% failed",
              "mean capacity loss", "goodput", "interruptions", "downtime h",
              spare_head, "max power/TDP"]
    return [header] + rows


def text_table(result: SimResult | Ensemble) -> str:
    rows = table_rows(result)
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def markdown_table(result: SimResult | Ensemble) -> str:
    rows = table_rows(result)
    lines = ["| " + " | ".join(r) + " |" for r in rows]
    lines.insert(1, "|" + "|".join(["---"] * len(rows[0])) + "|")
    return "\n".join(lines)


def summary(result: SimResult | Ensemble) -> str:
    ens = as_ensemble(result)
    first, n = ens.first, len(ens.results)
    s = first.step
    ev = ens.failure("events")
    down = ens.failure("mean_failed_fraction")
    peak = ens.failure("peak_failed_fraction")
    seeds = f" (median of {n} seeds, [5th, 95th] percentiles)" if n > 1 else ""
    head = [
        first.layout + seeds,
        f"healthy step {s.step_s:.2f} s (compute {s.compute_s:.2f}, TP comm {s.tp_comm_s:.2f}, "
        f"DP all-reduce {s.dp_comm_s:.2f}), {s.tokens_per_s / 1e6:.2f}M tokens/s, "
        f"MFU {s.mfu * 100:.1f}%",
        f"{ens.config.duration_days:g} days: {_num(ev, n)} failure events, mean "
        f"{_pct(down, n, 3)} of GPUs down (peak {_pct(peak, n, 3)})",
    ]
    extras = {k: ens.failure(k)[0] for k in FAILURE_FIELDS}
    more = [f"{int(round(extras[k]))} {label}" for k, label in
            (("power", "racks lost to power-domain failures"), ("spare_swaps", "spare swaps"),
             ("hot_swaps", "hot-spare swaps"), ("idle_spare_failures", "idle spares failed"))
            if extras[k] > 0]
    if extras["repair_wait_hours"] > 0:
        more.append(f"{extras['repair_wait_hours']:.0f} h of repairs waiting for a slot")
    if more:
        head.append(", ".join(more))
    if first.calibration is not None:
        c = first.calibration
        head.append(f"calibrated from {c['source']}: step-time ratios "
                    + ", ".join(f"TP{d} {v / c['step_seconds'][c['healthy_tp']]:.3f}"
                                for d, v in c["step_seconds"].items())
                    + (f", recovery {c['recovery_seconds']:.2f} s"
                       if c["recovery_seconds"] is not None else ""))
    notes = "\n".join(first.notes)
    return "\n".join(head) + "\n\n" + text_table(ens) + ("\n\n" + notes if notes else "")
