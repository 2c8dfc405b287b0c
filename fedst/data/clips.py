"""Clips, augmentation, validation and batching shared by every dataset backend.

A sample is one labelled frame (the *current* frame) plus ``num_frames - 1`` earlier frames at
``interval_s`` spacing (paper Sec. IV-A3: 4 frames, the current and 3 previous). Where the video has
no frame at the wanted time the nearest earlier frame is used; before the video's first frame the
current frame is duplicated. Only the current frame needs a label.

Augmentation (paper: rotation and scale; flips, colour jitter (brightness, contrast, saturation,
hue) and Gaussian blur optional, all off by default) draws ONE random transform per sample and
applies it to every frame of the clip and to the mask (photometric parts: frames only). Areas rotated into
view are 0 in the images (before normalisation) and 255 (ignore) in the mask.

The dataset returns normalised tensors: frames resized to ``image_size`` (bilinear; masks nearest),
scaled to [0, 1], then normalised with :data:`IMAGENET_MEAN` / :data:`IMAGENET_STD`. Loader workers
(:class:`BatchStream`, :class:`FrameDataset`) send the uint8 clips and masks instead (4x and 8x
fewer bytes through shared memory); the consumer normalises them on its device with
:func:`normalize_clips`, the one implementation of the normalisation, so both paths are equal.

Reproducibility: :func:`make_loader` and :class:`BatchStream` hand the dataset ``(index, aug_seed)``
pairs drawn from ``(seed, epoch)``, so the sample order and every augmentation depend only on the
seed, not on the number of workers, and a resumed :class:`BatchStream` repeats the uninterrupted
stream exactly.
"""

from __future__ import annotations

import bisect
import functools
import logging
import multiprocessing
import os
import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import albumentations as A
import cv2
import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from fedst.data.base import (
    IGNORE_INDEX,
    DataError,
    SiteSource,
    VideoRecord,
    check_label_values,
)

__all__ = [
    "IMAGENET_MEAN",
    "IMAGENET_STD",
    "AugmentConfig",
    "BatchStream",
    "ClipConfig",
    "ClipDataset",
    "FrameDataset",
    "FrameHistory",
    "PlannedBatches",
    "build_augmentation",
    "clip_frame_positions",
    "collate_clips",
    "collate_frames",
    "frame_loader",
    "make_loader",
    "normalize_clips",
    "normalize_frames",
    "resize_frame",
    "resolve_num_workers",
    "usable_cpu_count",
]

logger = logging.getLogger(__name__)

IMAGENET_MEAN: tuple[float, float, float] = (0.485, 0.456, 0.406)
IMAGENET_STD: tuple[float, float, float] = (0.229, 0.224, 0.225)
_MEAN_255 = (np.array(IMAGENET_MEAN, dtype=np.float32) * 255).reshape(3, 1, 1)
_INV_STD_255 = (1 / (np.array(IMAGENET_STD, dtype=np.float32) * 255)).reshape(3, 1, 1)
AUTO_MAX_WORKERS = 4
"""``num_workers="auto"``: at most this many loader workers per loader (one core kept for the
process that trains)."""
TIME_TOLERANCE_S = 1e-6
SINGLE_FRAME_MODES = ("repeat", "single")
AUG_SEED_HIGH = 2**31 - 1
WORKER_START_METHOD = "forkserver"
"""How DataLoader workers start. Not "fork": a worker forked from a process whose OpenCV thread
pool has run hangs in its first cv2 call (seen here: cv2.setNumThreads blocked forever)."""
WORKER_PRELOAD = ("torch", "cv2", "albumentations", "fedst.data.clips", "fedst.data.generic")
"""Modules the fork server imports once, so a worker starts in ~0.5 s instead of importing them."""
Batch = tuple[torch.Tensor, torch.Tensor, list[str]]


