"""GEN-Guard's correction step: Disagreement-Aware Distillation (DAD) at each site, after training.

    python -m fedst.guard RUN_DIR [--site A ...] [--epochs N]

GEN-Guard (papers/002, Sec. 3.3.2, Eq. 8-12) corrects a model-selection failure without new
federated rounds: the conventionally selected model f_CONV (rule ``mixed``, Eq. 6) is the student,
the client-blocked model f_CBE (rule ``cbe``, Eq. 7) the teacher, both rebuilt from the run's kept
validation snapshots (fedst/federation/snapshots.py). Both stay frozen; only a small residual
generator trains:

* Eq. 8: ``e = G_embed([E_CBE || E_CONV])``, G_embed a 2-layer MLP (2D -> hidden -> dist_dim) on
  the normalised embeddings of both models;
* Eq. 9: R_pred (2-layer MLP, dist_dim -> hidden -> D*K + K) generates W_res [D, K] and b_res [K]
  for the student's prediction layer: ``y_final = E_CONV (W_CONV + W_res) + (b_CONV + b_res)``;
* Eq. 10-12: ``L_DAD = w_agree L_agree + w_disagree L_disagree``; where the student's and the
  teacher's argmax differ, KL at T_dis plus a cosine term (Eq. 11); where they agree, KL at
  T_agree (Eq. 12); plus, at in-federation sites, a supervised cross-entropy on the site's labels.

Where it runs: at each site, on that site's own **validation** split only (never test), in this
process for every site of a run: each training site corrects its v_k (student v_k at the
``mixed`` round, teacher v_k at the ``cbe`` round, supervised term on), and the held-out site
(``selection.held_out_site``) corrects the out-of-federation model (zero-shot: no labels). The
out-of-federation sites (E, GraSP) have no validation split (fedst/data/splits.py), so they
cannot train a correction of their own: they are scored with the held-out site's corrected
out-of-federation model, which never saw them (the paper's zero-shot Out-Fed column). Each
correction is saved beside the site's models, ``<site state dir>/guard/dad.pt`` (generator
weights, the rules and rounds of student and teacher, settings and the loss history), and the
corrected models run with ``guard=dad``:

    python -m fedst.infer run=RUN_DIR site=A input=VIDEO guard=dad
    python eval_outfed.py run=RUN_DIR guard=dad

Test scores before and after DAD (:func:`guard_test_scores`) are measured by
``python -m fedst.report msf RUN_DIR`` only once corrections exist (the discipline of
fedst/selection.py's evaluate_choices: nothing is tested before the correction is final).

Design notes (how we read the paper for a segmentation network):

* **Most abstract layer** = the decoder features E [B, D, h, w] that feed the final 1x1
  segmentation head (``decoder.head``, stride 4, D = ``network.decoder_dim``): every encoder
  stage, the temporal module and channel selection are fused in them, and the head is exactly
  the linear prediction layer (W_CONV [D, K], b_CONV [K]) of Eq. 9, so Eq. 9 is the network's own
  head plus a residual, applied at every pixel.
* **Sample** = the frame for Eq. 8-9, the pixel for Eq. 10-12. The paper gives each sample one
  vector E in R^embed_dim and one "distribution embedding" e_i: we pool E over the frame's pixels
  (mean, then L2-normalised per model) and generate one residual head per frame. Per-pixel
  embeddings would describe local content rather than the frame's distribution (site, lighting)
  and would turn the correction into a per-pixel dynamic convolution with D*K generated weights
  per pixel, far more capacity than a shallow post-hoc step fitted on a validation split. The
  predictions, and so the agree/disagree masks and the losses, are per pixel: a segmentation
  prediction is a class per pixel, and teacher and student disagree on some pixels of a frame.
* E_CONV in Eq. 9 is the student's raw head input (only Eq. 8 reads the normalised embeddings),
  and R_pred's last layer starts at zero, so before training y_final is exactly f_CONV's output.
* Loss conventions (the paper does not state them): KL is the distillation KL(p_teacher^T ||
  p_final^T) with p = softmax(logits / T) over the K classes, without a T^2 factor (the paper's
  formula has none); L_COS = 1 - cos(y_final, y_CBE) of the logit vectors (no temperature, as in
  Eq. 11); the masks come from the frozen models' argmax at the head's grid; the sums of Eq. 11-12
  run over the masks' pixels and Eq. 10 is divided by the batch's pixel count, a constant that
  keeps the paper's relative weighting of agree and disagree pixels. The supervised term is the
  cross-entropy of y_final upsampled to the labels' size (255 ignored), weight
  ``supervised_weight``.
* Early stopping: the last ``stop_fraction`` of a site's validation samples (dataset order: video
  by video, in time, so the held-back frames are a contiguous end) are not fitted; after every
  epoch the same objective (L_DAD, plus the supervised term where it is on) is measured on them,
  and training stops after ``patience`` epochs without improvement. The generator of the best
  epoch is kept; epoch 0 (the untrained generator, i.e. the student) is a candidate, so the
  correction never scores worse than the student on the held-back frames.
* Cost: the corrected model runs both networks (Eq. 8 reads the teacher's features of the same
  frame), about twice the student's inference cost, plus the generator (negligible).
"""

