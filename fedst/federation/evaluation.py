"""Evaluate one model on one site's test clips (Dice, IoU, HD95, ASSD via fedst.metrics)."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader, Subset
from tqdm import tqdm

from fedst.data.clips import IMAGENET_MEAN, IMAGENET_STD, ClipDataset
from fedst.metrics import SegmentationMeter

log = logging.getLogger(__name__)


@dataclass
class EvaluationResult:
    summary: dict[str, Any]
    """dice / iou (%), hd95 / assd (px), per_class, num_frames."""
    examples: list[tuple[str, np.ndarray, np.ndarray, np.ndarray]] = field(default_factory=list)
    """(sample id, RGB uint8 [H, W, 3], ground truth [H, W], prediction [H, W]) for overlays."""
    binary: bool = False
    """The site's labels are binary (instrument vs background)."""


def denormalize(frame: torch.Tensor) -> np.ndarray:
    """[3, H, W] normalised float -> RGB uint8 [H, W, 3]."""
    mean = torch.tensor(IMAGENET_MEAN).view(3, 1, 1)
    std = torch.tensor(IMAGENET_STD).view(3, 1, 1)
    rgb = (frame.cpu() * std + mean).clamp(0, 1) * 255
    return rgb.permute(1, 2, 0).round().to(torch.uint8).numpy()


@torch.no_grad()
def evaluate_model(
    model: nn.Module,
    dataset: ClipDataset,
    indicator: torch.Tensor | None,
    device: torch.device,
    *,
    max_frames: int | None = None,
    batch_size: int = 4,
    keep_examples: int = 0,
    progress: bool = False,
) -> EvaluationResult:
    """Predict every test clip's current frame and score it against its label.

    For a binary site (GraSP) every predicted part class counts as instrument (paper Sec. IV-D1).
    """
    model.eval()
    data = dataset if max_frames is None else Subset(dataset, range(min(max_frames, len(dataset))))
    loader = DataLoader(data, batch_size=batch_size, shuffle=False, num_workers=0)
    meter = SegmentationMeter(binary_target=dataset.binary)
    examples: list[tuple[str, np.ndarray, np.ndarray, np.ndarray]] = []
    ind = indicator.to(device) if indicator is not None else None
    for clips, masks, ids in tqdm(
        loader, desc=f"eval {dataset.site_name}", disable=not progress, leave=False
    ):
        logits = model(clips.to(device), ind)  # [B, C, H, W]
        preds = logits.argmax(1).cpu()  # [B, H, W]
        meter.update(preds, masks, list(ids))
        for i in range(len(ids)):
            if len(examples) < keep_examples:
                examples.append(
                    (ids[i], denormalize(clips[i, -1]), masks[i].numpy(), preds[i].numpy())
                )
    return EvaluationResult(summary=meter.summary(), examples=examples, binary=dataset.binary)