@dataclass(frozen=True)
class ClipConfig:
    num_frames: int = 4
    """Frames per clip T, the current frame last (paper: 4)."""
    interval_s: float = 0.2
    """Seconds between consecutive clip frames (paper: 0.2)."""
    image_size: tuple[int, int] = (128, 160)
    """(H, W) network input size."""
    single_frame_mode: str = "repeat"
    """Image-only data (every video one frame): "repeat" the frame T times, or "single" (T = 1)."""

    def __post_init__(self) -> None:
        if self.num_frames < 1:
            raise ValueError(f"clip.num_frames must be >= 1, got {self.num_frames}")
        if self.interval_s < 0:
            raise ValueError(f"clip.interval_s must be >= 0, got {self.interval_s}")
        if len(self.image_size) != 2 or min(self.image_size) < 1:
            raise ValueError(f"clip.image_size must be (H, W) > 0, got {self.image_size}")
        if self.single_frame_mode not in SINGLE_FRAME_MODES:
            raise ValueError(
                f"clip.single_frame_mode must be one of {SINGLE_FRAME_MODES}, "
                f"got {self.single_frame_mode!r}"
            )


@dataclass(frozen=True)
class AugmentConfig:
    enabled: bool = True
    """Apply the augmentation at all (training sets only)."""
    rotate_limit_deg: float = 15
    """Rotation drawn uniformly from [-limit, limit] degrees (paper: rotation)."""
    scale_limit: float = 0.1
    """Zoom drawn uniformly from [1 - limit, 1 + limit] (paper: scale)."""
    hflip: bool = False
    """Horizontal flip with probability 0.5."""
    vflip: bool = False
    """Vertical flip with probability 0.5."""
    color_jitter: float = 0.0
    """Brightness, contrast and saturation jitter strength (0: off; hue: ``hue``)."""
    hue: float = 0.0
    """Hue shift of the colour jitter, drawn from [-hue, hue] of the hue circle (0: off; <= 0.5)."""
    blur_sigma: float = 0.0
    """Gaussian blur, sigma drawn uniformly from [0, blur_sigma] pixels at the network input
    (0: off)."""

    def __post_init__(self) -> None:
        for name in ("rotate_limit_deg", "scale_limit", "color_jitter", "hue", "blur_sigma"):
            if getattr(self, name) < 0:
                raise ValueError(f"augment.{name} must be >= 0, got {getattr(self, name)}")
        if self.scale_limit >= 1:
            raise ValueError(f"augment.scale_limit must be < 1, got {self.scale_limit}")
        if self.hue > 0.5:
            raise ValueError(f"augment.hue must be <= 0.5 (half the hue circle), got {self.hue}")


def clip_frame_positions(
    times: Sequence[float], current: int, num_frames: int, interval_s: float
) -> list[int]:
    """Positions in ``times`` of the clip ending at ``current``, oldest first (length num_frames).

    Frame k steps back targets ``times[current] - k * interval_s``: the latest frame at or before it
    (within 1e-6 s); a target before the video's first frame gives the current frame (Sec. IV-A3).
    """
    if not 0 <= current < len(times):
        raise IndexError(f"current frame {current} outside a video of {len(times)} frames")
    positions = []
    for steps_back in range(num_frames - 1, 0, -1):
        target = times[current] - steps_back * interval_s
        latest = bisect.bisect_right(times, target + TIME_TOLERANCE_S) - 1
        positions.append(latest if latest >= 0 else current)
    positions.append(current)
    return positions


class FrameHistory:
    """:func:`clip_frame_positions` for a stream: frames arrive one by one with their times.

    Holds one item per earlier frame (e.g. its encoder features) and, for a new frame at time t,
    returns the items the clip ending at it uses: frame k steps back is the latest earlier frame at
    or before ``t - k * interval_s``, or the new frame itself (``None``) when that time is before
    the stream's first frame. Items no future clip can use are dropped, so memory stays at about
    ``(num_frames - 1) * interval_s * fps + 1`` items.
    """

    def __init__(self, num_frames: int, interval_s: float) -> None:
        if num_frames < 1 or interval_s < 0:
            raise ValueError(
                f"FrameHistory needs num_frames >= 1 and interval_s >= 0, got {num_frames}, "
                f"{interval_s}"
            )
        self.num_frames, self.interval_s = num_frames, interval_s
        self.times: list[float] = []
        self.items: list[Any] = []

    def __len__(self) -> int:
        return len(self.items)

    def reset(self) -> None:
        """Forget every frame (start of a new video)."""
        self.times.clear()
        self.items.clear()

    def context(self, time_s: float) -> list[Any | None]:
        """The ``num_frames - 1`` earlier items of a new frame at ``time_s``, oldest first;
        ``None`` where the clip uses the new frame itself."""
        if self.times and time_s <= self.times[-1]:
            raise ValueError(
                f"frame times must increase: got {time_s} s after {self.times[-1]} s"
            )
        current = len(self.times)
        positions = clip_frame_positions(
            [*self.times, time_s], current, self.num_frames, self.interval_s
        )
        return [None if p == current else self.items[p] for p in positions[:-1]]

    def append(self, time_s: float, item: Any) -> None:
        """Add the new frame's item (after :meth:`context`), then drop items no later clip needs:
        the oldest item goes once the next one is at or before the oldest target time, as later
        frames' targets are later still."""
        if self.times and time_s <= self.times[-1]:
            raise ValueError(
                f"frame times must increase: got {time_s} s after {self.times[-1]} s"
            )
        self.times.append(time_s)
        self.items.append(item)
        oldest_target = time_s - (self.num_frames - 1) * self.interval_s + TIME_TOLERANCE_S
        while len(self.times) > 1 and self.times[1] <= oldest_target:
            del self.times[0], self.items[0]


