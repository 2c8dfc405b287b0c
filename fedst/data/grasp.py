"""GraSP (binary out-of-federation test, paper Table VIII; robot-assisted radical prostatectomy).

Layout (reference/datasets.md, GraSP)::

    <root>/[GraSP_30fps/]frames/CASExxx/%09d.jpg                 30 fps frames
    <root>/[GraSP_30fps/]annotations/segmentations/[..]/CASExxx/%09d.png
                                                                 instrument-type id per pixel
    <root>/[GraSP_30fps/]annotations/grasp_short-term_{train,test}.json   COCO with RLE masks

Labels come from the PNG masks (searched recursively: test cases may sit one folder deeper) or,
when there are none or with ``label_source: coco``, from the COCO JSON files: uncompressed and
compressed RLE (decoded here in numpy; pycocotools is not needed) and polygons. The category ids
are read from the JSON's ``categories``. The target is binary: any instrument type -> 1
(``binary = True``); in COCO files an annotation whose category is not listed is an unknown value.

A labelled frame's file name is its index in the 30 fps video (``times = index / 30``); the frames
in the ``context_s`` seconds before it are listed too, so clips get true previous frames without
listing the whole video. Default test split: cases 41, 47, 50, 51, 53 (datasets.md); ``test_cases:
all`` evaluates on all 13 cases.
"""

from __future__ import annotations

import json
import logging
import os
import re
from pathlib import Path
from typing import Any

import cv2
import numpy as np

from fedst.data._io import (
    DecodedLabel,
    UnifiedLabelSource,
    check_policy,
    describe_label,
    read_grey_mask,
    reject_unknown_options,
    require_dir,
    trailing_number,
)
from fedst.data.base import IGNORE_INDEX, DataError, FrameRef, LabelRef, VideoRecord

log = logging.getLogger(__name__)

VIDEO_FPS = 30.0
DEFAULT_TEST_CASES = ("CASE041", "CASE047", "CASE050", "CASE051", "CASE053")
COCO_FILES = ("grasp_short-term_train.json", "grasp_short-term_test.json")
"""COCO files read by default (the fold files repeat the training cases)."""
LABEL_SOURCES = ("auto", "png", "coco")
FRAME_SUFFIXES = (".jpg", ".jpeg", ".png")
_CASE = re.compile(r"CASE\d+", re.IGNORECASE)


def rle_counts_from_string(counts: str) -> list[int]:
    """Run lengths of a compressed COCO RLE string (pycocotools' ``rleFrString``)."""
    runs: list[int] = []
    position = 0
    while position < len(counts):
        value, shift, more = 0, 0, True
        while more:
            chunk = ord(counts[position]) - 48
            value |= (chunk & 0x1F) << (5 * shift)
            more = bool(chunk & 0x20)
            position += 1
            shift += 1
            if not more and chunk & 0x10:
                value |= -1 << (5 * shift)
        if len(runs) > 2:
            value += runs[-2]
        runs.append(value)
    return runs


def rle_decode(rle: dict[str, Any]) -> np.ndarray:
    """COCO RLE ``{"size": [h, w], "counts": str | list[int]}`` -> bool mask [h, w].

    Runs alternate 0s and 1s (starting with 0s) over the mask in column-major order.
    """
    height, width = (int(v) for v in rle["size"])
    counts = rle["counts"]
    if isinstance(counts, bytes):
        counts = counts.decode("ascii")
    runs = rle_counts_from_string(counts) if isinstance(counts, str) else [int(c) for c in counts]
    if any(r < 0 for r in runs) or sum(runs) != height * width:
        raise DataError(f"RLE runs sum to {sum(runs)}, expected {height}x{width}={height * width}")
    values = np.arange(len(runs)) % 2 == 1  # run k is 0s for even k, 1s for odd k
    flat = np.repeat(values, runs)  # [h * w] column-major
    return flat.reshape(width, height).T  # [w, h] -> [h, w]


def polygon_decode(polygons: list[list[float]], height: int, width: int) -> np.ndarray:
    """COCO polygons ``[[x1, y1, x2, y2, ...], ...]`` -> bool mask [height, width]."""
    canvas = np.zeros((height, width), dtype=np.uint8)
    points = [
        np.round(np.asarray(p, dtype=np.float64).reshape(-1, 2)).astype(np.int32) for p in polygons
    ]
    cv2.fillPoly(canvas, points, 1)
    return canvas.astype(bool)


