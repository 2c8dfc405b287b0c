"""The correction itself (GEN-Guard Eq. 8-12): the residual head generator, the corrected
head, the distillation loss, and the corrected network and its stream (see the package
docstring)."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from fedst.config import ConfigError, require_at_least, require_positive
from fedst.errors import UserError
from fedst.model.network import FedSTNet

log = logging.getLogger("fedst.guard")

STUDENT_RULE, TEACHER_RULE = "mixed", "cbe"
PERSONAL, OUTFED = "personal", "outfed"


class GuardError(UserError, ValueError):
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
    ``model.prediction_head`` (the 1x1 prediction layer), of every forward pass in the block."""
    calls: list[tuple[torch.Tensor, torch.Tensor]] = []
    handle = model.prediction_head.register_forward_hook(
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
        head = self.student.prediction_head
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
