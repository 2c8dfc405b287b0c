"""Segmentation metrics: Dice, IoU, HD95 and ASSD per foreground class and per frame.

The paper (Sec. IV-A2) reports Dice (%), IoU (%), HD95 (pixels) and ASSD (pixels) for the part
classes shaft / wrist / jaw. A functional core (:func:`batch_metrics`, :func:`frame_metrics`) holds
the maths once; :class:`SegmentationMeter` accumulates frames and delegates to it.

What runs where:

* **Dice / IoU** come from per-class pixel counts (TP, FP, FN; fedst/scoring/overlap.py):
  :func:`overlap_counts` histograms the (label, prediction) value pairs of a batch of maps with
  torch ops on the maps' own device (the GPU in an evaluation; no host sync on CUDA) and keeps
  only int64 counts there;
  :func:`overlap_scores` copies those counts to the host once and turns them into scores. Value
  checks ride on the same histogram (an out-of-range class or label is an error when the counts
  reach the host). :func:`reference_batch_metrics` keeps the former path (one-hot maps scored by
  MONAI's ``compute_dice`` / ``compute_iou`` on the host) as the reference that the tests and
  ``bench/scoring.py`` compare with; the two agree to float rounding.
* **HD95 / ASSD** need distance transforms of the class maps (:func:`distance_metrics`): they run
  on the host with MONAI, only when asked for (``distances=True``; in training
  ``train.distance_metrics_every``, which paper.yaml sets to the last round only), and only then do
  the class maps leave the device.

Conventions (the paper does not state them; these are ours):

* **Ignore pixels** (``ignore_index``, 255) are set to background in both the prediction and the
  ground truth before any metric, so they count neither as true, false-positive nor false-negative
  pixels of a foreground class and carry no surface.
* **Absent in both**: a class that is in neither the prediction nor the ground truth of a frame is
  *skipped* for that frame (it does not enter any mean). Scoring it as Dice = 1 inflates rare
  classes (a pitfall seen in public releases).
* **One-sided**: a class present in the ground truth but not predicted, or predicted but absent
  from the ground truth, gets Dice = IoU = 0 and HD95 = ASSD = the image diagonal
  ``sqrt(H^2 + W^2)`` in pixels (the largest distance possible in the frame; MONAI would give inf).
* **Binary targets** (GraSP): every predicted part class counts as instrument; ground-truth part
  labels are merged the same way, and the only class scored is 1 ("instrument").
* **Distances**: surfaces are MONAI's mask edges (mask XOR its binary erosion), Euclidean distance
  in pixels between edge pixels. HD95 = max over the two directions of the 95th percentile of the
  directed edge distances (``compute_hausdorff_distance(percentile=95)``); ASSD = mean of the
  distances of both directions pooled (``compute_average_surface_distance(symmetric=True)``).
  For speed the edges and distances of a class are computed once by MONAI's
  ``get_edge_surface_distance`` and reduced both ways; the tests check equality with the two
  public MONAI functions.
* **Overlap**: Dice = 2 TP / (2 TP + FP + FN), IoU = TP / (TP + FP + FN) over the frame's pixels
  that are not ignored (MONAI's definitions, computed from exact integer counts).
* **Units**: :func:`frame_metrics` returns Dice / IoU as fractions in [0, 1]; the meter's
  ``summary()`` and ``per_frame()`` report them in percent. Distances are always in pixels of the
  maps given; fedst.scoring.evaluation passes maps at the native label resolution.
* **Averaging** (``SegmentationMeter.summary``): per class, the mean over the frames where that
  class was scored; then the mean over the classes scored at least once. Averaging per class first
  keeps the small, rare jaw class as heavy as the shaft, and skipping frames where a class is
  absent keeps a frame with no jaw from counting as a perfect or as a failed jaw prediction.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence

import numpy as np
import torch
import torch.nn.functional as F
from monai.metrics import compute_dice, compute_iou
from monai.metrics.utils import get_edge_surface_distance

from fedst.data.base import CLASS_NAMES, IGNORE_INDEX, NUM_CLASSES, check_label_values
from fedst.scoring.challenge import CHALLENGE_METRIC_NAMES, challenge_summary
from fedst.scoring.overlap import (
    GT_PRESENT,
    FrameScores,
    as_class_map,
    check_map_pair,
    overlap_counts,
    overlap_scores,
)

__all__ = [
    "BINARY_CLASS_NAMES",
    "CHALLENGE_METRIC_NAMES",
    "METRIC_NAMES",
    "SUMMARY_METRIC_NAMES",
    "SegmentationMeter",
    "batch_metrics",
    "distance_metrics",
    "frame_metrics",
    "merge_distances",
    "reference_batch_metrics",
]

METRIC_NAMES: tuple[str, ...] = ("dice", "iou", "hd95", "assd")
SUMMARY_METRIC_NAMES: tuple[str, ...] = METRIC_NAMES + CHALLENGE_METRIC_NAMES
"""The overall values of a summary: the paper's four, then the EndoVis challenge IoUs (%)."""
OVERLAP_METRICS: tuple[str, ...] = ("dice", "iou")
BINARY_CLASS_NAMES: tuple[str, ...] = ("background", "instrument")
HD_PERCENTILE = 95.0