class GraspSource(UnifiedLabelSource):
    """GraSP as a binary SiteSource (0 background, 1 instrument, 255 ignore).

    Options: ``frames_dir`` / ``annotations_dir`` (relative to ``root``; default: searched),
    ``label_source`` (auto | png | coco), ``coco_files`` (names under the annotations folder),
    ``test_cases`` (case names or ``all``), ``context_s`` (seconds of frames listed before a
    labelled frame), ``on_unknown_label``.
    """

    binary = True

    def __init__(
        self,
        root: Path,
        name: str,
        *,
        surgery_type: str = "prostatectomy",
        frames_dir: str | None = None,
        annotations_dir: str | None = None,
        label_source: str = "auto",
        coco_files: list[str] | tuple[str, ...] = COCO_FILES,
        test_cases: list[str] | tuple[str, ...] | str = DEFAULT_TEST_CASES,
        context_s: float = 1.0,
        on_unknown_label: str = "error",
        **unknown_options: Any,
    ) -> None:
        reject_unknown_options(type(self), name, unknown_options)
        self.name = name
        self.surgery_type = surgery_type
        self.root = require_dir(Path(root), f"site {name!r}: GraSP root", "see data/README.md")
        if label_source not in LABEL_SOURCES:
            raise DataError(
                f"site {name!r}: option label_source={label_source!r}; use one of {LABEL_SOURCES}"
            )
        if isinstance(test_cases, str) and test_cases != "all":
            raise DataError(f"site {name!r}: option test_cases={test_cases!r}; a list or 'all'")
        self.test_cases = None if test_cases == "all" else {c.upper() for c in test_cases}
        self.context_frames = max(0, round(float(context_s) * VIDEO_FPS))
        self.frames_dir = self._locate("frames", frames_dir)
        self.annotations_dir = self._locate("annotations", annotations_dir)
        self.segmentations_dir = self.annotations_dir / "segmentations"
        if label_source == "auto":
            label_source = "png" if self.segmentations_dir.is_dir() else "coco"
        self.label_source = label_source
        self.coco_paths = [self.annotations_dir / f for f in coco_files]
        self.on_unknown_label = check_policy(on_unknown_label, name)
        self._coco: dict[Path, _CocoIndex] = {}
        self._cache: dict[str, list[VideoRecord]] | None = None

    def _locate(self, folder: str, option: str | None) -> Path:
        if option is not None:
            return require_dir(self.root / option, f"site {self.name!r}: {folder} folder", "fix it")
        for candidate in (self.root / folder, self.root / "GraSP_30fps" / folder):
            if candidate.is_dir():
                return candidate
        found = sorted(p for p in self.root.glob(f"*/*/{folder}") if p.is_dir())
        if not found:
            raise DataError(
                f"site {self.name!r}: no '{folder}' folder under {self.root} (looked in "
                f"{folder}, GraSP_30fps/{folder} and two levels down); set option {folder}_dir"
            )
        return found[0]

    # --- listing --------------------------------------------------------------------------

    def videos(self, split: str) -> list[VideoRecord]:
        """One video per case; ``test`` = the test cases, ``train`` = the others, ``val`` empty."""
        if split not in ("train", "val", "test"):
            raise DataError(f"site {self.name!r}: unknown split {split!r}")
        if self._cache is None:
            self._cache = self._list_cases()
        return self._cache[split]

    def _list_cases(self) -> dict[str, list[VideoRecord]]:
        labels = self._png_labels() if self.label_source == "png" else self._coco_labels()
        splits: dict[str, list[VideoRecord]] = {"train": [], "val": [], "test": []}
        for case in sorted(labels):
            in_test = self.test_cases is None or case in self.test_cases
            splits["test" if in_test else "train"].append(self._case_video(case, labels[case]))
        if self.test_cases is not None:
            missing = sorted(self.test_cases - set(labels))
            if missing:
                log.warning("site %s: test case(s) %s have no labels", self.name, missing)
        return splits

    def _png_labels(self) -> dict[str, dict[int, LabelRef]]:
        require_dir(self.segmentations_dir, "GraSP segmentation masks", "or use label_source: coco")
        labels: dict[str, dict[int, LabelRef]] = {}
        for path in sorted(self.segmentations_dir.rglob("*.png")):
            case = _case_of(path.relative_to(self.segmentations_dir).as_posix(), path)
            index = trailing_number(path.stem, path)
            if index in labels.setdefault(case, {}):
                raise DataError(
                    f"{path}: frame {index} of {case} also labelled by {labels[case][index].path}"
                )
            labels[case][index] = LabelRef(path)
        if not labels:
            raise DataError(f"{self.segmentations_dir}: no PNG masks found")
        return labels

    def _coco_labels(self) -> dict[str, dict[int, LabelRef]]:
        labels: dict[str, dict[int, LabelRef]] = {}
        for path in self.coco_paths:
            if not path.is_file():
                raise DataError(
                    f"{path}: COCO annotation file not found; set option coco_files, or provide "
                    "the PNG masks under annotations/segmentations"
                )
            index = self._coco_index(path)
            for image_id, image in index.images.items():
                case = _case_of(image["file_name"], path)
                frame = trailing_number(Path(image["file_name"]).stem, path)
                labels.setdefault(case, {})[frame] = LabelRef(path, key=str(image_id))
        return labels

    def _case_video(self, case: str, labels: dict[int, LabelRef]) -> VideoRecord:
        case_dir = self.frames_dir / case
        available = _frame_numbers(case_dir)
        indices = set()
        for index in labels:
            if index not in available:
                raise DataError(
                    f"{case_dir / f'{index:09d}.jpg'}: frame of label "
                    f"{describe_label(labels[index])} not found"
                )
            wanted = range(index - self.context_frames, index + 1)
            indices.update(i for i in wanted if i in available)
        ordered = sorted(indices)
        position = {index: pos for pos, index in enumerate(ordered)}
        return VideoRecord(
            video_id=case,
            times=[index / VIDEO_FPS for index in ordered],
            frames=[FrameRef(case_dir / available[index]) for index in ordered],
            labels={position[index]: ref for index, ref in labels.items()},
        )

    # --- reading --------------------------------------------------------------------------

    def decode_label(self, ref: LabelRef) -> DecodedLabel:
        """Binary map [H, W]: instrument pixels 1 (any category id > 0), background 0."""
        if ref.key is None:
            raw = read_grey_mask(ref.path)  # [H, W] instrument-type ids
            return DecodedLabel((raw > 0).astype(np.uint8))
        return self._coco_index(ref.path).decode(int(ref.key), ref)

    def _coco_index(self, path: Path) -> _CocoIndex:
        if path not in self._coco:
            self._coco[path] = _CocoIndex(path)
        return self._coco[path]


