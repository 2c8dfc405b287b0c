"""Single frames for streaming evaluation: :class:`FrameDataset` reads the frames of a
:class:`ClipDataset`'s videos in a given order, as the network sees them before normalisation, with
each labelled frame's label once at native resolution, and :func:`frame_loader` batches them
through the loader workers of fedst/data/clips/loaders.py; :class:`FrameLoaders` keeps those
loaders and their workers between evaluations (issue 60: a site's evaluation started its workers
afresh every time, about 0.5 s a worker on the H200 machine and 2-7 s for 2-4 workers on this
project's loaded CPU, bench/loader.py --schedule)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.utils.data import DataLoader, Dataset

from fedst.data.clips.dataset import ClipDataset
from fedst.data.clips.loaders import (
    resolve_num_workers,
    seed_worker,
    shutdown_workers,
    worker_context,
)

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
        return (
            frame,
            torch.from_numpy(self.dataset.read_native_label(video, position, frame_size)),
            index,
        )


def collate_frames(
    items: Sequence[FrameItem],
) -> tuple[torch.Tensor, list[torch.Tensor | None], list[int]]:
    """FrameDataset items -> (frames uint8 [B, 3, H, W], B native labels or None, B indices);
    labels stay a list (their native sizes may differ)."""
    frames, labels, indices = zip(*items, strict=True)
    return torch.stack(frames), list(labels), list(indices)


def frame_loader(
    dataset: FrameDataset, batch_size: int, num_workers: int | str, persistent: bool = False
) -> DataLoader:
    """Batches of ``dataset`` in its order (:func:`collate_frames`), decoded by ``num_workers``
    workers (a count or "auto"), pinned when CUDA is present; ``persistent``: the workers stay
    between passes (until :meth:`FrameLoaders.close` or the loader's last reference)."""
    num_workers = resolve_num_workers(num_workers)
    return DataLoader(
        dataset,
        batch_size=batch_size,
        shuffle=False,
        num_workers=num_workers,
        multiprocessing_context=worker_context(num_workers),
        collate_fn=collate_frames,
        pin_memory=torch.cuda.is_available(),
        worker_init_fn=seed_worker,
        persistent_workers=persistent and num_workers > 0,
    )


class FrameLoaders:
    """A site's evaluation loaders, kept for the run: one persistent :func:`frame_loader` per
    (clip dataset, frame plan, batch size, workers), so each evaluation after the first of a
    dataset reuses its workers instead of starting them. The plan is part of the key: the
    workers hold the :class:`FrameDataset` they were started with."""

    def __init__(self) -> None:
        self._loaders: dict[tuple, tuple[ClipDataset, DataLoader]] = {}

    def __len__(self) -> int:
        return len(self._loaders)

    def loader(
        self,
        dataset: ClipDataset,
        frames: Sequence[tuple[int, int, bool]],
        batch_size: int,
        num_workers: int | str,
    ) -> DataLoader:
        """The kept loader of ``dataset``'s ``frames`` (made at the first call)."""
        workers = resolve_num_workers(num_workers)
        key = (id(dataset), tuple(frames), batch_size, workers)
        if key not in self._loaders:  # the dataset is held with it, so its id stays its own
            made = frame_loader(FrameDataset(dataset, frames), batch_size, workers, True)
            self._loaders[key] = (dataset, made)
        return self._loaders[key][1]

    def close(self) -> None:
        """Stop every kept loader's workers and drop the loaders."""
        for _, loader in self._loaders.values():
            shutdown_workers(loader)
        self._loaders = {}
