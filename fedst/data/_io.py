"""Image, video and label-decoding helpers shared by the real dataset backends.

Everything here raises :class:`~fedst.data.base.DataError` naming the file on a problem. Label
decoding is table driven: a backend maps each raw value (or colour) to a unified class, and any
value the table does not know is counted as *unknown*. :class:`UnifiedLabelSource.read_label` turns
unknown values into an error (default) or into ``IGNORE_INDEX`` (option ``on_unknown_label:
ignore``); the dataset checker calls :meth:`UnifiedLabelSource.decode_label` directly so it can
report unknown values whatever the policy.
"""

from __future__ import annotations

import abc
import functools
import inspect
import logging
import os
import re
import threading
from collections import OrderedDict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import cv2
import numpy as np
from PIL import Image, UnidentifiedImageError

from fedst.data.base import IGNORE_INDEX, DataError, FrameRef, LabelRef, SiteSource

log = logging.getLogger(__name__)

UNKNOWN_POLICIES = ("error", "ignore")
"""Values of the ``on_unknown_label`` backend option."""
_UNKNOWN = -1
_OPEN_VIDEOS_PER_PROCESS = 4


@dataclass
class DecodedLabel:
    """A unified label map [H, W] uint8 (unknown pixels already set to 255) and the unknown raw
    values found, as ``{printable value: pixel count}``."""

    label: np.ndarray
    unknown: dict[str, int] = field(default_factory=dict)


class UnifiedLabelSource(SiteSource, abc.ABC):
    """A SiteSource whose labels are decoded through a table; handles the unknown-label policy."""

    on_unknown_label: str = "error"

    @abc.abstractmethod
    def decode_label(self, ref: LabelRef) -> DecodedLabel:
        """Unified map [H, W] uint8 plus the unknown raw values with their pixel counts."""

    def read_label(self, ref: LabelRef) -> np.ndarray:
        """Unified label map uint8 [H, W]; unknown raw values raise unless the policy is ignore."""
        decoded = self.decode_label(ref)
        if decoded.unknown and self.on_unknown_label == "error":
            raise DataError(
                f"{describe_label(ref)}: unknown label value(s) {format_counts(decoded.unknown)} "
                f"(value: pixel count) for site {self.name!r}; fix the file, or set the site "
                "option on_unknown_label: ignore to map them to 255 (ignored in the loss)"
            )
        return decoded.label

    def read_frame(self, ref: FrameRef) -> np.ndarray:
        """RGB uint8 [H, W, 3] from an image file or from frame ``ref.video_frame`` of a video."""
        return read_frame_ref(ref)

    def frame_size(self, ref: FrameRef) -> tuple[int, int]:
        """(H, W) of a frame as ``read_frame`` returns it, from the file header (no decoding)."""
        return frame_file_size(ref)


def describe_label(ref: LabelRef) -> str:
    """A LabelRef as text for messages: the path, plus the key when there is one."""
    return str(ref.path) if ref.key is None else f"{ref.path} [{ref.key}]"


def format_counts(counts: Mapping[str, int], limit: int = 8) -> str:
    """``{value: count}`` as a short text, largest counts first."""
    items = sorted(counts.items(), key=lambda kv: -kv[1])
    text = ", ".join(f"{value}: {count}" for value, count in items[:limit])
    more = f", ... {len(items) - limit} more" if len(items) > limit else ""
    return "{" + text + more + "}"


def check_policy(value: str, site: str) -> str:
    """Validate the ``on_unknown_label`` option."""
    if value not in UNKNOWN_POLICIES:
        raise DataError(
            f"site {site!r}: option on_unknown_label={value!r} is not one of {UNKNOWN_POLICIES}"
        )
    return value


def reject_unknown_options(cls: type, site: str, unknown: Mapping[str, Any]) -> None:
    """Raise a DataError naming options the backend ``cls`` does not take, and those it does."""
    if not unknown:
        return
    params = inspect.signature(cls.__init__).parameters
    allowed = sorted(p for p in params if p not in ("self", "root", "name", "unknown_options"))
    raise DataError(
        f"site {site!r}: unknown option(s) {sorted(unknown)} for backend {cls.__name__}; "
        f"allowed options: {allowed}"
    )


def require_dir(path: Path, what: str, hint: str) -> Path:
    """``path`` if it is a folder, else a DataError saying what was expected and where to look."""
    if not path.is_dir():
        raise DataError(f"{what} {path} does not exist or is not a folder; {hint}")
    return path


def natural_key(text: str) -> tuple[Any, ...]:
    """Sort key that orders embedded numbers numerically (seq_2 < seq_10)."""
    return tuple(int(t) if t.isdigit() else t.lower() for t in re.split(r"(\d+)", text))


