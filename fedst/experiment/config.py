"""The typed experiment configuration as a whole: :class:`ExperimentConfig` holds the sections
(fedst/experiment/sections.py) with the data, network, clip and augment configs of their own
modules (fedst/data/sites.py, fedst/model/network.py, fedst/data/clips/), checks across sections
and derives values from them; how a plain mapping (resolved Hydra) or a saved config.json becomes
one; and what every engine reads from it: the torch device of a run."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from fedst.config import ConfigError, build, require_at_least, to_dict
from fedst.data.sites import DataConfig
from fedst.experiment.sections import (
    CommConfig,
    FedConfig,
    IndicatorConfig,
    MethodConfig,
    PretrainingConfig,
    PrivacyConfig,
    SelectionConfig,
    SerqConfig,
    TrainConfig,
)
from fedst.schema.clips import AugmentConfig, ClipConfig
from fedst.schema.indicators import resolve_unseen_indicator_rule
from fedst.schema.network import NetworkConfig
from fedst.schema.roles import SERVER, role

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class ExperimentConfig:
    data: DataConfig
    name: str = "demo"
    seed: int = 0
    method: MethodConfig = field(default_factory=MethodConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    pretraining: PretrainingConfig = field(default_factory=PretrainingConfig)
    serq: SerqConfig = field(default_factory=SerqConfig)
    network: NetworkConfig = field(default_factory=NetworkConfig)
    clip: ClipConfig = field(default_factory=ClipConfig)
    augment: AugmentConfig = field(default_factory=AugmentConfig)
    indicator: IndicatorConfig = field(default_factory=IndicatorConfig)
    comm: CommConfig = field(default_factory=CommConfig)
    fed: FedConfig = field(default_factory=FedConfig, metadata=role(SERVER))
    privacy: PrivacyConfig = field(default_factory=PrivacyConfig)
    selection: SelectionConfig = field(default_factory=SelectionConfig)

    def __post_init__(self) -> None:
        require_at_least("seed", self.seed, 0, "seeds are non-negative integers")
        self.unseen_indicator_rule()  # a rule the network cannot apply is a ConfigError now
        self._check_serq_continues_pretraining()
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

    def _check_serq_continues_pretraining(self) -> None:
        """SERQ keeps v_pre, its synthetic batch stream and its Adam state from the pre-training
        (fedst/methods/serq.py), so under method.serq the two must agree on batch size and lr."""
        if not (self.method.serq and self.method.synthetic_pretraining):
            return
        for name in ("batch_size", "lr"):
            pre, serq = getattr(self.pretraining, name), getattr(self.serq, name)
            if pre != serq:
                raise ConfigError(
                    f"pretraining.{name}={pre} but serq.{name}={serq}: SERQ continues the "
                    f"pre-training's synthetic stream and optimizer of v_pre, so they must be "
                    f"equal; set both"
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

    def uses_clip_frame_labels(self) -> bool:
        """Whether training clips carry every clip frame's label (``train.clip_frame_loss_weight``
        > 0 and a temporal network on clips of more than one frame): only then are earlier
        frames' labels read."""
        return (
            self.train.clip_frame_loss_weight > 0
            and self.method.temporal
            and self.clip.num_frames > 1
        )

    def uses_indicator(self) -> bool:
        return self.method.prompt or self.method.channel_selection

    def unseen_indicator_rule(self) -> str | None:
        """``indicator.unseen`` resolved (fedst.model.channel_selection.resolve_unseen_indicator_rule:
        own | fold | mean), None when the network reads no indicator."""
        if not self.uses_indicator():
            return None
        feddp = self.method.channel_selection and (
            self.method.algorithm == "feddp" or self.network.channel_selection_kind == "feddp"
        )  # fedst/methods/feddp.py builds FedDP's channel selection whatever network.* says
        return resolve_unseen_indicator_rule(self.indicator.unseen, self.method.indicator, feddp)

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


PRE_ISSUE58_OPTIMIZER = {"temporal_lr_mult": 1.0, "norm_weight_decay": True}
"""What a config.json written before issue 58 trained with: one AdamW lr, decay on every
parameter (its temporal module is the "windowed" variant)."""


def experiment_from_json(text: str) -> ExperimentConfig:
    """A saved config.json; one written before ``network.temporal_variant`` existed trained the
    "windowed" temporal module with one lr and decay everywhere, and is read so; one written
    before ``network.temporal_placement`` or ``train.clip_frame_loss_weight`` existed placed the
    temporal module in the encoder and supervised the current frame only (the defaults until
    CFFM's became them, issue 58), and is read so; one written
    before ``data.generator_version`` existed was rendered by
    version 1 of the procedural generator and is read as such (not as today's default); one
    written with ``train.amp`` (before ``train.amp_dtype``) reads true as "bf16", false as
    "none" (what each meant); one written before the ``pretraining`` group read its pre-training
    settings from ``serq.pretrain_iters``, ``serq.batch_size`` and ``serq.lr``, and is read so."""
    values = json.loads(text)
    serq = values.get("serq")
    if isinstance(serq, dict) and "pretrain_iters" in serq and "pretraining" not in values:
        defaults = PretrainingConfig()
        values = {
            **values,
            "serq": {k: v for k, v in serq.items() if k != "pretrain_iters"},
            "pretraining": {
                "iters": serq["pretrain_iters"],
                "batch_size": serq.get("batch_size", defaults.batch_size),
                "lr": serq.get("lr", defaults.lr),
            },
        }
    data = values.get("data")
    if isinstance(data, dict) and data.get("procedural") and "generator_version" not in data:
        values = {**values, "data": {**data, "generator_version": 1}}
    network = values.get("network")
    if isinstance(network, dict) and "temporal_variant" not in network:
        values = {**values, "network": {**network, "temporal_variant": "windowed"}}
        values["train"] = {**values.get("train", {}), **PRE_ISSUE58_OPTIMIZER}
    network = values.get("network")
    if isinstance(network, dict) and "temporal_placement" not in network:
        values = {**values, "network": {**network, "temporal_placement": "encoder"}}
    train = values.get("train")
    if isinstance(train, dict) and "clip_frame_loss_weight" not in train:
        values = {**values, "train": {**train, "clip_frame_loss_weight": 0.0}}
    train = values.get("train")
    if isinstance(train, dict) and "amp" in train:
        train = {k: v for k, v in train.items() if k != "amp"}
        values = {
            **values,
            "train": {**train, "amp_dtype": "bf16" if values["train"]["amp"] else "none"},
        }
    return experiment_from_dict(values)


def run_device(cfg: ExperimentConfig, option: str = "train.device") -> torch.device:
    """The device a run trains on, or a command scores its models on (:func:`resolve_device` of
    ``train.device`` with ``train.require_gpu``): where a server or a site sets up, and what
    ``Run.device`` is. ``option``: how the command names the device override (train_fed.py and
    eval_outfed.py ``train.device``, fedst.guard and fedst.report ``--device``),
    named in a device error's fix."""
    from fedst.accel import resolve_device  # torch: not needed to read a config

    return resolve_device(cfg.train.device, cfg.train.require_gpu, cfg.name, key=option)


def with_device(cfg: ExperimentConfig, device: str | None) -> ExperimentConfig:
    """``cfg`` with ``train.device`` set to ``device`` (None: ``cfg`` as it is): the override of
    a command that scores a finished run (eval_outfed.py ``train.device=``, ``--device`` of
    fedst.guard and fedst.report), checked as train_fed.py checks it and
    resolved by :func:`run_device` with the run's ``train.require_gpu``, as training resolves it."""
    if device is None:
        return cfg
    return dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, device=device))
