"""A site's datasets, opened from an ExperimentConfig: training clips (augmented) and test clips;
and what a training party reads (:func:`open_party_data`): one site's, or several sites' pooled."""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from itertools import accumulate
from typing import TYPE_CHECKING

import torch

from fedst.data.base import SiteSource
from fedst.data.clips import ClipDataset
from fedst.experiment import ExperimentConfig

if TYPE_CHECKING:
    from fedst.methods.base import Method


@dataclass
class SiteData:
    """A site's opened source and its datasets (train with augmentation, test without; the
    training masks are every clip frame's, [T, H, W], where ``cfg.uses_clip_frame_labels()``)."""

    source: SiteSource
    train: ClipDataset | None
    test: ClipDataset | None


def open_site_data(cfg: ExperimentConfig, name: str, splits: tuple[str, ...]) -> SiteData:
    source = cfg.data.open(name)
    clip = cfg.clip_config()
    train = (
        ClipDataset(
            source,
            "train",
            clip,
            cfg.augment,
            clip_frame_labels=cfg.uses_clip_frame_labels(),  # CFFM's every-frame supervision
        )
        if "train" in splits
        else None
    )
    test = ClipDataset(source, "test", clip, None) if "test" in splits else None
    return SiteData(source=source, train=train, test=test)


class PooledClips(torch.utils.data.Dataset):
    """Several sites' training clips as one dataset, in the given site order: pool index i is
    sample i - offset of the site it falls in. Items are indexed like a :class:`ClipDataset`'s
    (``index`` or ``(index, aug_seed)``, what :class:`fedst.data.clips.BatchStream` passes), so a
    seeded stream shuffles the pool as it shuffles one site."""

    def __init__(self, parts: list[ClipDataset]) -> None:
        lengths = {part.site_name: part.clip_length for part in parts}
        if len(set(lengths.values())) > 1:
            raise ValueError(
                f"pooled training sets must have one clip length to be batched together; got "
                f"{lengths} frames per clip (clip.single_frame_mode=repeat gives image-only "
                f"sets the clip length of video sets)"
            )
        self.parts = parts
        self.ends = list(accumulate(len(part) for part in parts))  # exclusive end of each part

    def __len__(self) -> int:
        return self.ends[-1]

    def locate(self, index: int) -> tuple[ClipDataset, int]:
        """The site dataset holding pool sample ``index`` and the sample's index in it."""
        if not 0 <= index < len(self):
            raise IndexError(f"pool index {index} out of range 0..{len(self) - 1}")
        part = bisect.bisect_right(self.ends, index)
        return self.parts[part], index - (self.ends[part - 1] if part else 0)

    def sample_id(self, index: int) -> str:
        dataset, local = self.locate(index)
        return dataset.sample_id(local)

    def _part_item(self, item: int | tuple[int, int]) -> tuple[ClipDataset, tuple[int, int | None]]:
        index, aug_seed = item if isinstance(item, tuple) else (item, None)
        dataset, local = self.locate(int(index))
        return dataset, (local, aug_seed)

    def __getitem__(self, item: int | tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor, str]:
        dataset, part_item = self._part_item(item)
        return dataset[part_item]

    def load_raw(self, item: int | tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor, str]:
        """The uint8 item loader workers send (:meth:`ClipDataset.load_raw`) of pool sample
        ``item``."""
        dataset, part_item = self._part_item(item)
        return dataset.load_raw(part_item)


@dataclass
class PartyData:
    """What a training party reads: its training clips and the test split of every site its
    model is scored on (:meth:`fedst.methods.base.Method.scored_sites`)."""

    train: ClipDataset | PooledClips
    tests: dict[str, ClipDataset]


def open_party_data(cfg: ExperimentConfig, method: Method, party: str) -> PartyData:
    """The training split of ``party`` (one site's, or the pool of the method's train sources in
    their order) and the test splits it is scored on.

    With ``data.mix_synthetic`` (paper Sec. IV-C6: "all synthetic samples are fully mixed into
    the real training data for each site") the server's synthetic set follows the party's own
    training split in the pool, every sample once (the upper bound's pool too: once, not once
    per site); the test splits stay the party's own. Each synthetic image is a single-frame
    video (no temporal order), read with the site's clip config and augmentation, i.e. as a clip
    of T = ``clip.num_frames`` copies of the image [T, 3, H, W] (``clip.single_frame_mode=repeat``,
    the default): that is how the clip builder already fills a clip at a video's first frame, so
    the site's network, temporal module included, and its batches [B, T, 3, H, W] take the images
    unchanged. The server reads the same files as 1-frame clips only because its passes never run
    the temporal module (fedst/federation/server.py). The party's sample count (n_k of FedAvg's
    sample weights) is then its real plus synthetic samples."""
    sources = (*method.train_sources(party), *filter(None, [method.synthetic_train_source()]))
    parts = [open_site_data(cfg, s, ("train",)).train for s in sources]
    tests = {s: open_site_data(cfg, s, ("test",)).test for s in method.scored_sites(party)}
    return PartyData(train=parts[0] if len(parts) == 1 else PooledClips(parts), tests=tests)
