"""Typed experiment configuration: the Hydra config enters here once and leaves as frozen objects.

A *method* (FedST, an ablation row, FedAvg, Local) is a small set of choices over shared pieces:
what is personalized (``personalization``), which network components exist (``temporal``,
``prompt``, ``channel_selection``), how shared parameters are aggregated (``aggregation``), whether
the server runs SERQ (``serq``) and whether sites communicate at all (``communicate``).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from fedst.config import ConfigError, build, require_at_least, require_positive, to_dict
from fedst.data.clips import AugmentConfig, ClipConfig
from fedst.data.sites import DataConfig
from fedst.model.indicators import DEFAULT_CLIP_MODEL, DEFAULT_CLIP_PRETRAINED
from fedst.model.network import NetworkConfig

AGGREGATIONS = ("fedavg", "fedmedian")
AGGREGATION_WEIGHTS = ("uniform", "samples")
INDICATOR_KINDS = ("clip", "onehot", "gaussian", "random")


@dataclass(frozen=True)
class MethodConfig:
    name: str = "fedst"
    """Label used in run names and result tables."""
    personalization: str = "encoder_query"
    """Partition preset (fedst.model.partition.PRESETS): which tensors stay at the site (rho)."""
    personal_patterns: tuple[str, ...] = ()
    """Extra regexes of state-dict keys kept private, added to the preset (e.g. "^decoder\\.head")."""
    personalize_channel_selection: bool = True
    """Keep the channel-selection / prompt modules private (FedST: yes)."""
    temporal: bool = True
    """Temporal cross-attention over 4-frame clips (Table IV 'TS')."""
    prompt: bool = True
    """Use the site indicator xi_k (Table IV 'Prompt')."""
    channel_selection: bool = True
    """Textual-guided channel selection network (Table IV 'CS', Eq. 7-8)."""
    indicator: str = "clip"
    """Indicator kind (Table VII): clip | onehot | gaussian | random."""
    serq: bool = True
    """Server-side SERQ step with synthetic data (Sec. III-C)."""
    aggregation: str = "fedavg"
    """fedavg (weighted mean, weights: ``aggregation_weights``) | fedmedian (coordinate-wise median)."""
    aggregation_weights: str = "uniform"
    """Site weights of the fedavg mean: uniform (1/K, FedST: Algorithm 1 line 8) | samples (n_k / n,
    McMahan et al.'s FedAvg). fedmedian is unweighted and needs "uniform"."""
    communicate: bool = True
    """False: every site trains alone (the 'Local' baseline); nothing travels."""

    def __post_init__(self) -> None:
        from fedst.model.partition import PRESETS

        if self.personalization not in PRESETS:
            raise ConfigError(
                f"method.personalization={self.personalization!r}; choose one of {sorted(PRESETS)}"
            )
        if self.aggregation not in AGGREGATIONS:
            raise ConfigError(f"method.aggregation={self.aggregation!r}; choose {AGGREGATIONS}")
        if self.aggregation_weights not in AGGREGATION_WEIGHTS:
            raise ConfigError(
                f"method.aggregation_weights={self.aggregation_weights!r}; choose {AGGREGATION_WEIGHTS}"
            )
        if self.aggregation == "fedmedian" and self.aggregation_weights != "uniform":
            raise ConfigError(
                "method.aggregation=fedmedian is an unweighted median; set "
                "method.aggregation_weights=uniform (got "
                f"{self.aggregation_weights!r})"
            )
        if self.indicator not in INDICATOR_KINDS:
            raise ConfigError(f"method.indicator={self.indicator!r}; choose {INDICATOR_KINDS}")
        if self.serq and not self.communicate:
            raise ConfigError("method.serq needs method.communicate=true (SERQ is a server step)")


@dataclass(frozen=True)
class TrainConfig:
    rounds: int = 300
    """Communication rounds T (paper: 300). The configs derive it as total_iters // local_iters."""
    local_iters: int = 100
    """Local iterations E per round (paper: 100)."""
    total_iters: int = 30000
    """Local iterations per site over the whole run (paper: 300 x 100). Fig. 6 varies local_iters
    at a fixed total, so configs/experiment/*.yaml set rounds: ${fedst.div:total_iters,local_iters}."""
    batch_size: int = 2
    """Clips per local batch (paper: 2)."""
    lr: float = 6e-5
    """AdamW learning rate at the sites (paper: 6e-5)."""
    weight_decay: float = 0.01
    """AdamW weight decay."""
    lambda_dice: float = 0.3
    """lambda_1 of L_seg = CE + lambda_1 * Dice (Eq. 9)."""
    eval_every: int = 10
    """Evaluate every site's personalized model on its test split every k rounds (and at the end)."""
    eval_max_frames: int | None = None
    """Cap on test frames per site per evaluation (None: all)."""
    num_workers: int = 0
    """DataLoader worker processes per site."""
    device: str = "auto"
    """auto | cpu | cuda | cuda:N."""
    amp: bool = True
    """Mixed precision (bfloat16 autocast) when the device is CUDA; ignored on CPU."""
    max_grad_norm: float | None = None
    """Gradient clipping norm (None: off)."""

    def __post_init__(self) -> None:
        require_at_least("train.local_iters", self.local_iters, 1)
        if self.rounds < 1:
            raise ConfigError(
                f"train.rounds={self.rounds}, train.local_iters={self.local_iters}: both must be "
                f">= 1 (rounds = total_iters // local_iters; raise train.total_iters)"
            )
        require_at_least("train.total_iters", self.total_iters, 1)
        require_at_least("train.batch_size", self.batch_size, 1)
        require_positive("train.lr", self.lr)
        require_at_least("train.weight_decay", self.weight_decay, 0)
        require_at_least("train.lambda_dice", self.lambda_dice, 0)
        require_at_least("train.eval_every", self.eval_every, 1, "evaluate every k >= 1 rounds")
        require_at_least("train.eval_max_frames", self.eval_max_frames, 1, "or null for all")
        require_at_least("train.num_workers", self.num_workers, 0)
        require_positive("train.max_grad_norm", self.max_grad_norm, "or null for no clipping")


@dataclass(frozen=True)
class SerqConfig:
    pretrain_iters: int = 3000
    """Iterations of synthetic pre-training of v_pre before round 1 (not given in the paper)."""
    batches_per_round: int = 100
    """Synthetic batches per round; EQ and SC each run over them (paper: 100)."""
    batch_size: int = 2
    """Synthetic images per batch."""
    lr: float = 1e-4
    """Adam learning rate of both SERQ steps (paper: 1e-4)."""
    lambda_eq: float = 0.3
    """lambda_2 of L_pre (Eq. 11)."""
    lambda_sc: float = 0.3
    """lambda_3 of L_g (Eq. 12)."""
    ema_mu: float = 0.5
    """mu of the feature bank's moving average (Eq. 10)."""
    feature_stage: int = 3
    """Encoder stage (0-3) whose features F are quantified."""

    def __post_init__(self) -> None:
        require_at_least("serq.pretrain_iters", self.pretrain_iters, 0)
        require_at_least("serq.batches_per_round", self.batches_per_round, 1)
        require_at_least("serq.batch_size", self.batch_size, 1)
        require_positive("serq.lr", self.lr)
        if not 0 <= self.ema_mu <= 1:
            raise ConfigError(f"serq.ema_mu={self.ema_mu!r}: must be in [0, 1]")
        if self.feature_stage not in range(4):
            raise ConfigError(f"serq.feature_stage={self.feature_stage!r}: choose 0, 1, 2 or 3")


@dataclass(frozen=True)
class IndicatorConfig:
    clip_model: str = DEFAULT_CLIP_MODEL
    """open_clip model name for the text tower (ViT-B-32)."""
    clip_pretrained: str = DEFAULT_CLIP_PRETRAINED
    """open_clip pretrained tag (openai; 'none' = random weights, tests only). Training and the
    cache builder (``python -m fedst.weights ... --prepare``) both read this one value."""
    cache_dir: str = "weights/clip_cache"
    """Where text embeddings are cached (computed once)."""
    dim: int = 512
    """Indicator dimension (CLIP ViT-B-32 text embedding: 512)."""


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

    def __post_init__(self) -> None:
        require_at_least("seed", self.seed, 0, "seeds are non-negative integers")

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
    """Strictly build an :class:`ExperimentConfig` from a plain mapping (e.g. resolved Hydra)."""
    return build(ExperimentConfig, values, "experiment")


def experiment_from_json(text: str) -> ExperimentConfig:
    return experiment_from_dict(json.loads(text))


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
