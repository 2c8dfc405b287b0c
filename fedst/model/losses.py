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

__all__ = ["SegmentationLoss", "soft_dice_loss"]

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
