"""Clips, augmentation, validation and batching shared by every dataset backend.

A sample is one labelled frame (the *current* frame) plus ``num_frames - 1`` earlier frames at
``interval_s`` spacing (paper Sec. IV-A3: 4 frames, the current and 3 previous). Where the video has
no frame at the wanted time the nearest earlier frame is used; before the video's first frame the
current frame is duplicated. Only the current frame needs a label (with
``train.clip_frame_loss_weight`` > 0 a training clip also carries its earlier frames' labels, 255
where a frame has none).

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

The package: ``clip`` (ClipConfig, which frames make a clip), ``normalization`` (resizing and
ImageNet normalisation), ``augmentation`` (AugmentConfig and its pipeline), ``dataset``
(ClipDataset), ``loaders`` (workers, seeded epochs, ``make_loader``, ``BatchStream``) and
``frames`` (FrameDataset, ``frame_loader`` and the kept FrameLoaders for streaming evaluation),
``cache`` (the preprocessed frame cache a ClipDataset reads with ``data.cache_dir``) and
``cache_build`` (writing it: ``python -m fedst.preprocess build``).

Layer: part of fedst.data; imports fedst.data and the root modules.
"""

from fedst.data.clips.augmentation import build_augmentation
from fedst.data.clips.clip import FrameHistory, clip_frame_positions
from fedst.data.clips.dataset import ClipDataset
from fedst.data.clips.frames import FrameDataset, FrameLoaders, collate_frames, frame_loader
from fedst.data.clips.loaders import (
    BatchStream,
    PlannedBatches,
    collate_clips,
    current_frame_masks,
    make_loader,
    resolve_num_workers,
    usable_cpu_count,
)
from fedst.data.clips.normalization import (
    IMAGENET_MEAN,
    IMAGENET_STD,
    normalize_clips,
    normalize_frames,
    resize_frame,
)
from fedst.schema.clips import AugmentConfig, ClipConfig

__all__ = [
    "IMAGENET_MEAN",
    "IMAGENET_STD",
    "AugmentConfig",
    "BatchStream",
    "ClipConfig",
    "ClipDataset",
    "FrameDataset",
    "FrameHistory",
    "FrameLoaders",
    "PlannedBatches",
    "build_augmentation",
    "clip_frame_positions",
    "collate_clips",
    "collate_frames",
    "current_frame_masks",
    "frame_loader",
    "make_loader",
    "normalize_clips",
    "normalize_frames",
    "resize_frame",
    "resolve_num_workers",
    "usable_cpu_count",
]
