"""Packages whose names load on first use (PEP 562): a package that re-exports heavy modules
(fedst.runs, fedst.deploy) stays cheap to import, so a command's ``--help`` and its argument
errors answer before torch loads."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from importlib import import_module
from typing import Any


def lazy_exports(
    package: str, exported_from: Mapping[str, str], namespace: dict[str, Any]
) -> Callable[[str], object]:
    """The module ``__getattr__`` of ``package``: a name of ``exported_from`` (name -> the module
    that defines it) is imported on first use and kept in ``namespace`` (the package's
    ``globals()``), so it is read once; any other name is an AttributeError."""

    def __getattr__(name: str) -> object:
        if name not in exported_from:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(import_module(exported_from[name]), name)
        namespace[name] = value
        return value

    return __getattr__
