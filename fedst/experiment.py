"""Typed experiment configuration: the Hydra config enters here once and leaves as frozen objects.

A *method* (FedST, an ablation row, FedAvg, Local, a baseline) is a small set of choices over
shared pieces: its algorithm (``algorithm``: what sites and server compute, fedst/methods/), what
is personalized (``personalization``), which network components exist (``temporal``, ``prompt``,
``channel_selection``), how shared parameters are aggregated (``aggregation``), whether the server
runs SERQ (``serq``) and whether sites communicate at all (``communicate``).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from fedst.accel import AMP_DTYPES
from fedst.config import ConfigError, build, require_at_least, require_positive, to_dict
from fedst.data.clips import AugmentConfig, ClipConfig
from fedst.data.sites import DataConfig
from fedst.model.indicators import DEFAULT_CLIP_MODEL, DEFAULT_CLIP_PRETRAINED
from fedst.model.network import NetworkConfig

AGGREGATIONS = ("fedavg", "fedmedian")
AGGREGATION_WEIGHTS = ("uniform", "samples", "fisher")
INDICATOR_KINDS = ("clip", "onehot", "gaussian", "random")
RETURNED_MODELS = ("own", "global")
"""method.returned_model: a site's own gamma_k^T, or gamma_g as the site adopts it (MethodConfig)."""


