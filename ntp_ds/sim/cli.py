"""``ntp-ds simulate [overrides] out=DIR``: run the goodput simulator.

Overrides use Hydra syntax (``sim.cluster.tp=16``) and are composed with the
primary config ``conf/simulate.yaml``.  ``recipe=NAME`` merges
``recipes/sim/NAME.yaml`` over the ``sim`` defaults before the command-line
overrides, which win.  Bad input prints one line on stderr and returns 2.
"""
from __future__ import annotations

import math
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

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
_NAME = re.compile(r"^[A-Za-z0-9_.-]+$")


class UsageError(Exception):
    """Bad command-line input; the message is one line."""


def config_dir() -> Path:
    """The Hydra config dir: the repo's ``conf/``, else one shipped in the package."""
    here = Path(__file__).resolve()
    for cand in (here.parents[2] / "conf", here.parents[1] / "conf"):
        if (cand / "simulate.yaml").is_file():
            return cand
    return here.parents[2] / "conf"


def recipes_dir() -> Path:
    """Directory holding ``sim/NAME.yaml`` recipes (repo root, else package)."""
    here = Path(__file__).resolve()
    for cand in (here.parents[2] / "recipes", here.parents[1] / "recipes"):
        if (cand / "sim").is_dir():
            return cand
    return here.parents[2] / "recipes"


def available_recipes() -> list[str]:
    d = recipes_dir() / "sim"
    return sorted(p.stem for p in d.glob("*.yaml")) if d.is_dir() else []


# --------------------------------------------------------------------------
# overrides

