"""Batches of clips, reproducibly: loader workers (how many, how they start, how they are seeded),
the sample order and augmentation seeds of an epoch drawn from ``(seed, epoch)`` only (so the
batches do not depend on the number of workers), :func:`make_loader` (epochs of a dataset) and
:class:`BatchStream` (an endless, resumable stream of full batches for fixed-iteration training,
uint8 from the workers and normalised on the device; :class:`PlannedBatches` replays a plan).

Feeding a GPU (design note). ``num_workers="auto"`` gives a loader the cores it can use alone:
the usable cores divided among the loaders that run at the same time, one core of each share kept
for the process that trains (:func:`resolve_num_workers`). In the in-process engine the sites
train in turn and the server's SERQ runs between them, so one loader runs at a time and may use
every core but one; an engine that runs several sites at once on one machine (Ray, ``deploy
local``) passes how many. A :class:`BatchStream` keeps one DataLoader per dataset it reads, with
persistent workers: the training stream, SERQ's augmented and canonical passes and a resumed
position reuse the same worker processes, round after round (their sample order comes from the
stream's plan, never from the workers' seeds). A stream given ``num_classes`` checks each batch's
labels in its workers (:class:`CheckedCollate`), not on the training thread. Batches are pinned when the stream's device is a
CUDA device and copied with ``non_blocking=True``."""

from __future__ import annotations

import multiprocessing
import os
import random
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import cv2
import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from fedst.data.base import (
    IGNORE_INDEX,
    check_label_values,
)
from fedst.data.clips.augmentation import AUG_SEED_HIGH
from fedst.data.clips.dataset import ClipDataset
from fedst.data.clips.normalization import normalize_clips

PREFETCH_FACTOR = 4
"""Batches each worker of a :class:`BatchStream` loads ahead (DataLoader ``prefetch_factor``; its
default is 2): a GPU step of the paper's batch of 2 takes milliseconds, a 1080p clip's decoding
tens, so every worker keeps several batches ready."""

WORKER_START_METHOD = "forkserver"
"""How DataLoader workers start. Not "fork": a worker forked from a process whose OpenCV thread
pool has run hangs in its first cv2 call (seen here: cv2.setNumThreads blocked forever)."""

WORKER_PRELOAD = ("torch", "cv2", "albumentations", "fedst.data.clips", "fedst.data.generic")
"""Modules the fork server imports once, so a worker starts in ~0.5 s instead of importing them."""

AUTO_WORKERS_MAX = 4
"""The most workers "auto" gives one loader. Measured (docs/paper-scale.md, "The first run on a
GPU"): one loader process decodes and augments ~15 clips/s of 1280x1024 frames at 512x640 (68 ms
a clip, bench/loader.py on a 2-core Xeon), and a paper-config site step on the H200 took ~90 ms
for its batch of 2, so 2 workers keep up and 4 leave a 2.6x margin. Workers start one after
another, ~0.5 s each: uncapped, the H200 machine's 15 per loader cost 8 s at every site's first
round and at every evaluation's loader. A number in ``train.num_workers`` is taken as given."""

Batch = tuple[torch.Tensor, torch.Tensor, list[str]]
"""(clips [B, T, 3, H, W], masks [B, H, W] or, from a ClipDataset with ``clip_frame_labels``,
every clip frame's [B, T, H, W], sample ids)."""


def current_frame_masks(masks: torch.Tensor) -> torch.Tensor:
    """A batch's labels of its current frames, [B, H, W]: ``masks`` itself, or the last frame's
    of every clip frame's labels [B, T, H, W] (``ClipDataset(clip_frame_labels=True)``)."""
    return masks[:, -1] if masks.dim() == 4 else masks


def usable_cpu_count() -> int:
    """CPU cores this process may run on (its affinity mask where the OS has one)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - macOS / Windows
        return os.cpu_count() or 1


def shutdown_workers(loader: DataLoader) -> None:
    """Stop ``loader``'s persistent workers now. DataLoader has no public call for it; this is
    what its iterator's ``__del__`` runs (a reference held elsewhere would otherwise keep them)."""
    iterator = getattr(loader, "_iterator", None)
    if iterator is not None and hasattr(iterator, "_shutdown_workers"):
        iterator._shutdown_workers()


