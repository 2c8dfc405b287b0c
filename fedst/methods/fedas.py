"""FedAS (Yang, Huang, Ye, CVPR 2024): parameter alignment at the site, Fisher-trace weighting at
the server.

Model = base + head; the head (final 1x1 classifier, fedst/methods/head.py) is private, the base
(encoder + decoder) is shared. For segmentation the per-sample features of the reference become
per-pixel features: the base's output f [B, D, h, w] that feeds the head (1/4 resolution), with
the mask resized to h x w (nearest).

Site, before adopting the received global base (rounds after the site's first):
  1. prototypes p_c = mean of the *local* model's base features over the pixels of class c
     (masked average pooling) on ``prototype_batches`` training batches;
  2. the received base is aligned to them: ``align_iters`` SGD steps (lr ``align_lr``, 0.01 as the
     reference) on L_align = sum_c mean_{pixels i of class c} mean_d (f_i - p_c)_d^2 (the
     reference's per-class MSE, summed over the classes of the batch that have a prototype);
  3. the aligned base is adopted, and local training follows.
  In the site's first round there is no local base yet: the received model is taken as is.

Reply: the trace of the empirical Fisher information after local training,
F_k = sum over training batches of ||grad_theta NLL||^2 (NLL: mean per-pixel negative
log-likelihood of the labels, theta: every parameter, model in eval mode, as the reference). It is
measured on ``fisher_batches`` batches and scaled to the site's epoch (x batches per epoch /
batches measured), so it stays the reference's sum over one epoch of the site's training data.

Server: gamma_g = sum_k F_k / sum_j F_j gamma_k (``method.aggregation_weights: fisher``,
Flower's FedAvg weighted by the replies' "fisher-trace").
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Iterable, Iterator

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from fedst.accel import LossLog
from fedst.data.clips import BatchStream, current_frame_masks
from fedst.experiment import ExperimentConfig
from fedst.methods.aggregation import FISHER_WEIGHT_KEY
from fedst.methods.base import Method, TrainingSite
from fedst.methods.head import head_input, is_head, with_private_head
from fedst.methods.reply_fields import ReplyField
from fedst.model.partition import Partition
from fedst.model.state import load_subset, state_subset
from fedst.schema.method_options import FedASOptions
from fedst.seeding import seed_everything

log = logging.getLogger(__name__)

Batch = tuple[torch.Tensor, torch.Tensor]
"""clips [B, T, 3, H, W], masks [B, H, W]."""

FISHER_SPREAD = 1e3
"""The server refuses a Fisher trace beyond 1000 x, or below 1/1000 x, the round's median: the
traces of one network on one task differ by the sites' data sizes and loss levels (a few x to
tens of x in our runs), while a site that claims 10^6 x the others would take the whole average
under Fisher weighting; 1000 x leaves honest spreads alone, and with the other K - 1 sites at the
median one site's weight is at most 1000 / (1000 + K - 1)."""

PROTOTYPE_DATA, ALIGN_DATA, FISHER_DATA = 1, 2, 3
"""Which of a round's extra batch streams (each seeded by seed, site, round and this number)."""


def pixel_features(
    model: nn.Module, clips: torch.Tensor, masks: torch.Tensor, indicator: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The base's per-pixel features [B, D, h, w] (the head's input) and the labels [B, h, w] of
    the same grid (masks resized by nearest neighbour)."""
    with head_input(model) as captured:
        model(clips, indicator)
    features = captured[-1]
    labels = F.interpolate(masks[:, None].float(), size=features.shape[2:], mode="nearest")
    return features, labels[:, 0].long()


def class_prototypes(
    model: nn.Module,
    batches: Iterable[Batch],
    indicator: torch.Tensor | None,
    num_classes: int,
    ignore_index: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Masked average pooling: prototypes [C, D] (mean feature of each class's pixels over all
    batches; zero for an absent class) and pixel counts [C]. Model in eval mode, no gradient."""
    model.eval()
    sums, counts = None, torch.zeros(num_classes, dtype=torch.float64)
    with torch.no_grad():
        for clips, masks in batches:
            features, labels = pixel_features(model, clips, masks, indicator)
            valid = labels != ignore_index  # [B, h, w]
            one_hot = F.one_hot(torch.where(valid, labels, 0), num_classes) * valid[..., None]
            one_hot = one_hot.to(torch.float64)  # [B, h, w, C]
            batch_sums = torch.einsum("bdhw,bhwc->cd", features.double(), one_hot)  # [C, D]
            sums = batch_sums if sums is None else sums + batch_sums
            counts += one_hot.sum(dim=(0, 1, 2)).cpu()
    if sums is None:
        raise ValueError("class_prototypes: no batch given")
    prototypes = sums / counts.to(sums.device).clamp(min=1)[:, None]
    return prototypes.float(), counts