def _hydra_value(v: Any) -> str:
    """Render a YAML value in Hydra's override grammar."""
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        if math.isnan(v):
            return "nan"
        if math.isinf(v):
            return "inf" if v > 0 else "-inf"
        return repr(v)
    if isinstance(v, str):
        # Hydra's quoted strings: backslashes are literal unless they precede
        # a quote (or the closing quote), where they are doubled
        body = re.sub(r"\\+(?='|$)", lambda m: m.group(0) * 2, v).replace("'", "\\'")
        return "'" + body + "'"
    if isinstance(v, (list, tuple)):
        return "[" + ",".join(_hydra_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ",".join(f"{k}:{_hydra_value(x)}" for k, x in v.items()) + "}"
    raise UsageError(f"unsupported value {v!r}")


def _flatten(data: dict, prefix: str) -> list[str]:
    out: list[str] = []
    for k, v in data.items():
        if isinstance(v, dict) and v:
            out += _flatten(v, f"{prefix}{k}.")
        else:
            out.append(f"{prefix}{k}={_hydra_value(v)}")
    return out


def _parse(argv: list[str]) -> list:
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parser = OverridesParser.create()
    parsed = []
    for tok in argv:
        if "=" not in tok or tok.startswith("="):
            raise UsageError(f"malformed override {tok!r}: expected KEY=VALUE")
        try:
            parsed.append(parser.parse_override(tok))
        except Exception as exc:  # hydra's OverrideParseException and friends
            msg = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise UsageError(f"malformed override {tok!r}: {msg}") from None
    return parsed


def read_recipe(folder: Path, name: str, resolve: bool = True) -> dict:
    """Read recipe `name` from `folder` as a plain mapping; a bad name, file or content is a UsageError."""
    from omegaconf import OmegaConf

    if not _NAME.match(name):
        raise UsageError(f"recipe={name!r}: not a recipe name")
    path = folder / f"{name}.yaml"
    if not path.is_file():
        known = ", ".join(sorted(p.stem for p in folder.glob("*.yaml"))) or "none"
        raise UsageError(f"recipe={name!r}: no such recipe (available: {known})")
    try:
        data = OmegaConf.to_container(OmegaConf.load(path), resolve=resolve)
    except Exception as exc:
        raise UsageError(f"recipe={name!r}: cannot read {path.name}: {str(exc).splitlines()[0]}") from None
    if not isinstance(data, dict):
        raise UsageError(f"recipe={name!r}: {path.name} is not a mapping")
    return data


def _recipe_overrides(name: str) -> list[str]:
    return _flatten(read_recipe(recipes_dir() / "sim", name), "sim.")


def _check_overrides(overrides: list, source: str = "") -> None:
    """Refuse what the schema cannot: adding or deleting keys, sweeps without -m, ``sim.seed`` (it is ``seed``)."""
    for o in overrides:
        if o.is_add() or o.is_delete() or o.is_force_add():
            raise UsageError(f"{o.input_line!r}: adding or deleting keys is not supported")
        if o.key_or_group == "sim.seed":
            raise UsageError(f"sim.seed{source}: set the first seed with seed=N")
        if o.is_sweep_override():
            raise UsageError(f"{o.input_line}: a sweep needs -m (ntp-ds simulate -m ...)")


@dataclass
class RunSpec:
    """One simulation as the command line asks for it."""

    config: Any
    out: Path
    seeds: int = 1
    workers: int = 0
    calibrate: str | None = None


def load_config(argv: list[str]):
    """Compose ``conf/simulate.yaml`` with a recipe and overrides.

    Returns ``(SimConfig, out_dir)``; raises :class:`UsageError` or
    ``ConfigError`` on bad input.
    """
    spec = load_run(argv)
    return spec.config, spec.out


def load_run(argv: list[str]) -> RunSpec:
    """Compose the config like :func:`load_config` and read ``seeds``, ``workers``, ``calibrate``."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from ntp_ds.schema import build, find_schema_error, recipe_note, to_plain

    from .config import ConfigError, SimulateConfig

    overrides = _parse(argv)
    _check_overrides(overrides)
    recipe = next((o.value() for o in overrides if o.key_or_group == "recipe"), None)
    extra: list[str] = []
    if recipe is not None:
        extra = _recipe_overrides(str(recipe))
        _check_overrides(_parse(extra), f" in recipe {recipe}")
    cdir = config_dir()
    if not (cdir / "simulate.yaml").is_file():
        raise UsageError(f"config dir {cdir}: simulate.yaml not found")
    if GlobalHydra.instance().is_initialized():
        GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(cdir), version_base="1.3"):
            spec = build(SimulateConfig, to_plain(compose(config_name="simulate", overrides=extra + list(argv))))
    except Exception as exc:  # Hydra's composition errors, OmegaConf's schema checks
        found = find_schema_error(exc)
        msg = str(found) if found else (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise UsageError(msg + recipe_note(found, None if recipe is None else str(recipe), extra, argv)) from None
    finally:
        GlobalHydra.instance().clear()
    sim_cfg = spec.sim
    sim_cfg.seed = spec.seed
    try:
        sim_cfg.validate()
    except ConfigError as exc:
        name = exc.field if exc.field == "seed" else "sim." + exc.field
        raise ConfigError(name, exc.value, exc.reason) from None
    for name, low in (("seeds", 1), ("workers", 0)):
        if getattr(spec, name) < low:
            raise ConfigError(name, getattr(spec, name), f"expected an integer >= {low}")
    return RunSpec(sim_cfg, Path(spec.out or "outputs/sim"), spec.seeds, spec.workers, spec.calibrate)


def _fail(msg: str) -> int:
    print(f"{_PROG}: error: {msg}", file=sys.stderr)
    return 2


def _simulate(spec: RunSpec, out: Path, quiet: bool = False):
    """Run one spec and write its files; returns the ensemble."""
    from . import report
    from .calibration import load as load_calibration
    from .ensemble import run_seeds

    cal = load_calibration(spec.calibrate) if spec.calibrate else None
    ens = run_seeds(spec.config, spec.seeds, spec.workers, cal)
    paths = report.write_all(ens, out)
    if not quiet:
        print(report.summary(ens))
        print(f"\nwrote {len(paths)} files to {out} in {ens.wall_seconds:.2f} s of simulation"
              + (f" ({spec.seeds} seeds)" if spec.seeds > 1 else ""))
    return ens


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


def _message(exc) -> str:
    from .config import ConfigError

    if not isinstance(exc, ConfigError):
        return str(exc)
    top = ("seed", "seeds", "workers", "calibrate")
    name = exc.field if exc.field in top or exc.field.startswith("sim.") else "sim." + exc.field
    return f"{name}={exc.value!r}: {exc.reason}"


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
