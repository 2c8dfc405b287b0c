"""Segmentation loss of FedST (paper Eq. 9): L_seg = L_CE + lambda1 * L_Dice.

Dice convention (stated once, here): soft multi-class Dice on softmax probabilities against one-hot
targets, averaged over **all** ``num_classes`` classes including background (0); sums run over
the whole batch and every non-ignored pixel; additive smoothing ``smooth = 1.0`` in numerator and
denominator, so a class absent from both target and prediction scores ~1 (loss ~0) rather than
0/0. Pixels equal to ``ignore_index`` contribute to neither term. A batch whose pixels are all
ignored gives a zero loss that still carries the graph (no NaN), computed without a branch (no
device-to-host sync).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from fedst.data.base import IGNORE_INDEX, NUM_CLASSES, check_label_values

__all__ = ["SegmentationLoss", "clip_frame_loss", "soft_dice_loss"]

DICE_SMOOTH = 1.0


def soft_dice_loss(
    logits: torch.Tensor,
    target: torch.Tensor,
    ignore_index: int = IGNORE_INDEX,
    smooth: float = DICE_SMOOTH,
) -> torch.Tensor:
    """1 - mean_c Dice_c of softmax(logits) [B, C, H, W] against labels [B, H, W]; scalar.
    C (the class count) is the logits' channel count."""
    if logits.dim() != 4 or target.shape != (logits.shape[0], *logits.shape[2:]):
        raise ValueError(
            f"soft_dice_loss: logits must be [B, C, H, W] and target [B, H, W]; got "
            f"{tuple(logits.shape)} and {tuple(target.shape)}"
        )
    num_classes = logits.shape[1]
    valid = (target != ignore_index).unsqueeze(1)  # [B, 1, H, W]
    probs = logits.softmax(dim=1) * valid  # [B, C, H, W]
    classes = torch.arange(num_classes, device=target.device).view(1, num_classes, 1, 1)
    one_hot = (target.unsqueeze(1) == classes).to(probs.dtype) * valid  # [B, C, H, W]
    dims = (0, 2, 3)
    intersection = (probs * one_hot).sum(dims)  # [C]
    denominator = probs.sum(dims) + one_hot.sum(dims)  # [C]
    dice = (2.0 * intersection + smooth) / (denominator + smooth)
    return 1.0 - dice.mean()


class SegmentationLoss(nn.Module):
    """L_seg = CE + lambda_dice * Dice (Eq. 9); logits [B, C, H, W], target [B, H, W] -> scalar.

    ``num_classes`` is the network's (``network.num_classes``); logits with another channel
    count are an error. With ``check_labels`` (default) labels are checked against it when they
    are on the CPU; on a GPU the check would make the host wait for the device every step, so
    there they are trusted: data validation checks every label file's values when a run starts
    (fedst/data/validation.py) and :class:`fedst.data.clips.BatchStream` checks each batch in its
    loader workers when given ``num_classes``. A training step whose batches come from such a
    stream passes ``check_labels=False`` (Method.segmentation_loss): the check is then a host
    read per step on the CPU and a graph break under ``torch.compile``. No other host sync
    either: an all-ignored batch needs no branch.
    """

    def __init__(
        self,
        lambda_dice: float = 0.3,
        num_classes: int = NUM_CLASSES,
        ignore_index: int = IGNORE_INDEX,
        check_labels: bool = True,
    ):
        super().__init__()
        if lambda_dice < 0:
            raise ValueError(f"SegmentationLoss: lambda_dice must be >= 0, got {lambda_dice}")
        if num_classes < 1:
            raise ValueError(f"SegmentationLoss: num_classes must be >= 1, got {num_classes}")
        self.lambda_dice = lambda_dice
        self.num_classes = num_classes
        self.ignore_index = ignore_index
        self.check_labels = check_labels
        """Check CPU labels in :meth:`forward` (False: the batches were checked at the loader)."""

    def forward(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        if logits.shape[1] != self.num_classes:
            raise ValueError(
                f"SegmentationLoss: logits have {logits.shape[1]} channels, expected "
                f"num_classes={self.num_classes}"
            )
        if self.check_labels and target.device.type == "cpu":
            check_label_values(target, self.num_classes, self.ignore_index, "SegmentationLoss")
        target = target.long()
        valid = target != self.ignore_index  # [B, H, W]
        # mean CE over valid pixels, 0 (with the graph) when every pixel is ignored: no branch
        ce_sum = F.cross_entropy(logits, target, ignore_index=self.ignore_index, reduction="sum")
        ce = ce_sum / valid.sum().clamp(min=1)
        dice = soft_dice_loss(logits, target, self.ignore_index)  # 0 when all ignored
        return ce + self.lambda_dice * dice


def clip_frame_loss(
    loss_fn: SegmentationLoss, frame_logits: torch.Tensor, frame_labels: torch.Tensor
) -> torch.Tensor:
    """CFFM's supervision of every clip frame, before its weight (``train.clip_frame_loss_weight``):
    ``loss_fn`` (L_seg, Eq. 9) of every clip frame's own prediction frame_logits [B, T, K, H, W]
    against its label frame_labels [B, T, H, W] (255: unlabelled), the B x T frames as one batch:
    CE averaged over batch x frames x labelled pixels, Dice over their pooled sums.

    The same loss as on the temporal prediction, as CFFM (its ``0.5 * loss_decode(per-frame) +
    loss_decode(temporal)``, one loss on both terms); CFFM's loss is CE alone, ours L_seg. Unlike
    mmseg's CE, whose mean counts ignored pixels in its denominator, CE here is averaged over
    labelled pixels only, so an unlabelled clip frame (all 255) changes nothing."""
    if frame_logits.dim() != 5 or frame_labels.shape != (
        *frame_logits.shape[:2],
        *frame_logits.shape[3:],
    ):
        raise ValueError(
            f"clip_frame_loss: frame_logits must be [B, T, K, H, W] and frame_labels [B, T, H, W]; "
            f"got {tuple(frame_logits.shape)} and {tuple(frame_labels.shape)}"
        )
    return loss_fn(frame_logits.flatten(0, 1), frame_labels.flatten(0, 1))