@dataclass(frozen=True)
class MethodConfig:
    name: str = "fedst"
    """Label used in run names and result tables."""
    algorithm: str = "partial"
    """What the sites and the server compute (fedst.methods.METHODS): partial (partial averaging:
    FedST, its ablations, FedAvg, Local) | the baselines' own algorithms."""
    options: dict[str, Any] = field(default_factory=dict)
    """Settings of the algorithm itself, typed by its ``Options`` dataclass (fedst/methods/)."""
    personalization: str = "encoder_query"
    """Partition preset (fedst.model.partition.PRESETS): which tensors stay at the site (rho)."""
    personal_patterns: tuple[str, ...] = ()
    """Extra regexes of state-dict keys kept private, added to the preset (e.g. "^decoder\\.head")."""
    personalize_channel_selection: bool = True
    """Keep the channel-selection / prompt modules private (FedST: yes)."""
    shared_components: tuple[str, ...] | None = None
    """Partial aggregation by component (fedst.model.partition.COMPONENTS: encoder, temporal,
    decoder, head, channel_selection): only these may travel, every other component stays at the
    site like rho, on top of ``personalization``. None: every component may travel."""
    temporal: bool = True
    """Temporal cross-attention over 4-frame clips (Table IV 'TS')."""
    prompt: bool = True
    """Use the site indicator xi_k (Table IV 'Prompt')."""
    channel_selection: bool = True
    """Textual-guided channel selection network (Table IV 'CS', Eq. 7-8)."""
    indicator: str = "clip"
    """Indicator kind (Table VII): clip | onehot | gaussian | random."""
    serq: bool = True
    """Server-side step with synthetic data after aggregation: SERQ (Sec. III-C), or plain
    synthetic fine-tuning of the global model with ``serq.mode=finetune`` (Fig. 5)."""
    synthetic_pretraining: bool = True
    """Start from the network pre-trained on the server's synthetic set (every method, paper
    Sec. IV-A; fedst/federation/pretraining.py). False: from the initialisation (an ablation)."""
    aggregation: str = "fedavg"
    """fedavg (weighted mean, weights: ``aggregation_weights``) | fedmedian (coordinate-wise median)."""
    aggregation_weights: str = "uniform"
    """Site weights of the fedavg mean: uniform (1/K, FedST: Algorithm 1 line 8) | samples (n_k / n,
    McMahan et al.'s FedAvg) | fisher (F_k / sum_j F_j, each site's empirical-Fisher trace: FedAS
    only). fedmedian is unweighted and needs "uniform"."""
    communicate: bool = True
    """False: every site trains alone (the 'Local' baseline); nothing travels."""
    returned_model: str = "own"
    """Which model a site returns, is scored with and enters the out-of-federation average
    (:data:`RETURNED_MODELS`): own (v_k = gamma_k^T U rho_k^T, the site's own shared
    parameters after its last local round: FedST's Algorithm 1 lines 14-17, Local, the upper
    bound) | global (gamma_g as the site adopts it, U rho_k: FedAvg, FedLD, FedRep, FedAS, FedDP
    before its stage 2). Each method's config sets its paper's rule; ``global`` on FedST restores
    the earlier scoring for comparison."""

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
        if self.shared_components is not None:
            from fedst.model.partition import COMPONENTS

            unknown = sorted(set(self.shared_components) - set(COMPONENTS))
            if unknown:
                raise ConfigError(
                    f"method.shared_components has unknown component(s) {unknown}; choose from "
                    f"{sorted(COMPONENTS)}"
                )
        if self.indicator not in INDICATOR_KINDS:
            raise ConfigError(f"method.indicator={self.indicator!r}; choose {INDICATOR_KINDS}")
        if self.serq and not self.synthetic_pretraining:
            raise ConfigError(
                "method.serq needs method.synthetic_pretraining=true (SERQ starts from the "
                "pre-trained v_pre^0, Algorithm 1 line 3)"
            )
        if self.returned_model not in RETURNED_MODELS:
            raise ConfigError(
                f"method.returned_model={self.returned_model!r}; choose one of {RETURNED_MODELS}"
            )
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
    """Cap on test (and validation) frames per site per evaluation (None: all)."""
    eval_batch_size: int = 8
    """Frames per forward pass of evaluation (fedst/federation/evaluation.py): frames of one
    video are encoded together, scores equal the frame-by-frame path's (to float rounding)."""
    distance_metrics_every: int | None = 1
    """HD95 / ASSD (a distance transform per class per frame at native resolution: the costly
    metrics) at evaluations of rounds that are multiples of k and at the last round; the other
    evaluations score Dice / IoU only (distances reported as absent). 1: every evaluation
    (default); None: the last round only (the final tables need them, learning curves use Dice)."""
    checkpoint_every: int = 1
    """The server writes its checkpoint (``server.pt`` and the feature bank entries changed since
    the last one) every k rounds and at the last round; a resumed run restarts after the latest
    one, redoing at most k - 1 rounds (each site keeps its states of the server's two latest
    checkpoint rounds). Results do not depend on k. 1: every round."""
    val_every: int | None = None
    """Score every site's personalized model on its validation split every k rounds and at the
    last round (metrics.jsonl rows with split "val"), keeping what selection needs of those rounds
    (fedst/selection.py). None: no validation (selection.rule must be last)."""
    num_workers: int | str = "auto"
    """DataLoader worker processes per site (training and evaluation loaders): a number, or
    "auto" = min(4, usable CPU cores - 1) (fedst.data.clips.resolve_num_workers). Workers decode,
    resize and augment; they send uint8 clips, normalised on the device."""
    device: str = "auto"
    """auto | cpu | cuda | cuda:N."""
    amp_dtype: str = "auto"
    """Mixed precision of forward passes on CUDA (fedst/accel.py; CPU always runs fp32): auto
    (bf16 where the GPU supports it, else fp16) | bf16 (autocast bfloat16) | fp16 (autocast
    float16 with a GradScaler) | none (fp32). Replaces ``train.amp`` (true = bf16, false = none)."""
    compile: bool = False
    """``torch.compile`` the network's training forward (in place, fedst.accel.maybe_compile):
    faster steps on a GPU after a slower first round; needs a C++ compiler for CPU."""
    tf32: bool = True
    """CUDA only: fp32 matmuls and convolutions on TF32 tensor cores (Ampere and later)."""
    cudnn_benchmark: bool = True
    """CUDA only: cuDNN picks the fastest convolution algorithm per input shape (shapes are fixed
    per run, so it is measured once)."""
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
        require_at_least("train.val_every", self.val_every, 1, "or null for no validation")
        require_at_least("train.eval_batch_size", self.eval_batch_size, 1)
        require_at_least("train.checkpoint_every", self.checkpoint_every, 1, "save every k rounds")
        require_at_least(
            "train.distance_metrics_every", self.distance_metrics_every, 1, "or null: last round"
        )
        check_num_workers("train.num_workers", self.num_workers)
        if self.amp_dtype not in AMP_DTYPES:
            raise ConfigError(f"train.amp_dtype={self.amp_dtype!r}; choose one of {AMP_DTYPES}")
        require_positive("train.max_grad_norm", self.max_grad_norm, "or null for no clipping")

    @property
    def amp(self) -> bool:
        """Whether mixed precision is on at all (``amp_dtype`` is not "none"); the former
        ``train.amp`` switch, kept for code that only asks whether to autocast."""
        return self.amp_dtype != "none"

    def evaluation_options(self, server_round: int | None = None) -> dict[str, Any]:
        """Keyword arguments of fedst.federation.evaluation.evaluate_model for the evaluation of
        ``server_round`` (None: a final evaluation, distances included): frame cap, batch size,
        loader workers and whether HD95 / ASSD are computed."""
        return {
            "max_frames": self.eval_max_frames,
            "batch_size": self.eval_batch_size,
            "num_workers": self.num_workers,
            "distances": server_round is None or self.distances_at(server_round),
        }

    def distances_at(self, server_round: int) -> bool:
        """Whether the evaluation of ``server_round`` computes HD95 / ASSD
        (``distance_metrics_every``; always at the last round and after it)."""
        every = self.distance_metrics_every
        return server_round >= self.rounds or (every is not None and server_round % every == 0)