def _as_long_tensor(x: torch.Tensor | np.ndarray, name: str) -> torch.Tensor:
    """An integer class map as a CPU int64 tensor; float maps (logits, probabilities) are errors."""
    return as_class_map(x, name).to(device="cpu", dtype=torch.long)


def _prepare(
    pred: torch.Tensor | np.ndarray,
    target: torch.Tensor | np.ndarray,
    num_classes: int,
    ignore_index: int,
    binary_target: bool,
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Validate [B, H, W] maps; return (pred, target) with ignore -> 0 and the scored class count.

    With ``binary_target`` every class >= 1 becomes 1 in both maps and the class count is 2.
    """
    if num_classes < 2:
        raise ValueError(f"num_classes must be >= 2 (background + foreground), got {num_classes}")
    pred = _as_long_tensor(pred, "pred")
    target = _as_long_tensor(target, "target")
    check_map_pair(pred, target)
    bad_pred = pred[(pred < 0) | (pred >= num_classes)]
    if bad_pred.numel():
        raise ValueError(
            f"pred holds class value(s) {sorted(set(bad_pred.unique().tolist()))[:5]} outside "
            f"0..{num_classes - 1}; pass the argmax class map and the model's num_classes"
        )
    check_label_values(target, num_classes, ignore_index, "target")
    ignored = target == ignore_index
    target = target.masked_fill(ignored, 0)
    pred = pred.masked_fill(ignored, 0)
    if binary_target:
        return (pred > 0).long(), (target > 0).long(), 2
    return pred, target, num_classes


def _directed_hd(distances: torch.Tensor) -> float:
    """95th percentile of one direction's edge distances (linear interpolation, as MONAI)."""
    return float(torch.quantile(distances.double(), HD_PERCENTILE / 100.0))


def _surface_distances(pred_mask: torch.Tensor, target_mask: torch.Tensor) -> tuple[float, float]:
    """(HD95, ASSD) in pixels between two non-empty boolean masks [H, W]."""
    with warnings.catch_warnings():
        # MONAI 1.6 passes its own deprecated `always_return_as_numpy` argument internally.
        warnings.filterwarnings(
            "ignore", message=".*always_return_as_numpy.*", category=FutureWarning
        )
        _, distances, _ = get_edge_surface_distance(pred_mask, target_mask, symmetric=True)
    hd95 = max(_directed_hd(d) for d in distances)
    assd = float(torch.cat(distances).double().mean())
    return hd95, assd


def reference_batch_metrics(
    pred: torch.Tensor | np.ndarray,
    target: torch.Tensor | np.ndarray,
    num_classes: int = NUM_CLASSES,
    ignore_index: int = IGNORE_INDEX,
    binary_target: bool = False,
    distances: bool = True,
) -> list[FrameScores]:
    """:func:`batch_metrics` as it was computed before the pixel counts, kept as the reference
    implementation (tests/test_metrics.py, bench/scoring.py): maps copied to the host as int64,
    one-hot encoded and scored by MONAI's ``compute_dice`` / ``compute_iou``. Same arguments,
    conventions and results (to float rounding); about 20 times slower at 1080p.
    """
    pred, target, scored_classes = _prepare(pred, target, num_classes, ignore_index, binary_target)
    height, width = pred.shape[-2:]
    diagonal = math.hypot(height, width)
    pred_onehot = (
        F.one_hot(pred, scored_classes).permute(0, 3, 1, 2).float()
    )  # (B,H,W) -> (B,C,H,W)
    target_onehot = F.one_hot(target, scored_classes).permute(0, 3, 1, 2).float()
    dice = compute_dice(pred_onehot, target_onehot, include_background=False, ignore_empty=False)
    iou = compute_iou(pred_onehot, target_onehot, include_background=False, ignore_empty=False)
    pred_present = pred_onehot[:, 1:].flatten(2).any(dim=2)  # (B, C-1)
    target_present = target_onehot[:, 1:].flatten(2).any(dim=2)

    frames: list[FrameScores] = []
    for b in range(pred.shape[0]):
        scores: FrameScores = {}
        for c in range(1, scored_classes):
            in_pred, in_target = bool(pred_present[b, c - 1]), bool(target_present[b, c - 1])
            if not (in_pred or in_target):
                continue
            scores[c] = {
                "dice": float(dice[b, c - 1]),
                "iou": float(iou[b, c - 1]),
                GT_PRESENT: float(in_target),
            }
            if not distances:
                continue
            if in_pred and in_target:
                hd95, assd = _surface_distances(pred[b] == c, target[b] == c)
            else:
                hd95 = assd = diagonal
            scores[c].update(hd95=hd95, assd=assd)
        frames.append(scores)
    return frames


def distance_metrics(
    pred: torch.Tensor | np.ndarray,
    target: torch.Tensor | np.ndarray,
    num_classes: int = NUM_CLASSES,
    ignore_index: int = IGNORE_INDEX,
    binary_target: bool = False,
) -> list[dict[int, dict[str, float]]]:
    """Per frame, per scored class present in either map, {"hd95", "assd"} in pixels, on the host.

    pred / target as :func:`batch_metrics` (copied to the host as int64). A class present in one
    map only gets the image diagonal; classes absent from both are left out, as in
    :func:`overlap_scores`, so the two dicts of a frame have the same keys.
    """
    pred, target, scored_classes = _prepare(pred, target, num_classes, ignore_index, binary_target)
    height, width = pred.shape[-2:]
    diagonal = math.hypot(height, width)
    frames: list[dict[int, dict[str, float]]] = []
    for b in range(pred.shape[0]):
        pred_present = torch.bincount(pred[b].flatten(), minlength=scored_classes) > 0
        target_present = torch.bincount(target[b].flatten(), minlength=scored_classes) > 0
        scores: dict[int, dict[str, float]] = {}
        for c in range(1, scored_classes):
            in_pred, in_target = bool(pred_present[c]), bool(target_present[c])
            if in_pred and in_target:
                hd95, assd = _surface_distances(pred[b] == c, target[b] == c)
            elif in_pred or in_target:
                hd95 = assd = diagonal
            else:
                continue
            scores[c] = {"hd95": hd95, "assd": assd}
        frames.append(scores)
    return frames


def merge_distances(
    overlap: Sequence[FrameScores], distances: Sequence[dict[int, dict[str, float]]]
) -> list[FrameScores]:
    """Each frame's overlap scores with its distances added (both from the same maps)."""
    merged: list[FrameScores] = []
    for scores, frame_distances in zip(overlap, distances, strict=True):
        if scores.keys() != frame_distances.keys():
            raise ValueError(
                f"overlap scores of classes {sorted(scores)} and distances of classes "
                f"{sorted(frame_distances)} do not come from the same maps"
            )
        merged.append({c: {**scores[c], **frame_distances[c]} for c in scores})
    return merged


def batch_metrics(
    pred: torch.Tensor | np.ndarray,
    target: torch.Tensor | np.ndarray,
    num_classes: int = NUM_CLASSES,
    ignore_index: int = IGNORE_INDEX,
    binary_target: bool = False,
    distances: bool = True,
) -> list[FrameScores]:
    """Per frame, per scored foreground class: {"dice", "iou", "hd95", "assd"}.

    pred: integer class map [B, H, W] (argmax of the logits); target: label map [B, H, W] with
    ``ignore_index`` for unlabelled pixels; ``num_classes``: the network's class count (pred in
    0..num_classes-1). Returns one dict per frame mapping class index (1..num_classes-1, or only
    1 with ``binary_target``) to its scores; classes absent from both maps are left out. Dice /
    IoU are fractions (:func:`overlap_counts` on the maps' device); distances are pixels
    (:func:`distance_metrics`, host). ``distances=False`` leaves out "hd95" and "assd" (their
    distance transforms are most of the cost at native resolution).
    """
    counts = overlap_counts(pred, target, num_classes, ignore_index, binary_target)
    scores = overlap_scores(counts)
    if not distances:
        return scores
    return merge_distances(
        scores, distance_metrics(pred, target, num_classes, ignore_index, binary_target)
    )


def frame_metrics(
    pred: torch.Tensor | np.ndarray,
    target: torch.Tensor | np.ndarray,
    num_classes: int = NUM_CLASSES,
    ignore_index: int = IGNORE_INDEX,
    binary_target: bool = False,
) -> FrameScores:
    """Scores of one frame: pred [H, W], target [H, W] -> {class: {"dice", "iou", "hd95", "assd"}}.

    See :func:`batch_metrics` and the module docstring for the conventions.
    """
    if pred.ndim != 2 or target.ndim != 2:
        raise ValueError(
            "frame_metrics takes one frame, pred and target [H, W]; got pred "
            f"{tuple(pred.shape)} and target {tuple(target.shape)} "
            "(use batch_metrics for [B, H, W])"
        )
    return batch_metrics(pred[None], target[None], num_classes, ignore_index, binary_target)[0]


class SegmentationMeter:
    """Accumulates per-frame scores over batches; summarises them per class and overall.

    Example::

        meter = SegmentationMeter()
        for clips, labels, ids in loader:
            meter.update(model(clips).argmax(1), labels, ids)
        meter.summary()["dice"]  # mean over classes of per-class means over frames, in %
    """

    def __init__(
        self,
        num_classes: int = NUM_CLASSES,
        ignore_index: int = IGNORE_INDEX,
        binary_target: bool = False,
        class_names: Sequence[str] | None = None,
        distances: bool = True,
    ) -> None:
        """``num_classes``: the network's; ``class_names`` includes background; by default the
        unified part names (or "instrument" with ``binary_target``). ``distances=False``: Dice and
        IoU only (HD95 / ASSD reported as not scored, ``None``)."""
        self.num_classes = num_classes
        self.ignore_index = ignore_index
        self.binary_target = binary_target
        self.distances = distances
        if class_names is None:
            if binary_target:
                class_names = BINARY_CLASS_NAMES
            elif num_classes == NUM_CLASSES:
                class_names = CLASS_NAMES
            else:
                class_names = ["background"] + [f"class_{c}" for c in range(1, num_classes)]
        expected = 2 if binary_target else num_classes
        if len(class_names) != expected:
            raise ValueError(
                f"class_names {list(class_names)} has {len(class_names)} entries; expected "
                f"{expected} (background first)"
            )
        self.class_names = tuple(class_names)
        self.reset()

    def reset(self) -> None:
        """Forget every frame seen so far."""
        self._frame_ids: list[str] = []
        self._frame_scores: list[FrameScores] = []

    @property
    def num_frames(self) -> int:
        """Frames seen (including frames where no class was scored)."""
        return len(self._frame_ids)

    def update(
        self,
        pred: torch.Tensor | np.ndarray,
        target: torch.Tensor | np.ndarray,
        sample_ids: Sequence[str] | None = None,
    ) -> None:
        """Add a batch: pred [B, H, W] class map, target [B, H, W] labels, optional B ids."""
        if sample_ids is not None and len(sample_ids) != pred.shape[0]:
            raise ValueError(
                f"got {len(sample_ids)} sample_ids for a batch of {pred.shape[0]} frames "
                f"(pred shape {tuple(pred.shape)})"
            )
        scores = batch_metrics(
            pred, target, self.num_classes, self.ignore_index, self.binary_target, self.distances
        )
        self.add_scores(scores, sample_ids)

    def add_scores(
        self, scores: Sequence[FrameScores], sample_ids: Sequence[str] | None = None
    ) -> None:
        """Add frames scored elsewhere (:func:`overlap_scores`, :func:`merge_distances`; e.g. by
        fedst.scoring.evaluation from counts made on the GPU): one dict per frame."""
        if sample_ids is None:
            sample_ids = [f"frame_{self.num_frames + i}" for i in range(len(scores))]
        if len(sample_ids) != len(scores):
            raise ValueError(f"got {len(sample_ids)} sample_ids for {len(scores)} scored frames")
        scored = 2 if self.binary_target else self.num_classes
        for frame in scores:
            if any(not 1 <= c < scored for c in frame):
                raise ValueError(
                    f"scores of class(es) {sorted(frame)} for a meter of classes 1..{scored - 1}"
                )
        self._frame_ids.extend(str(s) for s in sample_ids)
        self._frame_scores.extend(scores)

    def summary(self) -> dict:
        """Overall "dice", "iou" (%), "hd95", "assd" (px), the EndoVis "challenge_iou",
        "isi_iou" and "mciou" (%, fedst/scoring/challenge.py), "num_frames" and "per_class".

        ``per_class`` maps class name -> the four metrics and "frames" (frames where it was scored).

        A class never scored has ``"frames": 0`` and ``None`` values; an overall metric is ``None``
        when no class was scored at all (e.g. only empty frames predicted empty), and HD95 / ASSD
        are ``None`` when the meter computes no distances.
        """
        if self.num_frames == 0:
            raise ValueError("SegmentationMeter.summary() called before any update()")
        per_class: dict[str, dict[str, float | int | None]] = {}
        class_means: dict[str, list[float]] = {m: [] for m in METRIC_NAMES}
        for c in range(1, len(self.class_names)):
            values = [s[c] for s in self._frame_scores if c in s]
            entry: dict[str, float | int | None] = {}
            for metric in METRIC_NAMES:
                if values and metric in values[0]:
                    mean = float(np.mean([v[metric] for v in values])) * _scale(metric)
                    class_means[metric].append(mean)
                    entry[metric] = mean
                else:
                    entry[metric] = None
            entry["frames"] = len(values)
            per_class[self.class_names[c]] = entry
        result: dict = {m: (float(np.mean(v)) if v else None) for m, v in class_means.items()}
        result.update(challenge_summary(self._frame_scores))
        result["num_frames"] = self.num_frames
        result["per_class"] = per_class
        return result

    def per_frame(self) -> list[dict[str, str | float]]:
        """One row per (frame, scored class): sample_id, class, dice, iou (%), hd95, assd (px)."""
        rows: list[dict[str, str | float]] = []
        for sample_id, scores in zip(self._frame_ids, self._frame_scores, strict=True):
            for c, values in sorted(scores.items()):
                row: dict[str, str | float] = {"sample_id": sample_id, "class": self.class_names[c]}
                row.update({m: values[m] * _scale(m) for m in METRIC_NAMES if m in values})
                rows.append(row)
        return rows


def _scale(metric: str) -> float:
    """Summary unit factor: overlap metrics in percent, distances in pixels."""
    return 100.0 if metric in OVERLAP_METRICS else 1.0