def resize_frame(rgb: np.ndarray, image_size: tuple[int, int]) -> np.ndarray:
    """RGB uint8 [H0, W0, 3] -> [H, W, 3] at ``image_size`` = (H, W), bilinear (the network input)."""
    height, width = image_size
    return cv2.resize(rgb, (width, height), interpolation=cv2.INTER_LINEAR)


def normalize_frames(frames: np.ndarray) -> torch.Tensor:
    """uint8 [T, H, W, 3] -> float32 [T, 3, H, W]: scaled to [0, 1], minus :data:`IMAGENET_MEAN`,
    divided by :data:`IMAGENET_STD` (:func:`normalize_clips` after the channel transpose)."""
    return normalize_clips(torch.from_numpy(_channels_first(frames)))


def _channels_first(frames: np.ndarray) -> np.ndarray:
    """uint8 [T, H, W, 3] -> contiguous uint8 [T, 3, H, W]."""
    return np.ascontiguousarray(frames.transpose(0, 3, 1, 2))


def normalize_clips(frames: torch.Tensor) -> torch.Tensor:
    """uint8 [..., 3, H, W] on any device -> float32 on that device: (x - 255 * mean) / (255 *
    std) with :data:`IMAGENET_MEAN` / :data:`IMAGENET_STD`, per channel."""
    if frames.dtype != torch.uint8 or frames.dim() < 3 or frames.shape[-3] != 3:
        raise ValueError(
            f"normalize_clips expects uint8 [..., 3, H, W] frames, got {frames.dtype} "
            f"{tuple(frames.shape)}"
        )
    mean, inv_std = _normalization_constants(frames.device)
    return (frames.float() - mean) * inv_std


@functools.cache
def _normalization_constants(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(255 * mean, 1 / (255 * std)) as float32 [3, 1, 1] on ``device``, copied there once."""
    return torch.from_numpy(_MEAN_255).to(device), torch.from_numpy(_INV_STD_255).to(device)


def usable_cpu_count() -> int:
    """CPU cores this process may run on (its affinity mask where the OS has one)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - macOS / Windows
        return os.cpu_count() or 1


def resolve_num_workers(value: int | str) -> int:
    """``train.num_workers`` as a worker count: a number as given; "auto" =
    ``min(AUTO_MAX_WORKERS, usable cores - 1)`` (0 on a single core: load in this process)."""
    if value == "auto":
        return max(0, min(AUTO_MAX_WORKERS, usable_cpu_count() - 1))
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"num_workers={value!r}: a number of workers >= 0 or \"auto\"")
    return value


def build_augmentation(augment: AugmentConfig, num_frames: int) -> A.Compose:
    """One albumentations pipeline for a T-frame clip: targets ``image`` (current frame) and
    ``frame_1`` .. ``frame_{T-1}``, all receiving the same random parameters as the ``mask``."""
    transforms: list[A.BasicTransform] = [
        A.Affine(
            rotate=(-augment.rotate_limit_deg, augment.rotate_limit_deg),
            scale=(1 - augment.scale_limit, 1 + augment.scale_limit),
            interpolation=cv2.INTER_LINEAR,
            mask_interpolation=cv2.INTER_NEAREST,
            border_mode=cv2.BORDER_CONSTANT,
            fill=0,
            fill_mask=IGNORE_INDEX,
            p=1.0,
        )
    ]
    if augment.hflip:
        transforms.append(A.HorizontalFlip(p=0.5))
    if augment.vflip:
        transforms.append(A.VerticalFlip(p=0.5))
    if augment.color_jitter > 0 or augment.hue > 0:
        strength = augment.color_jitter
        transforms.append(
            A.ColorJitter(
                brightness=strength, contrast=strength, saturation=strength, hue=augment.hue, p=1
            )
        )
    if augment.blur_sigma > 0:
        transforms.append(A.GaussianBlur(blur_limit=0, sigma_limit=(0.0, augment.blur_sigma), p=1))
    extra_frames = {f"frame_{i}": "image" for i in range(1, num_frames)}
    return A.Compose(transforms, additional_targets=extra_frames)


