"""Single frames for streaming evaluation: :class:`FrameDataset` reads the frames of a
:class:`ClipDataset`'s videos in a given order, as the network sees them before normalisation, with
each labelled frame's label once at native resolution, and :func:`frame_loader` batches them
through the loader workers of fedst/data/clips/loaders.py."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.utils.data import DataLoader, Dataset

from fedst.data.clips.dataset import ClipDataset
from fedst.data.clips.loaders import resolve_num_workers, seed_worker, worker_context

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


def frame_loader(dataset: FrameDataset, batch_size: int, num_workers: int | str) -> DataLoader:
    """Batches of ``dataset`` in its order (:func:`collate_frames`), decoded by ``num_workers``
    workers (a count or "auto"), pinned when CUDA is present."""
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
    )
