"""Reports of finished runs: ``results`` (run directories loaded, grouped, the Table model),
``tables`` (the paper's table layouts, and ``python -m fedst.report RUN_DIR``), ``selection``
(its ``msf`` and ``matrix`` commands) and ``plots`` (the figures).

Layer: reads finished runs; imports fedst.guard, fedst.runs.model_selection, fedst.runs.outfed, fedst.federation
and below, never the apps, the training entry point or fedst.paper.
"""

from fedst.report.tables import main

__all__ = ["main"]
