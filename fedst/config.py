"""Turn a Hydra/OmegaConf mapping into typed, frozen config objects exactly once, at the entry point.

Modules receive these dataclasses (or plain arguments), never the Hydra config or a Flower context.
Unknown keys are errors that name the key and the config section, so a typo cannot silently fall
back to a default.
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from collections.abc import Iterable, Mapping
from typing import Any, TypeVar

from fedst.errors import UserError

T = TypeVar("T")


class ConfigError(UserError, ValueError):
    """A config value or key that cannot be used; the message names the section and the key."""


def build(cls: type[T], values: Mapping[str, Any] | None, where: str = "") -> T:
    """Construct dataclass ``cls`` from ``values``; nested dataclass fields are built recursively.

    Lists become tuples where the field is annotated as a tuple. Values are checked against the
    field's type hint (int, float, str, bool, tuples, dicts, ``X | None``, nested dataclasses);
    ranges are checked by the dataclasses' ``__post_init__``. Missing keys take the dataclass
    defaults; unknown keys and values of the wrong type raise :class:`ConfigError`.
    """
    values = dict(values or {})
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - names)
    if unknown:
        raise ConfigError(
            f"unknown key(s) {unknown} in config section '{where or cls.__name__}'"
            f"{did_you_mean(unknown[0], names)}; allowed: {sorted(names)}"
        )
    kwargs = {}
    for name, value in values.items():
        kwargs[name] = _convert(hints[name], value, f"{where}.{name}" if where else name)
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as err:
        raise ConfigError(f"config section '{where or cls.__name__}': {err}") from err


def did_you_mean(key: str, valid: Iterable[str]) -> str:
    """``" (did you mean 'total_iters'?)"``: the valid key closest to the unknown ``key``
    (difflib's similarity ratio >= 0.6), or ``""`` when none is close."""
    close = difflib.get_close_matches(key, list(valid), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _convert(hint: Any, value: Any, where: str) -> Any:
    """``value`` checked against the type hint ``hint`` (lists become tuples); a value of the wrong
    type is a :class:`ConfigError` naming the key ``where``, the value and what is accepted."""
    origin = typing.get_origin(hint)
    if hint is Any:
        return value
    if dataclasses.is_dataclass(hint):
        if isinstance(value, Mapping):
            return build(hint, value, where)
        raise _type_error(where, value, f"a mapping of {hint.__name__} fields")
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(hint)
        if value is None and type(None) in args:
            return None
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _convert(arg, value, where)
            except ConfigError:
                continue
        raise _type_error(where, value, " or ".join(_describe(a) for a in args))
    if origin is tuple:
        if not isinstance(value, (list, tuple)):
            raise _type_error(where, value, _describe(hint))
        args = typing.get_args(hint)
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_convert(args[0], v, f"{where}[{i}]") for i, v in enumerate(value))
        if args and len(args) != len(value):
            raise _type_error(where, value, _describe(hint))
        inner = args or (Any,) * len(value)
        return tuple(
            _convert(h, v, f"{where}[{i}]")
            for i, (h, v) in enumerate(zip(inner, value, strict=True))
        )
    if origin is dict:
        if not isinstance(value, Mapping):
            raise _type_error(where, value, _describe(hint))
        value_hint = typing.get_args(hint)[1] if typing.get_args(hint) else Any
        return {k: _convert(value_hint, v, f"{where}.{k}") for k, v in value.items()}
    if hint is bool:
        if isinstance(value, bool):
            return value
        raise _type_error(where, value, "true or false")
    if hint is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise _type_error(where, value, "an integer")
    if hint is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return value  # an int is a valid float (kept as written, so config.json is unchanged)
        raise _type_error(where, value, "a number")
    if hint is str:
        if isinstance(value, str):
            return value
        raise _type_error(where, value, "a string")
    return value


def _describe(hint: Any) -> str:
    """A type hint as the config values it accepts, for error messages."""
    if hint is type(None):
        return "null"
    names = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}
    if hint in names:
        return names[hint]
    if typing.get_origin(hint) is tuple:
        args = typing.get_args(hint)
        if len(args) == 2 and args[1] is Ellipsis:
            return f"a list of {_describe(args[0])}"
        return f"a list of {len(args)} values ({', '.join(_describe(a) for a in args)})"
    if typing.get_origin(hint) is dict:
        return "a mapping"
    return getattr(hint, "__name__", str(hint))


def _type_error(where: str, value: Any, accepted: str) -> ConfigError:
    return ConfigError(f"{where}={value!r} ({type(value).__name__}): expected {accepted}")


def to_dict(obj: Any) -> Any:
    """A dataclass config as plain JSON-ready Python values (tuples become lists)."""
    if dataclasses.is_dataclass(obj):
        return {f.name: to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, (list, tuple)):
        return [to_dict(v) for v in obj]
    if isinstance(obj, Mapping):
        return {k: to_dict(v) for k, v in obj.items()}
    return obj


def require_at_least(where: str, value: Any, minimum: float, hint: str = "") -> None:
    """ConfigError unless ``value >= minimum`` (``None`` passes: "off" for Optional fields)."""
    if value is not None and not value >= minimum:
        raise ConfigError(
            f"{where}={value!r}: must be >= {minimum}" + (f"; {hint}" if hint else "")
        )


def require_positive(where: str, value: Any, hint: str = "") -> None:
    """ConfigError unless ``value > 0`` and finite (``None`` passes)."""
    if value is not None and not (value > 0 and value != float("inf")):
        raise ConfigError(
            f"{where}={value!r}: must be a finite number > 0" + (f"; {hint}" if hint else "")
        )
