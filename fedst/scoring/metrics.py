"""Segmentation metrics: Dice, IoU, HD95 and ASSD per foreground class and per frame.

The paper (Sec. IV-A2) reports Dice (%), IoU (%), HD95 (pixels) and ASSD (pixels) for the part
classes shaft / wrist / jaw. A functional core (:func:`batch_metrics`, :func:`frame_metrics`) holds
the maths once; :class:`SegmentationMeter` accumulates frames and delegates to it.

What runs where:

* **Dice / IoU** come from per-class pixel counts (TP, FP, FN): :func:`overlap_counts` histograms
  the (label, prediction) value pairs of a batch of maps with torch ops on the maps' own device
  (the GPU in an evaluation; no host sync on CUDA) and keeps only int64 counts there;
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
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from monai.metrics import compute_dice, compute_iou
from monai.metrics.utils import get_edge_surface_distance

from fedst.data.base import CLASS_NAMES, IGNORE_INDEX, NUM_CLASSES, check_label_values

__all__ = [
    "BINARY_CLASS_NAMES",
    "METRIC_NAMES",
    "VALUE_CODES",
    "OverlapCounts",
    "SegmentationMeter",
    "batch_metrics",
    "distance_metrics",
    "format_score",
    "frame_metrics",
    "merge_distances",
    "overlap_counts",
    "overlap_scores",
    "reference_batch_metrics",
]

METRIC_NAMES: tuple[str, ...] = ("dice", "iou", "hd95", "assd")
OVERLAP_METRICS: tuple[str, ...] = ("dice", "iou")
BINARY_CLASS_NAMES: tuple[str, ...] = ("background", "instrument")
HD_PERCENTILE = 95.0

FrameScores = dict[int, dict[str, float]]

VALUE_CODES = 257
"""Codes of map values in :class:`OverlapCounts`: 0..255 stand for themselves (uint8 maps hold
nothing else), 256 for any value outside them."""
_OTHER_VALUE = VALUE_CODES - 1


def _as_class_map(x: torch.Tensor | np.ndarray, name: str) -> torch.Tensor:
    """An integer class map as a tensor on its own device (numpy: int64 unless uint8); float maps
    (logits, probabilities) are errors."""
    if isinstance(x, np.ndarray):
        if not np.issubdtype(x.dtype, np.integer):
            raise ValueError(
                f"{name} must be an integer class-index map (e.g. logits.argmax(1)), "
                f"got a numpy array of dtype {x.dtype} and shape {tuple(x.shape)}"
            )
        if x.dtype == np.uint8:
            return torch.from_numpy(x)
        return torch.from_numpy(x.astype(np.int64, copy=False))
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor or numpy array, got {type(x).__name__}")
    if x.dtype.is_floating_point or x.dtype.is_complex or x.dtype == torch.bool:
        raise ValueError(
            f"{name} must be an integer class-index map (e.g. logits.argmax(1)), "
            f"got dtype {x.dtype} and shape {tuple(x.shape)}"
        )
    return x.detach()


def _as_long_tensor(x: torch.Tensor | np.ndarray, name: str) -> torch.Tensor:
    """An integer class map as a CPU int64 tensor; float maps (logits, probabilities) are errors."""
    return _as_class_map(x, name).to(device="cpu", dtype=torch.long)


def _check_pair(pred: torch.Tensor, target: torch.Tensor) -> None:
    """ValueError unless pred and target are non-empty [B, H, W] maps of one shape and device."""
    if pred.ndim != 3 or pred.shape != target.shape:
        raise ValueError(
            "pred and target must both be [B, H, W] class maps of the same shape, got pred "
            f"{tuple(pred.shape)} and target {tuple(target.shape)}"
        )
    if pred.numel() == 0:
        raise ValueError(f"pred and target are empty (shape {tuple(pred.shape)})")
    if pred.device != target.device:
        raise ValueError(
            f"pred is on {pred.device} and target on {target.device}; move both to one device"
        )


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
    _check_pair(pred, target)
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
            scores[c] = {"dice": float(dice[b, c - 1]), "iou": float(iou[b, c - 1])}
            if not distances:
                continue
            if in_pred and in_target:
                hd95, assd = _surface_distances(pred[b] == c, target[b] == c)
            else:
                hd95 = assd = diagonal
            scores[c].update(hd95=hd95, assd=assd)
        frames.append(scores)
    return frames


@dataclass(frozen=True)
class OverlapCounts:
    """Pixel counts of a batch of frames, on the device of the maps they come from.

    ``counts``: int64 [B, C - 1, 3], the (TP, FP, FN) pixels of each scored foreground class
    1..C-1 (C = ``num_classes``, or 2 for a binary target), ignore pixels counted in none.
    ``invalid``: int64 [B, 2, VALUE_CODES], per value code the pixels of pred (row 0) holding no
    class and of target (row 1) holding neither a class nor ``ignore_index``; zero for valid maps.
    """

    counts: torch.Tensor
    invalid: torch.Tensor
    num_classes: int
    """The network's class count (pred values 0..num_classes-1)."""
    ignore_index: int

    def __len__(self) -> int:
        return self.counts.shape[0]

    def cpu(self) -> OverlapCounts:
        """The same counts on the host (one copy of each tensor)."""
        return OverlapCounts(
            self.counts.cpu(), self.invalid.cpu(), self.num_classes, self.ignore_index
        )

    @staticmethod
    def cat(parts: Sequence[OverlapCounts]) -> OverlapCounts:
        """The frames of ``parts`` in order, as one batch (on the parts' device)."""
        if not parts:
            raise ValueError("OverlapCounts.cat needs at least one batch of counts")
        first = parts[0]
        return OverlapCounts(
            torch.cat([p.counts for p in parts]),
            torch.cat([p.invalid for p in parts]),
            first.num_classes,
            first.ignore_index,
        )