class ClipDataset(Dataset):
    """One sample per labelled frame of ``split``: ``(clip [T, 3, H, W] float, mask [H, W] long,
    sample_id)`` with ``sample_id = "<site>/<video_id>/<position>"``, the current frame being
    ``video.frames[position]`` (see :meth:`sample_ref`).

    The clip is already normalised: resized to ``clip.image_size``, scaled to [0, 1], minus
    :data:`IMAGENET_MEAN`, divided by :data:`IMAGENET_STD`; the current frame is the last. The
    mask holds 0..3 (0..1 when ``binary``) and 255 = ignore.

    Items may be indexed by ``index`` or by ``(index, aug_seed)`` (what the samplers of this module
    pass); with a plain index the augmentation seed comes from torch's global RNG.
    :meth:`load_raw` gives the same item before normalisation (what loader workers send).
    """

    def __init__(
        self,
        source: SiteSource,
        split: str,
        clip: ClipConfig = ClipConfig(),
        augment: AugmentConfig | None = None,
        validate: bool = True,
    ) -> None:
        self.source = source
        self.split = split
        self.clip = clip
        self.site_name = source.name
        self.binary = source.binary
        self.surgery_type = source.surgery_type
        self.videos: list[VideoRecord] = source.videos(split)
        self.samples: list[tuple[int, int]] = [
            (video_index, position)
            for video_index, video in enumerate(self.videos)
            for position in sorted(video.labels)
        ]
        if not self.samples:
            raise DataError(f"site {self.site_name!r} split {split!r}: no labelled frames")
        self.num_samples = len(self.samples)
        image_only = all(len(video.frames) == 1 for video in self.videos)
        single = image_only and clip.single_frame_mode == "single"
        self.clip_length = 1 if single else clip.num_frames
        self._augment = (
            build_augmentation(augment, self.clip_length) if augment and augment.enabled else None
        )
        self._index_of_id: dict[str, int] | None = None
        if validate:
            self.validate()

    def __len__(self) -> int:
        return self.num_samples

    def sample_ref(self, index: int) -> tuple[VideoRecord, int]:
        """The video and the position of the current frame of sample ``index``."""
        video_index, position = self.samples[index]
        return self.videos[video_index], position

    def clip_positions(self, video: VideoRecord, position: int) -> list[int]:
        """Positions in ``video.frames`` of the clip ending at ``position`` (oldest first)."""
        if self.clip_length == 1:
            return [position]
        return clip_frame_positions(video.times, position, self.clip_length, self.clip.interval_s)

    def sample_id(self, index: int) -> str:
        """``"<site>/<video_id>/<position>"`` of sample ``index`` (as returned by ``__getitem__``)."""
        video, position = self.sample_ref(index)
        return f"{self.site_name}/{video.video_id}/{position}"

    def index_of(self, sample_id: str) -> int:
        """The index of the sample called ``sample_id`` (inverse of :meth:`sample_id`)."""
        if self._index_of_id is None:
            self._index_of_id = {self.sample_id(i): i for i in range(self.num_samples)}
        if sample_id not in self._index_of_id:
            raise KeyError(f"site {self.site_name!r} split {self.split!r} has no sample {sample_id!r}")
        return self._index_of_id[sample_id]

    def native_label(self, sample_id: str) -> np.ndarray:
        """The label of ``sample_id`` at the dataset's native resolution (uint8 [H0, W0], 255 =
        ignore), not resized and not augmented: what distances are measured on (evaluation)."""
        video, position = self.sample_ref(self.index_of(sample_id))
        return self.source.read_label(video.labels[position])

    def __getitem__(self, item: int | tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor, str]:
        """``(clip [T, 3, H, W] float32 normalised, mask [H, W] int64, sample_id)``."""
        clip, mask, sample_id = self.load_raw(item)
        return normalize_clips(clip), mask.long(), sample_id

    def load_raw(self, item: int | tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor, str]:
        """``(clip [T, 3, H, W] uint8, mask [H, W] uint8, sample_id)``: :meth:`__getitem__`
        before :func:`normalize_clips` (resized and augmented; what loader workers send)."""
        index, aug_seed = item if isinstance(item, tuple) else (item, None)
        video, position = self.sample_ref(int(index))
        positions = self.clip_positions(video, position)
        frames = {p: self.source.read_frame(video.frames[p]) for p in set(positions)}
        label = self._read_label(video, position, frames[position].shape[:2])
        resized = {p: resize_frame(f, self.clip.image_size) for p, f in frames.items()}
        clip = [resized[p] for p in positions]  # T x [H, W, 3] uint8, oldest first
        if self._augment is not None:
            clip, label = self._apply_augmentation(clip, label, aug_seed)
        clip_tensor = torch.from_numpy(_channels_first(np.stack(clip)))  # [T, 3, H, W] uint8
        return clip_tensor, torch.from_numpy(label), self.sample_id(int(index))

    def _read_label(
        self, video: VideoRecord, position: int, frame_size: tuple[int, ...]
    ) -> np.ndarray:
        """Label of ``video.frames[position]`` resized (nearest) to ``image_size``: uint8 [H, W]."""
        return self.resize_label(self.read_native_label(video, position, frame_size))

    def read_native_label(
        self, video: VideoRecord, position: int, frame_size: tuple[int, ...]
    ) -> np.ndarray:
        """Label of ``video.frames[position]`` as stored (uint8 [H0, W0], 255 = ignore), checked
        against the size of its frame (``frame_size`` (H0, W0))."""
        label_ref = video.labels[position]
        label = self.source.read_label(label_ref)
        if tuple(frame_size) != label.shape:
            raise DataError(
                f"{label_ref.path}: mask size {label.shape} differs from frame size "
                f"{tuple(frame_size)} of {video.frames[position].path}"
            )
        return label

    def resize_label(self, label: np.ndarray) -> np.ndarray:
        """A native label [H0, W0] at ``image_size`` (nearest): uint8 [H, W]."""
        height, width = self.clip.image_size
        return cv2.resize(label, (width, height), interpolation=cv2.INTER_NEAREST)

    def read_frame(self, video: VideoRecord, position: int) -> tuple[torch.Tensor, tuple[int, int]]:
        """One frame as the network sees it without augmentation: ([3, H, W] float32 normalised,
        its size on disk (H0, W0)). What :meth:`__getitem__` puts in a clip, frame by frame."""
        frame, frame_size = self.read_raw_frame(video, position)
        return normalize_clips(frame), frame_size

    def read_raw_frame(
        self, video: VideoRecord, position: int
    ) -> tuple[torch.Tensor, tuple[int, int]]:
        """:meth:`read_frame` before normalisation: (uint8 [3, H, W], size on disk (H0, W0))."""
        rgb = self.source.read_frame(video.frames[position])
        frame = torch.from_numpy(_channels_first(resize_frame(rgb, self.clip.image_size)[None])[0])
        return frame, (rgb.shape[0], rgb.shape[1])

    def _apply_augmentation(
        self, clip: list[np.ndarray], label: np.ndarray, aug_seed: int | None
    ) -> tuple[list[np.ndarray], np.ndarray]:
        if aug_seed is None:
            aug_seed = int(torch.randint(AUG_SEED_HIGH, ()).item())
        self._augment.set_random_seed(aug_seed)
        targets = {f"frame_{i}": frame for i, frame in enumerate(clip[:-1], start=1)}
        out = self._augment(image=clip[-1], mask=label, **targets)
        return [out[f"frame_{i}"] for i in range(1, len(clip))] + [out["image"]], out["mask"]

    def problems(self) -> list[str]:
        """Every problem of this split's files (see :mod:`fedst.data.validation`): each labelled
        frame and each clip context frame decoded in full, each label read and compared with its
        frame; results of files that passed are cached by path, size and mtime."""
        from fedst.data.validation import ValidationCache, dataset_problems

        cache = ValidationCache.for_site(self.source)
        try:
            return dataset_problems(self, cache)
        finally:
            cache.save()

    def validate(self) -> None:
        """Raise one DataError listing every problem of :meth:`problems` (first 20, then a count)."""
        from fedst.data.validation import format_problems

        problems = self.problems()
        if problems:
            raise DataError(
                format_problems(
                    f"site {self.site_name!r} split {self.split!r}: {len(problems)} bad label(s) "
                    f"of {self.num_samples} (labelled frames, clip frames and labels decoded):",
                    problems,
                )
            )
        logger.info(
            "site %s split %s: validated %d samples", self.site_name, self.split, self.num_samples
        )