def resolve_num_workers(
    value: int | str, parallel_loaders: int = 1, cpu_count: int | None = None
) -> int:
    """``train.num_workers`` as a worker count: a number as given; "auto" = the cores of one
    loader's share, ``cpu_count // parallel_loaders``, less the core of the process that trains
    (0 where the share is one core: load in that process), at most :data:`AUTO_WORKERS_MAX`.

    ``parallel_loaders``: how many loaders of this machine load at the same time (the in-process
    engine: 1, its sites train in turn; Ray / ``deploy local``: the sites that train at once).
    ``cpu_count``: the usable cores (default: :func:`usable_cpu_count`)."""
    if isinstance(parallel_loaders, bool) or parallel_loaders < 1:
        raise ValueError(f"parallel_loaders={parallel_loaders!r}: at least 1 loader")
    if value == "auto":
        cores = usable_cpu_count() if cpu_count is None else cpu_count
        return min(AUTO_WORKERS_MAX, max(0, cores // parallel_loaders - 1))
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f'num_workers={value!r}: a number of workers >= 0 or "auto"')
    return value


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


class CheckedCollate:
    """:func:`collate_clips` that first checks the batch's labels (uint8 masks [B, H, W]) against
    ``num_classes`` (``check_label_values``: a ValueError naming the batch's sample ids). A
    DataLoader runs its collate function in its workers, so with workers the check costs the
    training thread nothing (a worker's ValueError reaches the reader with its message)."""

    def __init__(self, num_classes: int) -> None:
        self.num_classes = num_classes

    def __call__(self, samples: Sequence[tuple[torch.Tensor, torch.Tensor, str]]) -> Batch:
        clips, masks, sample_ids = collate_clips(samples)
        check_label_values(masks, self.num_classes, IGNORE_INDEX, f"batch {sample_ids}")
        return clips, masks, sample_ids


def worker_context(num_workers: int) -> multiprocessing.context.BaseContext | None:
    """The start method of DataLoader workers (None: no workers, load in this process)."""
    if num_workers == 0:
        return None
    context = multiprocessing.get_context(WORKER_START_METHOD)
    context.set_forkserver_preload(list(WORKER_PRELOAD))
    return context


def seed_worker(worker_id: int) -> None:
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
        multiprocessing_context=worker_context(num_workers),
        drop_last=drop_last,
        collate_fn=collate_clips,
        persistent_workers=num_workers > 0,
        pin_memory=torch.cuda.is_available(),
        worker_init_fn=seed_worker,
        generator=torch.Generator().manual_seed(seed),
    )


class _ResumableBatchSampler:
    """Endless batches of ``(index, aug_seed)`` of a stream's epochs (``_epoch_plan`` of
    ``seed``, shuffled) from (epoch, position) on; batches span epochs."""

    def __init__(
        self, num_samples: int, seed: int, batch_size: int, epoch: int, position: int
    ) -> None:
        self.num_samples, self.seed, self.batch_size = num_samples, seed, batch_size
        self.epoch, self.position = epoch, position

    def __iter__(self) -> Iterator[list[tuple[int, int]]]:
        epoch, position = self.epoch, self.position
        order, aug_seeds = _epoch_plan(self.num_samples, self.seed, epoch, shuffle=True)
        while True:
            batch = []
            while len(batch) < self.batch_size:
                if position == len(order):
                    epoch, position = epoch + 1, 0
                    order, aug_seeds = _epoch_plan(self.num_samples, self.seed, epoch, True)
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


class _BatchSource:
    """The batch sampler of a persistent DataLoader: a pass over the loader yields the batches
    set for it just before, so one loader (and its workers) serves every pass."""

    def __init__(self) -> None:
        self.batches: Iterable[list[tuple[int, int]]] = ()

    def __iter__(self) -> Iterator[list[tuple[int, int]]]:
        return iter(self.batches)


@dataclass
class _Loader:
    """A stream's DataLoader of one dataset, kept for the stream's life."""

    dataset: ClipDataset
    loader: DataLoader
    source: _BatchSource
    passes: int = 0
    """Passes started over ``loader``; a pass is stale once a later one has started (the
    workers then load the later pass's batches)."""


