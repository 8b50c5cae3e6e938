"""Hydra structured configs: the schemas of `ntp-ds train` and `ntp-ds simulate` are dataclasses registered with
Hydra's ConfigStore, so OmegaConf checks types, unknown keys and missing (`???`) values while Hydra composes.

This module registers them and turns OmegaConf's errors into one line that names the full dotted key, the value
and what would be valid. Checks that cross fields stay with each config (`RunConfig.validate`, `SimConfig.validate`).
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

_NO_VALUE = object()
_KINDS = {"Integer": "an integer", "Float": "a number", "Boolean": "true or false", "String": "a string"}


class SchemaError(ValueError):
    """A value the schema refuses; `key` is the full dotted key (e.g. `parallel.degrees[1]`)."""

    def __init__(self, key: str, value: Any, reason: str):
        self.key, self.value, self.reason = key, value, reason
        self.has_value = value is not _NO_VALUE
        shown = key if value is _NO_VALUE else f"{key}={_show(value)}"
        super().__init__(f"{shown} {reason}")


def register(name: str, node: type, group: str | None = None) -> None:
    """Store dataclass `node` as config `name` (of `group`), for a defaults list to extend."""
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(name=name, node=node, group=group)


def build(schema: type, data: Any, prefix: str = "") -> Any:
    """Instantiate dataclass `schema` from a plain mapping (or a composed config), checked by OmegaConf."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    try:
        return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(schema), data))
    except OmegaConfBaseException as e:
        raise schema_error(e, prefix) from None


def to_plain(cfg) -> dict:
    """The composed config as plain containers, interpolations resolved; a `???` left anywhere is an error."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    try:
        return OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True)
    except OmegaConfBaseException as e:
        raise schema_error(e) from None


def find_schema_error(exc: BaseException, prefix: str = "") -> SchemaError | None:
    """The OmegaConf error behind `exc` (Hydra wraps them in its composition errors) as a SchemaError, if any."""
    from omegaconf.errors import OmegaConfBaseException

    seen = exc
    while seen is not None:
        if isinstance(seen, SchemaError):
            return seen
        if isinstance(seen, OmegaConfBaseException) and getattr(seen, "full_key", None):
            return schema_error(seen, prefix)
        seen = seen.__cause__ or seen.__context__
    return None


def schema_error(exc, prefix: str = "") -> SchemaError:
    """Translate one OmegaConf error; `prefix` is put before its key (e.g. `sim.` for a nested build)."""
    from omegaconf.errors import ConfigAttributeError, ConfigKeyError, MissingMandatoryValue

    key = prefix + str(getattr(exc, "full_key", "") or getattr(exc, "key", "") or "")
    first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
    if isinstance(exc, MissingMandatoryValue):
        return SchemaError(key, _NO_VALUE, f"is missing (???): give it a value, e.g. {key}=VALUE")
    if isinstance(exc, (ConfigKeyError, ConfigAttributeError)):
        known = _field_names(getattr(exc, "object_type", None))
        return SchemaError(key, _NO_VALUE, "is not a known setting" + (f"; valid: {', '.join(known)}" if known else ""))
    value = getattr(exc, "value", _NO_VALUE)
    kind = re.search(r"could not be converted to (\w+)", first)
    if kind:
        return SchemaError(key, value, f"must be {_KINDS.get(kind.group(1), kind.group(1))}")
    if "cannot be assigned None" in first or "is not Optional" in first:
        return SchemaError(key, None, "is not allowed: the field is not optional")
    if "is not a valid bool" in first:
        return SchemaError(key, value, "must be true or false")
    if "is not a ListConfig" in first:
        return SchemaError(key, value, "must be a list")
    if "is not a subclass of" in first or "is not a DictConfig" in first or "Cannot assign" in first:
        return SchemaError(key, value, "must be a mapping")
    return SchemaError(key, value, f"is refused: {first}")


def recipe_note(error: SchemaError | None, recipe: str | None, recipe_argv: list[str], argv: list[str]) -> str:
    """` (in recipe NAME)` when the key the schema refused was set by the recipe and not on the command line."""
    if error is None or recipe is None:
        return ""
    key = re.sub(r"\[\d+\]", "", error.key)
    given = {a.split("=", 1)[0].lstrip("+~") for a in argv}
    from_recipe = {a.split("=", 1)[0] for a in recipe_argv}
    return f" (in recipe {recipe})" if key in from_recipe and key not in given else ""


def _field_names(object_type) -> list[str]:
    if isinstance(object_type, type) and dataclasses.is_dataclass(object_type):
        return sorted(f.name for f in dataclasses.fields(object_type))
    return []


def _show(value) -> str:
    return "null" if value is None else repr(value)
