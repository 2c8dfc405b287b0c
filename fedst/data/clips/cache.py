"""The preprocessed frame cache (issue 60, item 4), as nnU-Net preprocesses once: each frame a
site's clips read, decoded once and resized to ``clip.image_size`` (bilinear, the loader's
:func:`~fedst.data.clips.normalization.resize_frame`), and each labelled frame's label resized
(nearest, :meth:`ClipDataset.resize_label`), stored as uint8 ``.npy`` files read memory-mapped.
A :class:`ClipDataset` whose source is a :class:`CachedSource` (``data.cache_dir``) reads its
frames and labels there instead of decoding them; the augmentation, the clip rule and the label
checks run on the same pixels as without the cache (tests/test_data_cache.py).

Layout, one folder per site and input size::

    <cache_dir>/<site>/<H>x<W>/manifest.json
    <cache_dir>/<site>/<H>x<W>/<video key>.frames.npy   uint8 [N, H, W, 3]: the stored positions
    <cache_dir>/<site>/<H>x<W>/<video key>.labels.npy   uint8 [M, H, W]: the labelled positions

A video's key is a digest of its id and its frame and label files (a split's listing of the same
video finds it, whichever split lists it). The manifest holds, per video, the positions stored,
each frame's size on disk, and the ``(path, size, mtime_ns)`` of every source file they came
from with their digest; and the preprocessing settings (:func:`cache_settings`) with theirs.

The digest of the sources is of paths, sizes and modification times, not of contents: checking
contents would read every source file (GBs of video) at every start, the cost the cache removes;
the same stamp decides whether fedst/data/validation.py re-validates a file. A file rewritten
with the same size and modification time (``cp -p`` of another file of equal size) is not seen.

Nothing falls back to decoding: a missing cache, a video not in it, a changed source file, other
settings or a clip needing a frame the cache lacks is a :class:`CacheError` naming the file, what
differs and the command that rebuilds it (:data:`BUILD_COMMAND`). Built by
fedst/data/clips/cache_build.py (``python -m fedst.preprocess build``)."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import cv2
import numpy as np

from fedst.data.base import DataError, FrameRef, LabelRef, SiteSource, VideoRecord

CACHE_FORMAT = 1
"""Version of the layout and of the resize rules below; a change makes every cache stale."""
MANIFEST = "manifest.json"
BUILD_COMMAND = "python -m fedst.preprocess build"
"""The command that (re)builds a cache, with the run's own overrides (fedst/preprocess.py)."""


class CacheError(DataError):
    """The preprocessed cache is missing or does not match its sources or settings."""


def cache_settings(image_size: Sequence[int]) -> dict[str, Any]:
    """What the cached pixels depend on besides the source files: the format, the input size
    (H, W), the resize rules and the OpenCV version that applies them."""
    return {
        "format": CACHE_FORMAT,
        "image_size": [int(image_size[0]), int(image_size[1])],
        "frame_resize": "cv2.resize INTER_LINEAR",
        "label_resize": "cv2.resize INTER_NEAREST",
        "opencv": cv2.__version__,
    }


def digest(value: Any) -> str:
    """sha256 of ``value`` as canonical JSON."""
    return hashlib.sha256(json.dumps(value, sort_keys=True).encode()).hexdigest()


def size_folder(cache_dir: Path | str, site: str, image_size: Sequence[int]) -> Path:
    """``<cache_dir>/<site>/<H>x<W>``: where a site's cache at one input size lives."""
    return Path(cache_dir) / site / f"{int(image_size[0])}x{int(image_size[1])}"


def video_key(video: VideoRecord) -> str:
    """A digest of the video's id and of where each frame and label is (16 hex digits)."""
    frames = [[str(ref.path), ref.video_frame] for ref in video.frames]
    labels = [[p, str(ref.path), ref.key] for p, ref in sorted(video.labels.items())]
    return digest([video.video_id, frames, labels])[:16]


def source_files(video: VideoRecord, positions: Iterable[int]) -> list[Path]:
    """The files the frames at ``positions`` and the video's labels are read from, sorted."""
    refs: list[FrameRef | LabelRef] = [video.frames[p] for p in positions]
    refs += list(video.labels.values())
    return sorted({ref.path for ref in refs}, key=str)


def file_stamps(paths: Iterable[Path], where: str = "", hint: str = "") -> list[list]:
    """``[path, size, mtime_ns]`` of each file; a missing one is a CacheError naming it (after
    ``where``; then ``hint``, what to do)."""
    stamps = []
    for path in paths:
        try:
            stat = Path(path).stat()
        except OSError as err:
            raise CacheError(
                f"{where}source file {path} cannot be read ({err.strerror}){hint}"
            ) from err
        stamps.append([str(path), stat.st_size, stat.st_mtime_ns])
    return stamps


def rebuild_hint(cache_dir: Path | str, image_size: Sequence[int]) -> str:
    height, width = int(image_size[0]), int(image_size[1])
    return (
        f"rebuild it with this run's overrides: {BUILD_COMMAND} <train_fed.py overrides> "
        f"data.cache_dir={cache_dir} clip.image_size=[{height},{width}] (docs/paper-scale.md, "
        f'"The preprocessed cache"), or leave data.cache_dir unset to decode the sources'
    )


