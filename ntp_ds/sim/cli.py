"""``ntp-ds simulate [overrides] out=DIR``: run the goodput simulator.

Overrides use Hydra syntax (``sim.cluster.tp=16``) and are composed with the
primary config ``conf/simulate.yaml``.  ``recipe=NAME`` merges
``recipes/sim/NAME.yaml`` over the ``sim`` defaults before the command-line
overrides, which win.  Bad input prints one line on stderr and returns 2.
"""
from __future__ import annotations

import sys

from ntp_ds.overrides import UsageError

from .runspec import _message, _simulate, available_recipes, load_run

USAGE = """\
usage: ntp-ds simulate [-m] [KEY=VALUE ...] [recipe=NAME] [out=DIR] [seed=N] [seeds=N]
                       [workers=N] [calibrate=RUN_DIR|TABLE]

Cluster-scale goodput simulator: throughput loss of DP-DROP, NTP, NTP with
power boost and checkpoint-restart, spare domains needed, goodput over a run.

  recipe=NAME      merge recipes/sim/NAME.yaml over the defaults ({recipes})
  out=DIR          output directory (default: {out})
  seed=N           first random seed (default: 0)
  seeds=N          run N seeds; report medians and 5th-95th percentiles
  workers=N        worker processes for seeds (default 0: one per core)
  calibrate=PATH   measured step times and pauses from a training run
                   directory (metrics.jsonl, events.jsonl) or a table file
  -m, --multirun   sweep comma-separated values, e.g.
                   -m sim.failures.gpu_mtbf_hours=25000,50000 sim.cluster.tp=8,16
                   writes DIR/<job>/ per combination, DIR/multirun.csv and,
                   when TP and MTBF are swept, DIR/best_tp.png
  sim.GROUP.KEY=V  any simulator field, e.g.
                   sim.cluster.num_gpus=32768 sim.cluster.domain_size=32
                   sim.cluster.tp=32 sim.failures.gpu_mtbf_hours=50000
                   sim.ntp.min_tp=28 sim.boost.cap=0.3 sim.duration_days=15
                   groups: {groups}

Writes DIR/loss_vs_failures.csv, spares.csv, goodput.csv, timeline.csv,
levels.csv and loss_vs_failures.png, goodput_timeline.png, spares.png,
summary.png (and calibration.yaml with calibrate=).
"""

_PROG = "ntp-ds simulate"


def _fail(msg: str) -> int:
    print(f"{_PROG}: error: {msg}", file=sys.stderr)
    return 2


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if any(a in ("-h", "--help", "help") for a in argv):
        groups = "cluster model hardware failures ntp boost checkpoint spares sweep"
        print(USAGE.format(recipes=", ".join(available_recipes()) or "none",
                           out="outputs/sim", groups=groups))
        return 0
    from .config import ConfigError

    multirun = any(a in ("-m", "--multirun") for a in argv)
    argv = [a for a in argv if a not in ("-m", "--multirun")]
    if multirun:
        from .multirun import run_multirun

        try:
            return run_multirun(argv)
        except (UsageError, ConfigError) as exc:
            return _fail(_message(exc))
    try:
        spec = load_run(argv)
    except (UsageError, ConfigError) as exc:
        return _fail(str(exc))
    try:
        _simulate(spec, spec.out)
    except ConfigError as exc:
        return _fail(_message(exc))
    except OSError as exc:
        return _fail(f"out={str(spec.out)!r}: {exc.strerror or exc}")
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