def check_num_workers(where: str, value: int | str) -> None:
    """ConfigError unless ``value`` is an integer >= 0 or "auto"."""
    if isinstance(value, str):
        if value != "auto":
            raise ConfigError(f'{where}={value!r}: a number of workers >= 0 or "auto"')
        return
    require_at_least(where, value, 0, 'or "auto"')


SERQ_MODES = ("serq", "finetune")
"""serq.mode: SERQ (Sec. III-C, Eq. 10-12) or plain synthetic fine-tuning (Fig. 5, blue line)."""


@dataclass(frozen=True)
class SerqConfig:
    mode: str = "serq"
    """What the server's synthetic step after aggregation does (:data:`SERQ_MODES`; only with
    method.serq=true): serq (EQ then SC, Eq. 10-12) | finetune (Fig. 5's blue line: the global
    model trained on the round's synthetic batches with L_seg only, no EQ step, no descriptor,
    no feature term; fedst/federation/serq.py)."""
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
    feature_stage: int | None = None
    """Encoder stage (0-3) whose features F are quantified. None: the stage the temporal module
    reads (network.temporal_stages[0]), the paper's F = F_ts (Sec. III-C1: "we denote F_ts as F")."""
    descriptor_step: float = 0.1
    """Step of D_sy per EQ batch, as a fraction of the way to that batch's minimiser of Eq. 11,
    mean_b(F_sy - F_hat_g): plain gradient descent on the quadratic with step size
    descriptor_step / curvature (fedst/federation/serq.py). Adam at ``lr`` moves D_sy by at most
    lr per step, 0.01 over the demo, against features of RMS ~1 that it must offset."""

    def __post_init__(self) -> None:
        if self.mode not in SERQ_MODES:
            raise ConfigError(f"serq.mode={self.mode!r}; choose one of {SERQ_MODES}")
        require_at_least("serq.pretrain_iters", self.pretrain_iters, 0)
        require_at_least("serq.batches_per_round", self.batches_per_round, 1)
        require_at_least("serq.batch_size", self.batch_size, 1)
        require_positive("serq.lr", self.lr)
        if not 0 <= self.ema_mu <= 1:
            raise ConfigError(f"serq.ema_mu={self.ema_mu!r}: must be in [0, 1]")
        if self.feature_stage is not None and self.feature_stage not in range(4):
            raise ConfigError(
                f"serq.feature_stage={self.feature_stage!r}: choose 0, 1, 2, 3 or null (the "
                f"temporal module's stage)"
            )
        if not 0 < self.descriptor_step <= 1:
            raise ConfigError(
                f"serq.descriptor_step={self.descriptor_step!r}: must be in (0, 1] (the fraction "
                f"of the way to a batch's optimum of Eq. 11 that D_sy moves per EQ batch)"
            )