def _epoch_plan(
    num_samples: int, seed: int, epoch: int, shuffle: bool
) -> tuple[np.ndarray, np.ndarray]:
    """Sample order and per-position augmentation seeds of one epoch: a function of both."""
    rng = np.random.default_rng((seed, epoch))
    order = rng.permutation(num_samples) if shuffle else np.arange(num_samples)
    return order, rng.integers(0, AUG_SEED_HIGH, size=num_samples)


class _EpochSampler(Sampler):
    """Yields ``(index, aug_seed)``; the n-th pass over it is epoch n of ``_epoch_plan``."""

    def __init__(self, num_samples: int, seed: int, shuffle: bool) -> None:
        self.num_samples, self.seed, self.shuffle = num_samples, seed, shuffle
        self.epoch = 0

    def __len__(self) -> int:
        return self.num_samples

    def __iter__(self) -> Iterator[tuple[int, int]]:
        order, aug_seeds = _epoch_plan(self.num_samples, self.seed, self.epoch, self.shuffle)
        self.epoch += 1
        yield from zip(order.tolist(), aug_seeds.tolist(), strict=True)


def collate_clips(samples: Sequence[tuple[torch.Tensor, torch.Tensor, str]]) -> Batch:
    """Stack samples into ``(clips [B, T, 3, H, W], masks [B, H, W], sample_ids list[str])``."""
    clips, masks, sample_ids = zip(*samples, strict=True)
    return torch.stack(clips), torch.stack(masks), list(sample_ids)


