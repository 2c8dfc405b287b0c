"""A run directory and the models it holds: :class:`Run` (config and method read once, the
returned models), the layout of its files, their safe writing and typed reading, and what reads
a run's models afterwards: out-of-federation scoring (``outfed``) and model selection on
validation (``model_selection``).

The package's own names (``Run``, ``ServerCheckpoint``, ``SiteState``, ``ReturnedModelError``)
are imported when first read (PEP 562), so that ``fedst.runs.layout`` (the file names, which a
failed command's clean-up reads, fedst/cli.py) imports no torch.

Layer: above fedst.scoring, below fedst.federation (which writes what this package reads);
imports fedst.scoring, fedst.methods, fedst.experiment, fedst.model and below.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from fedst.lazy import lazy_exports

if TYPE_CHECKING:
    from fedst.runs.records import ServerCheckpoint, SiteState
    from fedst.runs.returned import ReturnedModelError
    from fedst.runs.run import Run

__all__ = ["ReturnedModelError", "Run", "ServerCheckpoint", "SiteState"]

EXPORTED_FROM = {
    "ReturnedModelError": "fedst.runs.returned",
    "Run": "fedst.runs.run",
    "ServerCheckpoint": "fedst.runs.records",
    "SiteState": "fedst.runs.records",
}
"""Each name of :data:`__all__` -> the module that defines it (imported on first use)."""


__getattr__ = lazy_exports(__name__, EXPORTED_FROM, globals())
