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
    ``globals()``), so it is read once; a submodule's name gives the submodule, as it would once
    an eager package had imported it (``fedst.deploy.superlink``); any other name is an
    AttributeError."""

    def __getattr__(name: str) -> object:
        if name in exported_from:
            value = getattr(import_module(exported_from[name]), name)
        else:
            try:
                value = import_module(f"{package}.{name}")
            except ModuleNotFoundError as err:
                if err.name != f"{package}.{name}":
                    raise  # the submodule exists and fails to import: say so
                raise AttributeError(f"module {package!r} has no attribute {name!r}") from None
        namespace[name] = value
        return value

    return __getattr__
