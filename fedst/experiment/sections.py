"""The sections of the typed experiment configuration, each a frozen dataclass with its defaults
and checks, and the names each accepts: ``method`` (:class:`MethodConfig`, the algorithm and the
components a method uses), ``train``, ``pretraining``, ``serq``, ``fed``, ``comm``, ``privacy``,
``selection`` and ``indicator``. :class:`fedst.experiment.config.ExperimentConfig` holds them with
the data, network, clip and augment configs of their own modules and checks across them."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from fedst.config import ConfigError, build, require_at_least, require_positive
from fedst.schema.accel import AMP_DTYPES, check_device_name, compile_mode
from fedst.schema.indicators import (
    DEFAULT_CLIP_MODEL,
    DEFAULT_CLIP_PRETRAINED,
    INDICATOR_KINDS,
    UNSEEN_INDICATOR_RULES,
)
from fedst.schema.method_options import OPTIONS
from fedst.schema.partition import COMPONENTS, PRESETS
from fedst.schema.roles import CADENCE, EXECUTION, MEASURE, NODE, RESOURCE, role

AGGREGATIONS = ("fedavg", "fedmedian", "trimmed_mean")
AGGREGATION_WEIGHTS = ("uniform", "samples", "fisher")
ALGORITHMS = tuple(OPTIONS)
"""method.algorithm: the keys of fedst.methods.METHODS (tests/test_config_floor.py ties them),
checked here with their options (fedst/schema/method_options.py) without the methods' code."""
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
    Sec. IV-A; fedst/methods/pretraining.py). False: from the initialisation (an ablation)."""
    aggregation: str = "fedavg"
    """fedavg (weighted mean, weights: ``aggregation_weights``) | fedmedian (coordinate-wise
    median) | trimmed_mean (Flower's FedTrimmedAvg: per coordinate, the mean without the
    ``fed.trim_fraction`` lowest and highest values; robust to a minority of outlying sites that
    the reply checks let through, at the cost of averaging fewer values)."""
    aggregation_weights: str = "uniform"
    """Site weights of the fedavg mean: uniform (1/K, FedST: Algorithm 1 line 8) | samples (n_k / n,
    McMahan et al.'s FedAvg) | fisher (F_k / sum_j F_j, each site's empirical-Fisher trace: FedAS
    only). fedmedian is unweighted and needs "uniform"."""
    communicate: bool = True
    """False: every site trains alone (the 'Local' baseline); nothing travels."""
    returned_model: str = field(default="own", metadata=role(MEASURE))
    """Which model a site returns, is scored with and enters the out-of-federation average
    (:data:`RETURNED_MODELS`): own (v_k = gamma_k^T U rho_k^T, the site's own shared
    parameters after its last local round: FedST's Algorithm 1 lines 14-17, Local, the upper
    bound) | global (gamma_g as the site adopts it, U rho_k: FedAvg, FedLD, FedRep, FedAS, FedDP
    before its stage 2). Each method's config sets its paper's rule; ``global`` on FedST restores
    the earlier scoring for comparison."""

    def typed_options(self) -> Any:
        """``options`` built into the algorithm's dataclass (fedst/schema/method_options.py), as
        its method builds them: a ConfigError names a wrong key or value, without torch."""
        return build(OPTIONS[self.algorithm], self.options, "method.options")

    def __post_init__(self) -> None:
        if self.algorithm not in ALGORITHMS:
            raise ConfigError(
                f"method.algorithm={self.algorithm!r}; choose one of {sorted(ALGORITHMS)}"
            )
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
        if self.aggregation != "fedavg" and self.aggregation_weights != "uniform":
            raise ConfigError(
                f"method.aggregation={self.aggregation} is unweighted; set "
                "method.aggregation_weights=uniform (got "
                f"{self.aggregation_weights!r})"
            )
        if self.shared_components is not None:
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


LR_SCHEDULES = ("constant", "warmup_poly")
"""``train.lr_schedule`` values (fedst/methods/optimizer.py)."""


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
    eval_every: int = field(default=10, metadata=role(CADENCE))
    """Evaluate every site's personalized model on its test split every k rounds (and at the end)."""
    eval_max_frames: int | None = field(default=None, metadata=role(MEASURE))
    """Cap on test (and validation) frames per site per evaluation (None: all)."""
    eval_batch_size: int = field(default=8, metadata=role(CADENCE))
    """Frames per forward pass of evaluation (fedst/scoring/evaluation.py): frames of one
    video are encoded together, scores equal the frame-by-frame path's (to float rounding)."""
    distance_metrics_every: int | None = field(default=1, metadata=role(CADENCE))
    """HD95 / ASSD (a distance transform per class per frame at native resolution: the costly
    metrics) at evaluations of rounds that are multiples of k and at the last round; the other
    evaluations score Dice / IoU only (distances reported as absent). 1: every evaluation
    (default); None: the last round only (the final tables need them, learning curves use Dice)."""
    checkpoint_every: int = field(default=1, metadata=role(CADENCE))
    """The server writes its checkpoint (``server.pt`` and the feature bank entries changed since
    the last one) every k rounds and at the last round; a resumed run restarts after the latest
    one, redoing at most k - 1 rounds (each site keeps its states of the server's two latest
    checkpoint rounds). Results do not depend on k. 1: every round."""
    keep_resume_state: bool = field(default=False, metadata=role(RESOURCE))
    """What a run keeps once its training has finished (fedst/runs/footprint.py; sizes in
    docs/running.md). False: its models only (v_g, each site's rho_k and gamma_k of the last
    round, the validation rounds' snapshots), since a finished run is never resumed. True: also
    what resuming would read (the previous server checkpoint, SERQ's state and feature bank, the
    sites' optimizer moments, data order and earlier rounds), as while it trains."""
    val_every: int | None = field(default=None, metadata=role(CADENCE))
    """Score every site's personalized model on its validation split every k rounds and at the
    last round (metrics.jsonl rows with split "val"), keeping what selection needs of those rounds
    (fedst/runs/model_selection.py). None: no validation (selection.rule must be last)."""
    num_workers: int | str = field(default="auto", metadata=role(NODE))
    """DataLoader worker processes per site (training and evaluation loaders): a number, or
    "auto" = the usable CPU cores divided among the loaders that run at once, less one core for
    the training process, at most 4 (fedst.data.clips.resolve_num_workers): in-process cores - 1
    (sites train in turn), under Ray the actor's CPU share - 1. Workers decode, resize and augment;
    they send uint8 clips, normalised on the device; training loaders keep them (persistent)."""
    device: str = field(default="auto", metadata=role(NODE))
    """auto (the first CUDA device when present, else the CPU; see ``require_gpu``) | cpu |
    cuda | cuda:N (an error where CUDA is unavailable)."""
    require_gpu: bool = field(default=False, metadata=role(EXECUTION))
    """The config is sized for a GPU (configs/experiment/paper.yaml): ``device=auto`` that finds
    no CUDA device stops the run with the reason instead of training for weeks on the CPU; an
    explicit ``train.device=cpu`` still runs it there (fedst.accel.resolve_device)."""
    amp_dtype: str = "auto"
    """Mixed precision of forward passes on CUDA (fedst/accel/precision.py; CPU always runs fp32): auto
    (bf16 where the GPU supports it, else fp16) | bf16 (autocast bfloat16) | fp16 (autocast
    float16 with a GradScaler) | none (fp32). Replaces ``train.amp`` (true = bf16, false = none)."""
    compile: str | bool = field(default="none", metadata=role(EXECUTION))
    """``torch.compile`` mode of the training steps (fedst.accel.maybe_compile): a site's step
    (forward and loss) and SERQ's passes (v_pre's and the global model's forwards and losses
    in EQ and SC, the bank's F_g). none (eager) | default | reduce-overhead (CUDA graphs: the
    steps' shapes are fixed, every batch is full) | max-autotune. The former true / false read
    as default / none (fedst.accel.compile_mode). Faster steps on a GPU after slower first
    steps; CPU compiling needs a C++ compiler."""
    channels_last: bool = field(default=False, metadata=role(EXECUTION))
    """CUDA only: the site's and SERQ's models and their input frames in ``torch.channels_last``
    memory order (NHWC convolutions in cuDNN; fedst.accel.use_channels_last). A no-op on the
    CPU, whose results stay those of NCHW."""
    tf32: bool = True
    """CUDA only: fp32 matmuls and convolutions on TF32 tensor cores (Ampere and later)."""
    cudnn_benchmark: bool = True
    """CUDA only: cuDNN picks the fastest convolution algorithm per input shape (shapes are fixed
    per run, so it is measured once)."""
    max_grad_norm: float | None = None
    """Gradient clipping norm (None: off)."""
    temporal_lr_mult: float = 10.0
    """Learning-rate multiplier of the temporal module's parameters (``temporal.*``). CFFM, whose
    r, p, window, optimizer and batch the paper takes, trains its whole decode head (its
    cross-frame block included) at 10x the base lr (``paramwise_cfg``, ``'head': lr_mult=10``):
    6e-4 beside the paper's 6e-5 (fedst/methods/optimizer.py; docs/design-notes.md). 1: one lr."""
    norm_weight_decay: bool = False
    """Apply AdamW's weight decay to parameters whose name contains ``norm`` too. False, as CFFM's
    ``'norm': decay_mult=0``; true: decay on every parameter (the runs of issues 1-47)."""
    lr_schedule: str = "constant"
    """constant | warmup_poly (CFFM's: linear warm-up over ``warmup_iters`` local iterations from
    1e-6 x lr, then poly decay, power 1, to 0 at ``total_iters``). Constant by default: FedST's
    text gives AdamW 6e-5 for every method and no schedule (fedst/methods/optimizer.py)."""
    warmup_iters: int = 1500
    """Warm-up length of ``lr_schedule=warmup_poly`` in local iterations (CFFM: 1500)."""
    clip_frame_loss_weight: float = 0.5
    """CFFM's supervision of every clip frame (docs/design-notes.md, "The temporal module against
    CFFM", row 11): the local objective adds ``weight x L_seg`` of each clip frame's own
    single-frame prediction (the decoder on that frame's encoder maps, no temporal module)
    against that frame's label, mean over batch x frames x labelled pixels, to the temporal
    prediction's L_seg (fedst/model/losses.py, ``clip_frame_loss``). CFFM's 0.5 is the default
    (since issue 58; the paper lists every clip frame's label as training data). 0: the current
    frame only, and no earlier frame's label is read (the runs before issue 58). A network
    without the temporal module ignores it (it predicts the current frame only)."""
    deterministic: bool = field(default=False, metadata=role(EXECUTION))
    """CUDA only: deterministic algorithms (``torch.use_deterministic_algorithms(True,
    warn_only=True)``: an op without a deterministic kernel warns), cuDNN without autotuning
    (overrides ``cudnn_benchmark``) and ``CUBLAS_WORKSPACE_CONFIG=:4096:8`` where unset
    (fedst.accel.configure_device), so a resumed run or another engine repeats a run's numbers
    bit for bit on the same GPU; slower. CPU runs are deterministic without it."""

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
        check_device_name("train.device", self.device)
        if self.amp_dtype not in AMP_DTYPES:
            raise ConfigError(f"train.amp_dtype={self.amp_dtype!r}; choose one of {AMP_DTYPES}")
        try:  # a mode string from here on (the former boolean is mapped)
            object.__setattr__(self, "compile", compile_mode(self.compile))
        except ValueError as err:
            raise ConfigError(str(err)) from err
        require_positive("train.max_grad_norm", self.max_grad_norm, "or null for no clipping")
        require_positive("train.temporal_lr_mult", self.temporal_lr_mult)
        require_at_least("train.warmup_iters", self.warmup_iters, 0)
        weight = self.clip_frame_loss_weight
        numeric = isinstance(weight, (int, float)) and not isinstance(weight, bool)
        if not (numeric and math.isfinite(weight) and weight >= 0):
            raise ConfigError(
                f"train.clip_frame_loss_weight={weight!r}: must be a finite number >= 0 (the "
                f"weight of the clip frames' own predictions in the loss; CFFM: 0.5, 0: off)"
            )
        if self.lr_schedule not in LR_SCHEDULES:
            raise ConfigError(
                f"train.lr_schedule={self.lr_schedule!r}; choose one of {LR_SCHEDULES}"
            )

    @property
    def amp(self) -> bool:
        """Whether mixed precision is on at all (``amp_dtype`` is not "none"); the former
        ``train.amp`` switch, kept for code that only asks whether to autocast."""
        return self.amp_dtype != "none"

    def evaluation_options(self, server_round: int | None = None) -> dict[str, Any]:
        """Keyword arguments of fedst.scoring.evaluation.evaluate_model for the evaluation of
        ``server_round`` (None: a final evaluation, distances included): frame cap, batch size,
        loader workers, whether HD95 / ASSD are computed and the autocast dtype."""
        return {
            "max_frames": self.eval_max_frames,
            "batch_size": self.eval_batch_size,
            "num_workers": self.num_workers,
            "distances": server_round is None or self.distances_at(server_round),
            "amp_dtype": self.amp_dtype,
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
BANK_STORAGES = ("memory", "disk")
"""serq.bank_storage: SERQ's working feature bank in a dict or in a scratch file."""


@dataclass(frozen=True)
class PretrainingConfig:
    """Synthetic pre-training of v_g^0 before round 1, every method's (paper Sec. IV-A; Algorithm 1,
    line 3; fedst/methods/pretraining.py; ``method.synthetic_pretraining=false`` skips it). The
    paper gives none of these values. Runs written before this group read theirs from
    ``serq.pretrain_iters``, ``serq.batch_size`` and ``serq.lr`` (:func:`experiment_from_json`)."""

    iters: int = 3000
    """Adam steps on the synthetic set (``data.server``) before round 1 (0: none)."""
    batch_size: int = 2
    """Synthetic images per step."""
    lr: float = 1e-4
    """Adam learning rate."""

    def __post_init__(self) -> None:
        require_at_least("pretraining.iters", self.iters, 0)
        require_at_least("pretraining.batch_size", self.batch_size, 1)
        require_positive("pretraining.lr", self.lr)


@dataclass(frozen=True)
class SerqConfig:
    mode: str = "serq"
    """What the server's synthetic step after aggregation does (:data:`SERQ_MODES`; only with
    method.serq=true): serq (EQ then SC, Eq. 10-12) | finetune (Fig. 5's blue line: the global
    model trained on the round's synthetic batches with L_seg only, no EQ step, no descriptor,
    no feature term; fedst/methods/serq.py)."""
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
    descriptor_step / curvature (fedst/methods/serq.py). Adam at ``lr`` moves D_sy by at most
    lr per step, 0.01 over the demo, against features of RMS ~1 that it must offset."""
    bank_storage: str = field(default="memory", metadata=role(RESOURCE))
    """Where SERQ's working feature bank lives between checkpoints (fedst/federation/
    feature_bank.py): memory (a dict: the bank's size in resident memory, 2.35 GB for SISVSE at
    512x640) | disk (one scratch file, serq_bank.work in the run directory, read and written per
    batch: a 640 KiB read and write per sample visit at 512x640). Results are identical."""

    def __post_init__(self) -> None:
        if self.mode not in SERQ_MODES:
            raise ConfigError(f"serq.mode={self.mode!r}; choose one of {SERQ_MODES}")
        require_at_least("serq.batches_per_round", self.batches_per_round, 1)
        require_at_least("serq.batch_size", self.batch_size, 1)
        require_positive("serq.lr", self.lr)
        if self.bank_storage not in BANK_STORAGES:
            raise ConfigError(
                f"serq.bank_storage={self.bank_storage!r}: choose one of {BANK_STORAGES}"
            )
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


@dataclass(frozen=True)
class FedConfig:
    """How the server treats the sites' replies beyond the always-on checks (keys, shapes,
    finite values, round, site, sample count: fedst/federation/reply_checks.py)."""

    max_update_ratio: float | None = None
    """R of the norm rule: refuse a training reply whose update norm ||gamma_k - gamma_g^t||_2
    exceeds R x the median of the round's update norms (a refused reply is a dropped site for
    the round). null: off. Needs 3 or more sites to refuse anything (with two, no norm exceeds
    2 x their median); R = 10 leaves a healthy round's spread alone (train.jsonl
    ``update_norm`` shows it)."""
    max_data_change: float = 2.0
    """F of the data-size rule: a site that says its data changed may report a training-data
    size within [previous / F, previous x F] of its previous accepted reply; beyond it the reply
    is refused (``samples`` check). 2: a site may double or halve its data per round, which a
    real hospital adding or retiring videos rarely exceeds, while under sample weights a site
    holding a share s of the data reaches at most 2s / (1 + s) in one round (1/4 -> 2/5) instead
    of the whole average."""
    trim_fraction: float = 0.25
    """``method.aggregation=trimmed_mean``: the fraction of sites cut at each end of every
    coordinate (Flower's ``beta``; floor(fraction x K) values each end). 0.25 cuts one of 4 sites
    each end; Flower's default 0.2 cuts none below 5 sites."""

    def __post_init__(self) -> None:
        if self.max_update_ratio is not None and self.max_update_ratio <= 1:
            raise ConfigError(
                f"fed.max_update_ratio={self.max_update_ratio}: must be > 1 (a multiple of the "
                f"round's median update norm) or null (off)"
            )
        if not self.max_data_change > 1:
            raise ConfigError(
                f"fed.max_data_change={self.max_data_change}: must be > 1 (the factor a site's "
                f"data size may change by per round)"
            )
        if not 0 <= self.trim_fraction < 0.5:
            raise ConfigError(f"fed.trim_fraction={self.trim_fraction}: must be in [0, 0.5)")


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
    """Central differential privacy with Flower's strategy wrappers (fedst/methods/privacy.py)
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
    """Which round's model a run reports besides the last one (fedst/runs/model_selection.py; the paper's
    tables always use the last round)."""

    rule: str = field(default="last", metadata=role(MEASURE))
    """last | val (per site: its best validation round) | mixed (best pooled validation score of
    the training sites, GEN-Guard Eq. 6) | cbe (best score of the out-of-federation model on the
    held-out site's validation split, GEN-Guard Eq. 7)."""
    held_out_site: str | None = None
    """A site of data.federation that never trains: it is taken out of data.federation when the
    config is read, and its validation split scores the out-of-federation model for ``cbe``."""
    metric: str = field(default="dice", metadata=role(MEASURE))
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
    cache_dir: str = field(default="weights/clip_cache", metadata=role(NODE))
    """Where text embeddings are cached (computed once)."""
    dim: int = 512
    """Indicator dimension (CLIP ViT-B-32 text embedding: 512)."""
    unseen: str = field(default="auto", metadata=role(MEASURE))
    """The indicator of the out-of-federation model at a site outside the federation
    (:data:`UNSEEN_INDICATOR_RULES`; docs/methods.md): own (the site's own indicator: its prompt's
    CLIP embedding, the paper's Sec. IV-B2) | fold (each site's frozen xi_k folded into its own
    channel-selection bias, b'_k = b_k + W^xi_k xi_k, before the sample-weighted average; the
    average reads no indicator) | mean (the averaged model run at the sample-weighted mean of the
    federated sites' xi_k) | auto (own for clip, whose unseen prompt shares the sites' template;
    fold for onehot, gaussian and random, whose unseen vector meets weights no site trained;
    own for FedDP's channel selection, which cannot fold)."""

    def __post_init__(self) -> None:
        if self.unseen not in UNSEEN_INDICATOR_RULES:
            raise ConfigError(
                f"indicator.unseen={self.unseen!r}; choose one of {UNSEEN_INDICATOR_RULES}"
            )