def alignment_loss(
    features: torch.Tensor,
    labels: torch.Tensor,
    prototypes: torch.Tensor,
    counts: torch.Tensor,
    ignore_index: int,
) -> torch.Tensor:
    """sum_c mean_{pixels i of class c} mean_d (f_i - p_c)_d^2 over the classes c present in
    ``labels`` that have a prototype (counts[c] > 0); features [B, D, h, w], labels [B, h, w]."""
    known = counts.to(labels.device) > 0
    safe = torch.where(labels == ignore_index, 0, labels)
    valid = (labels != ignore_index) & known[safe]  # [B, h, w]
    squared = (features.permute(0, 2, 3, 1) - prototypes[safe]).pow(2).mean(dim=-1)  # [B, h, w]
    loss = features.sum() * 0.0
    for label in labels[valid].unique():
        loss = loss + squared[valid & (labels == label)].mean()
    return loss


def align_base(
    model: nn.Module,
    batches: Iterable[Batch],
    prototypes: torch.Tensor,
    counts: torch.Tensor,
    indicator: torch.Tensor | None,
    lr: float,
    ignore_index: int,
) -> list[float]:
    """One SGD step (lr ``lr``) on :func:`alignment_loss` per batch, over every base parameter
    (not the head); returns the losses before each step."""
    base = [p for name, p in model.named_parameters() if not is_head(name)]
    optimizer = torch.optim.SGD(base, lr=lr)
    model.train()
    losses = LossLog()  # on the device: one host copy at the end, not one per step
    for clips, masks in batches:
        features, labels = pixel_features(model, clips, masks, indicator)
        loss = alignment_loss(features, labels, prototypes, counts, ignore_index)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        losses.append(loss)
    optimizer.zero_grad(set_to_none=True)
    return losses.values()


def fisher_trace(
    model: nn.Module,
    batches: Iterable[Batch],
    indicator: torch.Tensor | None,
    ignore_index: int,
) -> tuple[float, int]:
    """(sum over batches of ||grad_theta NLL||^2 over every trainable parameter theta, batches
    used); NLL = mean over labelled pixels of -log softmax(logits)[label]. Eval mode; a batch with
    no labelled pixel is skipped. Leaves no gradient on the parameters."""
    model.eval()
    parameters = [p for p in model.parameters() if p.requires_grad]
    total, used = 0.0, 0
    for clips, masks in batches:
        masks = masks.long()
        if not (masks != ignore_index).any():
            continue
        logits = model(clips, indicator).float()  # [B, C, H, W]
        nll = F.cross_entropy(logits, masks, ignore_index=ignore_index)
        grads = torch.autograd.grad(nll, parameters, allow_unused=True)
        total += sum(float(g.double().pow(2).sum()) for g in grads if g is not None)
        used += 1
    return total, used


