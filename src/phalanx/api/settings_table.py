"""The settings field table: how a settings field is declared and how flags, environment variables and the
ElasticJob spec map onto it.

A field is declared with :func:`setting`, which records a one-line doc and the unit; that metadata is the
single source for ``--help`` texts (:func:`describe`), the environment variable names (:func:`env_names`,
:func:`from_env`) and the CRD field descriptions. :func:`from_mapping` builds a settings group from raw
values (flags, variables, spec fields), converting each to the field's declared type. The groups themselves
are in :mod:`phalanx.api.settings_groups` and :mod:`phalanx.api.settings`.

Environment variables are ``PHALANX_<GROUP>_<FIELD>`` in upper case, for example
``PHALANX_HEARTBEAT_TIMEOUT_S=5`` for ``MasterSettings.heartbeat.timeout_s``.
"""

from __future__ import annotations

import dataclasses
import math
import re
import types
import typing
from collections.abc import Mapping
from dataclasses import field
from typing import Any, TypeVar

from phalanx.api.errors import ConfigError

T = TypeVar("T")

ENV_PREFIX = "PHALANX_"


def setting(default: Any, *, doc: str, unit: str = "") -> Any:
    """Declares a settings field with its default, a one-line doc and its unit."""
    return field(default=default, metadata={"doc": doc, "unit": unit})


def group(factory: Any, *, doc: str) -> Any:
    """Declares a nested settings group."""
    return field(default_factory=factory, metadata={"doc": doc, "unit": ""})


# ------------------------------------------------------------------------------------------------------
# Parsers for the textual forms used by flags, environment variables and the CRD.

_DURATION = re.compile(r"^\s*((?:\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?)\s*(ms|s|m|h)?\s*$")
_DURATION_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, None: 1.0}
# Go's compound form, which the CRD admits too: "1h30m", "2m0.5s".
_COMPOUND_DURATION = re.compile(r"^(?:[0-9]+(?:[.][0-9]+)?(?:ms|s|m|h))+$")
_DURATION_PART = re.compile(r"([0-9]+(?:[.][0-9]+)?)(ms|s|m|h)")


def parse_duration(text: str | float | int, *, name: str = "duration") -> float:
    """Parses ``"500ms"``, ``"30s"``, ``"2m"``, ``"1h"``, Go's compound form (``"1h30m"``) or a plain number
    of seconds."""
    if isinstance(text, bool):
        raise ConfigError(f"expected a duration such as 30s, got {text!r}", field=name)
    if isinstance(text, int | float):
        seconds = float(text)
    else:
        match = _DURATION.match(text)
        if match:
            seconds = float(match.group(1)) * _DURATION_UNITS[match.group(2)]
        elif _COMPOUND_DURATION.match(text.strip()):
            parts = _DURATION_PART.findall(text)
            seconds = sum(float(n) * _DURATION_UNITS[unit] for n, unit in parts)
        else:
            raise ConfigError(f"expected a duration such as 500ms, 30s, 2m or 1h, got {text!r}", field=name)
    if not math.isfinite(seconds):
        raise ConfigError(f"a duration must be a finite number of seconds, got {text!r}", field=name)
    if seconds < 0:
        raise ConfigError(f"a duration cannot be negative, got {text!r}", field=name)
    return seconds


def parse_node_range(text: str, *, name: str = "nnodes") -> tuple[int, int]:
    """Parses torchrun's ``--nnodes`` form: ``"N"`` or ``"MIN:MAX"``."""
    parts = str(text).split(":")
    try:
        if len(parts) == 1:
            low = high = int(parts[0])
        elif len(parts) == 2:
            low, high = int(parts[0]), int(parts[1])
        else:
            raise ValueError(text)
    except ValueError as exc:
        raise ConfigError(f"expected N or MIN:MAX (e.g. 2:4), got {text!r}", field=name) from exc
    if low < 1:
        raise ConfigError(f"the minimum number of nodes must be at least 1, got {low}", field=name)
    if high < low:
        raise ConfigError(f"the maximum ({high}) is below the minimum ({low})", field=name)
    return low, high


def _convert(value: Any, target: Any, name: str) -> Any:
    """Converts a flag/env/spec value to the field's declared type."""
    if target is bool:
        if isinstance(value, bool):
            return value
        lowered = str(value).strip().lower()
        if lowered in {"1", "true", "yes", "on"}:
            return True
        if lowered in {"0", "false", "no", "off"}:
            return False
        raise ConfigError(f"expected true or false, got {value!r}", field=name)
    if target is int:
        if isinstance(value, bool):
            raise ConfigError(f"expected an integer, got {value!r}", field=name)
        try:
            return int(value)
        except (TypeError, ValueError, OverflowError) as exc:  # int(inf) overflows
            raise ConfigError(f"expected an integer, got {value!r}", field=name) from exc
    if target is float:
        if name.endswith("_s"):
            return parse_duration(value, name=name)
        try:
            return float(value)
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"expected a number, got {value!r}", field=name) from exc
    if target is str:
        return str(value)
    raise ConfigError(f"cannot set a field of type {target!r} from text", field=name)