PRECISIONS = ("fp32", "fp16", "bf16")
DP_MODES = ("none", "server_fixed", "server_adaptive", "client_fixed", "client_adaptive")


@dataclass(frozen=True)
class CommConfig:
    precision: str = "fp32"
    """Wire precision of the shared tensors, both directions (fedst/federation/transport.py):
    fp32 | fp16 | bf16. Receivers restore fp32; the server aggregates in fp32."""

    def __post_init__(self) -> None:
        if self.precision not in PRECISIONS:
            raise ConfigError(f"comm.precision={self.precision!r}; choose {PRECISIONS}")


@dataclass(frozen=True)
class PrivacyConfig:
    """Central differential privacy with Flower's strategy wrappers (fedst/federation/privacy.py)
    on the shared update gamma_k - gamma_g; personalized parameters never travel, so never need it."""

    dp: str = "none"
    """none | server_fixed | server_adaptive (the server clips each update) | client_fixed |
    client_adaptive (each site clips its own update with Flower's client mods)."""
    noise_multiplier: float = 1.0
    """sigma: Gaussian noise std = noise_multiplier * clipping_norm / number of sites."""
    clipping_norm: float = 1.0
    """Fixed clipping: the L2 bound of one site's update. Adaptive: the initial bound."""
    target_clipped_quantile: float = 0.5
    """Adaptive clipping: the fraction of updates the bound should clip (0.5: the median norm)."""
    clip_norm_lr: float = 0.2
    """Adaptive clipping: learning rate of the bound's geometric update."""

    def __post_init__(self) -> None:
        if self.dp not in DP_MODES:
            raise ConfigError(f"privacy.dp={self.dp!r}; choose {DP_MODES}")
        require_at_least("privacy.noise_multiplier", self.noise_multiplier, 0)
        require_positive("privacy.clipping_norm", self.clipping_norm)
        if not 0 < self.target_clipped_quantile < 1:
            raise ConfigError(
                f"privacy.target_clipped_quantile={self.target_clipped_quantile!r}: must be in (0, 1)"
            )
        require_positive("privacy.clip_norm_lr", self.clip_norm_lr)


SELECTION_RULES = ("last", "val", "mixed", "cbe")


@dataclass(frozen=True)
class SelectionConfig:
    """Which round's model a run reports besides the last one (fedst/selection.py; the paper's
    tables always use the last round)."""

    rule: str = "last"
    """last | val (per site: its best validation round) | mixed (best pooled validation score of
    the training sites, GEN-Guard Eq. 6) | cbe (best score of the out-of-federation model on the
    held-out site's validation split, GEN-Guard Eq. 7)."""
    held_out_site: str | None = None
    """A site of data.federation that never trains: it is taken out of data.federation when the
    config is read, and its validation split scores the out-of-federation model for ``cbe``."""
    metric: str = "dice"
    """Validation metric the rules maximise: dice | iou."""

    def __post_init__(self) -> None:
        if self.rule not in SELECTION_RULES:
            raise ConfigError(f"selection.rule={self.rule!r}; choose one of {SELECTION_RULES}")
        if self.metric not in ("dice", "iou"):
            raise ConfigError(f"selection.metric={self.metric!r}; choose dice or iou")
        if self.rule == "cbe" and self.held_out_site is None:
            raise ConfigError(
                "selection.rule=cbe needs selection.held_out_site=<a site of data.federation> "
                "(the client-blocked site that never trains)"
            )


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


# -- what a site receives, and what it adds from its own node -------------------------------------

SITE_VIEW_UNSET = ""
"""Placeholder of every data root in a site's view: paths never travel (each site has its own)."""

NODE_LOCAL_FIELDS = ("train.device", "train.num_workers", "indicator.cache_dir")
"""Experiment fields each site sets for itself (node config); the view carries their defaults."""