def trailing_number(text: str, path: Path) -> int:
    """The last integer in ``text`` (e.g. frame index of ``frame012``); DataError if none."""
    numbers = re.findall(r"\d+", text)
    if not numbers:
        raise DataError(f"{path}: expected a number in the name {text!r}")
    return int(numbers[-1])


# ---------------------------------------------------------------------------------------------
# Reading pixels


def read_image_any(path: Path) -> np.ndarray:
    """The image as stored (grey [H, W], or RGB / RGBA [H, W, 3|4] in RGB channel order), uint8."""
    if not path.is_file():
        raise DataError(f"{path}: file not found")
    data = np.fromfile(str(path), dtype=np.uint8)
    image = cv2.imdecode(data, cv2.IMREAD_UNCHANGED) if data.size else None
    if image is None:
        raise DataError(f"{path}: cannot decode the image (corrupt or not an image); replace it")
    if image.dtype != np.uint8:
        if image.dtype == np.uint16 and int(image.max(initial=0)) <= 255:
            image = image.astype(np.uint8)
        else:
            raise DataError(
                f"{path}: image of type {image.dtype} with values up to {image.max()}; "
                "expected 8-bit"
            )
    if image.ndim == 3 and image.shape[2] == 1:
        image = image[:, :, 0]
    elif image.ndim == 3 and image.shape[2] == 3:
        image = cv2.cvtColor(image, cv2.COLOR_BGR2RGB)
    elif image.ndim == 3 and image.shape[2] == 4:
        image = cv2.cvtColor(image, cv2.COLOR_BGRA2RGBA)
    elif image.ndim != 2:
        raise DataError(f"{path}: unexpected image shape {image.shape}")
    return image


def read_rgb(path: Path) -> np.ndarray:
    """RGB uint8 [H, W, 3] (grey is replicated, alpha dropped)."""
    image = read_image_any(path)
    if image.ndim == 2:
        return np.repeat(image[:, :, None], 3, axis=2)  # [H, W] -> [H, W, 3]
    return np.ascontiguousarray(image[:, :, :3])


def read_grey_mask(path: Path) -> np.ndarray:
    """A single-channel mask uint8 [H, W]; masks saved with 3 or 4 channels give channel 0."""
    image = read_image_any(path)
    return image if image.ndim == 2 else np.ascontiguousarray(image[:, :, 0])


def read_colour_mask(path: Path) -> np.ndarray:
    """A colour-coded mask as RGB uint8 [H, W, 3] (alpha dropped, never converted to grey)."""
    image = read_image_any(path)
    if image.ndim == 2:
        raise DataError(f"{path}: expected an RGB or RGBA colour label, found a grey image")
    return np.ascontiguousarray(image[:, :, :3])


class _VideoCache:
    """A few open ``cv2.VideoCapture`` per process, so reading consecutive frames needs no seek.

    Random access seeks with ``CAP_PROP_POS_FRAMES`` (frame-exact for intra-coded MJPG; for
    inter-coded video OpenCV's FFmpeg backend decodes from the previous key frame, which is slow:
    prefer extracted frames such as SAR-RARP50's ``rgb/`` for training).
    """

    def __init__(self) -> None:
        self.pid = os.getpid()
        self.lock = threading.Lock()
        self.open: OrderedDict[Path, list[Any]] = OrderedDict()  # path -> [capture, next index]

    def read(self, path: Path, index: int) -> np.ndarray:
        if self.pid != os.getpid():  # forked into a DataLoader worker: never share captures
            self.pid, self.lock, self.open = os.getpid(), threading.Lock(), OrderedDict()
        with self.lock:
            return self._read(path, index)

    def _read(self, path: Path, index: int) -> np.ndarray:
        entry = self.open.pop(path, None)
        if entry is None:
            if not path.is_file():
                raise DataError(f"{path}: video file not found")
            capture = cv2.VideoCapture(str(path))
            if not capture.isOpened():
                raise DataError(f"{path}: OpenCV cannot open the video; re-encode or replace it")
            entry = [capture, 0]
        capture = entry[0]
        if entry[1] != index:
            capture.set(cv2.CAP_PROP_POS_FRAMES, index)
        ok, frame = capture.read()
        if not ok or frame is None:
            capture.release()
            raise DataError(f"{path}: cannot decode frame {index} (past the end or corrupt video)")
        entry[1] = index + 1
        self.open[path] = entry
        while len(self.open) > _OPEN_VIDEOS_PER_PROCESS:
            _, (old, _) = self.open.popitem(last=False)
            old.release()
        return cv2.cvtColor(frame, cv2.COLOR_BGR2RGB)


_VIDEOS = _VideoCache()


def read_video_frame(path: Path, index: int) -> np.ndarray:
    """Frame ``index`` (0-based) of the video at ``path`` as RGB uint8 [H, W, 3]."""
    return _VIDEOS.read(path, index)


