"""EndoVis2017 Robotic Instrument Segmentation (site A: porcine nephrectomy, da Vinci Xi).

Layout (reference/datasets.md, section A)::

    <root>/train/instrument_dataset_{1..8}/left_frames/frame000.png .. frame224.png
    <root>/train/instrument_dataset_k/ground_truth/<Instrument>[_labels]/frameNNN.png  one per tool
    <root>/test/instrument_dataset_{1..10}/left_frames/frameNNN.png  225-299 (1-8), 000-299 (9,10)
    <root>/**/instrument_dataset_k/**/PartsSegmentation/frameNNN.png  test labels (searched)

Train labels combine one grey mask per instrument folder (folders in sorted order; a later folder
wins where masks overlap): 10 shaft, 20 wrist, 30 clasper -> jaw, 40 probe -> background; folders
named ``Other*`` (non-robotic tools) stay background; 3-channel masks give channel 0. Test labels
are combined maps with a DIFFERENT encoding: 30 shaft, 100 wrist, 255 jaw, 200 probe ->
background. The decoder is chosen from where the label comes from (instrument folders vs.
PartsSegmentation), never from pixel values.

Frames were sampled at 2 Hz, so ``times = frame_number * 0.5 s``. A test video of datasets 1-8 also
lists that dataset's training frames (000-224, unlabelled there) when present: they are the same
video, so the first test frames get true previous frames. Splits: the official train/test split
(default), or with ``fold`` the common 4-fold split of the training sequences (held-out sequences
form ``val``).
"""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Any

import numpy as np

from fedst.data._io import (
    DecodedLabel,
    UnifiedLabelSource,
    check_policy,
    decode_values,
    frame_file_size,
    read_frame_ref,
    read_grey_mask,
    reject_unknown_options,
    require_dir,
    trailing_number,
    value_table,
)
from fedst.data.base import DataError, FrameRef, LabelRef, VideoRecord

log = logging.getLogger(__name__)

FRAME_PERIOD_S = 0.5
"""Released frames are 2 Hz samples of the 30 Hz video."""
TRAIN_SEQUENCES = tuple(range(1, 9))
TEST_SEQUENCES = tuple(range(1, 11))
FOLDS: dict[int, tuple[int, ...]] = {0: (1, 3), 1: (2, 5), 2: (4, 8), 3: (6, 7)}
"""The common 4-fold cross-validation split: held-out training sequences per fold."""
CROP_SOURCE_HW = (1080, 1920)
CROP_BOX = (28, 320, 1024, 1280)
"""Official crop: (top, left, height, width) inside the 1920x1080 frame."""
TRAIN_PART_VALUES = {0: 0, 10: 1, 20: 2, 30: 3, 40: 0}
"""Train instrument masks (parts_mapping.json): 0 bg, 10 shaft, 20 wrist, 30 clasper, 40 probe."""
TEST_PART_VALUES = {0: 0, 30: 1, 100: 2, 255: 3, 200: 0}
"""Test PartsSegmentation maps: 30 shaft, 100 wrist, 255 clasper, 200 probe."""
_DATASET_DIR = re.compile(r"instrument_dataset_(\d+)$")