def _worker_context(num_workers: int) -> multiprocessing.context.BaseContext | None:
    """The start method of DataLoader workers (None: no workers, load in this process)."""
    if num_workers == 0:
        return None
    context = multiprocessing.get_context(WORKER_START_METHOD)
    context.set_forkserver_preload(list(WORKER_PRELOAD))
    return context


def _seed_worker(worker_id: int) -> None:
    """Seed numpy/random in a DataLoader worker from torch's per-worker seed; one cv2 thread."""
    worker_seed = torch.initial_seed() % 2**32
    np.random.seed(worker_seed)
    random.seed(worker_seed)
    cv2.setNumThreads(1)


def make_loader(
    dataset: ClipDataset,
    batch_size: int,
    shuffle: bool,
    num_workers: int | str,
    seed: int,
    drop_last: bool,
) -> DataLoader:
    """A DataLoader of ``(clips [B, T, 3, H, W], masks [B, H, W], sample_ids)`` whose order and
    augmentations depend only on ``seed`` and the epoch (each pass over the loader is one epoch).
    Items are the dataset's (normalised float clips); :class:`BatchStream` is the training path
    that sends uint8."""
    num_workers = resolve_num_workers(num_workers)
    return DataLoader(
        dataset,
        batch_size=batch_size,
        sampler=_EpochSampler(len(dataset), seed, shuffle),
        num_workers=num_workers,
        multiprocessing_context=_worker_context(num_workers),
        drop_last=drop_last,
        collate_fn=collate_clips,
        persistent_workers=num_workers > 0,
        pin_memory=torch.cuda.is_available(),
        worker_init_fn=_seed_worker,
        generator=torch.Generator().manual_seed(seed),
    )


class _ResumableBatchSampler:
    """Endless batches of ``(index, aug_seed)`` from (epoch, position) on; batches span epochs."""

    def __init__(self, stream: BatchStream, epoch: int, position: int) -> None:
        self.stream, self.epoch, self.position = stream, epoch, position

    def __iter__(self) -> Iterator[list[tuple[int, int]]]:
        epoch, position = self.epoch, self.position
        order, aug_seeds = self.stream.epoch_plan(epoch)
        while True:
            batch = []
            while len(batch) < self.stream.batch_size:
                if position == len(order):
                    epoch, position = epoch + 1, 0
                    order, aug_seeds = self.stream.epoch_plan(epoch)
                batch.append((int(order[position]), int(aug_seeds[position])))
                position += 1
            yield batch


