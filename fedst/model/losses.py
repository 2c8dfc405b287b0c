"""Segmentation loss of FedST (paper Eq. 9): L_seg = L_CE + lambda1 * L_Dice.

Dice convention (stated once, here): soft multi-class Dice on softmax probabilities against one-hot
targets, averaged over **all** ``num_classes`` classes including background (0); sums run over
the whole batch and every non-ignored pixel; additive smoothing ``smooth = 1.0`` in numerator and
denominator, so a class absent from both target and prediction scores ~1 (loss ~0) rather than
0/0. Pixels equal to ``ignore_index`` contribute to neither term. A batch whose pixels are all
ignored gives a zero loss that still carries the graph (no NaN).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["SegmentationLoss", "soft_dice_loss"]

DICE_SMOOTH = 1.0


def soft_dice_loss(
    logits: torch.Tensor,
    target: torch.Tensor,
    ignore_index: int = 255,
    smooth: float = DICE_SMOOTH,
) -> torch.Tensor:
    """1 - mean_c Dice_c of softmax(logits) [B, C, H, W] against labels [B, H, W]; scalar."""
    if logits.dim() != 4 or target.shape != (logits.shape[0], *logits.shape[2:]):
        raise ValueError(
            f"soft_dice_loss: logits must be [B, C, H, W] and target [B, H, W]; got "
            f"{tuple(logits.shape)} and {tuple(target.shape)}"
        )
    num_classes = logits.shape[1]
    valid = (target != ignore_index).unsqueeze(1)  # [B, 1, H, W]
    probs = logits.softmax(dim=1) * valid  # [B, C, H, W]
    safe_target = torch.where(valid.squeeze(1), target, torch.zeros_like(target))
    one_hot = F.one_hot(safe_target.long(), num_classes).permute(0, 3, 1, 2)  # [B, C, H, W]
    one_hot = one_hot.to(probs.dtype) * valid
    dims = (0, 2, 3)
    intersection = (probs * one_hot).sum(dims)  # [C]
    denominator = probs.sum(dims) + one_hot.sum(dims)  # [C]
    dice = (2.0 * intersection + smooth) / (denominator + smooth)
    return 1.0 - dice.mean()


class SegmentationLoss(nn.Module):
    """L_seg = CE + lambda_dice * Dice (Eq. 9); logits [B, C, H, W], target [B, H, W] -> scalar."""

    def __init__(self, lambda_dice: float = 0.3, num_classes: int = 4, ignore_index: int = 255):
        super().__init__()
        if lambda_dice < 0:
            raise ValueError(f"SegmentationLoss: lambda_dice must be >= 0, got {lambda_dice}")
        self.lambda_dice = lambda_dice
        self.num_classes = num_classes
        self.ignore_index = ignore_index

    def forward(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        if logits.shape[1] != self.num_classes:
            raise ValueError(
                f"SegmentationLoss: logits have {logits.shape[1]} channels, expected "
                f"num_classes={self.num_classes}"
            )
        target = target.long()
        valid = target != self.ignore_index
        bad = target[valid]
        if bad.numel() and (bad.min() < 0 or bad.max() >= self.num_classes):
            raise ValueError(
                f"SegmentationLoss: labels must be in [0, {self.num_classes}) or "
                f"{self.ignore_index}; got values in [{int(bad.min())}, {int(bad.max())}]"
            )
        if not valid.any():
            return logits.sum() * 0.0
        ce = F.cross_entropy(logits, target, ignore_index=self.ignore_index)
        dice = soft_dice_loss(logits, target, self.ignore_index)
        return ce + self.lambda_dice * dice
