"""Building the preprocessed frame cache of fedst/data/clips/cache.py: every frame a site's clip
datasets read, decoded once and resized with the loader's own functions (:func:`resize_frame`,
:meth:`ClipDataset.read_native_label` and :meth:`ClipDataset.resize_label`, so a label whose size
differs from its frame's stops the build with the loader's error), written as uint8 ``.npy``
files, then the manifest. A video whose entry still matches (same files, stamps, settings and
positions) is kept as it is; files no entry names are removed."""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from fedst.data.base import SiteSource, VideoRecord
from fedst.data.clips.cache import (
    MANIFEST,
    CacheError,
    cache_settings,
    digest,
    file_stamps,
    size_folder,
    source_files,
    video_key,
)
from fedst.data.clips.dataset import ClipDataset
from fedst.data.clips.normalization import resize_frame
from fedst.schema.clips import ClipConfig

log = logging.getLogger(__name__)


@dataclass
class SiteCacheSummary:
    """What :func:`build_site_cache` did for one site."""

    site: str
    folder: Path
    videos_written: int
    videos_kept: int
    frames: int
    labels: int
    megabytes: float


def build_site_cache(
    source: SiteSource, splits: Sequence[str], clip: ClipConfig, cache_dir: Path | str
) -> SiteCacheSummary:
    """Write the cache of ``source``'s ``splits`` (their clips at ``clip``: the frames each
    split's clips read, the labels of every labelled frame) at ``clip.image_size`` under
    ``cache_dir`` (fedst/data/clips/cache.py's layout)."""
    folder = size_folder(cache_dir, source.name, clip.image_size)
    folder.mkdir(parents=True, exist_ok=True)
    settings = cache_settings(clip.image_size)
    wanted: dict[str, tuple[VideoRecord, set[int], ClipDataset]] = {}
    for split in splits:
        dataset = ClipDataset(source, split, clip, None, validate=False)
        for video, positions in zip(dataset.videos, dataset.needed_positions(), strict=True):
            key = video_key(video)
            if key not in wanted:
                wanted[key] = (video, set(), dataset)
            wanted[key][1].update(positions)
    old = _manifest(folder / MANIFEST)
    reusable = old["videos"] if old.get("settings_digest") == digest(settings) else {}
    entries, written = {}, 0
    for key, (video, positions, dataset) in wanted.items():
        entry = reusable.get(key)
        if entry is None or not _still_valid(entry, video, positions):
            entry = _write_video(folder, key, video, sorted(positions), dataset)
            written += 1
        entries[key] = entry
    manifest = {
        "format": settings["format"],
        "site": source.name,
        "settings": settings,
        "settings_digest": digest(settings),
        "videos": entries,
    }
    temporary = folder / f".{MANIFEST}.tmp"
    temporary.write_text(json.dumps(manifest, indent=1))
    os.replace(temporary, folder / MANIFEST)  # the manifest last: a broken build leaves no cache
    named = {e[name] for e in entries.values() for name in ("frames_file", "labels_file")}
    for stale in folder.glob("*.npy"):
        if stale.name not in named:
            stale.unlink()
    megabytes = sum((folder / name).stat().st_size for name in named) / 2**20
    summary = SiteCacheSummary(
        site=source.name,
        folder=folder,
        videos_written=written,
        videos_kept=len(entries) - written,
        frames=sum(len(e["positions"]) for e in entries.values()),
        labels=sum(len(e["labelled"]) for e in entries.values()),
        megabytes=megabytes,
    )
    return summary


def _manifest(path: Path) -> dict:
    if not path.is_file():
        return {"videos": {}}
    try:
        return json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError):
        log.warning("%s is not readable JSON: every video is written again", path)
        return {"videos": {}}


def _still_valid(entry: dict, video: VideoRecord, positions: set[int]) -> bool:
    """The entry holds ``positions`` and its source files are unchanged."""
    if not positions <= set(entry["positions"]):
        return False
    try:
        stamps = file_stamps(source_files(video, entry["positions"]))
    except CacheError:  # a source file is gone: written again, where the read names it
        return False
    return digest(stamps) == entry["source_digest"]


def _write_video(
    folder: Path, key: str, video: VideoRecord, positions: list[int], dataset: ClipDataset
) -> dict:
    """Decode, resize and write one video's ``positions`` and labels; its manifest entry."""
    stamps = file_stamps(source_files(video, positions))  # before reading: a later change shows
    height, width = dataset.clip.image_size
    labelled = sorted(video.labels)
    frames_file, labels_file = f"{key}.frames.npy", f"{key}.labels.npy"
    frames = np.lib.format.open_memmap(
        folder / f".{frames_file}.tmp", "w+", np.uint8, (len(positions), height, width, 3)
    )
    labels = np.lib.format.open_memmap(
        folder / f".{labels_file}.tmp", "w+", np.uint8, (len(labelled), height, width)
    )
    native_sizes = {}
    for row, position in enumerate(positions):
        rgb = dataset.source.read_frame(video.frames[position])  # [H0, W0, 3]
        native_sizes[position] = [int(rgb.shape[0]), int(rgb.shape[1])]
        frames[row] = resize_frame(rgb, (height, width))
    for row, position in enumerate(labelled):
        native = dataset.read_native_label(video, position, tuple(native_sizes[position]))
        labels[row] = dataset.resize_label(native)
    frames.flush()
    labels.flush()
    del frames, labels
    for name in (frames_file, labels_file):
        os.replace(folder / f".{name}.tmp", folder / name)
    clip = asdict(dataset.clip)
    return {
        "video_id": video.video_id,
        "frames_file": frames_file,
        "labels_file": labels_file,
        "positions": positions,
        "labelled": labelled,
        "native_sizes": [native_sizes[p] for p in positions],
        "clip": {k: clip[k] for k in ("num_frames", "interval_s", "single_frame_mode")},
        "files": stamps,
        "source_digest": digest(stamps),
    }