class CachedFrames:
    """One split's cached frames and labels, read memory-mapped (opened on first use in each
    process: a loader worker receives the paths, not the arrays).

    ``rows``: video id -> (frames file, {position: row}, labels file, {labelled position: row},
    {position: size on disk (H0, W0)})."""

    def __init__(self, rows: dict[str, tuple[Path, dict, Path, dict, dict]]) -> None:
        self.rows = rows
        self._maps: dict[Path, np.ndarray] = {}

    def __getstate__(self) -> dict[str, Any]:
        return {"rows": self.rows, "_maps": {}}  # memory maps are opened again in the worker

    def _array(self, path: Path) -> np.ndarray:
        if path not in self._maps:
            self._maps[path] = np.load(path, mmap_mode="r")
        return self._maps[path]

    def frame(self, video: VideoRecord, position: int) -> np.ndarray:
        """The frame at ``position`` resized to the input size: uint8 [H, W, 3] (a copy)."""
        frames_file, frame_rows, *_ = self.rows[video.video_id]
        return np.array(self._array(frames_file)[frame_rows[position]])

    def label(self, video: VideoRecord, position: int) -> np.ndarray:
        """The label of the labelled frame at ``position`` resized (nearest): uint8 [H, W]."""
        _, _, labels_file, label_rows, _ = self.rows[video.video_id]
        return np.array(self._array(labels_file)[label_rows[position]])

    def native_size(self, video: VideoRecord, position: int) -> tuple[int, int]:
        """The size on disk (H0, W0) of the frame at ``position``."""
        return self.rows[video.video_id][4][position]


class CachedSource(SiteSource):
    """``inner`` whose clip datasets read their frames from the cache in ``cache_dir``
    (``data.cache_dir``); listings and native reads (evaluation's labels) go to ``inner``."""

    def __init__(self, inner: SiteSource, cache_dir: Path | str) -> None:
        self.inner = inner
        self.cache_dir = Path(cache_dir)
        self.name = inner.name
        self.surgery_type = inner.surgery_type
        self.binary = inner.binary

    def __getattr__(self, item: str):  # backend extras (site_root, fps, ...)
        if item == "inner":
            raise AttributeError(item)
        return getattr(self.inner, item)

    def videos(self, split: str) -> list[VideoRecord]:
        return self.inner.videos(split)

    def read_frame(self, ref: FrameRef) -> np.ndarray:
        return self.inner.read_frame(ref)

    def read_label(self, ref: LabelRef) -> np.ndarray:
        return self.inner.read_label(ref)

    def open_frames(
        self,
        split: str,
        videos: Sequence[VideoRecord],
        needed: Sequence[Sequence[int]],
        image_size: Sequence[int],
    ) -> CachedFrames:
        """The cache of ``split``'s ``videos``, ``needed[i]`` the positions of video i its clips
        read, at ``image_size``, checked against the manifest: every video present with those
        positions, its source files unchanged, the same settings. Otherwise a CacheError."""
        folder = size_folder(self.cache_dir, self.name, image_size)
        manifest_path = folder / MANIFEST
        hint = rebuild_hint(self.cache_dir, image_size)
        where = f"site {self.name!r} split {split!r}"
        if not manifest_path.is_file():
            built = sorted(p.name for p in (self.cache_dir / self.name).glob("*x*"))
            sizes = f" (it holds sizes {built})" if built else ""
            raise CacheError(
                f"{where}: data.cache_dir={self.cache_dir} has no cache of this site at "
                f"{image_size[0]}x{image_size[1]}: {manifest_path} is missing{sizes}; {hint}"
            )
        manifest = json.loads(manifest_path.read_text())
        settings = cache_settings(image_size)
        if manifest.get("settings_digest") != digest(settings):
            built = manifest.get("settings", {})
            differ = [
                f"{key}: built with {built.get(key)!r}, now {value!r}"
                for key, value in settings.items()
                if built.get(key) != value
            ]
            raise CacheError(
                f"{manifest_path}: built with other preprocessing settings ({'; '.join(differ)}); "
                f"{hint}"
            )
        rows = {}
        for video, positions in zip(videos, needed, strict=True):
            entry = manifest["videos"].get(video_key(video))
            if entry is None:
                raise CacheError(
                    f"{manifest_path}: {where} video {video.video_id!r} is not in the cache (its "
                    f"frames or labels are not those the cache was built from); {hint}"
                )
            stored = {p: row for row, p in enumerate(entry["positions"])}
            missing = sorted(set(positions) - set(stored))
            if missing:
                raise CacheError(
                    f"{manifest_path}: video {video.video_id!r} lacks frame position(s) "
                    f"{missing[:5]} that the clips read (built for clips {entry['clip']}); {hint}"
                )
            stamps = file_stamps(
                source_files(video, entry["positions"]),
                f"{manifest_path}: ",
                f"; the cache is checked against its sources: restore the file, or {hint}",
            )
            if digest(stamps) != entry["source_digest"]:
                recorded = {path: (size, mtime) for path, size, mtime in entry["files"]}
                changed = next(s for s in stamps if recorded.get(s[0]) != (s[1], s[2]))
                raise CacheError(
                    f"{manifest_path}: source file {changed[0]} changed since the cache was built "
                    f"(size, mtime_ns {recorded.get(changed[0])} then, {tuple(changed[1:])} "
                    f"now); {hint}"
                )
            labels = {p: row for row, p in enumerate(entry["labelled"])}
            sizes = {
                p: tuple(size)
                for p, size in zip(entry["positions"], entry["native_sizes"], strict=True)
            }
            rows[video.video_id] = (
                folder / entry["frames_file"],
                stored,
                folder / entry["labels_file"],
                labels,
                sizes,
            )
        return CachedFrames(rows)