def _value_codes(x: torch.Tensor) -> torch.Tensor:
    """Integer map -> its :data:`VALUE_CODES` codes: uint8 as it is, other dtypes as int32 with
    every value outside 0..255 replaced by 256."""
    if x.dtype == torch.uint8:
        return x
    return torch.where((x >= 0) & (x < _OTHER_VALUE), x, _OTHER_VALUE).to(torch.int32)


def _count_by_scatter(codes: torch.Tensor, bins: int) -> torch.Tensor:
    """Occurrences of each value of the 1-D ``codes`` in int64 [bins], by ``scatter_add_``: no
    host sync, deterministic on CUDA (torch.use_deterministic_algorithms lists it)."""
    ones = torch.ones((), dtype=torch.int64, device=codes.device).expand(codes.numel())
    counts = torch.zeros(bins, dtype=torch.int64, device=codes.device)
    return counts.scatter_add_(0, codes.long(), ones)


def _histogram(codes: torch.Tensor, bins: int) -> torch.Tensor:
    """Occurrences of each value of the 1-D int32 ``codes`` (all in [0, bins)): int64 [bins].

    On CUDA :func:`torch.bincount` reads the largest value back to size its output (a host sync
    per call), so the device path scatters; elsewhere bincount is ~3x faster than scattering.
    """
    if codes.is_cuda:
        return _count_by_scatter(codes, bins)
    return torch.bincount(codes, minlength=bins)


