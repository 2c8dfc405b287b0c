"""Backend registry: a site's ``backend`` name in configs/data/*.yaml -> its SiteSource class.

Classes are imported lazily so that a missing optional dependency of one backend cannot break the
others. Every backend class takes ``root`` (a Path), ``name`` (the site's name) and its own keyword
options, which come straight from the site's config entry.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

from fedst.data.base import DataError, SiteSource

BACKENDS: dict[str, str] = {
    "generic": "fedst.data.generic:GenericLayoutSource",
    "endovis2017": "fedst.data.endovis2017:EndoVis2017Source",
    "endovis2018": "fedst.data.endovis2018:EndoVis2018Source",
    "sarrarp50": "fedst.data.sarrarp50:SarRarp50Source",
    "grasp": "fedst.data.grasp:GraspSource",
    "sisvse": "fedst.data.sisvse:SisvseSource",
}


def open_site(backend: str, root: str | Path, name: str, **options: Any) -> SiteSource:
    """Instantiate the SiteSource for ``backend`` reading ``root``."""
    if backend not in BACKENDS:
        raise DataError(
            f"site {name!r}: unknown backend {backend!r}; choose one of {sorted(BACKENDS)}"
        )
    module_name, class_name = BACKENDS[backend].split(":")
    cls = getattr(importlib.import_module(module_name), class_name)
    return cls(root=Path(root), name=name, **options)