@dataclass
class _Pass:
    """One pass over a :class:`_Loader`: its number and the loader's iterator."""

    owner: _Loader
    number: int
    batches: Iterator[Batch]

    @property
    def current(self) -> bool:
        return self.owner.passes == self.number


class BatchStream:
    """An endless, seeded, resumable stream of shuffled batches for fixed-iteration training.

    Every batch is full (it continues into the next epoch's order when one ends). ``state_dict()``
    holds ``(epoch, position)`` of the next sample; loading it continues the same sequence of
    samples and augmentations.

    Workers send uint8 clips and masks (pinned when ``device`` is a CUDA device);
    :meth:`next_batch` copies them to ``device`` without blocking and normalises there, so the
    batches equal the dataset's items. The stream keeps one DataLoader per dataset it reads (its
    own; :meth:`load_plan`'s), whose workers persist until :meth:`close`.
    """

    def __init__(
        self,
        dataset: ClipDataset,
        batch_size: int,
        seed: int,
        num_workers: int | str = 0,
        device: torch.device | str | None = None,
        num_classes: int | None = None,
        prefetch_factor: int = PREFETCH_FACTOR,
    ) -> None:
        """``num_workers``: a count or "auto" (:func:`resolve_num_workers`); ``device``: where
        batches are normalised and returned (None: the CPU); ``num_classes``: the network's,
        against which every batch's labels are checked on the CPU, before the copy, in the
        loader workers (:class:`CheckedCollate`; None: not checked here, and a loss given these
        batches must check them); ``prefetch_factor``: batches each worker loads ahead."""
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if prefetch_factor < 1:
            raise ValueError(f"prefetch_factor must be >= 1, got {prefetch_factor}")
        self.dataset, self.batch_size, self.seed = dataset, batch_size, seed
        self.num_workers = resolve_num_workers(num_workers)
        self.prefetch_factor = prefetch_factor
        self.device = torch.device(device if device is not None else "cpu")
        self.num_classes = num_classes
        self.epoch, self.position = 0, 0
        self._loaders: list[_Loader] = []
        self._training: _Pass | None = None
        """The pass :meth:`next_batch` reads (None: start one at (epoch, position))."""

    def epoch_plan(self, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        """(sample order, augmentation seeds) of ``epoch``."""
        return _epoch_plan(len(self.dataset), self.seed, epoch, shuffle=True)

    def next_batch(self) -> Batch:
        """``(clips [B, T, 3, H, W] float32 normalised, masks [B, H, W] int64, sample_ids)``, on
        the stream's device."""
        if self._training is None or not self._training.current:
            sampler = _ResumableBatchSampler(
                len(self.dataset), self.seed, self.batch_size, self.epoch, self.position
            )
            self._training = self._start(self.dataset, sampler)
        batch = next(self._training.batches)  # uint8 [B, T, 3, H, W], uint8 [B, H, W], ids
        self._advance(1)
        return self._to_device(*batch)

    def next_plan(self, num_batches: int) -> list[list[tuple[int, int]]]:
        """The ``(index, aug_seed)`` pairs of the next ``num_batches`` batches, one list per batch,
        without loading them: exactly the samples and augmentations ``num_batches`` calls of
        :meth:`next_batch` would return, and the stream's position advances as theirs would.
        Load them with :meth:`load_plan`."""
        if num_batches < 0:
            raise ValueError(f"num_batches must be >= 0, got {num_batches}")
        sampler = _ResumableBatchSampler(
            len(self.dataset), self.seed, self.batch_size, self.epoch, self.position
        )
        batches = iter(sampler)
        plan = [next(batches) for _ in range(num_batches)]
        self._training = None  # a live pass would continue from the old position
        self._advance(num_batches)
        return plan

    def load_plan(
        self, plan: Sequence[Sequence[tuple[int, int]]], dataset: ClipDataset | None = None
    ) -> PlannedBatches:
        """The batches of ``plan`` (from :meth:`next_plan`) read from ``dataset`` (default: the
        stream's; e.g. the same samples without augmentation), as :meth:`next_batch` returns
        them, loaded by the stream's persistent workers of that dataset one batch at a time
        (plus their prefetch)."""
        return PlannedBatches(self, dataset if dataset is not None else self.dataset, plan)

    def _loader_of(self, dataset: ClipDataset) -> _Loader:
        """The stream's DataLoader of ``dataset`` (uint8 batches), created at its first pass."""
        for entry in self._loaders:
            if entry.dataset is dataset:
                return entry
        source = _BatchSource()
        workers = self.num_workers
        loader = DataLoader(
            _RawClips(dataset),
            batch_sampler=source,
            num_workers=workers,
            multiprocessing_context=worker_context(workers),
            collate_fn=collate_clips
            if self.num_classes is None
            else CheckedCollate(self.num_classes),
            pin_memory=self.device.type == "cuda",
            worker_init_fn=seed_worker,
            generator=torch.Generator().manual_seed(self.seed),
            persistent_workers=workers > 0,
            prefetch_factor=self.prefetch_factor if workers > 0 else None,
        )
        entry = _Loader(dataset, loader, source)
        self._loaders.append(entry)
        return entry

    def _start(self, dataset: ClipDataset, batches: Iterable[list[tuple[int, int]]]) -> _Pass:
        """Begin a pass over ``batches`` of ``dataset``: its workers start loading now. An
        earlier pass over the same dataset becomes stale."""
        entry = self._loader_of(dataset)
        entry.passes += 1
        entry.source.batches = batches
        return _Pass(entry, entry.passes, iter(entry.loader))

    def _advance(self, num_batches: int) -> None:
        """Move (epoch, position) past ``num_batches`` batches (batches span epochs)."""
        consumed = self.position + num_batches * self.batch_size
        self.epoch += consumed // len(self.dataset)
        self.position = consumed % len(self.dataset)

    def _to_device(self, clips: torch.Tensor, masks: torch.Tensor, sample_ids: list[str]) -> Batch:
        """A loader's uint8 batch (labels checked by its collate function) -> :meth:`next_batch`'s:
        copied to the device (from pinned memory on CUDA: no host wait) and normalised there."""
        clips = clips.to(self.device, non_blocking=True)
        masks = masks.to(self.device, non_blocking=True)
        return normalize_clips(clips), masks.long(), sample_ids

    def state_dict(self) -> dict[str, Any]:
        return {"seed": self.seed, "epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state``; its seed must match this stream's (the workers stay)."""
        if state["seed"] != self.seed:
            raise ValueError(f"BatchStream state has seed {state['seed']}, stream has {self.seed}")
        self._training = None
        self.epoch, self.position = int(state["epoch"]), int(state["position"])

    def close(self) -> None:
        """Stop the worker processes (if any) and drop the DataLoaders; the next pass starts
        new ones."""
        self._training = None
        for entry in self._loaders:
            shutdown_workers(entry.loader)
        self._loaders = []


class PlannedBatches:
    """The batches of a plan (:meth:`BatchStream.next_plan`) read from one dataset; each pass
    loads them again, in order, through the stream's persistent workers of that dataset (one
    batch in memory at a time plus the workers' prefetch), as :meth:`BatchStream.next_batch`
    returns them. :meth:`start` lets the workers begin before the pass is read."""

    def __init__(
        self, stream: BatchStream, dataset: ClipDataset, plan: Sequence[Sequence[tuple[int, int]]]
    ) -> None:
        self.stream, self.dataset = stream, dataset
        self.plan = [list(batch) for batch in plan]
        self._started: _Pass | None = None

    def __len__(self) -> int:
        return len(self.plan)

    def start(self) -> PlannedBatches:
        """Start the next pass now (the workers load its first batches ahead); returns self."""
        if self._started is None and self.plan:
            self._started = self.stream._start(self.dataset, self.plan)
        return self

    def __iter__(self) -> Iterator[Batch]:
        if not self.plan:
            return
        self.start()
        started, self._started = self._started, None
        while True:
            if not started.current:
                raise RuntimeError(
                    "a pass over planned batches went stale: another pass over the same dataset "
                    "of the stream started before it ended; read one pass at a time per dataset"
                )
            try:
                batch = next(started.batches)
            except StopIteration:
                return
            yield self.stream._to_device(*batch)
