"""Turn a Hydra/OmegaConf mapping into typed, frozen config objects exactly once, at the entry point.

Modules receive these dataclasses (or plain arguments), never the Hydra config or a Flower context.
Unknown keys are errors that name the key and the config section, so a typo cannot silently fall
back to a default.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Mapping
from typing import Any, TypeVar

T = TypeVar("T")


class ConfigError(ValueError):
    """A config value or key that cannot be used; the message names the section and the key."""


def build(cls: type[T], values: Mapping[str, Any] | None, where: str = "") -> T:
    """Construct dataclass ``cls`` from ``values``; nested dataclass fields are built recursively.

    Lists become tuples where the field is annotated as a tuple. Missing keys take the dataclass
    defaults; unknown keys raise :class:`ConfigError`.
    """
    values = dict(values or {})
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - names)
    if unknown:
        raise ConfigError(
            f"unknown key(s) {unknown} in config section '{where or cls.__name__}'; "
            f"allowed: {sorted(names)}"
        )
    kwargs = {}
    for name, value in values.items():
        kwargs[name] = _convert(hints[name], value, f"{where}.{name}" if where else name)
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as err:
        raise ConfigError(f"config section '{where or cls.__name__}': {err}") from err


def _convert(hint: Any, value: Any, where: str) -> Any:
    origin = typing.get_origin(hint)
    if dataclasses.is_dataclass(hint) and isinstance(value, Mapping):
        return build(hint, value, where)
    if origin in (typing.Union, types.UnionType):
        for arg in typing.get_args(hint):
            if dataclasses.is_dataclass(arg) and isinstance(value, Mapping):
                return build(arg, value, where)
        return value
    if origin is tuple and isinstance(value, (list, tuple)):
        args = typing.get_args(hint)
        inner = args[0] if args else Any
        return tuple(_convert(inner, v, where) for v in value)
    if origin is dict and isinstance(value, Mapping):
        value_hint = typing.get_args(hint)[1] if typing.get_args(hint) else Any
        return {k: _convert(value_hint, v, f"{where}.{k}") for k, v in value.items()}
    return value


def to_dict(obj: Any) -> Any:
    """A dataclass config as plain JSON-ready Python values (tuples become lists)."""
    if dataclasses.is_dataclass(obj):
        return {f.name: to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, (list, tuple)):
        return [to_dict(v) for v in obj]
    if isinstance(obj, Mapping):
        return {k: to_dict(v) for k, v in obj.items()}
    return obj
