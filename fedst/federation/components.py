"""Build the pieces every party of a run needs from one ExperimentConfig: the network, its
personalized/shared partition, the loss, the site indicators and the datasets.

Server, sites and the out-of-federation evaluator all call these, so a run's parties agree on
the model and on which tensors may travel.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from fedst.data.base import SiteSource
from fedst.data.clips import ClipDataset
from fedst.experiment import ExperimentConfig
from fedst.model.losses import SegmentationLoss
from fedst.model.network import FedSTNet, build_network
from fedst.model.partition import PRESETS, Partition, PartitionRules, split_state


def seed_everything(*parts: int) -> None:
    """Seed Python, NumPy and torch from a tuple of integers (seed, site index, round, ...)."""
    seed = int(np.random.SeedSequence(list(parts)).generate_state(1)[0])
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def build_model(cfg: ExperimentConfig) -> FedSTNet:
    """The method's network, initialised identically for every party (seeded by ``cfg.seed``)."""
    seed_everything(cfg.seed, 0xC0FFEE)
    return build_network(cfg.network_config())


def partition_of(model: nn.Module, cfg: ExperimentConfig) -> Partition:
    """Which state-dict keys stay at the site (rho), travel (gamma) or are fixed buffers."""
    preset = PRESETS[cfg.method.personalization]
    rules = PartitionRules((*preset.personal, *cfg.method.personal_patterns))
    return split_state(
        model,
        rules,
        personalize_channel_selection=cfg.method.personalize_channel_selection,
    )


def build_loss(cfg: ExperimentConfig) -> SegmentationLoss:
    return SegmentationLoss(lambda_dice=cfg.train.lambda_dice)


def site_order(cfg: ExperimentConfig) -> list[str]:
    """Fixed site order for one-hot / Gaussian indicators: federation, out-of-fed, the CBE
    held-out site (selection.held_out_site), server."""
    data, held_out = cfg.data, cfg.selection.held_out_site
    return [
        *data.federation,
        *data.out_of_federation,
        *([held_out] if held_out else []),
        *([data.server] if data.server else []),
    ]


def build_indicators(cfg: ExperimentConfig) -> dict[str, torch.Tensor]:
    """Frozen indicator xi_k of every site of the experiment (empty when the method uses none)."""
    if not cfg.uses_indicator():
        return {}
    from fedst.model.indicators import site_indicators

    names = site_order(cfg)
    sites = [(name, cfg.data.sites[name].surgery_type) for name in names]
    return site_indicators(
        cfg.method.indicator,
        sites,
        dim=cfg.indicator.dim,
        site_order=names,
        clip_model=cfg.indicator.clip_model,
        clip_pretrained=cfg.indicator.clip_pretrained,
        cache_dir=cfg.indicator.cache_dir,
        seed=cfg.seed,
    )


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


def state_subset(model: nn.Module, keys: tuple[str, ...] | list[str]) -> dict[str, torch.Tensor]:
    """Detached CPU copies of the named state-dict entries."""
    state = model.state_dict()
    return {k: state[k].detach().to("cpu", copy=True) for k in keys}


def load_subset(model: nn.Module, values: dict[str, torch.Tensor]) -> None:
    """Copy ``values`` into the model's state in place, keeping each tensor's dtype and device."""
    state = model.state_dict()
    unknown = sorted(set(values) - set(state))
    if unknown:
        raise KeyError(f"received tensors the model does not have: {unknown[:5]}")
    with torch.no_grad():
        for key, value in values.items():
            target = state[key]
            if target.shape != value.shape:
                raise ValueError(
                    f"{key}: received shape {tuple(value.shape)}, model has {tuple(target.shape)}"
                )
            target.copy_(torch.as_tensor(value).to(dtype=target.dtype))
