"""A site's datasets, opened from an ExperimentConfig: training clips (augmented) and test clips."""

from __future__ import annotations

from dataclasses import dataclass

from fedst.data.base import SiteSource
from fedst.data.clips import ClipDataset
from fedst.experiment import ExperimentConfig


@dataclass
class SiteData:
    """A site's opened source and its datasets (train with augmentation, test without)."""

    source: SiteSource
    train: ClipDataset | None
    test: ClipDataset | None


def open_site_data(cfg: ExperimentConfig, name: str, splits: tuple[str, ...]) -> SiteData:
    source = cfg.data.open(name)
    clip = cfg.clip_config()
    train = ClipDataset(source, "train", clip, cfg.augment) if "train" in splits else None
    test = ClipDataset(source, "test", clip, None) if "test" in splits else None
    return SiteData(source=source, train=train, test=test)
