"""Evaluate one model on one site's test clips (Dice, IoU, HD95, ASSD via fedst.scoring.metrics).

Predictions come from the streaming path (:meth:`fedst.model.network.FedSTNet.stream`), video by
video in time order: every frame a test clip needs is encoded once and its temporal-stage features
are reused by later clips, instead of encoding all 4 frames of every clip. The clip frames are the
clip dataset's (:func:`fedst.data.clips.clip_frame_positions` at ``clip.interval_s``), so the
predictions equal ``model(clip)`` on each test clip (tests/test_infer.py).

Batched (:func:`predict_test_frames`): loader workers decode and resize the needed frames
(:class:`fedst.data.clips.FrameDataset`) and read each label once, at native resolution; they send
uint8 frames, normalised on the device; ``batch_size`` consecutive frames of a video share one
encoder pass (:meth:`fedst.model.network.StreamingState.step_frames`), under autocast at
``train.amp_dtype`` (:func:`fedst.accel.resolve_precision`; fp32 off CUDA).

On the device (:func:`evaluate_model`): the upsampling, the argmax and the per-class pixel counts
of Dice / IoU (:func:`fedst.scoring.overlap.overlap_counts`); the counts of up to
:data:`COUNT_FLUSH_FRAMES` frames reach the host in one copy. HD95 / ASSD (distance transforms,
on the host) are computed only when asked for (``distances=True``; ``train.distance_metrics_every``),
and only then does each class map come to the host.

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

from fedst.accel import resolve_precision
from fedst.data.clips import (
    ClipDataset,
    FrameDataset,
    FrameLoaders,
    clip_frame_positions,
    frame_loader,
    normalize_clips,
)
from fedst.model.network import FedSTNet
from fedst.progress import progress_bar
from fedst.scoring.metrics import SegmentationMeter, distance_metrics, merge_distances
from fedst.scoring.overlap import OverlapCounts, overlap_counts, overlap_scores

log = logging.getLogger(__name__)


METRICS_RECORD = "metrics"
"""Name of the MetricRecord of an evaluate reply that scores the party's own test split; the
split of another site ``S`` (a party scored on several sites, e.g. the upper bound's pool) is
scored in the record ``"metrics@S"``."""


COUNT_FLUSH_FRAMES = 256
"""Frames whose pixel counts (a few kB each) wait on the device before one copy to the host."""


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


@dataclass
class FramePrediction:
    """One test sample's prediction, as :func:`predict_test_frames` yields it."""

    sample_id: str
    frame: torch.Tensor
    """The current frame as the network saw it before normalisation: uint8 [3, H, W] (host)."""
    label: torch.Tensor
    """Its label as stored: uint8 [H0, W0] (native resolution, 255 = ignore; host)."""
    logits: torch.Tensor
    """[K, H, W] at the network's input size, on the model's device."""


def evaluation_plan(
    dataset: ClipDataset, max_frames: int | None, temporal: bool
) -> list[tuple[int, int, bool]]:
    """``(video_index, position, labelled)`` of every frame the first ``max_frames`` samples
    need, video by video in time order: the labelled frames and, with the temporal module, the
    earlier frames of their clips (each once)."""
    samples = dataset.samples[: len(dataset) if max_frames is None else max_frames]
    plan = []
    for video_index, group in groupby(samples, key=lambda sample: sample[0]):
        video = dataset.videos[video_index]
        labelled = {position for _, position in group}
        needed = set(labelled)
        if temporal:
            for position in labelled:
                needed.update(
                    clip_frame_positions(
                        video.times, position, dataset.clip_length, dataset.clip.interval_s
                    )
                )
        plan += [(video_index, position, position in labelled) for position in sorted(needed)]
    return plan


@torch.no_grad()
def predict_test_frames(
    model: FedSTNet,
    dataset: ClipDataset,
    indicator: torch.Tensor | None,
    device: torch.device,
    max_frames: int | None = None,
    batch_size: int = 1,
    num_workers: int | str = 0,
    amp_dtype: str = "none",
    loaders: FrameLoaders | None = None,
) -> Iterator[FramePrediction]:
    """Predictions of the first ``max_frames`` samples of ``dataset``, in dataset order, by
    streaming each video's needed frames (:func:`evaluation_plan`) in batches of up to
    ``batch_size`` consecutive frames of one video, loaded by ``num_workers`` workers (kept in
    ``loaders`` when given), the network under autocast at ``amp_dtype`` (``train.amp_dtype``;
    "none": fp32).

    Sparse labels (e.g. 1 fps labels in a 25 fps video) cost 4 encoder passes per label at most,
    dense labels 1.
    """
    if batch_size < 1:
        raise ValueError(f"evaluation batch_size must be >= 1, got {batch_size}")
    precision = resolve_precision(amp_dtype, device)
    model.eval()
    temporal = model.uses_temporal(dataset.clip_length)
    plan = evaluation_plan(dataset, max_frames, temporal)
    if loaders is None:
        loader = frame_loader(FrameDataset(dataset, plan), batch_size, num_workers)
    else:
        loader = loaders.loader(dataset, plan, batch_size, num_workers)
    state, current_video = None, None
    for frames, labels, indices in loader:  # uint8 [B, 3, H, W], B x (uint8 [H0, W0] | None)
        normalized = normalize_clips(frames.to(device, non_blocking=True))  # float [B, 3, H, W]
        start = 0
        while start < len(indices):  # one run of consecutive frames of one video at a time
            video_index = plan[indices[start]][0]
            end = start
            while end < len(indices) and plan[indices[end]][0] == video_index:
                end += 1
            if video_index != current_video:
                state = model.stream(
                    indicator, interval_s=dataset.clip.interval_s, use_temporal=temporal
                )
                current_video = video_index
            video = dataset.videos[video_index]
            run = [plan[i] for i in indices[start:end]]
            with precision.autocast():  # not around the yield: autocast is thread-global
                logits = state.step_frames(
                    normalized[start:end],
                    [video.times[position] for _, position, _ in run],
                    [labelled for _, _, labelled in run],
                )  # [M, K, H, W] of the labelled frames of the run
            labelled_rows = [start + j for j, (_, _, labelled) in enumerate(run) if labelled]
            for k, row in enumerate(labelled_rows):
                position = plan[indices[row]][1]
                yield FramePrediction(
                    sample_id=f"{dataset.site_name}/{video.video_id}/{position}",
                    frame=frames[row],
                    label=labels[row],
                    logits=logits[k],
                )
            start = end


@torch.no_grad()
def stream_test_clips(
    model: FedSTNet,
    dataset: ClipDataset,
    indicator: torch.Tensor | None,
    device: torch.device,
    max_frames: int | None = None,
) -> Iterator[tuple[torch.Tensor, torch.Tensor, str, torch.Tensor]]:
    """``(frame [3, H, W], mask [H, W], sample_id, logits [K, H, W])`` of the first ``max_frames``
    samples, frame by frame in this process: :func:`predict_test_frames` with the frame and the
    mask as ``dataset[i]`` gives them (normalised float; int64 at the network's input size)."""
    for prediction in predict_test_frames(model, dataset, indicator, device, max_frames):
        mask = torch.from_numpy(dataset.resize_label(prediction.label.numpy()).astype(np.int64))
        yield normalize_clips(prediction.frame), mask, prediction.sample_id, prediction.logits


@torch.no_grad()
def native_class_map(logits: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
    """logits [K, h, w] -> class map uint8 [H0, W0] = ``size`` on the logits' device: bilinear
    upsampling (align_corners=False), then argmax (K <= 256 classes)."""
    native = F.interpolate(
        logits[None].float(), size=size, mode="bilinear", align_corners=False
    )  # [1, K, h, w] -> [1, K, H0, W0]
    return native[0].argmax(0).to(torch.uint8)


def label_on_device(label: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host label map on ``device``; on CUDA through pinned memory, so the copy is queued
    without waiting for the device (a copy from pageable memory first syncs the stream)."""
    if device.type == "cuda":
        return label.pin_memory().to(device, non_blocking=True)
    return label.to(device)


class _DeviceScoring:
    """Feeds a :class:`SegmentationMeter` from pixel counts kept on the device: each frame adds
    its :class:`OverlapCounts` (and its distances, when computed); every
    :data:`COUNT_FLUSH_FRAMES` frames and at the end, one copy brings the counts to the host."""

    def __init__(self, meter: SegmentationMeter) -> None:
        self.meter = meter
        self._counts: list[OverlapCounts] = []
        self._ids: list[str] = []
        self._distances: list[dict[int, dict[str, float]]] = []

    def add(
        self,
        counts: OverlapCounts,
        sample_id: str,
        distances: dict[int, dict[str, float]] | None,
    ) -> None:
        """One frame's counts [1, C - 1, 3] and, when scored, its HD95 / ASSD per class."""
        self._counts.append(counts)
        self._ids.append(sample_id)
        if distances is not None:
            self._distances.append(distances)
        if len(self._counts) >= COUNT_FLUSH_FRAMES:
            self.flush()

    def flush(self) -> None:
        """Score the pending frames on the host and add them to the meter."""
        if not self._counts:
            return
        scores = overlap_scores(OverlapCounts.cat(self._counts), self._ids)
        if self._distances:
            scores = merge_distances(scores, self._distances)
        self.meter.add_scores(scores, self._ids)
        self._counts, self._ids, self._distances = [], [], []


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
    batch_size: int = 1,
    num_workers: int | str = 0,
    distances: bool = True,
    amp_dtype: str = "none",
    loaders: FrameLoaders | None = None,
) -> EvaluationResult:
    """Predict every test clip's current frame (:func:`predict_test_frames`: ``batch_size``
    frames per pass, ``num_workers`` loader workers, autocast at ``amp_dtype``; callers pass
    ``train.evaluation_options()``) and score it against its label at native resolution: the
    logits upsampled to the label's size, the argmax and the pixel counts of Dice / IoU on the
    device (:func:`native_class_map`, :func:`fedst.scoring.overlap.overlap_counts`), only the counts
    copied to the host. ``distances=False``: Dice / IoU only (HD95 / ASSD ``None``); with
    distances, each class map is also copied to the host for its distance transforms.
    ``loaders``: a site's kept evaluation loaders (their workers persist between evaluations;
    None: a loader of this call only).

    The class count is the network's (its logits' channels). For a binary site (GraSP) every
    predicted part class counts as instrument (paper Sec. IV-D1).
    """
    scoring: _DeviceScoring | None = None
    examples: list[tuple[str, np.ndarray, np.ndarray, np.ndarray]] = []
    ind = indicator.to(device) if indicator is not None else None
    total = len(dataset) if max_frames is None else min(max_frames, len(dataset))
    predictions = predict_test_frames(
        model, dataset, ind, device, max_frames, batch_size, num_workers, amp_dtype, loaders
    )
    for prediction in progress_bar(
        predictions, total=total, desc=f"eval {dataset.site_name}", enabled=progress, leave=False
    ):
        num_classes = prediction.logits.shape[0]
        if scoring is None:
            scoring = _DeviceScoring(
                SegmentationMeter(
                    num_classes=num_classes, binary_target=dataset.binary, distances=distances
                )
            )
        label = prediction.label  # uint8 [H0, W0], host
        pred = native_class_map(prediction.logits, tuple(label.shape))  # uint8 [H0, W0], device
        counts = overlap_counts(
            pred[None],
            label_on_device(label, pred.device)[None],
            num_classes,
            binary_target=dataset.binary,
        )
        frame_distances = None
        if distances:
            frame_distances = distance_metrics(
                pred.cpu()[None], label[None], num_classes, binary_target=dataset.binary
            )[0]
        scoring.add(counts, prediction.sample_id, frame_distances)
        if len(examples) < keep_examples:
            rgb = prediction.frame.permute(1, 2, 0).numpy()  # [H, W, 3] uint8
            mask = dataset.resize_label(label.numpy()).astype(np.int64)  # [H, W]
            small = prediction.logits.argmax(0).cpu().numpy()  # [H, W], network input size
            examples.append((prediction.sample_id, rgb, mask, small))
    assert scoring is not None  # a ClipDataset has at least one sample
    scoring.flush()
    return EvaluationResult(
        summary=scoring.meter.summary(), examples=examples, binary=dataset.binary
    )