EVALUATION_FIELDS = (
    "eval_every",
    "eval_max_frames",
    "val_every",
    "eval_batch_size",
    "distance_metrics_every",
    "checkpoint_every",
)
"""Train fields that change what is measured or when the server saves, not a site's private
state (left out of the state fingerprint, so a run may be resumed with another cadence)."""


def site_view(cfg: ExperimentConfig) -> ExperimentConfig:
    """The experiment as every site receives it in a train/evaluate message.

    It keeps what defines training (method, network, train hyper-parameters, every site's name,
    backend and surgery type: the indicators of Table VII need the whole site list) and drops
    every path and host-specific choice: data roots and backend options of all sites, the common
    root, the procedural preset, device, DataLoader workers and the CLIP cache folder. A site adds
    its own from its node config (:class:`SiteNodeConfig`).
    """
    sites = {
        name: dataclasses.replace(spec, root=SITE_VIEW_UNSET, options={})
        for name, spec in cfg.data.sites.items()
    }
    defaults_train, defaults_indicator = TrainConfig(), IndicatorConfig()
    return dataclasses.replace(
        cfg,
        data=dataclasses.replace(cfg.data, sites=sites, root=None, procedural=None),
        train=dataclasses.replace(
            cfg.train, device=defaults_train.device, num_workers=defaults_train.num_workers
        ),
        indicator=dataclasses.replace(cfg.indicator, cache_dir=defaults_indicator.cache_dir),
    )


def state_fingerprint(view: ExperimentConfig) -> str:
    """Fingerprint of what produces a site's private state: the site view without the
    evaluation settings (:data:`EVALUATION_FIELDS`, the selection rule, method.returned_model)."""
    values = json.loads(view.to_json())
    for key in EVALUATION_FIELDS:
        values["train"].pop(key)
    for key in ("rule", "metric"):  # which round is reported, not what a site learns
        values["selection"].pop(key)
    values["method"].pop("returned_model")  # which model is scored, not what a site learns
    return hashlib.sha1(json.dumps(values, sort_keys=True).encode()).hexdigest()[:12]


