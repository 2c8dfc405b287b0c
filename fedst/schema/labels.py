"""The unified label encoding, torch-free: 0 background, 1 shaft, 2 wrist, 3 jaw, 255 ignore
(fedst/data/base.py's contract; docs/data.md). The report's plots read it without importing
the data stack."""

from __future__ import annotations

CLASS_NAMES: tuple[str, ...] = ("background", "shaft", "wrist", "jaw")
NUM_CLASSES = len(CLASS_NAMES)
IGNORE_INDEX = 255
