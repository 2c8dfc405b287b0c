"""The IoUs of the EndoVis instrument-segmentation literature: challenge IoU, ISI IoU and mean
class IoU (mcIoU), from the per-frame class scores the Dice / IoU path already computes (pixel
counts made on the device, fedst/scoring/overlap.py; no further pass over the maps).

Source: ISINet (Gonzalez, Bravo-Sanchez, Arbelaez, "ISINet: An Instance-Based Approach for Surgical
Instrument Segmentation", MICCAI 2020), whose evaluation code (github.com/BCV-Uniandes/ISINet) is
reused as ``eval_endovis`` by MATIS (Ayobi et al., ISBI 2023) and SurgicalSAM (Yue et al., AAAI
2024), which report "challenge IoU", "IoU" (here ``isi_iou``) and "mcIoU". Per frame f and
foreground class c, IoU(f, c) = TP / (TP + FP + FN); background is never a class here.

* **challenge IoU**: per frame, the mean of IoU(f, c) over the classes c present in the frame's
  ground truth (a class only predicted does not count); a frame whose ground truth holds no
  instrument is left out (whatever is predicted there); then the mean over the frames left.
* **ISI IoU**: per frame, the mean of IoU(f, c) over the classes present in the ground truth OR
  the prediction (a class only predicted scores 0); a frame with neither is left out, a frame
  with no instrument but a prediction scores 0; then the mean over the frames left.
* **mcIoU**: per class, the mean of IoU(f, c) over the frames where c is in the ground truth or
  the prediction; then the mean over the classes with at least one such frame (a class absent
  from the whole split, never predicted, is left out; one only predicted counts with 0). This is
  the averaging of fedst's own per-class IoU (fedst/scoring/metrics.py), so ``mciou`` equals
  ``iou``; it is reported under its literature name for comparison.

Ignore pixels (255) count in no class (fedst/scoring/metrics.py). Some TernausNet-derived
scripts (``ch_iou`` / ``isi_iou`` in EndoVis 2017 evaluate.py) instead score a frame with no
instrument 1 when nothing is predicted and 0 otherwise: not this convention.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from fedst.scoring.overlap import GT_PRESENT, FrameScores

__all__ = ["CHALLENGE_METRIC_NAMES", "challenge_summary"]

CHALLENGE_METRIC_NAMES: tuple[str, ...] = ("challenge_iou", "isi_iou", "mciou")


def challenge_summary(frames: Sequence[FrameScores]) -> dict[str, float | None]:
    """{"challenge_iou", "isi_iou", "mciou"} in percent over ``frames`` (per frame, per scored
    class: "iou" as a fraction and :data:`GT_PRESENT`); ``None`` when no frame (or class)
    enters the mean, e.g. challenge IoU over frames without any instrument."""
    challenge: list[float] = []
    isi: list[float] = []
    per_class: dict[int, list[float]] = {}
    for scores in frames:
        labelled = [s["iou"] for s in scores.values() if s[GT_PRESENT]]
        if labelled:
            challenge.append(float(np.mean(labelled)))
        if scores:
            isi.append(float(np.mean([s["iou"] for s in scores.values()])))
        for c, s in scores.items():
            per_class.setdefault(c, []).append(s["iou"])
    class_means = [float(np.mean(values)) for values in per_class.values()]
    return {
        "challenge_iou": _percent(challenge),
        "isi_iou": _percent(isi),
        "mciou": _percent(class_means),
    }


def _percent(values: list[float]) -> float | None:
    return 100.0 * float(np.mean(values)) if values else None
