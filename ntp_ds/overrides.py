"""Hydra recipes and command-line overrides, shared by `ntp-ds train` (`ntp_ds.run.compose`) and `ntp-ds simulate`
(`ntp_ds.sim.runspec`): where the config and recipe folders are, reading a recipe, rendering values in Hydra's
override grammar and parsing overrides, each bad input one line (`UsageError`)."""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

_NAME = re.compile(r"^[A-Za-z0-9_.-]+$")


class UsageError(Exception):
    """Bad command-line input; the message is one line."""


def repo_or_package(folder: str, holds) -> Path:
    """The repo's `folder` if `holds(it)`, else the package's if it does, else the repo's."""
    here = Path(__file__).resolve()
    for cand in (here.parents[1] / folder, here.parent / folder):
        if holds(cand):
            return cand
    return here.parents[1] / folder


def config_dir() -> Path:
    """The Hydra config dir: the repo's ``conf/``, else one shipped in the package."""
    return repo_or_package("conf", lambda d: (d / "simulate.yaml").is_file())


def recipes_dir() -> Path:
    """Directory holding ``sim/NAME.yaml`` recipes (repo root, else package)."""
    return repo_or_package("recipes", lambda d: (d / "sim").is_dir())


# --------------------------------------------------------------------------
# overrides

def hydra_value(v: Any) -> str:
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
        return "[" + ",".join(hydra_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ",".join(f"{k}:{hydra_value(x)}" for k, x in v.items()) + "}"
    raise UsageError(f"unsupported value {v!r}")


def flatten(data: dict, prefix: str) -> list[str]:
    out: list[str] = []
    for k, v in data.items():
        if isinstance(v, dict) and v:
            out += flatten(v, f"{prefix}{k}.")
        else:
            out.append(f"{prefix}{k}={hydra_value(v)}")
    return out


def parse(argv: list[str]) -> list:
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