def video_frame_count(path: Path) -> int:
    """Number of frames OpenCV reports for a video; DataError when it cannot open it."""
    capture = cv2.VideoCapture(str(path))
    try:
        if not capture.isOpened():
            raise DataError(f"{path}: OpenCV cannot open the video; re-encode or replace it")
        count = int(capture.get(cv2.CAP_PROP_FRAME_COUNT))
    finally:
        capture.release()
    if count <= 0:
        raise DataError(f"{path}: OpenCV reports no frames; re-encode the video")
    return count


@functools.lru_cache(maxsize=256)
def video_size(path: Path) -> tuple[int, int]:
    """(H, W) of a video's frames from OpenCV's properties (cached per path)."""
    capture = cv2.VideoCapture(str(path))
    try:
        if not capture.isOpened():
            raise DataError(f"{path}: OpenCV cannot open the video; re-encode or replace it")
        return int(capture.get(cv2.CAP_PROP_FRAME_HEIGHT)), int(
            capture.get(cv2.CAP_PROP_FRAME_WIDTH)
        )
    finally:
        capture.release()


def frame_file_size(ref: FrameRef) -> tuple[int, int]:
    """(H, W) of an image file from its header, or of a video from OpenCV's properties."""
    if ref.video_frame is not None:
        return video_size(ref.path)
    try:
        with Image.open(ref.path) as image:
            width, height = image.size
    except (OSError, UnidentifiedImageError) as err:
        raise DataError(f"{ref.path}: unreadable image ({err}); replace it") from err
    return height, width


def read_frame_ref(ref: FrameRef) -> np.ndarray:
    """RGB uint8 [H, W, 3] for an image FrameRef or a video FrameRef."""
    if ref.video_frame is not None:
        return read_video_frame(ref.path, ref.video_frame)
    return read_rgb(ref.path)


# ---------------------------------------------------------------------------------------------
# Decoding raw labels


def value_table(mapping: Mapping[int, int], extra_known: Iterable[int] = ()) -> np.ndarray:
    """A 256-entry lookup table raw value -> unified class; unmapped values are unknown (-1)."""
    table = np.full(256, _UNKNOWN, dtype=np.int16)
    for raw, unified in mapping.items():
        table[raw] = unified
    for raw in extra_known:
        table[raw] = 0
    return table


def decode_values(raw: np.ndarray, table: np.ndarray) -> DecodedLabel:
    """Map a grey mask [H, W] uint8 through ``table``; unknown values become 255 and are counted."""
    mapped = table[raw]  # [H, W] int16, -1 where unknown
    unknown_mask = mapped == _UNKNOWN
    unknown: dict[str, int] = {}
    if unknown_mask.any():
        values, counts = np.unique(raw[unknown_mask], return_counts=True)
        unknown = {str(int(v)): int(c) for v, c in zip(values, counts, strict=True)}
        mapped[unknown_mask] = IGNORE_INDEX
    return DecodedLabel(mapped.astype(np.uint8), unknown)


def decode_colours(rgb: np.ndarray, colours: Mapping[tuple[int, int, int], int]) -> DecodedLabel:
    """Match every pixel of an RGB mask [H, W, 3] EXACTLY against ``colours`` -> unified class."""
    keys = _colour_keys(rgb)  # [H, W] int32
    known = np.array(sorted(_colour_key(c) for c in colours), dtype=np.int32)
    classes = np.array([colours[c] for c in sorted(colours, key=_colour_key)], dtype=np.uint8)
    position = np.clip(np.searchsorted(known, keys), 0, len(known) - 1)
    matched = known[position] == keys
    label = np.where(matched, classes[position], IGNORE_INDEX).astype(np.uint8)
    unknown: dict[str, int] = {}
    if not matched.all():
        values, counts = np.unique(keys[~matched], return_counts=True)
        unknown = {
            str((int(v) >> 16, (int(v) >> 8) & 255, int(v) & 255)): int(c)
            for v, c in zip(values, counts, strict=True)
        }
    return DecodedLabel(label, unknown)


def _colour_key(colour: tuple[int, int, int]) -> int:
    r, g, b = colour
    return (int(r) << 16) | (int(g) << 8) | int(b)


def _colour_keys(rgb: np.ndarray) -> np.ndarray:
    rgb = rgb.astype(np.int32)
    return (rgb[:, :, 0] << 16) | (rgb[:, :, 1] << 8) | rgb[:, :, 2]  # [H, W, 3] -> [H, W]


def check_same_size(shape_a: tuple[int, ...], shape_b: tuple[int, ...], what: str) -> None:
    """DataError when two [H, W] sizes differ; ``what`` names the files involved."""
    if tuple(shape_a[:2]) != tuple(shape_b[:2]):
        raise DataError(
            f"size mismatch: {what} ({shape_a[0]}x{shape_a[1]} vs {shape_b[0]}x{shape_b[1]} HxW)"
        )
