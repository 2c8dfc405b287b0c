"""A run directory and the models it holds: :class:`Run` (config and method read once, the
returned models), the layout of its files, their safe writing and typed reading, and what reads
a run's models afterwards: out-of-federation scoring (``outfed``) and model selection on
validation (``model_selection``).

Layer: above fedst.scoring, below fedst.federation (which writes what this package reads);
imports fedst.scoring, fedst.methods, fedst.experiment, fedst.model and below.
"""

from fedst.runs.records import ServerCheckpoint, SiteState
from fedst.runs.returned import ReturnedModelError
from fedst.runs.run import Run

__all__ = ["ReturnedModelError", "Run", "ServerCheckpoint", "SiteState"]