class FedAS(Method):
    """Head private; alignment of the received base before adoption; Fisher-trace weights."""

    Options = FedASOptions
    reply_scalars = (
        ReplyField(FISHER_WEIGHT_KEY, "float", low=0, low_open=True, median_factor=FISHER_SPREAD),
    )

    def __init__(self, cfg: ExperimentConfig) -> None:
        super().__init__(cfg)
        self.local_base: dict[str, torch.Tensor] | None = None
        """At a site: its base after its last local training (None before its first round)."""

    def partition(self, model: nn.Module) -> Partition:
        """The method's partition with the head always private."""
        return with_private_head(super().partition(model), model)

    # -- data of the site's extra passes ---------------------------------------------------------
    def _batches(
        self, site: TrainingSite, server_round: int, purpose: int, count: int
    ) -> Iterator[Batch]:
        """``count`` training batches from a stream of their own (seeded by seed, site, round and
        ``purpose``), so the site's training stream and its saved position are untouched."""
        seed = np.random.SeedSequence([self.cfg.seed, site.index, server_round, purpose])
        stream = BatchStream(
            site.data.train,
            batch_size=self.cfg.train.batch_size,
            seed=int(seed.generate_state(1)[0]),
            num_workers=self.cfg.train.num_workers,
            device=site.device,
            num_classes=self.cfg.network.num_classes,
        )
        try:
            for _ in range(count):
                clips, masks, _ = stream.next_batch()  # on site.device, normalised
                yield clips, current_frame_masks(masks)  # [B, H, W]: its passes' labels
        finally:
            stream.close()

    def _indicator(self, site: TrainingSite) -> torch.Tensor | None:
        return site.indicator.to(site.device) if site.indicator is not None else None

    # -- the site's round ------------------------------------------------------------------------
    def adopt(
        self, site: TrainingSite, received: dict[str, torch.Tensor], server_round: int
    ) -> None:
        """Align the received base to the local model's class prototypes, then keep it."""
        if self.local_base is None or self.options.align_iters == 0:
            log.info("site %s round %d: no local base yet, no alignment", site.name, server_round)
            super().adopt(site, received, server_round)
            return
        seed_everything(self.cfg.seed, site.index, server_round, ALIGN_DATA)
        num_classes, ignore = site.loss_fn.num_classes, site.loss_fn.ignore_index
        load_subset(site.model, self.local_base)  # the local model v_k of the last round
        prototypes, counts = class_prototypes(
            site.model,
            self._batches(site, server_round, PROTOTYPE_DATA, self.options.prototype_batches),
            self._indicator(site),
            num_classes,
            ignore,
        )
        super().adopt(site, received, server_round)
        losses = align_base(
            site.model,
            self._batches(site, server_round, ALIGN_DATA, self.options.align_iters),
            prototypes,
            counts,
            self._indicator(site),
            self.options.align_lr,
            ignore,
        )
        log.info(
            "site %s round %d: aligned the received base to %d class prototypes, loss %.4g -> %.4g",
            site.name,
            server_round,
            int((counts > 0).sum()),
            losses[0],
            losses[-1],
        )

    def site_state(self, site: TrainingSite) -> dict[str, torch.Tensor]:
        """The local base after training: the next round's prototypes come from it."""
        self.local_base = state_subset(site.model, site.partition.shared)
        return self.local_base

    def load_site_state(self, site: TrainingSite, state: dict[str, torch.Tensor]) -> None:
        self.local_base = dict(state) if state else None

    def reply_metrics(self, site: TrainingSite) -> dict[str, float]:
        """{"fisher-trace": F_k}, scaled from the measured batches to one epoch."""
        per_epoch = math.ceil(len(site.data.train) / self.cfg.train.batch_size)
        measured = min(self.options.fisher_batches, per_epoch)
        total, used = fisher_trace(
            site.model,
            self._batches(site, site.completed_round, FISHER_DATA, measured),
            self._indicator(site),
            site.loss_fn.ignore_index,
        )
        if used == 0:
            raise ValueError(
                f"site {site.name}: none of {measured} training batches has a labelled pixel; "
                f"the Fisher trace (FedAS's aggregation weight) is undefined. Raise "
                f"method.options.fisher_batches"
            )
        return {FISHER_WEIGHT_KEY: total * per_epoch / used}

    def describe(self) -> dict:
        return {**super().describe(), **dataclasses.asdict(self.options)}
