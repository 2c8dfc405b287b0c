"""Site data: backends that read datasets from disk, and the shared clip pipeline.

* :mod:`fedst.data.base`: the backend contract (SiteSource, VideoRecord, DataError, labels).
* :mod:`fedst.data.registry`: backend name -> SiteSource class (``open_site``).
* :mod:`fedst.data.generic`: the generic layout (Hyst-YT / Lob-YT, procedural benchmark).
* :mod:`fedst.data.clips`: ClipDataset, augmentation, validation, ``make_loader``, ``BatchStream``.

Nothing is imported here, so that reading the contract does not import torch or albumentations.

Layer: above the root; imports the root modules only (no model, method or run).
"""
