"""Compose the train config with Hydra: `conf/config.yaml`, then a recipe from `recipes/`, then the command line.

A recipe is a partial config: a string under a group name picks that group's option (`model: llama_1b`), a mapping
sets fields (`parallel: {tp: 4}`). It becomes a list of overrides placed before the user's, so the user's win.
The config and recipe directories are the ones `ntp-ds simulate` uses.
"""

from __future__ import annotations

import os
import re
import sys

from ntp_ds.engine.config import ConfigError
from ntp_ds.envs import LOCAL_RANK
from ntp_ds.overrides import UsageError, config_dir, flatten, hydra_value, parse, read_recipe, recipes_dir
from ntp_ds.run.config import RunConfig
from ntp_ds.schema import find_schema_error, recipe_note, to_plain

PRIMARY = "config"
GROUPS = ("model", "parallel", "data", "optim", "fault", "logging", "launcher")


def available_recipes() -> list[str]:
    return sorted(p.stem for p in recipes_dir().glob("*.yaml"))


def group_options(group: str) -> list[str]:
    return sorted(p.stem for p in (config_dir() / group).glob("*.yaml"))


def strip_launcher_args(argv: list[str]) -> list[str]:
    """Drop the `--local_rank=N` the deepspeed launcher appends, recording it in LOCAL_RANK."""
    out, i = [], 0
    while i < len(argv):
        arg = argv[i]
        if arg in ("--local_rank", "--local-rank") and i + 1 < len(argv):
            os.environ.setdefault(LOCAL_RANK, argv[i + 1])
            i += 2
            continue
        if arg.startswith(("--local_rank=", "--local-rank=")):
            os.environ.setdefault(LOCAL_RANK, arg.split("=", 1)[1])
        else:
            out.append(arg)
        i += 1
    return out


def recipe_overrides(name: str) -> list[str]:
    """Turn recipes/NAME.yaml into Hydra overrides: group options first, then fields."""
    data = read_recipe(recipes_dir(), name, resolve=False)
    choices, values = [], []
    for key, value in data.items():
        if key in GROUPS and isinstance(value, str):
            choices.append(f"{key}={value}")
        elif isinstance(value, dict):
            values += flatten(value, f"{key}.")
        else:
            values.append(f"{key}={hydra_value(value)}")
    return choices + values


def _check_choices(overrides: list, source: str) -> None:
    """Name an unknown group option in one line, with the valid ones (Hydra's own message is a paragraph)."""
    for o in overrides:
        key = o.key_or_group
        if key in GROUPS and not o.is_delete():
            value = o.value()
            if not isinstance(value, str) or value not in group_options(key):
                raise UsageError(f"{key}={value}{source}: no such option (available: "
                                 f"{', '.join(group_options(key))})")


def _one_line(exc: Exception) -> str:
    """Hydra's composition error in one line: the schema's wording when OmegaConf refused a value or key."""
    found = find_schema_error(exc)
    if found is not None:
        return str(found)
    lines = [ln.strip() for ln in str(exc).strip().splitlines() if ln.strip()]
    if not lines:
        return type(exc).__name__
    key = re.match(r"Could not override '([^']+)'", lines[0])
    if key:
        return f"{key.group(1)} is not a known setting (check the spelling; `ntp-ds train --help` lists the groups)"
    return lines[0]


def _quote_store(argv: list[str]) -> list[str]:
    """`launcher.store=etcd://A:1,B:2/JOB` as written: quoted for Hydra, which reads an unquoted comma as a sweep."""
    key = "launcher.store="
    return [f"{key}'{a[len(key):]}'" if a.startswith(key) and "," in a and a[len(key):][:1] not in "'\"" else a
            for a in argv]


def compose_dict(argv: list[str]) -> dict:
    """The composed config as a plain dict (with `hydra.run.dir` resolved into `run_dir` when unset)."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from omegaconf import open_dict

    argv = _quote_store(argv)
    overrides = parse(argv)
    _check_choices(overrides, "")
    extra: list[str] = []
    recipe = next((o.value() for o in overrides if o.key_or_group == "recipe"), None)
    if recipe is not None:
        extra = recipe_overrides(str(recipe))
        _check_choices(parse(extra), f" (in recipe {recipe})")
    cdir = config_dir()
    if not (cdir / f"{PRIMARY}.yaml").is_file():
        raise UsageError(f"config dir {cdir}: {PRIMARY}.yaml not found")
    if GlobalHydra.instance().is_initialized():
        GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(cdir), version_base="1.3"):
            cfg = compose(config_name=PRIMARY, overrides=extra + list(argv), return_hydra_config=True)
            hydra_run_dir = str(cfg.hydra.run.dir)
            with open_dict(cfg):
                del cfg["hydra"]
            data = to_plain(cfg)
    except Exception as e:  # Hydra's composition and interpolation errors, OmegaConf's schema checks
        raise UsageError(_one_line(e) + recipe_note(find_schema_error(e), recipe, extra, argv)) from None
    finally:
        GlobalHydra.instance().clear()
    if not data.get("run_dir"):
        data["run_dir"] = hydra_run_dir
    return data


def load_config(argv: list[str]) -> RunConfig:
    """Compose and build the RunConfig; validation is left to the caller, which knows the world size."""
    return RunConfig.from_dict(compose_dict(argv))


def fail(prog: str, exc: Exception) -> int:
    """Print a one-line error for bad input and return the usage exit code."""
    print(f"{prog}: error: {exc}", file=sys.stderr)
    return 2


BAD_INPUT = (UsageError, ConfigError)