from __future__ import annotations

import argparse
import copy
import json
import logging
import sys
import uuid
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset, Subset

from fedst.config import ConfigError, require_at_least, require_positive
from fedst.data.base import IGNORE_INDEX
from fedst.data.clips import collate_clips
from fedst.experiment import ExperimentConfig, resolve_device, site_state_dir
from fedst.federation.run_io import atomic_torch_save, atomic_write_text, load_checkpoint
from fedst.federation.snapshots import SELECTION_DIR, snapshot_rounds
from fedst.model.network import FedSTNet
from fedst.progress import progress_bar

__all__ = [
    "GuardConfig",
    "GuardError",
    "GuardedNet",
    "ResidualHeadGenerator",
    "corrected_logits",
    "dad_loss",
    "guard_file",
    "guard_test_scores",
    "load_guarded_model",
    "main",
    "run_guard",
]

log = logging.getLogger(__name__)

GUARD_DIR = "guard"
GUARD_FILE = "dad.pt"
GUARD_SCORES = f"{SELECTION_DIR}/guard.json"
STUDENT_RULE, TEACHER_RULE = "mixed", "cbe"
PERSONAL, OUTFED = "personal", "outfed"


class GuardError(ValueError):
    """DAD cannot run on this run or site, or its correction file is missing; one line with the fix."""


@dataclass(frozen=True)
class GuardConfig:
    """DAD settings; defaults are GEN-Guard's (papers/002, Sec. 4 settings) where it gives them."""

    epochs: int = 5
    """T_max: at most this many passes over the fitted validation frames (paper: 5)."""
    lr: float = 1e-4
    """Adam learning rate of the generator (paper: 1e-4)."""
    temperature_disagree: float = 2.0
    """T_dis of Eq. 11 (paper: 2.0)."""
    weight_disagree: float = 2.0
    """w_disagree of Eq. 10 (paper: 2.0)."""
    temperature_agree: float = 1.0
    """T_agree of Eq. 12 (paper: 1.0)."""
    weight_agree: float = 1.0
    """w_agree of Eq. 10 (paper: 1.0)."""
    supervised_weight: float = 1.0
    """Weight of the supervised cross-entropy at in-federation sites (the paper's optional
    L_supervised); 0 = zero-shot everywhere. The held-out site is always zero-shot."""
    dist_dim: int = 32
    """Size of the distribution embedding e (Eq. 8; not given in the paper)."""
    hidden_dim: int = 64
    """Hidden width of both 2-layer MLPs, G_embed and R_pred (not given in the paper)."""
    batch_size: int = 2
    """Validation clips per step (the sites' training batch)."""
    stop_fraction: float = 0.2
    """Fraction of a site's validation samples held back for early stopping (the last ones)."""
    patience: int = 1
    """Stop after this many epochs without a lower early-stopping loss."""

    def __post_init__(self) -> None:
        require_at_least("guard.epochs", self.epochs, 1)
        require_positive("guard.lr", self.lr)
        for name in ("temperature_disagree", "temperature_agree"):
            require_positive(f"guard.{name}", getattr(self, name))
        for name in ("weight_disagree", "weight_agree", "supervised_weight"):
            require_at_least(f"guard.{name}", getattr(self, name), 0)
        for name in ("dist_dim", "hidden_dim", "batch_size", "patience"):
            require_at_least(f"guard.{name}", getattr(self, name), 1)
        if not 0 < self.stop_fraction < 1:
            raise ConfigError(f"guard.stop_fraction={self.stop_fraction!r}: must be in (0, 1)")


# -- Eq. 8-9: the residual generator and the corrected head ----------------------------------------


def frame_embedding(features: torch.Tensor) -> torch.Tensor:
    """[B, D, h, w] -> [B, D]: mean over the frame's pixels, L2-normalised (Eq. 8's E of a frame)."""
    return F.normalize(features.mean(dim=(2, 3)), dim=1)


