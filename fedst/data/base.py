"""The contract every dataset backend fulfils.

A backend (procedural/generic layout, EndoVis2017, EndoVis2018, SAR-RARP50, GraSP, SISVSE) turns a
dataset on disk into :class:`VideoRecord` lists per split and knows how to read one frame and one
label map. Everything above it (clip assembly, augmentation, batching) is shared and lives in
:mod:`fedst.data.clips`.

Unified labels: 0 background, 1 shaft, 2 wrist, 3 jaw, 255 ignore. A binary site (GraSP) yields
0 background / 1 instrument / 255 ignore and sets ``binary = True``.
"""

from __future__ import annotations

import abc
import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from fedst.errors import UserError
from fedst.schema.labels import CLASS_NAMES as CLASS_NAMES  # the encoding, re-exported here
from fedst.schema.labels import IGNORE_INDEX
from fedst.schema.labels import NUM_CLASSES as NUM_CLASSES

SPLITS = ("train", "val", "test")


class DataError(UserError, ValueError):
    """Bad input on disk. The message names the file, the value found and what to do."""


def check_label_values(
    labels: torch.Tensor,
    num_classes: int,
    ignore_index: int = IGNORE_INDEX,
    where: str = "labels",
    hint: str = "check the label encoding of the dataset backend and network.num_classes",
) -> None:
    """ValueError naming ``where`` and the first bad values unless every value of the integer map
    ``labels`` is a class in [0, num_classes) or ``ignore_index``. Meant for CPU tensors: on a
    GPU the check would make the host wait for the device."""
    bad = ((labels < 0) | (labels >= num_classes)) & (labels != ignore_index)
    if bad.any():
        values = sorted(labels[bad].unique().tolist())[:5]
        raise ValueError(
            f"{where}: labels must be in [0, {num_classes}) or {ignore_index}; got value(s) "
            f"{values}; {hint}"
        )


MIN_FPS = 0.1
"""Lowest accepted frame rate (one frame per 10 s): below it clip frames 0.2 s apart cannot exist."""
MAX_FPS = 1000.0
"""Highest accepted frame rate. Surgical video is recorded at 25-60 fps (high-speed cameras: a few
hundred); a larger value is a typo or a unit error and would make every clip repeat one frame."""


def check_fps(value: object, where: str) -> float:
    """``value`` as a frame rate in [MIN_FPS, MAX_FPS], else a DataError naming ``where``."""
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or not MIN_FPS <= value <= MAX_FPS
    ):
        raise DataError(
            f"{where}: fps must be a finite number in [{MIN_FPS}, {MAX_FPS}] (frames per "
            f"second of the source video), found {value!r}"
        )
    return float(value)


@dataclass(frozen=True)
class FrameRef:
    """Where one frame's pixels are: an image file, or frame ``video_frame`` of a video file."""

    path: Path
    video_frame: int | None = None


@dataclass(frozen=True)
class LabelRef:
    """Where one frame's label lives; ``key`` is backend-specific extra addressing (or None)."""

    path: Path
    key: str | None = None


@dataclass
class VideoRecord:
    """One video of a site: its available frames in time order and the labelled ones among them.

    times:  seconds since the video's start, strictly increasing, one per entry of ``frames``.
    labels: position in ``frames`` -> label of that frame (only labelled frames are samples).
    """

    video_id: str
    times: list[float]
    frames: list[FrameRef]
    labels: dict[int, LabelRef] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if len(self.times) != len(self.frames):
            raise DataError(
                f"video {self.video_id!r}: {len(self.times)} times for {len(self.frames)} frames"
            )
        if not all(math.isfinite(t) for t in self.times):
            raise DataError(f"video {self.video_id!r}: frame times are not all finite numbers")
        if any(b <= a for a, b in zip(self.times, self.times[1:], strict=False)):
            raise DataError(f"video {self.video_id!r}: frame times are not strictly increasing")


class SiteSource(abc.ABC):
    """One site's data on disk, in whatever layout the dataset ships.

    Subclasses set ``name``, ``surgery_type``, ``binary`` and implement the three methods.
    ``read_frame`` returns RGB uint8 [H, W, 3]; ``read_label`` returns the unified uint8 map [H, W].
    Both raise :class:`DataError` naming the file on any problem.
    """

    name: str
    surgery_type: str
    binary: bool = False

    @abc.abstractmethod
    def videos(self, split: str) -> list[VideoRecord]:
        """The videos of ``split`` (one of :data:`SPLITS`), each with at least one label."""

    @abc.abstractmethod
    def read_frame(self, ref: FrameRef) -> np.ndarray:
        """RGB uint8 [H, W, 3]."""

    @abc.abstractmethod
    def read_label(self, ref: LabelRef) -> np.ndarray:
        """Unified label map uint8 [H, W] (values in 0..3 or 0..1 when binary, plus 255)."""