def overlap_counts(
    pred: torch.Tensor | np.ndarray,
    target: torch.Tensor | np.ndarray,
    num_classes: int = NUM_CLASSES,
    ignore_index: int = IGNORE_INDEX,
    binary_target: bool = False,
) -> OverlapCounts:
    """Per frame, per scored foreground class, the (TP, FP, FN) pixels, on the maps' device.

    pred: integer class map [B, H, W] (argmax of the logits); target: label map [B, H, W]
    (``ignore_index`` for unlabelled pixels), both on one device, uint8 the fastest. One
    histogram of the (label, prediction) value pairs of all frames gives the confusion matrix of
    each frame; nothing is read back to the host (:func:`overlap_scores` does that, and raises
    for out-of-range values then). Conventions as :func:`batch_metrics`.
    """
    if num_classes < 2:
        raise ValueError(f"num_classes must be >= 2 (background + foreground), got {num_classes}")
    if not num_classes <= ignore_index < _OTHER_VALUE:
        raise ValueError(
            f"ignore_index={ignore_index} must be a value in [num_classes={num_classes}, 255]: "
            "a label that is no class"
        )
    pred = _as_class_map(pred, "pred")
    target = _as_class_map(target, "target")
    _check_pair(pred, target)
    batch = pred.shape[0]
    codes = _value_codes(target).to(torch.int32).mul_(VALUE_CODES)  # [B, H, W]
    codes += _value_codes(pred)  # (label, prediction) pair code in [0, VALUE_CODES**2)
    pair_codes = VALUE_CODES * VALUE_CODES
    if batch > 1:
        offsets = torch.arange(batch, dtype=torch.int32, device=codes.device) * pair_codes
        codes += offsets.view(batch, 1, 1)
    pairs = _histogram(codes.view(-1), batch * pair_codes)
    pairs = pairs.view(batch, VALUE_CODES, VALUE_CODES)  # [B, label code, prediction code]

    value = torch.arange(VALUE_CODES, device=pairs.device)
    invalid = torch.stack(
        [
            pairs.sum(1) * (value >= num_classes),  # prediction codes over every pixel
            pairs.sum(2) * ((value >= num_classes) & (value != ignore_index)),
        ],
        dim=1,
    )  # [B, 2, VALUE_CODES]

    confusion = pairs[:, :num_classes, :num_classes]  # [B, K, K]; ignore pixels left out
    if binary_target:  # every part class is instrument, in both maps
        confusion = torch.stack(
            [
                confusion[:, 0, 0],
                confusion[:, 0, 1:].sum(1),
                confusion[:, 1:, 0].sum(1),
                confusion[:, 1:, 1:].sum((1, 2)),
            ],
            dim=1,
        ).view(batch, 2, 2)
    true_pos = confusion.diagonal(dim1=1, dim2=2)  # [B, C]
    false_pos = confusion.sum(1) - true_pos  # predicted c, labelled otherwise
    false_neg = confusion.sum(2) - true_pos  # labelled c, predicted otherwise
    counts = torch.stack([true_pos, false_pos, false_neg], dim=2)[:, 1:]  # [B, C - 1, 3]
    return OverlapCounts(counts, invalid, num_classes, ignore_index)


def _invalid_values(invalid: torch.Tensor) -> list[int | str]:
    """Value codes with a non-zero count in int64 [N, VALUE_CODES] (256 -> "<0 or >255")."""
    codes = torch.nonzero(invalid.sum(0)).flatten().tolist()
    return [code if code < _OTHER_VALUE else "<0 or >255" for code in codes][:5]


def overlap_scores(
    counts: OverlapCounts, sample_ids: Sequence[str] | None = None
) -> list[FrameScores]:
    """Per frame, per scored class {"dice", "iou"} (fractions) from :func:`overlap_counts`.

    Copies the counts to the host (the only transfer) and raises ValueError when a map held an
    out-of-range value, naming the values and the first such frame (``sample_ids``, if given).
    A class absent from both maps of a frame is left out of that frame's dict.
    """
    counts = counts.cpu()
    for row, what in ((0, "pred"), (1, "target")):
        bad_frames = torch.nonzero(counts.invalid[:, row].sum(1)).flatten().tolist()
        if not bad_frames:
            continue
        values = _invalid_values(counts.invalid[:, row])
        frame = bad_frames[0] if sample_ids is None else sample_ids[bad_frames[0]]
        if what == "pred":
            raise ValueError(
                f"pred holds class value(s) {values} outside 0..{counts.num_classes - 1} (frame "
                f"{frame}); pass the argmax class map and the model's num_classes"
            )
        raise ValueError(
            f"target: labels must be in [0, {counts.num_classes}) or {counts.ignore_index}; got "
            f"value(s) {values} (frame {frame}); check the label encoding of the dataset backend "
            "and network.num_classes"
        )
    frames: list[FrameScores] = []
    for frame_counts in counts.counts.tolist():
        scores: FrameScores = {}
        for c, (true_pos, false_pos, false_neg) in enumerate(frame_counts, start=1):
            union = true_pos + false_pos + false_neg
            if union == 0:  # absent from both maps: skipped
                continue
            scores[c] = {
                "dice": 2 * true_pos / (union + true_pos),
                "iou": true_pos / union,
            }
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
        """Overall "dice", "iou" (%), "hd95", "assd" (px), "num_frames" and "per_class".

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


def format_score(value: float | None, digits: int = 2) -> str:
    """A summary value for humans: "n/a" when it was not scored (``None``), else ``digits``
    decimals."""
    return "n/a" if value is None else f"{value:.{digits}f}"


def _scale(metric: str) -> float:
    """Summary unit factor: overlap metrics in percent, distances in pixels."""
    return 100.0 if metric in OVERLAP_METRICS else 1.0