class ResidualHeadGenerator(nn.Module):
    """G_embed (Eq. 8) and R_pred (Eq. 9): both models' features of a frame -> W_res, b_res.

    R_pred's output vector [D*K + K] is read as W_res [D, K] (row-major, its first D*K entries)
    and b_res [K] (the last K). Its last layer starts at zero: W_res = 0, b_res = 0.
    """

    def __init__(self, embed_dim: int, num_classes: int, dist_dim: int, hidden_dim: int):
        super().__init__()
        self.embed_dim, self.num_classes = embed_dim, num_classes
        self.embed = nn.Sequential(  # G_embed
            nn.Linear(2 * embed_dim, hidden_dim), nn.GELU(), nn.Linear(hidden_dim, dist_dim)
        )
        self.residual = nn.Sequential(  # R_pred
            nn.Linear(dist_dim, hidden_dim),
            nn.GELU(),
            nn.Linear(hidden_dim, embed_dim * num_classes + num_classes),
        )
        nn.init.zeros_(self.residual[-1].weight)
        nn.init.zeros_(self.residual[-1].bias)

    def forward(
        self, teacher_features: torch.Tensor, student_features: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """E_CBE, E_CONV [B, D, h, w] -> (W_res [B, D, K], b_res [B, K])."""
        pair = torch.cat(  # [E_CBE || E_CONV]: [B, 2D]
            [frame_embedding(teacher_features), frame_embedding(student_features)], dim=1
        )
        out = self.residual(self.embed(pair))  # [B, 2D] -> [B, dist_dim] -> [B, D*K + K]
        split = self.embed_dim * self.num_classes
        weight = out[:, :split].reshape(-1, self.embed_dim, self.num_classes)  # [B, D, K]
        return weight, out[:, split:]  # [B, K]


def corrected_logits(
    student_features: torch.Tensor,
    head_weight: torch.Tensor,
    head_bias: torch.Tensor,
    residual_weight: torch.Tensor,
    residual_bias: torch.Tensor,
) -> torch.Tensor:
    """Eq. 9 at every pixel: E_CONV [B, D, h, w], W_CONV [K, D] (the 1x1 head's weight), b_CONV
    [K], W_res [B, D, K], b_res [B, K] -> y_final [B, K, h, w] = E (W_CONV^T + W_res) + b + b_res."""
    weight = head_weight.t().unsqueeze(0) + residual_weight  # [B, D, K]
    bias = head_bias.unsqueeze(0) + residual_bias  # [B, K]
    return torch.einsum("bdhw,bdk->bkhw", student_features, weight) + bias[:, :, None, None]


# -- Eq. 10-12: the loss -----------------------------------------------------------------------


@dataclass
class DadLoss:
    """Eq. 10's total and its parts (each already divided by the batch's pixel count)."""

    total: torch.Tensor
    agree: torch.Tensor
    """L_agree of Eq. 12 (unweighted)."""
    disagree: torch.Tensor
    """L_disagree of Eq. 11 (unweighted)."""
    disagree_fraction: float
    """Share of the batch's pixels in M_disagree."""


def distillation_kl(
    final_logits: torch.Tensor, teacher_logits: torch.Tensor, temperature: float
) -> torch.Tensor:
    """Per pixel KL(softmax(y_CBE / T) || softmax(y_final / T)): [B, K, h, w] x 2 -> [B, h, w]."""
    teacher_log_p = F.log_softmax(teacher_logits / temperature, dim=1)
    final_log_p = F.log_softmax(final_logits / temperature, dim=1)
    return (teacher_log_p.exp() * (teacher_log_p - final_log_p)).sum(dim=1)


def disagreement_mask(student_logits: torch.Tensor, teacher_logits: torch.Tensor) -> torch.Tensor:
    """M_disagree: pixels where f_CONV's and f_CBE's argmax differ; [B, K, h, w] x 2 -> bool
    [B, h, w] (its complement is M_agree)."""
    return student_logits.argmax(dim=1) != teacher_logits.argmax(dim=1)


def dad_loss(
    final_logits: torch.Tensor,
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    settings: GuardConfig,
) -> DadLoss:
    """Eq. 10-12 on logits [B, K, h, w] at the head's grid: y_final (corrected student), y_CONV
    (frozen student, for the masks only) and y_CBE (frozen teacher)."""
    disagree = disagreement_mask(student_logits, teacher_logits)  # [B, h, w]
    pixels = disagree.numel()
    kl_agree = distillation_kl(final_logits, teacher_logits, settings.temperature_agree)
    kl_disagree = distillation_kl(final_logits, teacher_logits, settings.temperature_disagree)
    cosine = 1 - F.cosine_similarity(final_logits, teacher_logits, dim=1)  # [B, h, w]
    loss_agree = (kl_agree * ~disagree).sum() / pixels  # Eq. 12
    loss_disagree = ((kl_disagree + cosine) * disagree).sum() / pixels  # Eq. 11
    total = settings.weight_agree * loss_agree + settings.weight_disagree * loss_disagree
    return DadLoss(total, loss_agree, loss_disagree, float(disagree.float().mean()))


# -- the frozen networks' features and the corrected model ----------------------------------------


@contextmanager
def head_calls(model: FedSTNet) -> Iterator[list[tuple[torch.Tensor, torch.Tensor]]]:
    """Record ``(E [B, D, h, w], logits [B, K, h, w])``, the input and output of
    ``model.decoder.head`` (the 1x1 prediction layer), of every forward pass in the block."""
    calls: list[tuple[torch.Tensor, torch.Tensor]] = []
    handle = model.decoder.head.register_forward_hook(
        lambda _module, inputs, output: calls.append((inputs[0], output))
    )
    try:
        yield calls
    finally:
        handle.remove()


@dataclass
class HeadOutputs:
    """One batch at the head's grid: y_final (with the generator's graph), y_CONV, y_CBE."""

    final: torch.Tensor
    student: torch.Tensor
    teacher: torch.Tensor


class GuardedNet(nn.Module):
    """The DAD-corrected model: student f_CONV whose head is corrected by Eq. 9 with residuals
    generated from both frozen models' features (Eq. 8). Offers what evaluation and inference use
    of a :class:`FedSTNet` (``forward``, ``uses_temporal``, ``stream``, ``cfg``)."""

    def __init__(self, student: FedSTNet, teacher: FedSTNet, generator: ResidualHeadGenerator):
        super().__init__()
        self.student, self.teacher, self.generator = student, teacher, generator
        for network in (student, teacher):
            network.requires_grad_(False)

    @property
    def cfg(self):
        return self.student.cfg

    @property
    def needs_indicator(self) -> bool:
        return self.student.needs_indicator

    def uses_temporal(self, num_frames: int, use_temporal: bool = True) -> bool:
        return self.student.uses_temporal(num_frames, use_temporal)

    def correct(
        self, student_features: torch.Tensor, teacher_features: torch.Tensor
    ) -> torch.Tensor:
        """E_CONV, E_CBE [B, D, h, w] -> y_final [B, K, h, w] (Eq. 8-9)."""
        residual_weight, residual_bias = self.generator(teacher_features, student_features)
        head = self.student.decoder.head
        return corrected_logits(
            student_features, head.weight[:, :, 0, 0], head.bias, residual_weight, residual_bias
        )

    def head_outputs(self, clip: torch.Tensor, indicator: torch.Tensor | None) -> HeadOutputs:
        """clip [B, T, 3, H, W] -> y_final, y_CONV, y_CBE [B, K, h, w] (frozen models without
        gradient; y_final carries the generator's graph)."""
        with torch.no_grad():
            with head_calls(self.student) as student_calls:
                self.student(clip, indicator)
            with head_calls(self.teacher) as teacher_calls:
                self.teacher(clip, indicator)
        ((student_features, student_logits),) = student_calls
        ((teacher_features, teacher_logits),) = teacher_calls
        final = self.correct(student_features, teacher_features)
        return HeadOutputs(final, student_logits, teacher_logits)

    def forward(self, clip: torch.Tensor, indicator: torch.Tensor | None = None) -> torch.Tensor:
        """clip [B, T, 3, H, W] -> corrected logits [B, K, H, W] (upsampled as the decoder does)."""
        final = self.head_outputs(clip, indicator).final
        return F.interpolate(final, size=clip.shape[-2:], mode="bilinear")

    def stream(self, indicator: torch.Tensor | None, *args: Any, **kwargs: Any) -> GuardedStream:
        """Streaming inference over one video: :meth:`FedSTNet.stream`'s arguments, both models
        stepped together."""
        return GuardedStream(
            self,
            self.student.stream(indicator, *args, **kwargs),
            self.teacher.stream(indicator, *args, **kwargs),
        )


class GuardedStream:
    """:class:`fedst.model.network.StreamingState` of the corrected model: the student's and the
    teacher's streams take the same frames; their head inputs give the corrected logits."""

    def __init__(self, net: GuardedNet, student_stream, teacher_stream):
        self.net, self.student_stream, self.teacher_stream = net, student_stream, teacher_stream

    def reset(self) -> None:
        self.student_stream.reset()
        self.teacher_stream.reset()

    @torch.no_grad()
    def step(
        self, frame: torch.Tensor, time_s: float | None = None, *, predict: bool = True
    ) -> torch.Tensor | None:
        """frame [B, 3, H, W] -> corrected logits [B, K, H, W] (None with ``predict=False``)."""
        return self._corrected(
            lambda stream: stream.step(frame, time_s, predict=predict), frame.shape[-2:]
        )

    @torch.no_grad()
    def step_frames(self, frames: torch.Tensor, *args: Any) -> torch.Tensor | None:
        """frames [N, 3, H, W] (then StreamingState.step_frames's times and predict flags) ->
        corrected logits [M, K, H, W] of the predicted frames."""
        return self._corrected(lambda stream: stream.step_frames(frames, *args), frames.shape[-2:])

    def _corrected(self, advance, size) -> torch.Tensor | None:
        with head_calls(self.net.student) as student_calls:
            predicted = advance(self.student_stream)
        with head_calls(self.net.teacher) as teacher_calls:
            advance(self.teacher_stream)
        if predicted is None:
            return None
        ((student_features, _),) = student_calls
        ((teacher_features, _),) = teacher_calls
        final = self.net.correct(student_features, teacher_features)  # [M, K, h, w]
        return F.interpolate(final, size=tuple(size), mode="bilinear")


# -- which corrections a run has, and their models -------------------------------------------------


@dataclass(frozen=True)
class SitePlan:
    """What DAD does at one site: which model it corrects, from which rounds, supervised or not."""

    site: str
    model: str
    """"personal" (the site's v_k) | "outfed" (the out-of-federation model: held-out site)."""
    student_round: int
    teacher_round: int
    supervised: bool


def guard_file(run_dir: Path, site: str) -> Path:
    """``<site state dir>/guard/dad.pt``: the site's correction."""
    return site_state_dir(run_dir, site) / GUARD_DIR / GUARD_FILE


def check_guard_run(cfg: ExperimentConfig, run_dir: Path) -> None:
    """GuardError (one line naming the overrides) unless the run kept validation snapshots and
    had a held-out site, which rules mixed and cbe need."""
    missing = []
    if cfg.train.val_every is None or not snapshot_rounds(run_dir):
        missing.append("no validation snapshots (train.val_every)")
    if cfg.selection.held_out_site is None:
        missing.append("no held-out site (selection.held_out_site)")
    if missing:
        raise GuardError(
            f"{run_dir}: {' and '.join(missing)}; DAD's student and teacher are the rounds rules "
            f"mixed and cbe choose, so train the run with train.val_every=<k> "
            f"selection.held_out_site=<a site of data.federation>"
        )


def chosen_rounds(
    cfg: ExperimentConfig, run_dir: Path, device: torch.device, progress: bool = False
) -> tuple[int, int]:
    """(student round, teacher round): the rounds of rules mixed and cbe, from validation rows
    only (the held-out site's rows are scored first when the run lacks them)."""
    from fedst.selection import HELD_OUT_ROWS, choose, select_rounds, validation_rows

    if (run_dir / HELD_OUT_ROWS).exists():
        choices = choose(
            validation_rows(run_dir),
            cfg.data.federation,
            cfg.selection.held_out_site,
            cfg.selection.metric,
        )
    else:
        choices = select_rounds(cfg, run_dir, device, progress)
    return choices[STUDENT_RULE].outfed, choices[TEACHER_RULE].outfed


def site_plans(
    cfg: ExperimentConfig,
    rounds: tuple[int, int],
    settings: GuardConfig,
    sites: Sequence[str] | None = None,
) -> list[SitePlan]:
    """The training sites (their v_k, supervised) and the held-out site (the out-of-federation
    model, zero-shot), or the named subset of them."""
    held_out = cfg.selection.held_out_site
    supervised = settings.supervised_weight > 0
    plans = {s: SitePlan(s, PERSONAL, *rounds, supervised) for s in cfg.data.federation}
    plans[held_out] = SitePlan(held_out, OUTFED, *rounds, supervised=False)
    for site in sites or ():
        if site in cfg.data.out_of_federation:
            raise GuardError(
                f"site {site} is out of federation and has no validation split to fit DAD on; "
                f"it is scored with the held-out site {held_out}'s correction (--site {held_out})"
            )
        if site not in plans:
            raise GuardError(f"--site {site}: not a site of this run; choose from {list(plans)}")
    return [plans[s] for s in sites] if sites else list(plans.values())


def _site_networks(
    cfg: ExperimentConfig, run_dir: Path, plan: SitePlan, device: torch.device
) -> tuple[FedSTNet, FedSTNet]:
    """(student, teacher) of a plan, rebuilt from the kept snapshots, in eval mode."""
    from fedst.federation.snapshots import snapshot_outfed_model, snapshot_site_model

    def build(server_round: int) -> FedSTNet:
        if plan.model == OUTFED:
            return snapshot_outfed_model(cfg, run_dir, server_round, device).eval()
        return snapshot_site_model(cfg, run_dir, plan.site, server_round, device).eval()

    return build(plan.student_round), build(plan.teacher_round)


def _new_generator(student: FedSTNet, settings: GuardConfig) -> ResidualHeadGenerator:
    head = student.decoder.head
    return ResidualHeadGenerator(
        head.in_channels, head.out_channels, settings.dist_dim, settings.hidden_dim
    )


def load_guarded_model(
    cfg: ExperimentConfig, run_dir: Path, site: str, device: torch.device
) -> GuardedNet:
    """The corrected model saved at ``site`` (a training site: its v_k; the held-out site: the
    out-of-federation model), in eval mode; a missing file is a one-line GuardError."""
    path = guard_file(run_dir, site)
    if not path.exists():
        raise GuardError(
            f"{path} is missing: site {site} has no DAD correction; make it with "
            f"python -m fedst.guard {run_dir} --site {site}"
        )
    record = load_checkpoint(path)
    plan = SitePlan(**record["plan"])
    student, teacher = _site_networks(cfg, run_dir, plan, device)
    generator = _new_generator(student, GuardConfig(**record["settings"]))
    generator.load_state_dict(record["generator"])
    return GuardedNet(student, teacher, generator.to(device)).eval()


def held_out_site(cfg: ExperimentConfig) -> str:
    """The site whose correction the out-of-federation model uses."""
    if cfg.selection.held_out_site is None:
        raise GuardError(
            "the run has no held-out site, so no corrected out-of-federation model; train it "
            "with train.val_every=<k> selection.held_out_site=<a site of data.federation>"
        )
    return cfg.selection.held_out_site


# -- fitting DAD at one site (its validation split only) ----------------------------------------


def _batches(dataset: Dataset, batch_size: int, shuffle: bool, seed: int) -> DataLoader:
    """Clips of ``dataset`` (no augmentation), loaded in this process (validation splits are
    small)."""
    return DataLoader(
        dataset,
        batch_size=batch_size,
        shuffle=shuffle,
        collate_fn=collate_clips,
        generator=torch.Generator().manual_seed(seed),
    )


def _objective(
    model: GuardedNet,
    clips: torch.Tensor,
    masks: torch.Tensor,
    indicator: torch.Tensor | None,
    settings: GuardConfig,
    supervised: bool,
) -> tuple[torch.Tensor, DadLoss]:
    """L_DAD (Eq. 10) plus, when ``supervised``, w_sup * CE(y_final at the labels' size, labels)."""
    outputs = model.head_outputs(clips, indicator)
    loss = dad_loss(outputs.final, outputs.student, outputs.teacher, settings)
    total = loss.total
    if supervised:
        upsampled = F.interpolate(outputs.final, size=masks.shape[-2:], mode="bilinear")
        total = total + settings.supervised_weight * F.cross_entropy(
            upsampled, masks, ignore_index=IGNORE_INDEX
        )
    return total, loss


def fit_dad(
    model: GuardedNet,
    indicator: torch.Tensor | None,
    fit_data: Dataset,
    stop_data: Dataset,
    settings: GuardConfig,
    supervised: bool,
    device: torch.device,
    seed: int,
    progress: bool = False,
    desc: str = "DAD",
) -> dict[str, Any]:
    """Train ``model.generator`` (Adam) on ``fit_data`` for at most ``settings.epochs`` epochs,
    early-stopped on the objective over ``stop_data``; the best epoch's generator is loaded back.
    Returns the history: per epoch the mean fitting and stopping losses."""
    optimizer = torch.optim.Adam(model.generator.parameters(), lr=settings.lr)
    ind = indicator.to(device) if indicator is not None else None

    def stopping_loss() -> tuple[float, float]:
        total, disagree, frames = 0.0, 0.0, 0
        with torch.no_grad():
            for clips, masks, _ in _batches(stop_data, settings.batch_size, False, seed):
                loss, parts = _objective(
                    model, clips.to(device), masks.to(device), ind, settings, supervised
                )
                total += float(loss) * len(clips)
                disagree += parts.disagree_fraction * len(clips)
                frames += len(clips)
        return total / frames, disagree / frames

    stop_loss, disagree = stopping_loss()
    history = [{"epoch": 0, "fit_loss": None, "stop_loss": stop_loss, "disagree": disagree}]
    best = (stop_loss, 0, copy.deepcopy(model.generator.state_dict()))
    epochs = progress_bar(range(1, settings.epochs + 1), desc=desc, enabled=progress)
    for epoch in epochs:
        model.generator.train()
        fit_total, frames = 0.0, 0
        loader = _batches(fit_data, settings.batch_size, True, seed + epoch)
        for clips, masks, _ in progress_bar(
            loader, desc=f"epoch {epoch}", enabled=progress, leave=False
        ):
            loss, _ = _objective(
                model, clips.to(device), masks.to(device), ind, settings, supervised
            )
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            fit_total += float(loss.detach()) * len(clips)
            frames += len(clips)
        model.generator.eval()
        stop_loss, disagree = stopping_loss()
        history.append(
            {
                "epoch": epoch,
                "fit_loss": fit_total / frames,
                "stop_loss": stop_loss,
                "disagree": disagree,
            }
        )
        epochs.set_postfix(stop_loss=f"{stop_loss:.4f}", refresh=False)
        if stop_loss < best[0]:
            best = (stop_loss, epoch, copy.deepcopy(model.generator.state_dict()))
        elif epoch - best[1] >= settings.patience:
            break
    model.generator.load_state_dict(best[2])
    return {"history": history, "best_epoch": best[1], "epochs_run": history[-1]["epoch"]}


def split_for_stopping(num_samples: int, stop_fraction: float, site: str) -> tuple[list, list]:
    """(fitted indices, early-stopping indices): the last round(stop_fraction * n) of the n
    samples (at least one, at most n - 1) are held back."""
    if num_samples < 2:
        raise GuardError(
            f"site {site}: its validation split has {num_samples} labelled frame(s); DAD needs "
            f"at least 2 (fitted and early-stopping frames)"
        )
    held_back = min(num_samples - 1, max(1, round(stop_fraction * num_samples)))
    cut = num_samples - held_back
    return list(range(cut)), list(range(cut, num_samples))


def guard_site(
    cfg: ExperimentConfig,
    run_dir: Path,
    plan: SitePlan,
    settings: GuardConfig,
    device: torch.device,
    progress: bool = False,
) -> Path:
    """Fit DAD at one site on its validation split and save ``<site state dir>/guard/dad.pt``."""
    from fedst.data.splits import validation_dataset
    from fedst.methods import method_of

    dataset = validation_dataset(cfg.data.open(plan.site), cfg.data.val_split, cfg.clip_config())
    fit, stop = split_for_stopping(len(dataset), settings.stop_fraction, plan.site)
    student, teacher = _site_networks(cfg, run_dir, plan, device)
    with torch.random.fork_rng(devices=[]):  # the generator's initialisation, seeded by the run
        torch.manual_seed(cfg.seed)
        generator = _new_generator(student, settings)
    model = GuardedNet(student, teacher, generator.to(device))
    log.info(
        "DAD at %s (%s model): student round %d (rule %s), teacher round %d (rule %s), %s; "
        "%d validation frames fitted, %d held back for early stopping",
        plan.site,
        plan.model,
        plan.student_round,
        STUDENT_RULE,
        plan.teacher_round,
        TEACHER_RULE,
        "supervised" if plan.supervised else "zero-shot",
        len(fit),
        len(stop),
    )
    if plan.student_round == plan.teacher_round:
        log.warning(
            "no model-selection failure (mixed and cbe both chose round %d): teacher = student, "
            "so the distillation terms are zero and only a supervised term can move the head",
            plan.student_round,
        )
    result = fit_dad(
        model,
        method_of(cfg).indicators().get(plan.site),
        Subset(dataset, fit),
        Subset(dataset, stop),
        settings,
        plan.supervised,
        device,
        cfg.seed,
        progress,
        desc=f"DAD {plan.site}",
    )
    record = {
        "plan": asdict(plan),
        "rules": {"student": STUDENT_RULE, "teacher": TEACHER_RULE},
        "settings": asdict(settings),
        "generator": {k: v.detach().cpu() for k, v in model.generator.state_dict().items()},
        "fit_frames": len(fit),
        "stop_frames": len(stop),
        "id": uuid.uuid4().hex,
        "created": datetime.now(UTC).isoformat(timespec="seconds"),
        **result,
    }
    path = guard_file(run_dir, plan.site)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_torch_save(record, path)
    log.info(
        "DAD at %s: best epoch %d of %d run (early-stopping loss %.4f -> %.4f); wrote %s",
        plan.site,
        result["best_epoch"],
        result["epochs_run"],
        result["history"][0]["stop_loss"],
        result["history"][result["best_epoch"]]["stop_loss"],
        path,
    )
    return path


def run_guard(
    cfg: ExperimentConfig,
    run_dir: Path,
    settings: GuardConfig = GuardConfig(),
    sites: Sequence[str] | None = None,
    progress: bool = False,
) -> list[Path]:
    """DAD at every site of the run (or ``sites``), each on its own validation split."""
    check_guard_run(cfg, run_dir)
    device = resolve_device(cfg.train.device)
    rounds = chosen_rounds(cfg, run_dir, device, progress)
    plans = site_plans(cfg, rounds, settings, sites)
    return [guard_site(cfg, run_dir, plan, settings, device, progress) for plan in plans]


# -- test scores before and after (only once the corrections exist) --------------------------------


def saved_corrections(run_dir: Path) -> dict[str, dict[str, Any]]:
    """Site -> its dad.pt record without the generator weights (empty: DAD never ran)."""
    records = {}
    for path in sorted((run_dir / "sites").glob(f"*/{GUARD_DIR}/{GUARD_FILE}")):
        record = load_checkpoint(path)
        records[path.parent.parent.name] = {k: v for k, v in record.items() if k != "generator"}
    return records


def guard_test_scores(
    cfg: ExperimentConfig, run_dir: Path, device: torch.device, progress: bool = False
) -> dict[str, Any] | None:
    """Test Dice before (student) and after DAD of every corrected model, or None when the run
    has no correction. Read from ``selection/guard.json`` when it scored the same corrections,
    else measured now (only after DAD has finished: it reads the saved files) and written there.

    ``{"corrections": site -> id, "rounds": {"student", "teacher"}, "in_federation" |
    "held_out" | "out_of_federation": site -> {"before", "after"} (dice, iou, num_frames)}``.
    """
    corrections = saved_corrections(run_dir)
    if not corrections:
        return None
    ids = {site: record["id"] for site, record in corrections.items()}
    path = run_dir / GUARD_SCORES
    if path.exists():
        cached = json.loads(path.read_text())
        if cached.get("corrections") == ids:
            return cached
    held_out = cfg.selection.held_out_site
    groups: dict[str, list[tuple[str, str]]] = {  # group -> (scored site, correcting site)
        "in_federation": [(s, s) for s in cfg.data.federation if s in corrections],
        "held_out": [(held_out, held_out)] if held_out in corrections else [],
        "out_of_federation": [
            (s, held_out) for s in cfg.data.out_of_federation if held_out in corrections
        ],
    }

    def score(model: nn.Module, site: str) -> dict[str, Any]:
        summary = _test_summary(cfg, model, site, device, progress, distances=False)
        return {k: summary[k] for k in ("dice", "iou", "num_frames")}

    plan = next(iter(corrections.values()))["plan"]  # every site's plan has the same rounds
    scores: dict[str, Any] = {
        "corrections": ids,
        "rounds": {"student": plan["student_round"], "teacher": plan["teacher_round"]},
    }
    for group, pairs in groups.items():
        scores[group] = {}
        for site, owner in pairs:
            guarded = load_guarded_model(cfg, run_dir, owner, device)
            scores[group][site] = {
                "before": score(guarded.student, site),
                "after": score(guarded, site),
            }
    atomic_write_text(json.dumps(scores, indent=1, sort_keys=True), path)
    return scores


def evaluate_guarded_sites(
    cfg: ExperimentConfig,
    run_dir: Path,
    sites: Sequence[str],
    device: torch.device,
    progress: bool = False,
) -> dict[str, dict[str, Any]]:
    """The held-out site's corrected out-of-federation model on each site's test split
    (``eval_outfed.py guard=dad``); site -> evaluation summary."""
    unknown = [s for s in sites if s not in cfg.data.sites]
    if unknown:
        raise GuardError(
            f"sites {unknown} are not configured in {run_dir}: {sorted(cfg.data.sites)}"
        )
    model = load_guarded_model(cfg, run_dir, held_out_site(cfg), device)
    return {site: _test_summary(cfg, model, site, device, progress) for site in sites}


def _test_summary(
    cfg: ExperimentConfig,
    model: nn.Module,
    site: str,
    device: torch.device,
    progress: bool,
    **options: Any,
) -> dict[str, Any]:
    """evaluate_model's summary of ``model`` on ``site``'s test split, prompted as that site
    (``options`` override the run's evaluation options)."""
    from fedst.federation.evaluation import evaluate_model
    from fedst.federation.site_data import open_site_data
    from fedst.methods import method_of

    return evaluate_model(
        model,
        open_site_data(cfg, site, ("test",)).test,
        method_of(cfg).indicators().get(site),
        device,
        progress=progress,
        **{**cfg.train.evaluation_options(), **options},
    ).summary


def main(argv: Sequence[str] | None = None) -> list[Path]:
    parser = argparse.ArgumentParser(
        prog="python -m fedst.guard", description=__doc__.split("\n")[0]
    )
    parser.add_argument("run_dir", type=Path, help="run directory written by train_fed.py")
    parser.add_argument(
        "--site",
        nargs="+",
        help="only these sites (default: every training site and the held-out site)",
    )
    parser.add_argument("--epochs", type=int, help=f"T_max (default {GuardConfig.epochs})")
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a DAD setting (a GuardConfig field of fedst/guard.py), e.g. temperature_disagree=3",
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    args = parser.parse_args(sys.argv[1:] if argv is None else list(argv))
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    from omegaconf import OmegaConf

    from fedst.config import build
    from fedst.federation.run_io import load_config

    try:
        if any("=" not in item for item in args.set):
            raise GuardError(f"--set takes KEY=VALUE, got {args.set}")
        values = OmegaConf.to_container(OmegaConf.from_dotlist(args.set))
        if args.epochs is not None:
            values["epochs"] = args.epochs
        settings = build(GuardConfig, values, "guard")
        cfg = load_config(args.run_dir)
        written = run_guard(cfg, args.run_dir, settings, args.site, not args.no_progress)
    except (GuardError, ConfigError, FileNotFoundError) as err:
        sys.exit(f"fedst.guard: {err}")
    for path in written:
        print(f"wrote {path}")
    return written


if __name__ == "__main__":
    main()
