"""SISVSE synthetic surgical images (the server's synthetic set for SERQ, paper Sec. III-C).

Layout (reference/datasets.md, SISVSE)::

    <root>/[miccai2022_sisvse_dataset/]images/<set>/<name>.jpg
    <root>/[miccai2022_sisvse_dataset/]semantic_masks/<set>/<name>.png   category id 0..31

Sets (option ``sets``): manual_syn (3400 images) and domain_random_syn (1236) by default. Mask
category ids map to parts: Head {1,3,6,9,11,13,16} -> jaw, Wrist {4,7,14,17} -> wrist, Body
{2,5,8,10,12,15,18} -> shaft, 0 and 19..31 (other tools, organs, gauze, other) -> background; ids
stored as 100 + id are read as id. Images were sampled for class balance, with no temporal order, so
each image is a single-frame video (``times = [0]``); only the ``train`` split exists.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from fedst.data._io import (
    DecodedLabel,
    UnifiedLabelSource,
    check_policy,
    decode_values,
    natural_key,
    read_grey_mask,
    reject_unknown_options,
    require_dir,
    value_table,
)
from fedst.data.base import DataError, FrameRef, LabelRef, VideoRecord

log = logging.getLogger(__name__)

HEAD_IDS = (1, 3, 6, 9, 11, 13, 16)
WRIST_IDS = (4, 7, 14, 17)
BODY_IDS = (2, 5, 8, 10, 12, 15, 18)
OTHER_IDS = (0, *range(19, 32))
OFFSET = 100
"""Some copies store category id + 100."""
DEFAULT_SETS = ("manual_syn", "domain_random_syn")
IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png")


def _category_table() -> dict[int, int]:
    table = {i: 3 for i in HEAD_IDS} | {i: 2 for i in WRIST_IDS} | {i: 1 for i in BODY_IDS}
    table |= {i: 0 for i in OTHER_IDS}
    return table | {OFFSET + i: part for i, part in table.items()}


CATEGORY_PARTS = _category_table()
"""Mask value -> unified class, ids 0..31 and 100..131."""


class SisvseSource(UnifiedLabelSource):
    """SISVSE synthetic sets as a SiteSource of single-frame videos (``train`` split only).

    Options: ``sets`` (image sets to use), ``on_unknown_label``.
    """

    def __init__(
        self,
        root: Path,
        name: str,
        *,
        surgery_type: str = "gastrectomy",
        sets: list[str] | tuple[str, ...] = DEFAULT_SETS,
        on_unknown_label: str = "error",
        **unknown_options: Any,
    ) -> None:
        reject_unknown_options(type(self), name, unknown_options)
        self.name = name
        self.surgery_type = surgery_type
        root = require_dir(Path(root), f"site {name!r}: SISVSE root", "see data/README.md")
        nested = root / "miccai2022_sisvse_dataset"
        self.root = nested if not (root / "images").is_dir() and nested.is_dir() else root
        if not sets:
            raise DataError(f"site {name!r}: option sets is empty; e.g. {list(DEFAULT_SETS)}")
        self.sets = tuple(sets)
        self.on_unknown_label = check_policy(on_unknown_label, name)
        self._table = value_table(CATEGORY_PARTS)
        self._train: list[VideoRecord] | None = None

    def videos(self, split: str) -> list[VideoRecord]:
        """Every mask of the chosen sets as a one-frame video in ``train``; other splits empty."""
        if split in ("val", "test"):
            return []
        if split != "train":
            raise DataError(f"site {self.name!r}: unknown split {split!r}")
        if self._train is None:
            self._train = [record for s in self.sets for record in self._set_videos(s)]
        return self._train

    def _set_videos(self, image_set: str) -> list[VideoRecord]:
        masks_dir = require_dir(
            self.root / "semantic_masks" / image_set,
            f"site {self.name!r}: SISVSE mask folder",
            "check the option sets and data/README.md",
        )
        images_dir = require_dir(
            self.root / "images" / image_set, f"site {self.name!r}: SISVSE image folder", ""
        )
        records = []
        masks = sorted(masks_dir.rglob("*.png"), key=lambda p: natural_key(str(p)))
        for mask in masks:
            relative = mask.relative_to(masks_dir).with_suffix("")
            image = next(
                (
                    images_dir / f"{relative}{s}"
                    for s in IMAGE_SUFFIXES
                    if (images_dir / f"{relative}{s}").is_file()
                ),
                None,
            )
            if image is None:
                raise DataError(
                    f"{mask}: no image {images_dir / relative}.jpg for this mask; "
                    "restore the image or remove the mask"
                )
            records.append(
                VideoRecord(
                    video_id=f"{image_set}/{relative.as_posix()}",
                    times=[0.0],
                    frames=[FrameRef(image)],
                    labels={0: LabelRef(mask)},
                )
            )
        if not records:
            log.warning("site %s: no masks in %s", self.name, masks_dir)
        return records

    def decode_label(self, ref: LabelRef) -> DecodedLabel:
        """Unified map [H, W] from a category-id mask [H, W] (100 + id read as id)."""
        return decode_values(read_grey_mask(ref.path), self._table)