@dataclass(frozen=True)
class SiteNodeConfig:
    """A site's own settings: Flower's ``node_config`` (``flower-supernode --node-config``), typed.

    Keys on the command line use dashes (``site-name="A" data-path="/data/a"``).
    """

    site_name: str | None = None
    """The site this node is (a name of data.federation). None: ``partition_id`` decides."""
    partition_id: int | None = None
    """Flower simulation's node index (Ray engine): site = data.federation[partition_id]."""
    data_path: str | None = None
    """The site's dataset root (its entry's ``root``). Required in deployment."""
    backend: str | None = None
    """Dataset backend of this site (default: the one named in the experiment)."""
    site_options: str = "{}"
    """Backend options of this site, as a JSON object (e.g. '{"site_dir": "hyst_yt"}')."""
    other_sites: str | None = None
    """Data of further sites this node reads, as a JSON object site -> {"root", "backend",
    "options"}: a party that trains or is scored on other sites' data (Method.data_sites, e.g.
    the upper bound's pool of every federated site). None (a hospital's own node): none."""
    state_dir: str | None = None
    """Folder of this site's private state; each run gets a sub-folder named by the server."""
    run_state_dir: str | None = None
    """Exact private-state folder for this run (the in-process engine: <run>/sites/<site>)."""
    device: str = TrainConfig.device
    """auto | cpu | cuda | cuda:N (this site's hardware)."""
    num_workers: int | str = TrainConfig.num_workers
    """DataLoader worker processes at this site (a number or "auto", as train.num_workers)."""
    clip_cache: str = IndicatorConfig.cache_dir
    """Folder of cached CLIP text embeddings at this site."""
    progress: bool = False
    """Progress bars for local iterations and evaluation."""
    share_personal: bool = True
    """Send rho_k once at the end for the out-of-federation average (the only time private
    parameters leave the site; logged on both sides). False: this site is left out."""

    def __post_init__(self) -> None:
        check_num_workers("node_config num-workers", self.num_workers)

    @classmethod
    def from_node_config(cls, node_config: dict[str, Any]) -> SiteNodeConfig:
        names = {f.name.replace("_", "-"): f.name for f in dataclasses.fields(cls)}
        known = {k: v for k, v in node_config.items() if k in names}
        return build(cls, {names[k]: v for k, v in known.items()}, "node_config")

    def to_node_config(self) -> dict[str, Any]:
        return {
            f.name.replace("_", "-"): getattr(self, f.name)
            for f in dataclasses.fields(self)
            if getattr(self, f.name) is not None
        }

    def to_cli(self) -> str:
        """The ``--node-config`` argument of ``flower-supernode`` (TOML values, space separated)."""
        return " ".join(
            f"{key}={json.dumps(value)}" for key, value in self.to_node_config().items()
        )

    def private_state_dir(self, run_name: str, site: str) -> Path:
        if self.run_state_dir is not None:
            return Path(self.run_state_dir)
        if self.state_dir is None:
            raise ConfigError(
                f"site {site}: node config has neither state-dir nor run-state-dir; start the "
                f"site with a state folder (train_fed.py site={site} deploy.state_dir=<folder>)"
            )
        return Path(self.state_dir) / run_name

    def local_experiment(self, view: ExperimentConfig, site: str) -> ExperimentConfig:
        """The view completed with this node's own data location (and those of the other sites
        it reads), backend options and hardware."""
        try:
            others = json.loads(self.other_sites) if self.other_sites else {}
        except json.JSONDecodeError as err:
            raise ConfigError(f"node_config other-sites is not JSON: {err}") from err
        located = {}
        if site in view.data.sites:  # a data site (the upper bound's pool is none)
            if self.data_path is None:
                raise ConfigError(
                    f"site {site}: node config has no data-path; start the site with its data "
                    f"folder (train_fed.py site={site} data.sites.{site}.root=<folder>)"
                )
            try:
                options = json.loads(self.site_options)
            except json.JSONDecodeError as err:
                raise ConfigError(f"node_config site-options is not JSON: {err}") from err
            located[site] = {"root": self.data_path, "backend": self.backend, "options": options}
        located.update(others)
        unknown = sorted(set(located) - set(view.data.sites))
        if unknown:
            raise ConfigError(
                f"node of {site}: node_config other-sites names {unknown}, which are not sites "
                f"of the experiment ({sorted(view.data.sites)})"
            )
        sites = {
            name: dataclasses.replace(
                view.data.sites[name],
                root=where["root"],
                backend=where.get("backend") or view.data.sites[name].backend,
                options=where.get("options", {}),
            )
            for name, where in located.items()
        }
        return dataclasses.replace(
            view,
            data=dataclasses.replace(view.data, sites={**view.data.sites, **sites}),
            train=dataclasses.replace(view.train, device=self.device, num_workers=self.num_workers),
            indicator=dataclasses.replace(view.indicator, cache_dir=self.clip_cache),
        )


EVAL_TIMEOUT_FACTOR = 3.0
"""``deploy.eval_timeout`` when unset: this many times ``deploy.round_timeout`` (DeployConfig)."""


def default_eval_timeout(round_timeout: float | None, eval_timeout: float | None) -> float | None:
    """``eval_timeout``, or EVAL_TIMEOUT_FACTOR x ``round_timeout`` when it is None (None when
    both are: no timeout)."""
    if eval_timeout is not None:
        return eval_timeout
    return None if round_timeout is None else EVAL_TIMEOUT_FACTOR * round_timeout


