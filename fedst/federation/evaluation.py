"""Evaluate one model on one site's test clips (Dice, IoU, HD95, ASSD via fedst.metrics).

Scores are measured at each frame's **native label resolution**, as in the paper: the logits
[C, h, w] at the network's input size are upsampled bilinearly to the label's size [H0, W0]
(the frame was resized to the input without cropping, so the two grids cover the same image),
then the argmax is compared with the label as stored (:func:`score_at_native_resolution`).
HD95 and ASSD are therefore in native pixels, comparable with the paper's tables.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Subset

from fedst.data.clips import IMAGENET_MEAN, IMAGENET_STD, ClipDataset
from fedst.metrics import SegmentationMeter
from fedst.progress import progress_bar

log = logging.getLogger(__name__)


@dataclass
class EvaluationResult:
    summary: dict[str, Any]
    """dice / iou (%), hd95 / assd (pixels at native label resolution), per_class, num_frames."""
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
def score_at_native_resolution(
    meter: SegmentationMeter, logits: torch.Tensor, sample_ids: list[str], dataset: ClipDataset
) -> None:
    """Score logits [B, C, h, w] against each frame's native label [H0, W0].

    Per frame: bilinear upsampling of the logits to [H0, W0] (align_corners=False), argmax,
    then ``meter.update`` with the label as stored (``dataset.native_label``).
    """
    for frame_logits, sample_id in zip(logits, sample_ids, strict=True):
        label = torch.from_numpy(dataset.native_label(sample_id).astype(np.int64))  # [H0, W0]
        native = F.interpolate(
            frame_logits[None].float(),
            size=tuple(label.shape),
            mode="bilinear",
            align_corners=False,
        )  # [1, C, h, w] -> [1, C, H0, W0]
        meter.update(native.argmax(1).cpu(), label[None], [sample_id])


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
    """Predict every test clip's current frame and score it against its label at native
    resolution (:func:`score_at_native_resolution`).

    For a binary site (GraSP) every predicted part class counts as instrument (paper Sec. IV-D1).
    """
    model.eval()
    data = dataset if max_frames is None else Subset(dataset, range(min(max_frames, len(dataset))))
    loader = DataLoader(data, batch_size=batch_size, shuffle=False, num_workers=0)
    meter = SegmentationMeter(binary_target=dataset.binary)
    examples: list[tuple[str, np.ndarray, np.ndarray, np.ndarray]] = []
    ind = indicator.to(device) if indicator is not None else None
    for clips, masks, ids in progress_bar(
        loader, desc=f"eval {dataset.site_name}", enabled=progress, leave=False
    ):
        logits = model(clips.to(device), ind)  # [B, C, H, W]
        preds = logits.argmax(1).cpu()  # [B, H, W], network input size (overlays)
        score_at_native_resolution(meter, logits, list(ids), dataset)
        for i in range(len(ids)):
            if len(examples) < keep_examples:
                examples.append(
                    (ids[i], denormalize(clips[i, -1]), masks[i].numpy(), preds[i].numpy())
                )
    return EvaluationResult(summary=meter.summary(), examples=examples, binary=dataset.binary)
