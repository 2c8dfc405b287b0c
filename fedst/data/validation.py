"""Validation of a site's data before training: every labelled frame and every frame a clip uses
is decoded in full, every label is read; the result is cached so that it is paid once.

What is an error (shared by ``python -m fedst.data.check`` and ``train_fed.py``, which validates
every configured site before any training starts, see :func:`fedst.data.site_checks.validate_experiment_data`):

* a frame that does not decode, or decodes from a truncated file: a JPEG without its end-of-image
  marker (OpenCV would return a half-grey image and only warn on stderr) or a PNG without its
  IEND chunk;
* a frame smaller than :data:`MIN_FRAME_SIDE` pixels on a side (placeholders, broken exports);
* a label that does not decode, holds values outside the site's classes and 255 (or unknown raw
  values under ``on_unknown_label: error``), or whose size differs from its frame's;
* a split the site's role needs (:data:`REQUIRED_SPLITS`) without labelled frames.

Frame rates are checked where the videos are listed (:func:`fedst.data.base.check_fps`).

Cache: one JSON file per site under :func:`cache_dir` (``$FEDST_CACHE_DIR``, else
``$XDG_CACHE_HOME/fedst``, else ``~/.cache/fedst``) maps each file that passed to its size and
modification time (ns); a file whose size or mtime changed is decoded again. Only passing files
are cached, so a problem is reported on every run until it is fixed. Dataset folders stay
read-only.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Protocol

import numpy as np

from fedst import user_cache_dir
from fedst.data.base import (
    IGNORE_INDEX,
    NUM_CLASSES,
    DataError,
    FrameRef,
    LabelRef,
    SiteSource,
    VideoRecord,
)


class ClipSamples(Protocol):
    """What :func:`dataset_problems` reads of a split's samples (a
    :class:`fedst.data.clips.ClipDataset`): its site, label encoding and each sample's frames."""

    source: SiteSource
    binary: bool

    def __len__(self) -> int: ...

    def sample_ref(self, index: int) -> tuple[VideoRecord, int]: ...

    def clip_positions(self, video: VideoRecord, position: int) -> list[int]: ...


log = logging.getLogger(__name__)

MIN_FRAME_SIDE = 8
"""Frames (and so labels) must be at least this many pixels high and wide. Surgical frames are
hundreds of pixels; a few-pixel image is a placeholder or a broken export that would silently be
upsampled to the network's input size."""
REQUIRED_SPLITS: dict[str, tuple[str, ...]] = {
    "federation": ("train", "test"),
    "out_of_federation": ("test",),
    "server": ("train",),
}
"""Splits a site must have labelled frames in, by its role in the data config."""
MAX_REPORTED_PROBLEMS = 20
VALIDATION_VERSION = 1
"""Bump when the checks change: older cache files are then ignored."""
JPEG_SUFFIXES = (".jpg", ".jpeg")
JPEG_END = b"\xff\xd9"
PNG_END = b"IEND\xaeB`\x82"
_TAIL_BYTES = 64


def cache_dir() -> Path:
    """Where validation results are cached (see the module docstring)."""
    return user_cache_dir()


class ValidationCache:
    """``{key: [size, mtime_ns, height, width]}`` of files that passed, in one JSON file."""

    def __init__(self, path: Path | None) -> None:
        self.path = path
        self.entries: dict[str, list[int]] = {}
        self.hits = 0
        self._lock = threading.Lock()
        self._dirty = False
        if path is not None and path.is_file():
            try:
                data = json.loads(path.read_text())
                if data.get("version") == VALIDATION_VERSION:
                    self.entries = {k: list(v) for k, v in data["entries"].items()}
            except (OSError, ValueError, KeyError, AttributeError, TypeError):
                log.warning("validation cache %s is unreadable; validating from scratch", path)

    @classmethod
    def for_site(cls, source: SiteSource) -> ValidationCache:
        """The cache file of one site: by backend class, data folder, site name and the source's
        scalar settings (options such as a crop change what a frame decodes to)."""
        source = decoded_source(source)
        root = getattr(source, "site_root", None) or getattr(source, "root", "")
        settings = {k: v for k, v in vars(source).items() if isinstance(v, (str, int, float, bool))}
        ident = f"{type(source).__module__}.{type(source).__name__}|{Path(root).resolve()}|"
        ident += json.dumps(settings, sort_keys=True, default=str)
        digest = hashlib.sha1(ident.encode()).hexdigest()[:16]
        return cls(cache_dir() / "validation" / f"{source.name}-{digest}.json")

    @staticmethod
    def _stamp(path: Path) -> tuple[int, int] | None:
        try:
            stat = path.stat()
        except OSError:
            return None
        return stat.st_size, stat.st_mtime_ns

    def get(self, key: str, path: Path) -> tuple[int, int] | None:
        """(H, W) recorded for ``key`` if ``path`` is unchanged since, else None."""
        entry = self.entries.get(key)
        stamp = self._stamp(path)
        if entry is None or stamp is None or tuple(entry[:2]) != stamp:
            return None
        with self._lock:
            self.hits += 1
        return entry[2], entry[3]

    def put(self, key: str, path: Path, size: tuple[int, int]) -> None:
        stamp = self._stamp(path)
        if stamp is None:
            return
        with self._lock:
            self.entries[key] = [*stamp, int(size[0]), int(size[1])]
            self._dirty = True

    def save(self) -> None:
        """Write the cache atomically (best effort: a read-only cache dir only costs time)."""
        if self.path is None or not self._dirty:
            return
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=".", suffix=".tmp")
            with os.fdopen(fd, "w") as handle:
                json.dump({"version": VALIDATION_VERSION, "entries": self.entries}, handle)
            os.replace(tmp, self.path)
            self._dirty = False
        except OSError as err:
            log.warning("cannot write the validation cache %s (%s)", self.path, err)