class _RawClips(Dataset):
    """A ClipDataset whose items are :meth:`ClipDataset.load_raw`'s (uint8): what workers send."""

    def __init__(self, dataset: ClipDataset) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, item: int | tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor, str]:
        return self.dataset.load_raw(item)


class BatchStream:
    """An endless, seeded, resumable stream of shuffled batches for fixed-iteration training.

    Every batch is full (it continues into the next epoch's order when one ends). ``state_dict()``
    holds ``(epoch, position)`` of the next sample; loading it continues the same sequence of
    samples and augmentations.

    Workers send uint8 clips and masks (pinned when CUDA is present); :meth:`next_batch` copies
    them to ``device`` and normalises there, so the batches equal the dataset's items.
    """

    def __init__(
        self,
        dataset: ClipDataset,
        batch_size: int,
        seed: int,
        num_workers: int | str = 0,
        device: torch.device | str | None = None,
        num_classes: int | None = None,
    ) -> None:
        """``num_workers``: a count or "auto" (:func:`resolve_num_workers`); ``device``: where
        batches are normalised and returned (None: the CPU); ``num_classes``: the network's,
        against which every batch's labels are checked on the CPU, before the copy (None: not
        checked here; the loss then checks labels that are on the CPU)."""
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.dataset, self.batch_size, self.seed = dataset, batch_size, seed
        self.num_workers = resolve_num_workers(num_workers)
        self.device = torch.device(device if device is not None else "cpu")
        self.num_classes = num_classes
        self.epoch, self.position = 0, 0
        self._batches: Iterator[Batch] | None = None

    def epoch_plan(self, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        """(sample order, augmentation seeds) of ``epoch``."""
        return _epoch_plan(len(self.dataset), self.seed, epoch, shuffle=True)

    def next_batch(self) -> Batch:
        """``(clips [B, T, 3, H, W] float32 normalised, masks [B, H, W] int64, sample_ids)``, on
        the stream's device."""
        if self._batches is None:
            self._batches = iter(
                self._loader(self.dataset, _ResumableBatchSampler(self, self.epoch, self.position))
            )
        batch = next(self._batches)  # uint8 [B, T, 3, H, W], uint8 [B, H, W], ids
        self._advance(1)
        return self._to_device(*batch)

    def next_plan(self, num_batches: int) -> list[list[tuple[int, int]]]:
        """The ``(index, aug_seed)`` pairs of the next ``num_batches`` batches, one list per batch,
        without loading them: exactly the samples and augmentations ``num_batches`` calls of
        :meth:`next_batch` would return, and the stream's position advances as theirs would.
        Load them with :meth:`load_plan`."""
        if num_batches < 0:
            raise ValueError(f"num_batches must be >= 0, got {num_batches}")
        batches = iter(_ResumableBatchSampler(self, self.epoch, self.position))
        plan = [next(batches) for _ in range(num_batches)]
        self.close()  # a live loader would continue from the old position
        self._advance(num_batches)
        return plan

    def load_plan(
        self, plan: Sequence[Sequence[tuple[int, int]]], dataset: ClipDataset | None = None
    ) -> PlannedBatches:
        """The batches of ``plan`` (from :meth:`next_plan`) read from ``dataset`` (default: the
        stream's; e.g. the same samples without augmentation), as :meth:`next_batch` returns
        them, loaded by the stream's workers one batch at a time (plus their prefetch)."""
        return PlannedBatches(self, dataset if dataset is not None else self.dataset, plan)

    def _loader(self, dataset: ClipDataset, batch_sampler: Any) -> DataLoader:
        """uint8 batches of ``dataset`` in ``batch_sampler``'s order, by the stream's workers."""
        return DataLoader(
            _RawClips(dataset),
            batch_sampler=batch_sampler,
            num_workers=self.num_workers,
            multiprocessing_context=_worker_context(self.num_workers),
            collate_fn=collate_clips,
            pin_memory=torch.cuda.is_available(),
            worker_init_fn=_seed_worker,
            generator=torch.Generator().manual_seed(self.seed),
        )

    def _advance(self, num_batches: int) -> None:
        """Move (epoch, position) past ``num_batches`` batches (batches span epochs)."""
        consumed = self.position + num_batches * self.batch_size
        self.epoch += consumed // len(self.dataset)
        self.position = consumed % len(self.dataset)

    def _to_device(self, clips: torch.Tensor, masks: torch.Tensor, sample_ids: list[str]) -> Batch:
        """A loader's uint8 batch -> :meth:`next_batch`'s: labels checked on the CPU, then copied
        to the device and normalised there."""
        if self.num_classes is not None:
            check_label_values(masks, self.num_classes, IGNORE_INDEX, f"batch {sample_ids}")
        clips = clips.to(self.device, non_blocking=True)
        masks = masks.to(self.device, non_blocking=True)
        return normalize_clips(clips), masks.long(), sample_ids

    def state_dict(self) -> dict[str, Any]:
        return {"seed": self.seed, "epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state``; its seed must match this stream's."""
        if state["seed"] != self.seed:
            raise ValueError(f"BatchStream state has seed {state['seed']}, stream has {self.seed}")
        self.close()
        self.epoch, self.position = int(state["epoch"]), int(state["position"])

    def close(self) -> None:
        """Stop the worker processes (if any); the next ``next_batch`` restarts them."""
        self._batches = None



class PlannedBatches:
    """The batches of a plan (:meth:`BatchStream.next_plan`) read from one dataset; each pass
    loads them again, in order, through the stream's workers (one batch in memory at a time
    plus the workers' prefetch), as :meth:`BatchStream.next_batch` returns them."""

    def __init__(
        self, stream: BatchStream, dataset: ClipDataset, plan: Sequence[Sequence[tuple[int, int]]]
    ) -> None:
        self.stream, self.dataset = stream, dataset
        self.plan = [list(batch) for batch in plan]

    def __len__(self) -> int:
        return len(self.plan)

    def __iter__(self) -> Iterator[Batch]:
        if not self.plan:
            return
        for batch in self.stream._loader(self.dataset, self.plan):
            yield self.stream._to_device(*batch)


FrameItem = tuple[torch.Tensor, torch.Tensor | None, int]
"""One item of :class:`FrameDataset`: (frame uint8 [3, H, W], native label uint8 [H0, W0] or
None for a context frame, the item's index)."""


class FrameDataset(Dataset):
    """Single frames of a :class:`ClipDataset`'s videos for streaming evaluation, in a given order.

    ``frames`` lists ``(video_index, position, labelled)``; item ``i`` is :data:`FrameItem`:
    the frame as the network sees it before normalisation (:meth:`ClipDataset.read_raw_frame`)
    and, for a labelled frame, its label read once at native resolution (checked against the
    frame's size), the one label read of an evaluation.
    """

    def __init__(self, dataset: ClipDataset, frames: Sequence[tuple[int, int, bool]]) -> None:
        self.dataset = dataset
        self.frames = list(frames)

    def __len__(self) -> int:
        return len(self.frames)

    def __getitem__(self, index: int) -> FrameItem:
        video_index, position, labelled = self.frames[index]
        video = self.dataset.videos[video_index]
        frame, frame_size = self.dataset.read_raw_frame(video, position)
        if not labelled:
            return frame, None, index
        return frame, torch.from_numpy(self.dataset.read_native_label(video, position, frame_size)), index


def collate_frames(
    items: Sequence[FrameItem],
) -> tuple[torch.Tensor, list[torch.Tensor | None], list[int]]:
    """FrameDataset items -> (frames uint8 [B, 3, H, W], B native labels or None, B indices);
    labels stay a list (their native sizes may differ)."""
    frames, labels, indices = zip(*items, strict=True)
    return torch.stack(frames), list(labels), list(indices)


def frame_loader(dataset: FrameDataset, batch_size: int, num_workers: int | str) -> DataLoader:
    """Batches of ``dataset`` in its order (:func:`collate_frames`), decoded by ``num_workers``
    workers (a count or "auto"), pinned when CUDA is present."""
    num_workers = resolve_num_workers(num_workers)
    return DataLoader(
        dataset,
        batch_size=batch_size,
        shuffle=False,
        num_workers=num_workers,
        multiprocessing_context=_worker_context(num_workers),
        collate_fn=collate_frames,
        pin_memory=torch.cuda.is_available(),
        worker_init_fn=_seed_worker,
    )