class _CocoIndex:
    """A COCO file's images, annotations per image and categories (id -> name)."""

    def __init__(self, path: Path) -> None:
        try:
            data = json.loads(path.read_text())
            self.categories = {int(c["id"]): str(c.get("name", "")) for c in data["categories"]}
            self.images = {int(i["id"]): i for i in data["images"]}
            annotations = data["annotations"]
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as err:
            raise DataError(
                f"{path}: not a COCO file with images/annotations/categories ({err})"
            ) from err
        self.path = path
        self.by_image: dict[int, list[dict[str, Any]]] = {}
        for annotation in annotations:
            self.by_image.setdefault(int(annotation["image_id"]), []).append(annotation)
        log.info("%s: categories (id: name) %s", path, dict(sorted(self.categories.items())))

    def decode(self, image_id: int, ref: LabelRef) -> DecodedLabel:
        if image_id not in self.images:
            raise DataError(f"{describe_label(ref)}: image id {image_id} not in the file")
        image = self.images[image_id]
        height, width = int(image["height"]), int(image["width"])
        label = np.zeros((height, width), dtype=np.uint8)
        unknown: dict[str, int] = {}
        for annotation in self.by_image.get(image_id, []):
            mask = self._mask(annotation, height, width, ref)  # [H, W] bool
            category = int(annotation["category_id"])
            if category in self.categories and category > 0:
                label[mask & (label != IGNORE_INDEX)] = 1
            else:
                key = f"category {category}"
                unknown[key] = unknown.get(key, 0) + int(mask.sum())
                label[mask] = IGNORE_INDEX
        return DecodedLabel(label, unknown)

    def _mask(
        self, annotation: dict[str, Any], height: int, width: int, ref: LabelRef
    ) -> np.ndarray:
        segmentation = annotation.get("segmentation")
        where = f"{describe_label(ref)} annotation {annotation.get('id')}"
        try:
            if isinstance(segmentation, dict):
                mask = rle_decode(segmentation)
            elif isinstance(segmentation, list):
                mask = polygon_decode(segmentation, height, width)
            else:
                raise DataError(f"unsupported segmentation {type(segmentation).__name__}")
        except (DataError, KeyError, TypeError, ValueError, IndexError) as err:
            raise DataError(f"{where}: cannot decode the mask ({err})") from err
        if mask.shape != (height, width):
            raise DataError(
                f"size mismatch: {where} mask is {mask.shape[0]}x{mask.shape[1]}, the image "
                f"entry says {height}x{width} (HxW)"
            )
        return mask


def _case_of(text: str, path: Path) -> str:
    """The CASExxx name inside ``text`` (a relative path or file name)."""
    found = _CASE.findall(text)
    if not found:
        raise DataError(f"{path}: cannot tell the case (CASExxx) from {text!r}")
    return found[-1].upper()


def _frame_numbers(case_dir: Path) -> dict[int, str]:
    """frame index -> file name of the frames of one case (one directory scan)."""
    require_dir(case_dir, "GraSP frames folder", "extract GraSP_30fps/frames")
    numbers: dict[int, str] = {}
    with os.scandir(case_dir) as entries:
        for entry in entries:
            stem, suffix = os.path.splitext(entry.name)
            if suffix.lower() in FRAME_SUFFIXES and stem.isdigit():
                numbers[int(stem)] = entry.name
    return numbers
