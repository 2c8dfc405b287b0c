"""Generic-layout backend: Hyst-YT / Lob-YT style sites and what the procedural generator writes.

Layout (reference/datasets.md, section D/E)::

    <root>/<site>/meta.json   {"fps": 5, "annotated_fps": 5,
                               "classes": ["background", "shaft", "wrist", "jaw"],
                               "ignore_index": 255, "surgery_type": "hysterectomy",
                               "binary": false}
    <root>/<site>/videos/<video_id>/frames/<frame_index:09d>.png|jpg
    <root>/<site>/videos/<video_id>/masks/<frame_index:09d>.png   uint8 [H, W], 255 = ignore
    <root>/<site>/splits/{train,val,test}.txt                     one video_id per line

A frame's file name is its index in the source video, so its time is ``index / fps`` and clips can
use unlabelled frames between labelled ones. Required meta keys: fps, classes, ignore_index,
surgery_type; ``binary`` (default false) and ``annotated_fps`` are optional. ``annotated_fps`` =
fps / k for a whole k says that every frame whose index is a multiple of k is annotated: such a
frame without its mask is an error naming the mask file (a deleted label would otherwise turn the
frame into an unlabelled clip context frame without a word); another ratio, or no
``annotated_fps``, says nothing about which frames have masks. Labels must already be unified: classes equal to :data:`CLASS_NAMES` (or two classes when
binary) and ignore_index 255.

Validation is eager: meta.json at construction, a split's folders and files at the first
``videos(split)`` call; pixel problems (unreadable files, label values) at read time.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import cv2
import numpy as np
from PIL import Image, UnidentifiedImageError

from fedst.data.base import (
    CLASS_NAMES,
    IGNORE_INDEX,
    SPLITS,
    DataError,
    FrameRef,
    LabelRef,
    SiteSource,
    VideoRecord,
    check_fps,
)

__all__ = ["FRAME_SUFFIXES", "REQUIRED_META_KEYS", "GenericLayoutSource"]

logger = logging.getLogger(__name__)

REQUIRED_META_KEYS: tuple[str, ...] = ("fps", "classes", "ignore_index", "surgery_type")
FRAME_SUFFIXES: tuple[str, ...] = (".png", ".jpg", ".jpeg")
MASK_SUFFIX = ".png"
BINARY_CLASS_COUNT = 2


class GenericLayoutSource(SiteSource):
    """One site in the generic layout under ``root / (site_dir or name)``.

    Attributes: ``name``, ``fps``, ``annotated_fps``, ``surgery_type``, ``binary``, ``classes``.
    """

    def __init__(self, root: Path, name: str, site_dir: str | None = None) -> None:
        self.name = name
        self.site_root = Path(root) / (site_dir or name)
        if not self.site_root.is_dir():
            raise DataError(
                f"site {name!r}: folder {self.site_root} does not exist; check the site's root "
                f"(and site_dir option) in the data config"
            )
        meta = self._read_meta(self.site_root / "meta.json")
        self.fps: float = meta["fps"]
        self.annotated_fps: float = meta.get("annotated_fps", meta["fps"])
        self.surgery_type: str = meta["surgery_type"]
        self.binary: bool = meta.get("binary", False)
        self.classes: tuple[str, ...] = tuple(meta["classes"])
        self._label_every = annotated_every(meta, self.site_root / "meta.json")
        self._allowed_values = np.zeros(256, dtype=bool)
        self._allowed_values[: len(self.classes)] = True
        self._allowed_values[IGNORE_INDEX] = True
        self._records: dict[str, list[VideoRecord]] = {}

    def _read_meta(self, path: Path) -> dict[str, Any]:
        if not path.is_file():
            raise DataError(f"{path}: missing meta.json; write it with keys {REQUIRED_META_KEYS}")
        try:
            meta = json.loads(path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise DataError(f"{path}: not valid JSON ({err})") from err
        if not isinstance(meta, dict):
            raise DataError(f"{path}: expected a JSON object, found {type(meta).__name__}")
        missing = [key for key in REQUIRED_META_KEYS if key not in meta]
        if missing:
            raise DataError(f"{path}: missing key(s) {missing}; required: {REQUIRED_META_KEYS}")
        check_fps(meta["fps"], str(path))
        if not isinstance(meta.get("binary", False), bool):
            raise DataError(f"{path}: binary must be true or false, found {meta['binary']!r}")
        classes = meta["classes"]
        if meta.get("binary", False):
            if not isinstance(classes, list) or len(classes) != BINARY_CLASS_COUNT:
                raise DataError(
                    f"{path}: a binary site needs exactly 2 classes (background, instrument), "
                    f"found {classes!r}"
                )
        elif tuple(classes) != CLASS_NAMES:
            raise DataError(
                f"{path}: classes {classes!r} are not the unified classes {list(CLASS_NAMES)}; "
                f"remap the masks to 0 background, 1 shaft, 2 wrist, 3 jaw (or set binary: true)"
            )
        if meta["ignore_index"] != IGNORE_INDEX:
            raise DataError(
                f"{path}: ignore_index {meta['ignore_index']!r} is not {IGNORE_INDEX}; "
                f"rewrite the masks with {IGNORE_INDEX} as the ignore value"
            )
        return meta

    def videos(self, split: str) -> list[VideoRecord]:
        """The videos of ``split``: all frames of each (time order) and its labelled frames."""
        if split not in SPLITS:
            raise DataError(f"site {self.name!r}: unknown split {split!r}; choose one of {SPLITS}")
        if split not in self._records:
            video_ids = self._read_split(split)
            self._records[split] = [self._read_video(video_id, split) for video_id in video_ids]
            logger.info(
                "site %s split %s: %d videos, %d frames, %d labelled",
                self.name,
                split,
                len(video_ids),
                sum(len(r.frames) for r in self._records[split]),
                sum(len(r.labels) for r in self._records[split]),
            )
        return self._records[split]

    def _read_split(self, split: str) -> list[str]:
        path = self.site_root / "splits" / f"{split}.txt"
        if not path.is_file():
            raise DataError(f"{path}: missing split file; write one video_id per line")
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError as err:
            raise DataError(
                f"{path}: not UTF-8 text ({err.reason} at byte {err.start}); save the split "
                "file as UTF-8 with one video_id per line"
            ) from err
        video_ids = [line.strip() for line in text.splitlines() if line.strip()]
        if not video_ids:
            raise DataError(f"{path}: split file is empty; list at least one video_id")
        duplicates = sorted({v for v in video_ids if video_ids.count(v) > 1})
        if duplicates:
            raise DataError(f"{path}: video id(s) {duplicates} listed more than once")
        lines = [line.strip() for line in text.splitlines()]
        for video_id in video_ids:
            if not (self.site_root / "videos" / video_id).is_dir():
                raise DataError(
                    f"{path}: lists unknown video {video_id!r} on line "
                    f"{lines.index(video_id) + 1} (no folder "
                    f"{self.site_root / 'videos' / video_id}); fix the split file or add the video"
                )
        return video_ids

    def _read_video(self, video_id: str, split: str) -> VideoRecord:
        video_dir = self.site_root / "videos" / video_id
        frames_dir, masks_dir = video_dir / "frames", video_dir / "masks"
        where = f"video {video_id!r} (listed in splits/{split}.txt)"
        if not frames_dir.is_dir():
            raise DataError(f"{frames_dir}: missing frames folder of {where}")
        frame_paths: dict[int, Path] = {}
        for path in sorted(frames_dir.iterdir()):
            if path.suffix.lower() not in FRAME_SUFFIXES:
                continue
            index = _frame_index(path)
            if index in frame_paths:
                raise DataError(f"{path}: frame {index} also stored as {frame_paths[index].name}")
            frame_paths[index] = path
        if not frame_paths:
            raise DataError(f"{frames_dir}: no frames ({'|'.join(FRAME_SUFFIXES)}) for {where}")
        if not masks_dir.is_dir():
            raise DataError(f"{masks_dir}: missing masks folder of {where}; it has no labels")
        mask_paths = {_frame_index(p): p for p in sorted(masks_dir.glob(f"*{MASK_SUFFIX}"))}
        if not mask_paths:
            raise DataError(f"{masks_dir}: no masks (*{MASK_SUFFIX}) for {where}")
        for index, path in mask_paths.items():
            if index not in frame_paths:
                raise DataError(
                    f"{path}: mask without its frame (expected {frames_dir}/{path.stem}"
                    f"{'|'.join(FRAME_SUFFIXES)}); add the frame or remove the mask"
                )
        every = self._label_every
        if every is not None:  # meta.json says which frames are annotated: each has its mask
            unlabelled = [i for i in sorted(frame_paths) if i % every == 0 and i not in mask_paths]
            if unlabelled:
                frames_said = "every frame" if every == 1 else f"every {every}th frame"
                raise DataError(
                    f"{masks_dir / f'{unlabelled[0]:09d}{MASK_SUFFIX}'}: missing mask of an "
                    f"annotated frame ({len(unlabelled)} in {where}; meta.json annotated_fps "
                    f"{self.annotated_fps} at fps {self.fps} means {frames_said} has a mask); add "
                    "the mask, or correct annotated_fps"
                )
        indices = sorted(frame_paths)
        position = {index: pos for pos, index in enumerate(indices)}
        return VideoRecord(
            video_id=video_id,
            times=[index / self.fps for index in indices],
            frames=[FrameRef(frame_paths[index]) for index in indices],
            labels={position[index]: LabelRef(path) for index, path in mask_paths.items()},
        )

    def read_frame(self, ref: FrameRef) -> np.ndarray:
        """RGB uint8 [H, W, 3]."""
        bgr = cv2.imread(str(ref.path), cv2.IMREAD_COLOR)
        if bgr is None:
            raise DataError(f"{ref.path}: unreadable image (missing, corrupt or not an image)")
        return cv2.cvtColor(bgr, cv2.COLOR_BGR2RGB)

    def frame_size(self, ref: FrameRef) -> tuple[int, int]:
        """(H, W) of a frame from its file header, without decoding the pixels."""
        try:
            with Image.open(ref.path) as image:
                width, height = image.size
        except (OSError, UnidentifiedImageError) as err:
            raise DataError(f"{ref.path}: unreadable image ({err})") from err
        return height, width

    def read_label(self, ref: LabelRef) -> np.ndarray:
        """Label map uint8 [H, W]; values outside ``0..len(classes)-1`` and 255 are a DataError."""
        label = cv2.imread(str(ref.path), cv2.IMREAD_UNCHANGED)
        if label is None:
            raise DataError(f"{ref.path}: unreadable mask (missing, corrupt or not an image)")
        if label.ndim != 2 or label.dtype != np.uint8:
            raise DataError(
                f"{ref.path}: mask must be single-channel uint8, found shape {label.shape} "
                f"dtype {label.dtype}; save it as an 8-bit greyscale PNG"
            )
        counts = np.bincount(label.ravel(), minlength=256)
        bad_values = np.flatnonzero((counts > 0) & ~self._allowed_values)
        if bad_values.size:
            raise DataError(
                f"{ref.path}: label value(s) {bad_values.tolist()} outside classes "
                f"0..{len(self.classes) - 1} and ignore {IGNORE_INDEX}"
            )
        return label


def annotated_every(meta: dict[str, Any], path: Path) -> int | None:
    """k when meta.json's ``annotated_fps`` is ``fps / k`` for a whole k: then every frame whose
    index is a multiple of k is annotated (has a mask), as the procedural generator writes it;
    None without ``annotated_fps`` or with a ratio that names no frames (informational only)."""
    if "annotated_fps" not in meta:
        return None
    annotated = meta["annotated_fps"]
    if isinstance(annotated, bool) or not isinstance(annotated, (int, float)) or annotated <= 0:
        raise DataError(f"{path}: annotated_fps must be a positive number, found {annotated!r}")
    ratio = meta["fps"] / annotated
    every = round(ratio)
    if every < 1 or abs(ratio - every) > 1e-6 * ratio:
        return None
    return every


def _frame_index(path: Path) -> int:
    if not path.stem.isdigit():
        raise DataError(f"{path}: file name must be the frame index, e.g. 000000012{path.suffix}")
    return int(path.stem)
