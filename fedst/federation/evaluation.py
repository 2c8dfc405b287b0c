"""Evaluate one model on one site's test clips (Dice, IoU, HD95, ASSD via fedst.metrics).

Predictions come from the streaming path (:meth:`fedst.model.network.FedSTNet.stream`), video by
video in time order: every frame a test clip needs is encoded once and its temporal-stage features
are reused by later clips, instead of encoding all 4 frames of every clip. The clip frames are the
clip dataset's (:func:`fedst.data.clips.clip_frame_positions` at ``clip.interval_s``), so the
predictions equal ``model(clip)`` on each test clip (tests/test_infer.py).

Scores are measured at each frame's **native label resolution**, as in the paper: the logits
[C, h, w] at the network's input size are upsampled bilinearly to the label's size [H0, W0]
(the frame was resized to the input without cropping, so the two grids cover the same image),
then the argmax is compared with the label as stored (:func:`score_at_native_resolution`).
HD95 and ASSD are therefore in native pixels, comparable with the paper's tables.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass, field
from itertools import groupby
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from fedst.data.clips import IMAGENET_MEAN, IMAGENET_STD, ClipDataset, clip_frame_positions
from fedst.metrics import SegmentationMeter
from fedst.model.network import FedSTNet
from fedst.progress import progress_bar

log = logging.getLogger(__name__)


METRICS_RECORD = "metrics"
"""Name of the MetricRecord of an evaluate reply that scores the party's own test split; the
split of another site ``S`` (a party scored on several sites, e.g. the upper bound's pool) is
scored in the record ``"metrics@S"``."""


def metrics_record(scored: str, party: str) -> str:
    """The record name of ``party``'s scores on ``scored``'s test split in an evaluate reply."""
    return METRICS_RECORD if scored == party else f"{METRICS_RECORD}@{scored}"


def scored_site(record: str, party: str) -> str | None:
    """The site whose test split the record ``record`` of ``party``'s reply scores (None: the
    record holds no scores). Inverse of :func:`metrics_record`."""
    if record == METRICS_RECORD:
        return party
    prefix = f"{METRICS_RECORD}@"
    return record[len(prefix) :] if record.startswith(prefix) else None


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
def stream_test_clips(
    model: FedSTNet,
    dataset: ClipDataset,
    indicator: torch.Tensor | None,
    device: torch.device,
    max_frames: int | None = None,
) -> Iterator[tuple[torch.Tensor, torch.Tensor, str, torch.Tensor]]:
    """``(frame [3, H, W], mask [H, W], sample_id, logits [K, H, W])`` of the first ``max_frames``
    samples of ``dataset``, in dataset order, predicted by streaming each video's needed frames.

    The needed frames of a video are the union of its samples' clip frames, so sparse labels
    (e.g. 1 fps labels in a 25 fps video) cost 4 encoder passes per label at most, dense labels 1.
    """
    model.eval()
    samples = dataset.samples[: len(dataset) if max_frames is None else max_frames]
    temporal = model.uses_temporal(dataset.clip_length)
    for video_index, group in groupby(samples, key=lambda sample: sample[0]):
        video = dataset.videos[video_index]
        labelled = [position for _, position in group]
        needed = set(labelled)
        if temporal:
            for position in labelled:
                needed.update(
                    clip_frame_positions(
                        video.times, position, dataset.clip_length, dataset.clip.interval_s
                    )
                )
        state = model.stream(indicator, interval_s=dataset.clip.interval_s, use_temporal=temporal)
        labelled_set = set(labelled)
        for position in sorted(needed):
            frame, frame_size = dataset.read_frame(video, position)  # [3, H, W]
            predict = position in labelled_set
            logits = state.step(frame[None].to(device), video.times[position], predict=predict)
            if logits is not None:
                mask = dataset.read_mask(video, position, frame_size)  # [H, W]
                sample_id = f"{dataset.site_name}/{video.video_id}/{position}"
                yield frame, mask, sample_id, logits[0]


@torch.no_grad()
def evaluate_model(
    model: FedSTNet,
    dataset: ClipDataset,
    indicator: torch.Tensor | None,
    device: torch.device,
    *,
    max_frames: int | None = None,
    keep_examples: int = 0,
    progress: bool = False,
) -> EvaluationResult:
    """Predict every test clip's current frame (streaming, see the module docstring) and score it
    against its label at native resolution (:func:`score_at_native_resolution`).

    For a binary site (GraSP) every predicted part class counts as instrument (paper Sec. IV-D1).
    """
    meter = SegmentationMeter(binary_target=dataset.binary)
    examples: list[tuple[str, np.ndarray, np.ndarray, np.ndarray]] = []
    ind = indicator.to(device) if indicator is not None else None
    total = len(dataset) if max_frames is None else min(max_frames, len(dataset))
    for frame, mask, sample_id, logits in progress_bar(
        stream_test_clips(model, dataset, ind, device, max_frames),
        total=total,
        desc=f"eval {dataset.site_name}",
        enabled=progress,
        leave=False,
    ):
        score_at_native_resolution(meter, logits[None], [sample_id], dataset)
        if len(examples) < keep_examples:
            pred = logits.argmax(0).cpu()  # [H, W], network input size (overlays)
            examples.append((sample_id, denormalize(frame), mask.numpy(), pred.numpy()))
    return EvaluationResult(summary=meter.summary(), examples=examples, binary=dataset.binary)