class EndoVis2017Source(UnifiedLabelSource):
    """EndoVis2017 as a SiteSource; see the module docstring for layout and encodings.

    Options: ``crop`` (official 1280x1024 crop), ``fold`` (None: official split; 0-3: 4-fold
    split, held-out sequences as ``val``), ``test_sequences`` (official test datasets to use),
    ``train_dir`` / ``test_dir`` (relative to ``root`` or absolute), ``on_unknown_label``.
    """

    def __init__(
        self,
        root: Path,
        name: str,
        *,
        surgery_type: str = "nephrectomy",
        crop: bool = False,
        fold: int | None = None,
        test_sequences: list[int] | tuple[int, ...] = TEST_SEQUENCES,
        train_dir: str = "train",
        test_dir: str = "test",
        on_unknown_label: str = "error",
        **unknown_options: Any,
    ) -> None:
        reject_unknown_options(type(self), name, unknown_options)
        self.name = name
        self.surgery_type = surgery_type
        self.root = require_dir(
            Path(root), f"site {name!r}: EndoVis2017 root", "see data/README.md (site A)"
        )
        if fold is not None and fold not in FOLDS:
            raise DataError(
                f"site {name!r}: option fold={fold!r}; use null or one of {list(FOLDS)}"
            )
        bad = [s for s in test_sequences if s not in TEST_SEQUENCES]
        if bad:
            raise DataError(f"site {name!r}: test_sequences {bad} not in {list(TEST_SEQUENCES)}")
        self.crop = bool(crop)
        self.fold = fold
        self.test_sequences = tuple(int(s) for s in test_sequences)
        self.train_dir = self.root / train_dir
        self.test_dir = self.root / test_dir
        self.on_unknown_label = check_policy(on_unknown_label, name)
        self._train_table = value_table(TRAIN_PART_VALUES)
        self._test_table = value_table(TEST_PART_VALUES)
        self._cache: dict[str, list[VideoRecord]] = {}

    # --- listing --------------------------------------------------------------------------

    def videos(self, split: str) -> list[VideoRecord]:
        """Videos of ``split``; train/val from the training release, test from the test release."""
        if split not in self._cache:
            if split == "test":
                self._cache[split] = self._test_videos()
            elif split in ("train", "val"):
                held_out = FOLDS[self.fold] if self.fold is not None else ()
                if split == "train":
                    chosen = [s for s in TRAIN_SEQUENCES if s not in held_out]
                else:
                    chosen = list(held_out)
                self._cache[split] = [self._train_video(s) for s in chosen]
            else:
                raise DataError(f"site {self.name!r}: unknown split {split!r}")
        return self._cache[split]

    def _train_video(self, sequence: int) -> VideoRecord:
        folder = require_dir(
            self.train_dir / f"instrument_dataset_{sequence}",
            f"site {self.name!r}: EndoVis2017 training sequence",
            "unpack the training release into <root>/train (data/README.md, site A)",
        )
        frames = _frame_files(folder / "left_frames")
        ground_truth = require_dir(
            folder / "ground_truth", "EndoVis2017 ground truth", "it ships with the training set"
        )
        numbers = sorted(frames)
        return VideoRecord(
            video_id=f"instrument_dataset_{sequence}",
            times=[n * FRAME_PERIOD_S for n in numbers],
            frames=[FrameRef(frames[n]) for n in numbers],
            labels={i: LabelRef(ground_truth, key=frames[n].name) for i, n in enumerate(numbers)},
        )

    def _test_videos(self) -> list[VideoRecord]:
        parts = self._find_test_labels()
        records = []
        for sequence in self.test_sequences:
            test_folder = self.test_dir / f"instrument_dataset_{sequence}" / "left_frames"
            if not test_folder.is_dir():
                log.warning("site %r: test frames %s not found; skipping", self.name, test_folder)
                continue
            frames = _frame_files(test_folder)
            context = self.train_dir / f"instrument_dataset_{sequence}" / "left_frames"
            all_frames = {**(_frame_files(context) if context.is_dir() else {}), **frames}
            labels_dir = parts.get(sequence)
            numbers = sorted(all_frames)
            labels = {}
            for position, number in enumerate(numbers):
                label_file = labels_dir / all_frames[number].name if labels_dir else None
                if number in frames and label_file is not None and label_file.is_file():
                    labels[position] = LabelRef(label_file)
            if not labels:
                log.warning(
                    "site %r: no PartsSegmentation labels for test dataset %d under %s",
                    self.name,
                    sequence,
                    self.root,
                )
                continue
            records.append(
                VideoRecord(
                    video_id=f"instrument_dataset_{sequence}",
                    times=[n * FRAME_PERIOD_S for n in numbers],
                    frames=[FrameRef(all_frames[n]) for n in numbers],
                    labels=labels,
                )
            )
        return records

    def _find_test_labels(self) -> dict[int, Path]:
        """instrument_dataset number -> its PartsSegmentation folder, searched under the root."""
        found: dict[int, Path] = {}
        for folder in sorted(self.root.rglob("PartsSegmentation")):
            if not folder.is_dir() or self.train_dir in folder.parents:
                continue
            owner = next((p for p in folder.parents if _DATASET_DIR.search(p.name)), None)
            if owner is None:
                log.warning("%s: no instrument_dataset_k parent folder; skipped", folder)
                continue
            sequence = int(_DATASET_DIR.search(owner.name).group(1))
            if sequence in found and found[sequence] != folder:
                raise DataError(
                    f"two PartsSegmentation folders for test dataset {sequence}: "
                    f"{found[sequence]} and {folder}; keep one"
                )
            found[sequence] = folder
        return found

    # --- reading --------------------------------------------------------------------------

    def read_frame(self, ref: FrameRef) -> np.ndarray:
        """RGB uint8 [H, W, 3]; [1024, 1280, 3] when ``crop`` is set."""
        return self._crop(read_frame_ref(ref), ref.path)

    def frame_size(self, ref: FrameRef) -> tuple[int, int]:
        """(H, W) as ``read_frame`` returns it (the crop size when ``crop`` is set)."""
        size = frame_file_size(ref)
        if not self.crop:
            return size
        if size != CROP_SOURCE_HW:
            raise DataError(
                f"{ref.path}: crop needs a {CROP_SOURCE_HW[1]}x{CROP_SOURCE_HW[0]} image, found "
                f"{size[1]}x{size[0]}; set option crop: false for other sizes"
            )
        return CROP_BOX[2], CROP_BOX[3]

    def decode_label(self, ref: LabelRef) -> DecodedLabel:
        """Unified map [H, W]: combined instrument folders (train) or a PartsSegmentation map."""
        if ref.key is None:  # a combined test map: test encoding
            decoded = decode_values(read_grey_mask(ref.path), self._test_table)
        else:  # a training ground_truth folder: one mask per instrument, train encoding
            decoded = self._combine_instruments(ref)
        decoded.label = self._crop(decoded.label, ref.path)
        return decoded

    def _combine_instruments(self, ref: LabelRef) -> DecodedLabel:
        instrument_dirs = sorted(p for p in ref.path.iterdir() if p.is_dir())
        if not instrument_dirs:
            raise DataError(f"{ref.path}: no instrument folders; the ground truth is incomplete")
        label: np.ndarray | None = None
        unknown: dict[str, int] = {}
        first_file: Path | None = None
        for folder in instrument_dirs:
            if folder.name.lower().startswith("other"):  # non-robotic tools -> background
                continue
            mask_file = folder / ref.key
            raw = read_grey_mask(mask_file)  # [H, W] uint8
            if label is None:
                label = np.zeros(raw.shape, dtype=np.uint8)
                first_file = mask_file
            elif raw.shape != label.shape:
                raise DataError(
                    f"size mismatch: {mask_file} is {raw.shape[0]}x{raw.shape[1]} but "
                    f"{first_file} is {label.shape[0]}x{label.shape[1]} (HxW); fix the mask"
                )
            decoded = decode_values(raw, self._train_table)
            drawn = raw != 0  # later folders win where instruments overlap
            label[drawn] = decoded.label[drawn]
            for value, count in decoded.unknown.items():
                unknown[f"{value} in {folder.name}"] = count
        if label is None:  # only Other* folders: all background, size from the frame
            frame_file = ref.path.parent / "left_frames" / ref.key
            label = np.zeros(read_frame_ref(FrameRef(frame_file)).shape[:2], dtype=np.uint8)
        return DecodedLabel(label, unknown)

    def _crop(self, image: np.ndarray, path: Path) -> np.ndarray:
        if not self.crop:
            return image
        if image.shape[:2] != CROP_SOURCE_HW:
            raise DataError(
                f"{path}: crop needs a {CROP_SOURCE_HW[1]}x{CROP_SOURCE_HW[0]} image, found "
                f"{image.shape[1]}x{image.shape[0]}; set option crop: false for other sizes"
            )
        top, left, height, width = CROP_BOX
        return np.ascontiguousarray(image[top : top + height, left : left + width])


def _frame_files(folder: Path) -> dict[int, Path]:
    """frame number -> file for ``frameNNN.png`` (or .jpg) files in ``folder``."""
    require_dir(folder, "EndoVis2017 frame folder", "see data/README.md (site A)")
    files = {
        trailing_number(p.stem, p): p
        for p in folder.iterdir()
        if p.suffix.lower() in (".png", ".jpg", ".jpeg") and p.stem.startswith("frame")
    }
    if not files:
        raise DataError(f"{folder}: no frameNNN.png files")
    return files