@dataclass(frozen=True)
class RoundPolicy:
    """How the server treats sites that do not answer (deployment; the in-process engine keeps
    the defaults: every site must answer, no timeout)."""

    min_sites: int | None = None
    """Fewest sites whose replies a round aggregates (None: every federated site). A round with
    fewer stops the run with a message naming the missing sites and their errors."""
    round_timeout: float | None = None
    """Seconds the server waits for the replies of one training step (and the other non-evaluation
    steps: final stage, personal exchange and export) (None: forever)."""
    eval_timeout: float | None = None
    """Seconds the server waits for the replies of one evaluate step, test or validation scores
    (None: forever). Longer than ``round_timeout`` in a deployment (``deploy.eval_timeout``):
    see there."""
    join_timeout: float = 0.0
    """Seconds the server waits for SuperNodes to connect: before round 1 for every site, before
    later rounds for sites that dropped out (then it goes on with those connected)."""
    collect_personal: bool = False
    """Ask each site once, at the end, for rho_k (out-of-federation average; deployment only:
    in-process the run directory already holds the sites' states)."""
    audit: bool = False
    """Write wire.jsonl: record names, keys and shapes of every message (tests, audits)."""
    reply_poll: float = 0.2
    """Seconds between two requests for the replies of a step (``deploy.reply_poll``)."""

    def __post_init__(self) -> None:
        if self.min_sites is not None and self.min_sites < 1:
            raise ConfigError(f"deploy.min_sites={self.min_sites}: must be >= 1 (or null: all)")
        if self.round_timeout is not None and self.round_timeout <= 0:
            raise ConfigError(f"deploy.round_timeout={self.round_timeout}: must be > 0 or null")
        if self.eval_timeout is not None and self.eval_timeout <= 0:
            raise ConfigError(f"deploy.eval_timeout={self.eval_timeout}: must be > 0 or null")
        if self.reply_poll <= 0:
            raise ConfigError(f"deploy.reply_poll={self.reply_poll}: must be > 0 seconds")


@dataclass(frozen=True)
class RayConfig:
    """``ray.*`` of train_fed.py with ``engine=ray``: what Flower's simulation engine reserves for
    each site's actor (fedst.training.ray_client_resources). Ray starts as many actors as these
    shares fit in the machine, and hides the GPUs from an actor that reserved none."""

    num_cpus_per_site: float | str = "auto"
    """CPU cores per site actor; "auto" = max(1, CPU cores // number of sites), so at most one
    actor per site (each actor builds its own copy of the sites it runs)."""
    num_gpus_per_site: float | str = "auto"
    """GPU share per site actor (0.25: four sites share one GPU); "auto" = min(1, GPUs / number
    of sites) from torch.cuda.device_count() (0 without CUDA: sites train on the CPU)."""

    def __post_init__(self) -> None:
        for name in ("num_cpus_per_site", "num_gpus_per_site"):
            value = getattr(self, name)
            if isinstance(value, str):
                if value != "auto":
                    raise ConfigError(f'ray.{name}={value!r}: a number or "auto"')
            else:
                require_at_least(f"ray.{name}", value, 0, 'or "auto"')
        if self.num_cpus_per_site == 0:
            raise ConfigError("ray.num_cpus_per_site=0: each site actor needs a CPU share > 0")


