""":class:`ClipDataset`, one sample per labelled frame of a site's split: the clip ending at it
(fedst/data/clips/clip.py), read from the site's backend, resized, augmented with the sample's
seed and normalised, with its mask; the same item before normalisation for loader workers
(:meth:`ClipDataset.load_raw`), single frames and native labels for evaluation, and the
validation of the split's files."""

from __future__ import annotations

import logging
from collections.abc import Callable

import cv2
import numpy as np
import torch
from torch.utils.data import Dataset

from fedst.data.base import (
    IGNORE_INDEX,
    DataError,
    SiteSource,
    VideoRecord,
)
from fedst.data.clips.augmentation import AUG_SEED_HIGH, build_augmentation
from fedst.data.clips.cache import CachedFrames, CachedSource
from fedst.data.clips.clip import clip_frame_positions
from fedst.data.clips.normalization import channels_first, normalize_clips, resize_frame
from fedst.schema.clips import AugmentConfig, ClipConfig

logger = logging.getLogger("fedst.data.clips")  # the package's name, as before the split


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

    With ``clip_frame_labels`` (``train.clip_frame_loss_weight`` > 0: CFFM's supervision of every
    clip frame) and clips of more than one frame, the mask is every clip frame's label,
    [T, H, W] oldest first (the current frame's last), resized and augmented with the frames'
    own transform; a clip frame without a label is 255 (ignore) everywhere. Without it no
    earlier frame's label is read.
    """

    def __init__(
        self,
        source: SiteSource,
        split: str,
        clip: ClipConfig = ClipConfig(),
        augment: AugmentConfig | None = None,
        validate: bool = True,
        clip_frame_labels: bool = False,
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
        self.clip_frame_labels = clip_frame_labels and self.clip_length > 1
        """Masks are [T, H, W], every clip frame's label (class docstring), not [H, W]."""
        self._augment = (
            build_augmentation(augment, self.clip_length) if augment and augment.enabled else None
        )
        self._index_of_id: dict[str, int] | None = None
        self.cached: CachedFrames | None = None
        """The preprocessed frames and labels (``data.cache_dir``: the source is a CachedSource,
        fedst/data/clips/cache.py), read instead of decoding and resizing; None: decode."""
        if isinstance(source, CachedSource):
            self.cached = source.open_frames(
                split, self.videos, self.needed_positions(), clip.image_size
            )
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

    def needed_positions(self) -> list[list[int]]:
        """Per video (sorted): the positions of every frame the samples' clips read."""
        needed: list[set[int]] = [set() for _ in self.videos]
        for video_index, position in self.samples:
            needed[video_index].update(self.clip_positions(self.videos[video_index], position))
        return [sorted(positions) for positions in needed]

    def sample_id(self, index: int) -> str:
        """``"<site>/<video_id>/<position>"`` of sample ``index`` (as returned by ``__getitem__``)."""
        video, position = self.sample_ref(index)
        return f"{self.site_name}/{video.video_id}/{position}"

    def index_of(self, sample_id: str) -> int:
        """The index of the sample called ``sample_id`` (inverse of :meth:`sample_id`)."""
        if self._index_of_id is None:
            self._index_of_id = {self.sample_id(i): i for i in range(self.num_samples)}
        if sample_id not in self._index_of_id:
            raise KeyError(
                f"site {self.site_name!r} split {self.split!r} has no sample {sample_id!r}"
            )
        return self._index_of_id[sample_id]

    def native_label(self, sample_id: str) -> np.ndarray:
        """The label of ``sample_id`` at the dataset's native resolution (uint8 [H0, W0], 255 =
        ignore), not resized and not augmented: what distances are measured on (evaluation)."""
        video, position = self.sample_ref(self.index_of(sample_id))
        return self.source.read_label(video.labels[position])

    def __getitem__(self, item: int | tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor, str]:
        """``(clip [T, 3, H, W] float32 normalised, mask [H, W] int64, sample_id)``; the mask is
        [T, H, W] with ``clip_frame_labels``."""
        clip, mask, sample_id = self.load_raw(item)
        return normalize_clips(clip), mask.long(), sample_id

    def load_raw(self, item: int | tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor, str]:
        """``(clip [T, 3, H, W] uint8, mask [H, W] uint8, sample_id)``: :meth:`__getitem__`
        before :func:`normalize_clips` (resized and augmented; what loader workers send); the
        mask is [T, H, W] with ``clip_frame_labels``."""
        index, aug_seed = item if isinstance(item, tuple) else (item, None)
        video, position = self.sample_ref(int(index))
        positions = self.clip_positions(video, position)
        resized, label, earlier = self._resized_clip(video, positions, position)
        clip = [resized[p] for p in positions]  # T x [H, W, 3] uint8, oldest first
        if self._augment is not None:
            clip, label, earlier = self._apply_augmentation(clip, label, aug_seed, earlier)
        clip_tensor = torch.from_numpy(channels_first(np.stack(clip)))  # [T, 3, H, W] uint8
        mask = label if earlier is None else np.stack([*earlier, label])  # [H, W] | [T, H, W]
        return clip_tensor, torch.from_numpy(mask), self.sample_id(int(index))

    def _earlier_labels(
        self,
        video: VideoRecord,
        positions: list[int],
        label_at: Callable[[int], np.ndarray],
        current_label: np.ndarray,
    ) -> list[np.ndarray] | None:
        """The labels of the clip's earlier frames (``positions[:-1]``), T-1 x uint8 [H, W] at
        ``image_size`` (``label_at(position)`` reads one): the frame's own label, 255 everywhere
        for a frame without one (it adds no loss), the current frame's where the clip repeats it;
        None without ``clip_frame_labels`` (nothing read)."""
        if not self.clip_frame_labels:
            return None
        current = positions[-1]
        read = {p: label_at(p) for p in set(positions[:-1]) - {current} if p in video.labels}
        read[current] = current_label
        return [
            read[p] if p in read else np.full(self.clip.image_size, IGNORE_INDEX, np.uint8)
            for p in positions[:-1]
        ]

    def _resized_clip(
        self, video: VideoRecord, positions: list[int], position: int
    ) -> tuple[dict[int, np.ndarray], np.ndarray, list[np.ndarray] | None]:
        """({clip position: frame uint8 [H, W, 3]}, label of ``position`` uint8 [H, W], the
        earlier frames' labels (:meth:`_earlier_labels`) or None) at ``image_size``: decoded and
        resized, or read from the cache (:attr:`cached`)."""
        if self.cached is not None:
            cached = self.cached
            frames = {p: cached.frame(video, p) for p in set(positions)}
            label = cached.label(video, position)
            earlier = self._earlier_labels(
                video, positions, lambda p: cached.label(video, p), label
            )
            return frames, label, earlier
        frames = {p: self.source.read_frame(video.frames[p]) for p in set(positions)}
        label = self._read_label(video, position, frames[position].shape[:2])
        earlier = self._earlier_labels(
            video, positions, lambda p: self._read_label(video, p, frames[p].shape[:2]), label
        )
        resized = {p: resize_frame(f, self.clip.image_size) for p, f in frames.items()}
        return resized, label, earlier

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
        if self.cached is not None:
            resized = self.cached.frame(video, position)
            frame_size = self.cached.native_size(video, position)
        else:
            rgb = self.source.read_frame(video.frames[position])
            resized, frame_size = resize_frame(rgb, self.clip.image_size), rgb.shape[:2]
        frame = torch.from_numpy(channels_first(resized[None])[0])
        return frame, (int(frame_size[0]), int(frame_size[1]))

    def _apply_augmentation(
        self,
        clip: list[np.ndarray],
        label: np.ndarray,
        aug_seed: int | None,
        earlier_labels: list[np.ndarray] | None = None,
    ) -> tuple[list[np.ndarray], np.ndarray, list[np.ndarray] | None]:
        """The sample's one random transform on every frame, the label and (when given) the
        earlier frames' labels (albumentations' ``masks`` target: the mask's interpolation and
        fill)."""
        if aug_seed is None:
            aug_seed = int(torch.randint(AUG_SEED_HIGH, ()).item())
        self._augment.set_random_seed(aug_seed)
        targets = {f"frame_{i}": frame for i, frame in enumerate(clip[:-1], start=1)}
        if earlier_labels is not None:
            targets["masks"] = earlier_labels
        out = self._augment(image=clip[-1], mask=label, **targets)
        frames = [out[f"frame_{i}"] for i in range(1, len(clip))] + [out["image"]]
        earlier = None if earlier_labels is None else list(out["masks"])
        return frames, out["mask"], earlier

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
