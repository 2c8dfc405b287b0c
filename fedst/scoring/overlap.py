"""Dice / IoU from pixel counts: a batch of class maps -> per frame and foreground class the
(TP, FP, FN) pixels, histogrammed with torch ops on the maps' own device (:func:`overlap_counts`),
then scored on the host (:func:`overlap_scores`); with the validation of class maps the
distance metrics share (:func:`as_class_map`, :func:`check_map_pair`). The conventions (ignore
pixels, absent and one-sided classes, binary targets) are fedst/scoring/metrics.py's."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from fedst.data.base import IGNORE_INDEX, NUM_CLASSES

__all__ = [
    "GT_PRESENT",
    "VALUE_CODES",
    "FrameScores",
    "OverlapCounts",
    "as_class_map",
    "check_map_pair",
    "overlap_counts",
    "overlap_scores",
]

FrameScores = dict[int, dict[str, float]]

GT_PRESENT = "gt_present"
"""Key of a frame's class scores: 1.0 when the class has ground-truth pixels in the frame, 0.0
when it is only predicted there (the challenge IoU scores the former only)."""

VALUE_CODES = 257
"""Codes of map values in :class:`OverlapCounts`: 0..255 stand for themselves (uint8 maps hold
nothing else), 256 for any value outside them."""
_OTHER_VALUE = VALUE_CODES - 1


def as_class_map(x: torch.Tensor | np.ndarray, name: str) -> torch.Tensor:
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


def check_map_pair(pred: torch.Tensor, target: torch.Tensor) -> None:
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
    pred = as_class_map(pred, "pred")
    target = as_class_map(target, "target")
    check_map_pair(pred, target)
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
    A class absent from both maps of a frame is left out of that frame's dict; a scored class also
    carries :data:`GT_PRESENT` (1.0 when the ground truth holds it, 0.0 when only predicted).
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
                # ground-truth pixels of c in this frame (1.0) or a prediction only (0.0): the
                # challenge IoU counts a frame's labelled classes only (fedst/scoring/challenge.py)
                GT_PRESENT: float(true_pos + false_neg > 0),
            }
        frames.append(scores)
    return frames
