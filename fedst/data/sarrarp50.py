"""SAR-RARP50 (site C: robot-assisted radical prostatectomy).

Layout (reference/datasets.md, section C)::

    <root>/{train1,train2,test}/video_*/video_left.avi          60 fps
    <root>/{train1,train2,test}/video_*/segmentation/%09d.png    1 Hz masks (every 60th frame)
    <root>/{train1,train2,test}/video_*/rgb/%09d.png             10 Hz frames (official toolkit)

A file name is the frame's index in the 60 fps video, so ``times = index / 60``. Clip frames come
from ``rgb/`` when it exists (labelled frames missing there are decoded from the video), otherwise
from ``video_left.avi`` with OpenCV: every ``video_frame_step``-th frame (default 6, i.e. 10 Hz like
``rgb/``) plus every labelled frame. Masks are single-channel class ids: 3 tool shaft -> shaft,
2 tool wrist -> wrist, 1 tool clasper -> jaw, 4-9 (needle, thread, suction tool, needle holder,
clamps, catheter) -> background.

Why SAR-RARP50 for site C: the FedST paper cites the GraSP paper for its RARP site, but only
SAR-RARP50 has shaft / wrist / clasper labels (see data/README.md).
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
    trailing_number,
    value_table,
    video_frame_count,
)
from fedst.data.base import DataError, FrameRef, LabelRef, VideoRecord

log = logging.getLogger(__name__)

VIDEO_FPS = 60.0
"""Frame rate of ``video_left.avi``; file names are frame indices at this rate."""
CLASS_VALUES = {0: 0, 1: 3, 2: 2, 3: 1, 4: 0, 5: 0, 6: 0, 7: 0, 8: 0, 9: 0}
"""Mask id -> unified class: 1 clasper -> jaw, 2 wrist, 3 shaft, 4-9 other objects -> 0."""
FRAME_SOURCES = ("auto", "rgb", "video")
VIDEO_FILE = "video_left.avi"


class SarRarp50Source(UnifiedLabelSource):
    """SAR-RARP50 as a SiteSource; see the module docstring for layout and decoding.

    Options: ``train_dirs`` / ``test_dirs`` (folders of ``video_*`` under ``root``),
    ``frame_source`` (auto | rgb | video), ``video_frame_step`` (frames listed from the video when
    decoding it), ``on_unknown_label``.
    """

    def __init__(
        self,
        root: Path,
        name: str,
        *,
        surgery_type: str = "prostatectomy",
        train_dirs: list[str] | tuple[str, ...] = ("train1", "train2"),
        test_dirs: list[str] | tuple[str, ...] = ("test",),
        frame_source: str = "auto",
        video_frame_step: int = 6,
        on_unknown_label: str = "error",
        **unknown_options: Any,
    ) -> None:
        reject_unknown_options(type(self), name, unknown_options)
        self.name = name
        self.surgery_type = surgery_type
        self.root = require_dir(
            Path(root), f"site {name!r}: SAR-RARP50 root", "see data/README.md (site C)"
        )
        if frame_source not in FRAME_SOURCES:
            raise DataError(
                f"site {name!r}: option frame_source={frame_source!r}; use one of {FRAME_SOURCES}"
            )
        if int(video_frame_step) < 1:
            raise DataError(
                f"site {name!r}: option video_frame_step={video_frame_step} must be >= 1"
            )
        self.split_dirs = {"train": tuple(train_dirs), "val": (), "test": tuple(test_dirs)}
        self.frame_source = frame_source
        self.video_frame_step = int(video_frame_step)
        self.on_unknown_label = check_policy(on_unknown_label, name)
        self._table = value_table(CLASS_VALUES)
        self._cache: dict[str, list[VideoRecord]] = {}

    def videos(self, split: str) -> list[VideoRecord]:
        """Every ``video_*`` folder under the split's folders that has segmentation masks."""
        if split not in self.split_dirs:
            raise DataError(f"site {self.name!r}: unknown split {split!r}")
        if split not in self._cache:
            records = []
            for split_dir in self.split_dirs[split]:
                base = self.root / split_dir
                if not base.is_dir():
                    log.warning("site %s: split folder %s not found", self.name, base)
                    continue
                folders = sorted(base.glob("video_*"), key=lambda p: natural_key(p.name))
                for folder in folders:
                    if folder.is_dir():
                        record = self._video(f"{split_dir}/{folder.name}", folder)
                        if record is not None:
                            records.append(record)
            self._cache[split] = records
        return self._cache[split]

    def _video(self, video_id: str, folder: Path) -> VideoRecord | None:
        masks_dir = folder / "segmentation"
        if not masks_dir.is_dir():
            log.warning("%s: no segmentation folder; video skipped", folder)
            return None
        masks = {trailing_number(p.stem, p): p for p in masks_dir.glob("*.png")}
        if not masks:
            log.warning("%s: no masks; video skipped", masks_dir)
            return None
        video_file = folder / VIDEO_FILE
        rgb_dir = folder / "rgb"
        use_rgb = self.frame_source == "rgb" or (self.frame_source == "auto" and rgb_dir.is_dir())
        frames: dict[int, FrameRef] = {}
        if use_rgb:
            require_dir(rgb_dir, "SAR-RARP50 frame folder", "run the toolkit's frame extraction")
            frames = {
                trailing_number(p.stem, p): FrameRef(p)
                for p in rgb_dir.iterdir()
                if p.suffix.lower() in (".png", ".jpg")
            }
            for index in masks:
                if index not in frames:
                    if not video_file.is_file():
                        raise DataError(
                            f"{rgb_dir / f'{index:09d}.png'}: frame of mask {masks[index]} is "
                            f"missing and there is no {video_file} to decode it from"
                        )
                    frames[index] = FrameRef(video_file, video_frame=index)
        else:
            if not video_file.is_file():
                raise DataError(f"{video_file}: missing; needed for frames (no rgb/ folder)")
            count = video_frame_count(video_file)
            beyond = sorted(i for i in masks if i >= count)
            if beyond:
                raise DataError(
                    f"{masks[beyond[0]]}: frame index {beyond[0]} is past the end of {video_file} "
                    f"({count} frames)"
                )
            indices = set(range(0, count, self.video_frame_step)) | set(masks)
            frames = {i: FrameRef(video_file, video_frame=i) for i in indices}
        indices = sorted(frames)
        position = {index: pos for pos, index in enumerate(indices)}
        return VideoRecord(
            video_id=video_id,
            times=[index / VIDEO_FPS for index in indices],
            frames=[frames[index] for index in indices],
            labels={position[index]: LabelRef(path) for index, path in masks.items()},
        )

    def decode_label(self, ref: LabelRef) -> DecodedLabel:
        """Unified map [H, W] from a class-id mask [H, W] (3-channel masks give channel 0)."""
        return decode_values(read_grey_mask(ref.path), self._table)
