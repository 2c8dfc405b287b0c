"""The whole experiment, :class:`ExperimentConfig`: its sections (fedst/experiment/sections.py and
the data, network, clip and augment configs of their own modules), the checks across sections and
the values derived from them; how a plain mapping (resolved Hydra) or a saved config.json becomes
one; and what every engine reads from it: the torch device and a site's state folder in a run."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from fedst.config import ConfigError, build, require_at_least, to_dict
from fedst.data.clips import AugmentConfig, ClipConfig
from fedst.data.sites import DataConfig
from fedst.experiment.sections import (
    CommConfig,
    IndicatorConfig,
    MethodConfig,
    PrivacyConfig,
    SelectionConfig,
    SerqConfig,
    TrainConfig,
)
from fedst.model.network import NetworkConfig


@dataclass(frozen=True)
class ExperimentConfig:
    data: DataConfig
    name: str = "demo"
    seed: int = 0
    method: MethodConfig = field(default_factory=MethodConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    serq: SerqConfig = field(default_factory=SerqConfig)
    network: NetworkConfig = field(default_factory=NetworkConfig)
    clip: ClipConfig = field(default_factory=ClipConfig)
    augment: AugmentConfig = field(default_factory=AugmentConfig)
    indicator: IndicatorConfig = field(default_factory=IndicatorConfig)
    comm: CommConfig = field(default_factory=CommConfig)
    privacy: PrivacyConfig = field(default_factory=PrivacyConfig)
    selection: SelectionConfig = field(default_factory=SelectionConfig)

    def __post_init__(self) -> None:
        require_at_least("seed", self.seed, 0, "seeds are non-negative integers")
        if self.selection.rule != "last" and self.train.val_every is None:
            raise ConfigError(
                f"selection.rule={self.selection.rule} selects on validation scores: set "
                f"train.val_every=<k> (score the validation split every k rounds)"
            )
        held_out = self.selection.held_out_site
        if held_out is not None:
            data = self.data
            if held_out not in data.sites:
                raise ConfigError(
                    f"selection.held_out_site={held_out!r} has no entry under data.sites "
                    f"({sorted(data.sites)})"
                )
            if held_out in data.federation or held_out in data.out_of_federation:
                raise ConfigError(
                    f"selection.held_out_site={held_out!r} is also in data.federation or "
                    f"data.out_of_federation; a held-out site neither trains nor is tested"
                )
            if held_out == data.server:
                raise ConfigError(f"selection.held_out_site={held_out!r} is the server's set")
            if self.train.val_every is None:
                raise ConfigError(
                    "selection.held_out_site needs train.val_every=<k>: the held-out site only "
                    "scores validation rounds"
                )

    # -- derived values (computed once, logged with the run) ------------------------------------
    def network_config(self) -> NetworkConfig:
        """The network the method asks for: architecture from ``network``, switches from ``method``."""
        return dataclasses.replace(
            self.network,
            temporal=self.method.temporal,
            prompt=self.method.prompt,
            channel_selection=self.method.channel_selection,
            indicator_dim=self.indicator.dim,
        )

    def clip_config(self) -> ClipConfig:
        """Clips of ``clip.num_frames`` frames with the temporal module, single frames without."""
        if self.method.temporal:
            return self.clip
        return dataclasses.replace(self.clip, num_frames=1)

    def uses_indicator(self) -> bool:
        return self.method.prompt or self.method.channel_selection

    def to_json(self) -> str:
        return json.dumps(to_dict(self), sort_keys=True)

    def fingerprint(self) -> str:
        return hashlib.sha1(self.to_json().encode()).hexdigest()[:12]


def experiment_from_dict(values: dict[str, Any]) -> ExperimentConfig:
    """Strictly build an :class:`ExperimentConfig` from a plain mapping (e.g. resolved Hydra).

    ``selection.held_out_site`` is taken out of ``data.federation`` here, once (idempotent: a
    saved config.json already lacks it), so no engine ever starts a node for it.
    """
    held_out = (values.get("selection") or {}).get("held_out_site")
    data = values.get("data")
    if (
        held_out is not None
        and isinstance(data, dict)
        and held_out in (data.get("federation") or [])
    ):
        federation = [s for s in data["federation"] if s != held_out]
        values = {**values, "data": {**data, "federation": federation}}
    return build(ExperimentConfig, values, "experiment")


def experiment_from_json(text: str) -> ExperimentConfig:
    """A saved config.json; one written before ``data.generator_version`` existed was rendered by
    version 1 of the procedural generator and is read as such (not as today's default); one
    written with ``train.amp`` (before ``train.amp_dtype``) reads true as "bf16", false as
    "none" (what each meant)."""
    values = json.loads(text)
    data = values.get("data")
    if isinstance(data, dict) and data.get("procedural") and "generator_version" not in data:
        values = {**values, "data": {**data, "generator_version": 1}}
    train = values.get("train")
    if isinstance(train, dict) and "amp" in train:
        train = {k: v for k, v in train.items() if k != "amp"}
        values = {
            **values,
            "train": {**train, "amp_dtype": "bf16" if values["train"]["amp"] else "none"},
        }
    return experiment_from_dict(values)


def resolve_device(name: str) -> torch.device:
    """``auto`` -> the first CUDA device when available, else CPU."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(
            f"train.device={name!r} but CUDA is not available; use device=auto or cpu"
        )
    return device


def site_state_dir(run_dir: Path, site: str) -> Path:
    return run_dir / "sites" / site