def check_complete_file(path: Path) -> None:
    """DataError when a JPEG lacks its end-of-image marker or a PNG its IEND chunk (truncated)."""
    suffix = path.suffix.lower()
    if suffix not in (*JPEG_SUFFIXES, ".png"):
        return
    try:
        with path.open("rb") as handle:
            size = handle.seek(0, os.SEEK_END)
            handle.seek(max(0, size - _TAIL_BYTES))
            tail = handle.read()
    except OSError as err:
        raise DataError(f"{path}: cannot read the file ({err})") from err
    if suffix in JPEG_SUFFIXES:
        complete = tail.rstrip(b"\x00\r\n\t ").endswith(JPEG_END)
        what = "JPEG without its end-of-image marker (FFD9)"
    else:
        complete = tail.endswith(PNG_END)
        what = "PNG without its IEND chunk"
    if not complete:
        raise DataError(f"{path}: truncated image ({what}); re-export or replace the file")


def decode_frame(source: SiteSource, ref: FrameRef) -> tuple[int, int]:
    """Decode frame ``ref`` in full through the site's own reader; (H, W) or a DataError."""
    image = source.read_frame(ref)
    if ref.video_frame is None:  # decoders may return a partial image of a truncated file
        check_complete_file(ref.path)
    height, width = image.shape[:2]
    if min(height, width) < MIN_FRAME_SIDE:
        raise DataError(
            f"{ref.path}: frame of {width}x{height} px (WxH); frames must be at least "
            f"{MIN_FRAME_SIDE} px on each side"
        )
    return height, width


def _frame_key(ref: FrameRef) -> str:
    return f"frame|{ref.path}|{ref.video_frame}"


def decoded_source(source: SiteSource) -> SiteSource:
    """The source whose files a frame cache's source (fedst/data/clips/cache.py) reads: the
    validation results of a site's files are the same with the frame cache or without."""
    from fedst.data.clips.cache import CachedSource

    return source.inner if isinstance(source, CachedSource) else source


def _label_key(source: SiteSource, ref: LabelRef, num_classes: int) -> str:
    source = decoded_source(source)
    policy = getattr(source, "on_unknown_label", "")
    return f"label|{type(source).__name__}|{num_classes}|{policy}|{ref.path}|{ref.key}"


def dataset_problems(dataset: ClipSamples, cache: ValidationCache | None = None) -> list[str]:
    """Every problem of ``dataset``'s files: labelled frames and clip context frames decoded in
    full, labels read and checked against the frames' sizes. One message per bad file."""
    source = dataset.source
    num_classes = 2 if dataset.binary else NUM_CLASSES
    allowed = np.zeros(256, dtype=bool)
    allowed[:num_classes] = True
    allowed[IGNORE_INDEX] = True
    frames: dict[FrameRef, None] = {}
    labelled: list[tuple[FrameRef, LabelRef]] = []
    for index in range(len(dataset)):
        video, position = dataset.sample_ref(index)
        for p in dataset.clip_positions(video, position):
            frames[video.frames[p]] = None
        labelled.append((video.frames[position], video.labels[position]))

    def check_frame(ref: FrameRef) -> tuple[int, int] | str:
        key = _frame_key(ref)
        if cache is not None and (size := cache.get(key, ref.path)) is not None:
            return size
        try:
            size = decode_frame(source, ref)
        except (DataError, OSError) as err:
            return str(err)
        if cache is not None:
            cache.put(key, ref.path, size)
        return size

    def check_label(item: tuple[FrameRef, LabelRef]) -> str | None:
        frame_ref, label_ref = item
        frame_size = sizes.get(frame_ref)
        if isinstance(frame_size, str):
            return None  # the frame's own problem is reported already
        key = _label_key(source, label_ref, num_classes)
        size = cache.get(key, label_ref.path) if cache is not None else None
        if size is None:
            try:
                label = source.read_label(label_ref)
            except (DataError, OSError) as err:
                return str(err)
            counts = np.bincount(label.ravel(), minlength=256)
            bad_values = np.flatnonzero((counts > 0) & ~allowed)
            if bad_values.size:
                return (
                    f"{label_ref.path}: label value(s) {bad_values.tolist()} outside "
                    f"0..{num_classes - 1} and {IGNORE_INDEX}"
                )
            size = label.shape[:2]
        if tuple(size) != tuple(frame_size):
            return (
                f"{label_ref.path}: mask size {tuple(size)} differs from frame size "
                f"{tuple(frame_size)} (HxW) of {frame_ref.path} (size mismatch)"
            )
        if cache is not None:
            cache.put(key, label_ref.path, size)
        return None

    threads = min(4, os.cpu_count() or 1)
    with ThreadPoolExecutor(max_workers=threads) as pool:
        ordered = list(frames)
        sizes = dict(zip(ordered, pool.map(check_frame, ordered), strict=True))
        label_problems = list(pool.map(check_label, labelled))
    problems = [s for s in sizes.values() if isinstance(s, str)]
    problems += [p for p in label_problems if p is not None]
    return problems


def format_problems(header: str, problems: list[str]) -> str:
    """``header`` and the first :data:`MAX_REPORTED_PROBLEMS` problems, then a count."""
    shown = problems[:MAX_REPORTED_PROBLEMS]
    more = len(problems) - len(shown)
    return header + "\n  " + "\n  ".join(shown) + (f"\n  ... and {more} more" if more else "")