def _field_types(cls: type) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    resolved: dict[str, Any] = {}
    for name, hint in hints.items():
        if isinstance(hint, types.UnionType):  # `str | None` and the like: take the non-None member
            resolved[name] = next(a for a in typing.get_args(hint) if a is not type(None))
        else:
            resolved[name] = hint
    return resolved


def _is_group(hint: Any) -> typing.TypeGuard[type]:
    """True for a nested settings group (a dataclass type), false for scalar fields."""
    return isinstance(hint, type) and dataclasses.is_dataclass(hint)


def from_mapping(cls: type[T], values: Mapping[str, Any], *, where: str = "") -> T:
    """Builds a settings object from a (possibly nested) mapping of field names to raw values.

    Unknown keys are an error naming the key, so a typo never silently falls back to a default.
    """
    hints = _field_types(cls)
    known = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    kwargs: dict[str, Any] = {}
    for key, raw in values.items():
        path = f"{where}{key}"
        if key not in known:
            raise ConfigError(f"unknown setting; known ones are {', '.join(sorted(known))}", field=path)
        target = hints[key]
        if _is_group(target):
            if not isinstance(raw, Mapping):
                raise ConfigError("expected a group of settings", field=path)
            kwargs[key] = from_mapping(target, raw, where=f"{path}.")
        else:
            kwargs[key] = _convert(raw, target, path)
    try:
        return cls(**kwargs)
    except ConfigError as exc:
        if where and exc.field and not exc.field.startswith(where):
            raise ConfigError(str(exc).split(": ", 1)[-1], field=f"{where}{exc.field}") from exc
        raise


def from_env(cls: type[T], env: Mapping[str, str], *, prefix: str = ENV_PREFIX) -> T:
    """Builds settings from ``PHALANX_<GROUP>_<FIELD>`` variables; absent variables keep defaults."""
    return from_mapping(cls, _env_values(cls, env, prefix))


def _env_values(cls: type, env: Mapping[str, str], prefix: str) -> dict[str, Any]:
    hints = _field_types(cls)
    values: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        name = f"{prefix}{f.name.upper()}"
        target = hints[f.name]
        if _is_group(target):
            nested = _env_values(target, env, f"{name}_")
            if nested:
                values[f.name] = nested
        elif name in env:
            values[f.name] = env[name]
    return values


def env_names(cls: type, *, prefix: str = ENV_PREFIX) -> dict[str, str]:
    """Maps every environment variable a settings class reads to its doc line."""
    hints = _field_types(cls)
    names: dict[str, str] = {}
    for f in dataclasses.fields(cls):
        name = f"{prefix}{f.name.upper()}"
        target = hints[f.name]
        if _is_group(target):
            names.update(env_names(target, prefix=f"{name}_"))
        else:
            names[name] = describe(f)
    return names


def describe(f: dataclasses.Field[Any]) -> str:
    """The doc line of a field with its unit and default, for help texts and CRD descriptions."""
    doc = str(f.metadata.get("doc", ""))
    unit = f.metadata.get("unit")
    default = f.default if f.default is not dataclasses.MISSING else None
    tail = f" [{unit}]" if unit else ""
    if default not in (None, ""):
        tail += f" (default {default})"
    return doc + tail


def _refuse_non_finite(obj: Any) -> None:
    """nan passes every bound check (``nan < 0`` and ``nan > 0`` are both false) and inf passes every lower
    bound, then poisons what the setting feeds: a timer that never fires, a median that is nan."""
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"must be a finite number, got {value}", field=f.name)


def checked(cls: type[T]) -> type[T]:
    """Every settings group carries this decorator (above ``@dataclass``): its float settings must be finite
    before its own checks run, however it was built (flags, environment, the CRD, or code)."""
    own = cls.__dict__.get("__post_init__")

    def __post_init__(self: Any) -> None:
        _refuse_non_finite(self)
        if own is not None:
            own(self)

    cls.__post_init__ = __post_init__  # type: ignore[attr-defined]
    return cls


def positive(value: float, name: str) -> None:
    if value <= 0:
        raise ConfigError(f"must be greater than 0, got {value}", field=name)
