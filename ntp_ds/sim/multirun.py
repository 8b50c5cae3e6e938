"""``ntp-ds simulate -m KEY=A,B ...``: one simulation per combination of swept values.

The overrides follow Hydra's sweep grammar (``a,b,c``, ``range(...)``, ``choice(...)``) and are
expanded by Hydra's basic sweeper.  Each job writes its usual files under ``out/<job>/``; the sweep
writes ``out/multirun.csv`` (one row per job: the swept values, each policy's goodput median and
5th-95th percentiles, its effective tokens/s and spare need) and, when both ``sim.cluster.tp`` and
``sim.failures.gpu_mtbf_hours`` are swept, ``out/best_tp.png``: the TP degree with the most
effective tokens/s at each failure rate, per policy.  A combination the simulator cannot run
(TP that does not divide the domain, ...) is skipped with one line naming the field.
"""
from __future__ import annotations

import csv
import re
import sys
from pathlib import Path

import numpy as np

from .policies import POLICIES

TP_KEY = "sim.cluster.tp"
MTBF_KEY = "sim.failures.gpu_mtbf_hours"


def _job_name(i: int, swept: list[str]) -> str:
    short = ",".join(s.split(".")[-1] for s in swept)
    return f"{i:03d}_" + re.sub(r"[^A-Za-z0-9_.,=-]", "_", short)


def run_multirun(argv: list[str]) -> int:
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper

    from ntp_ds.overrides import UsageError, parse
    from .runspec import _message, _simulate, load_run
    from .config import ConfigError

    overrides = parse(argv)
    swept_keys = [o.key_or_group for o in overrides if o.is_sweep_override()]
    if not swept_keys:
        raise UsageError("-m needs at least one swept override, e.g. sim.cluster.tp=8,16")
    if any(k in ("out", "recipe") for k in swept_keys):
        raise UsageError("out and recipe cannot be swept")
    jobs = [job for batch in BasicSweeper.split_arguments(overrides, None) for job in batch]
    specs = []
    for job in jobs:
        swept = [j for j in job if j.split("=", 1)[0] in swept_keys]
        try:
            specs.append((swept, load_run(job), None))
        except ConfigError as exc:
            specs.append((swept, None, _message(exc)))
    if all(spec is None for _, spec, _ in specs):
        raise UsageError(f"no combination can run; first: {specs[0][2]}")
    root = next(spec.out for _, spec, _ in specs if spec is not None)
    root.mkdir(parents=True, exist_ok=True)
    rows = []
    for i, (swept, spec, error) in enumerate(specs):
        values = {s.split("=", 1)[0]: s.split("=", 1)[1] for s in swept}
        if spec is None:
            print(f"ntp-ds simulate: job {i} ({' '.join(swept)}) skipped: {error}", file=sys.stderr)
            rows.append({"job": i, **values, "status": f"skipped: {error}"})
            continue
        out = root / _job_name(i, swept)
        try:
            ens = _simulate(spec, out, quiet=True)
        except ConfigError as exc:
            msg = _message(exc)
            print(f"ntp-ds simulate: job {i} ({' '.join(swept)}) skipped: {msg}", file=sys.stderr)
            rows.append({"job": i, **values, "status": f"skipped: {msg}"})
            continue
        row = {"job": i, **values, "status": "ok", "dir": out.name,
               "healthy_tokens_per_s": ens.first.step.tokens_per_s}
        for p in POLICIES:
            med, lo, hi = ens.outcome(p, "goodput")
            row.update({f"{p}_goodput": med, f"{p}_goodput_p5": lo, f"{p}_goodput_p95": hi,
                        f"{p}_tokens_per_s": med * ens.first.step.tokens_per_s,
                        f"{p}_spares": ens.spares_needed(p)})
        rows.append(row)
        print(f"job {i}: {' '.join(swept)}: " + ", ".join(
            f"{p} {row[p + '_goodput'] * 100:.2f}%" for p in POLICIES))
    header = ["job", *swept_keys, "status", "dir", "healthy_tokens_per_s"]
    header += [f"{p}_{f}" for p in POLICIES
               for f in ("goodput", "goodput_p5", "goodput_p95", "tokens_per_s", "spares")]
    with (root / "multirun.csv").open("w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=header)
        w.writeheader()
        for r in rows:
            w.writerow({k: (f"{v:.6g}" if isinstance(v, float) else v) for k, v in r.items()})
    written = ["multirun.csv"]
    if TP_KEY in swept_keys and MTBF_KEY in swept_keys:
        best = best_tp(rows)
        if best:
            plot_best_tp(best, root / "best_tp.png")
            written.append("best_tp.png")
            for p in POLICIES:
                print(f"best TP for {p}: " + ", ".join(
                    f"MTBF {m:g} h -> TP{t}" for m, t in best[p]))
    print(f"wrote {', '.join(written)} and {sum(r['status'] == 'ok' for r in rows)} job "
          f"directories to {root}")
    return 0


def best_tp(rows: list[dict]) -> dict[str, list[tuple[float, int]]]:
    """Per policy, ``(gpu_mtbf_hours, TP)`` with the most effective tokens/s at each MTBF.

    When other keys are swept as well, each MTBF's best TP is taken over all of them.
    """
    ok = [r for r in rows if r["status"] == "ok"]
    out: dict[str, list[tuple[float, int]]] = {}
    for p in POLICIES:
        by_mtbf: dict[float, tuple[float, int]] = {}
        for r in ok:
            m, t, v = float(r[MTBF_KEY]), int(r[TP_KEY]), r[f"{p}_tokens_per_s"]
            if m not in by_mtbf or v > by_mtbf[m][0]:
                by_mtbf[m] = (v, t)
        out[p] = sorted((m, t) for m, (_, t) in by_mtbf.items())
    return out


def plot_best_tp(best: dict[str, list[tuple[float, int]]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from .report import COLORS, LABELS

    fig, ax = plt.subplots(figsize=(6, 3.8))
    for i, p in enumerate(POLICIES):
        m = np.array([x for x, _ in best[p]])
        t = np.array([y for _, y in best[p]])
        ax.plot(1e6 / m, t * (1 + 0.02 * (i - 1.5)), marker="o", color=COLORS[p], label=LABELS[p])
    ax.set_xscale("log")
    ax.set_yscale("log", base=2)
    ax.set_xlabel("failure events per GPU per 10^6 h (1e6 / gpu_mtbf_hours)")
    ax.set_ylabel("best TP degree (most tokens/s)")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7)
    ax.set_title("Best TP degree per failure rate", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
