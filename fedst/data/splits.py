"""Validation splits of the training sites (model selection never reads a test split).

Where a site's validation videos come from is one config value, ``data.val_split``:

* ``dataset`` (default): the dataset's own ``val`` split. The procedural benchmark writes one
  (``splits/val.txt``: 1 video per federated site in every preset), the generic layout reads
  ``splits/val.txt``, EndoVis2017 has one with its ``fold`` option (held-out training sequences).
  EndoVis2018, SAR-RARP50 and a generic site without ``val.txt`` have none: asking them for a
  validation score stops with a message naming the site and this key.
* ``train``: ``data.val_videos`` whole videos of the site's ``train`` split become its validation
  split and leave training (the site trains on fewer videos; the dataset's own val split, if any, is
  not used). Which videos: the ``val_videos`` video ids with the smallest
  SHA-256(``"<val_seed>/<site>/<video_id>"``), so the choice depends only on the seed, the site's
  name and its video ids (not on their order on disk) and never on a test video. Whole videos, so
  no validation frame has a neighbouring frame in training.

It applies to the sites that train or select (``data.federation`` and a CBE held-out site,
``selection.held_out_site``), never to out-of-federation sites or the server's synthetic set, and
the ``test`` split is passed through untouched in both modes.
"""

from __future__ import annotations

import hashlib
import logging

import numpy as np

from fedst.data.base import DataError, FrameRef, LabelRef, SiteSource, VideoRecord
from fedst.data.clips import ClipConfig, ClipDataset

log = logging.getLogger(__name__)

VAL_SPLIT_SOURCES = ("dataset", "train")


def carved_video_ids(video_ids: list[str], site: str, count: int, seed: int) -> list[str]:
    """The ``count`` ids of ``video_ids`` with the smallest SHA-256 of ``"<seed>/<site>/<id>"``
    (sorted by that hash); the rule of the module docstring."""

    def rank(video_id: str) -> str:
        return hashlib.sha256(f"{seed}/{site}/{video_id}".encode()).hexdigest()

    return sorted(video_ids, key=rank)[:count]


class CarvedValidationSource(SiteSource):
    """``inner`` with ``count`` whole training videos moved from ``train`` to ``val``
    (``data.val_split=train``); ``test`` and pixel reads go to ``inner`` unchanged."""

    def __init__(self, inner: SiteSource, count: int, seed: int) -> None:
        self.inner = inner
        self.name = inner.name
        self.surgery_type = inner.surgery_type
        self.binary = inner.binary
        self.count = count
        self.seed = seed
        self._val_ids: set[str] | None = None

    def __getattr__(self, item: str):  # backend extras (site_root, frame_size, fps, ...)
        if item == "inner":
            raise AttributeError(item)
        return getattr(self.inner, item)

    def _carved(self) -> set[str]:
        if self._val_ids is None:
            train_ids = [v.video_id for v in self.inner.videos("train")]
            if len(train_ids) <= self.count:
                raise DataError(
                    f"site {self.name!r}: data.val_split=train moves data.val_videos="
                    f"{self.count} whole training video(s) to validation, but the train split has "
                    f"only {len(train_ids)} ({train_ids}); lower data.val_videos or use the "
                    f"dataset's own val split (data.val_split=dataset)"
                )
            self._val_ids = set(carved_video_ids(train_ids, self.name, self.count, self.seed))
            log.info(
                "site %s: validation videos %s carved from its %d training videos (seed %d)",
                self.name,
                sorted(self._val_ids),
                len(train_ids),
                self.seed,
            )
        return self._val_ids

    def videos(self, split: str) -> list[VideoRecord]:
        if split == "train":
            carved = self._carved()
            return [v for v in self.inner.videos("train") if v.video_id not in carved]
        if split == "val":
            carved = self._carved()
            return [v for v in self.inner.videos("train") if v.video_id in carved]
        return self.inner.videos(split)

    def read_frame(self, ref: FrameRef) -> np.ndarray:
        return self.inner.read_frame(ref)

    def read_label(self, ref: LabelRef) -> np.ndarray:
        return self.inner.read_label(ref)


def with_validation_split(source: SiteSource, mode: str, count: int, seed: int) -> SiteSource:
    """The site as training and selection see it under ``data.val_split=mode``."""
    if mode == "train":
        return CarvedValidationSource(source, count, seed)
    return source


def validation_videos(source: SiteSource, mode: str) -> list[VideoRecord]:
    """The site's validation videos; a site without any is a DataError naming the fix."""
    try:
        videos = source.videos("val")
    except DataError as err:
        if mode == "train":
            raise
        raise DataError(
            f"site {source.name!r}: no usable validation split of its own ({err}); write one "
            f"(generic layout: splits/val.txt) or carve whole training videos with "
            f"data.val_split=train data.val_videos=N"
        ) from err
    if not any(v.labels for v in videos):
        raise DataError(
            f"site {source.name!r}: its dataset has no labelled validation video "
            f"(data.val_split={mode}); carve whole training videos with data.val_split=train "
            f"data.val_videos=N, or give the dataset a val split"
        )
    return videos


def validation_dataset(source: SiteSource, mode: str, clip: ClipConfig) -> ClipDataset:
    """The site's validation clips (no augmentation), checked by :func:`validation_videos`."""
    validation_videos(source, mode)
    return ClipDataset(source, "val", clip, None)