@dataclass(frozen=True)
class DeployConfig:
    """``deploy.*`` of train_fed.py: where the server listens, where certificates and keys are,
    a site's state folder, and the server's dropout policy (docs/deployment.md)."""

    server: str = "127.0.0.1:9092"
    """Site: the SuperLink address host:port it connects to."""
    host: str = "0.0.0.0"
    """Server: interface the SuperLink listens on (one HTTPS port for sites and the CLI)."""
    port: int = 9092
    """Server: the SuperLink port (open it to the hospitals)."""
    certs: str = "certs"
    """Folder with ca.crt (everyone) and server.pem + server.key (server only)."""
    keys: str = "keys"
    """Server: <site>_key.pub of every federated site. Site: its private key <site>_key."""
    insecure: bool = False
    """Development only: no TLS and no SuperNode authentication."""
    state_dir: str = "site_state"
    """Site: folder of its private state (a sub-folder per run)."""
    site_port: int = 9094
    """Site: local port of the SuperNode's ClientApp runtime (one per SuperNode on a host)."""
    share_personal: bool = True
    """Site: send rho_k once at the end for the out-of-federation average (logged)."""
    connect_timeout: float = 120.0
    """Site: give up connecting to the server after this many seconds."""
    min_sites: int | None = None
    """Server: fewest sites a round aggregates (None: all)."""
    round_timeout: float = 600.0
    """Server: seconds to wait for the replies of one training step (and of the final stage and
    the personal exchange / export)."""
    eval_timeout: float | None = None
    """Server: seconds to wait for the replies of one evaluate step (test scores, validation
    scores); null: EVAL_TIMEOUT_FACTOR (3) x round_timeout. An evaluate step can take longer than
    a training step: a site scores its whole test (or validation) split, every frame at native
    resolution with HD95 / ASSD (distance transforms on the CPU), plus the other sites' splits
    under method.returned_model / scored sites, while a training step is a fixed
    train.local_iters batches. A site still evaluating when the step times out would be left
    out of the round (or stop the run below deploy.min_sites) although it is healthy."""
    join_timeout: float = 300.0
    """Server: seconds to wait for the sites to connect (before round 1; before later rounds for
    sites that dropped out)."""
    audit: bool = False
    """Server: write wire.jsonl (record names, keys and shapes of every message)."""
    flwr_home: str | None = None
    """FLWR_HOME of the Flower processes (default: <run dir>/flwr on the server,
    <state_dir>/flwr at a site)."""
    # -- message latency (docs/deployment.md, "What sets the time of a message") --------------
    reply_poll: float = RoundPolicy.reply_poll
    """Server: seconds between two requests of the ServerApp for the sites' replies. Flower's
    Grid.send_and_receive pauses 3 s, so a step ended up to 3 s after its last reply; a request
    to the SuperLink on the same host costs about a millisecond."""
    executor_poll: float = 0.1
    """Site: seconds between two requests of the site's executor (fedst.app.site_executor) for a
    task when it has none: a message waits at most this long once its SuperNode has it; a
    request to the SuperNode on the same host costs about a millisecond."""
    transfers_in_flight: int = 2
    """All: object requests in flight while a message's objects are pushed or pulled (Flower's
    FLWR_PRIVATE_MAX_CONCURRENT_OBJ_PUSHES / _PULLS, default 2; Flower caps it at the host's
    cores). With gamma in a few buffers a message is a few 5 MiB chunks; raise it on a
    high-latency link."""
    chunk_mib: float = 5.0
    """All: largest piece of an array on the wire, in MiB (Flower's
    FLWR_PRIVATE_MAX_ARRAY_CHUNK_SIZE, default 5 MiB): each piece is one request; keep it below
    the proxies' request-size limit between a hospital and the server."""

    def __post_init__(self) -> None:
        for name in ("reply_poll", "executor_poll", "chunk_mib"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"deploy.{name}={getattr(self, name)}: must be > 0")
        if self.transfers_in_flight < 1:
            raise ConfigError(
                f"deploy.transfers_in_flight={self.transfers_in_flight}: must be >= 1"
            )
        if self.eval_timeout is not None and self.eval_timeout <= 0:
            raise ConfigError(f"deploy.eval_timeout={self.eval_timeout}: must be > 0 or null")

    def flower_env(self) -> dict[str, str]:
        """The environment variables through which Flower's processes read the transfer
        settings (flwr/supercore/constant.py, flwr/common/constant.py)."""
        return {
            "FLWR_PRIVATE_MAX_CONCURRENT_OBJ_PUSHES": str(self.transfers_in_flight),
            "FLWR_PRIVATE_MAX_CONCURRENT_OBJ_PULLS": str(self.transfers_in_flight),
            "FLWR_PRIVATE_MAX_ARRAY_CHUNK_SIZE": str(int(self.chunk_mib * 2**20)),
        }

    def policy(self) -> RoundPolicy:
        return RoundPolicy(
            min_sites=self.min_sites,
            round_timeout=self.round_timeout,
            eval_timeout=default_eval_timeout(self.round_timeout, self.eval_timeout),
            join_timeout=self.join_timeout,
            collect_personal=True,
            audit=self.audit,
            reply_poll=self.reply_poll,
        )
