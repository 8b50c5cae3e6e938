"""Simulator runs from recipes and overrides: the config tree, its Hydra-style parsing and checks, and running one
spec (what `ntp-ds simulate` and its multirun share, and what the training recipes reuse)."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ntp_ds.overrides import UsageError, config_dir, flatten, parse, read_recipe, recipes_dir


def available_recipes() -> list[str]:
    d = recipes_dir() / "sim"
    return sorted(p.stem for p in d.glob("*.yaml")) if d.is_dir() else []


def _recipe_overrides(name: str) -> list[str]:
    return flatten(read_recipe(recipes_dir() / "sim", name), "sim.")


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

    overrides = parse(argv)
    _check_overrides(overrides)
    recipe = next((o.value() for o in overrides if o.key_or_group == "recipe"), None)
    extra: list[str] = []
    if recipe is not None:
        extra = _recipe_overrides(str(recipe))
        _check_overrides(parse(extra), f" in recipe {recipe}")
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


def _message(exc) -> str:
    from .config import ConfigError

    if not isinstance(exc, ConfigError):
        return str(exc)
    top = ("seed", "seeds", "workers", "calibrate")
    name = exc.field if exc.field in top or exc.field.startswith("sim.") else "sim." + exc.field
    return f"{name}={exc.value!r}: {exc.reason}"
