"""Specification of fedst.scoring.challenge: the EndoVis challenge IoU, ISI IoU and mcIoU on
hand-computed maps whose three values differ (a class predicted but absent from the ground
truth, frames with no instrument, a class absent from the whole split)."""

from __future__ import annotations

import pytest
import torch

from fedst.scoring.metrics import SegmentationMeter

# Four 4x6 frames, classes 0 background, 1 shaft, 2 wrist, 3 jaw; (row, col) pixels.
# a: GT shaft on 4 pixels, predicted on 2 of them -> shaft IoU 2/4; wrist predicted on one pixel
#    the GT does not have -> wrist IoU 0 (prediction only).
# b: no instrument in the GT; shaft predicted on one pixel -> shaft IoU 0 (prediction only).
# c: no instrument in the GT and none predicted -> no class scored.
# d: GT shaft 2 pixels, predicted on those and 1 more -> 2/3; wrist exact -> 1.
# Jaw appears nowhere (neither GT nor prediction) in the whole split.
FRAMES = {
    "a": ({1: [(0, 0), (0, 1)], 2: [(3, 3)]}, {1: [(0, 0), (0, 1), (0, 2), (0, 3)]}),
    "b": ({1: [(2, 2)]}, {}),
    "c": ({}, {}),
    "d": ({1: [(1, 1), (1, 2), (1, 3)], 2: [(2, 0)]}, {1: [(1, 1), (1, 2)], 2: [(2, 0)]}),
}
# challenge IoU: frames with a GT instrument (a, d), mean over their GT classes:
#   a: shaft only (wrist is not in a's GT) = 1/2; d: (2/3 + 1) / 2 = 5/6 -> (1/2 + 5/6) / 2 = 2/3
CHALLENGE = 100 * 2 / 3
# ISI IoU: frames with a class in GT or prediction (a, b, d), mean over those classes:
#   a: (1/2 + 0) / 2 = 1/4; b: 0; d: 5/6 -> (1/4 + 0 + 5/6) / 3 = 13/36
ISI = 100 * 13 / 36
# mcIoU: shaft over a, b, d = (1/2 + 0 + 2/3) / 3 = 7/18; wrist over a, d = (0 + 1) / 2 = 1/2;
#   jaw never scored, left out -> (7/18 + 1/2) / 2 = 4/9
MCIOU = 100 * 4 / 9


def label_map(pixels: dict[int, list[tuple[int, int]]]) -> torch.Tensor:
    out = torch.zeros(4, 6, dtype=torch.long)
    for value, coords in pixels.items():
        for row, col in coords:
            out[row, col] = value
    return out


def scored_meter(frames: dict) -> SegmentationMeter:
    meter = SegmentationMeter(distances=False)
    for name, (pred, target) in frames.items():
        meter.update(label_map(pred)[None], label_map(target)[None], [name])
    return meter


def test_the_three_challenge_ious_follow_their_own_frame_and_class_rules():
    summary = scored_meter(FRAMES).summary()
    assert summary["challenge_iou"] == pytest.approx(CHALLENGE)
    assert summary["isi_iou"] == pytest.approx(ISI)
    assert summary["mciou"] == pytest.approx(MCIOU)
    # mcIoU averages as fedst's own per-class IoU does (classes scored at least once)
    assert summary["iou"] == pytest.approx(MCIOU)


def test_frames_without_any_instrument_give_no_challenge_iou():
    # only b and c: no GT instrument anywhere -> challenge IoU has no frame; ISI IoU scores b 0
    summary = scored_meter({k: FRAMES[k] for k in ("b", "c")}).summary()
    assert summary["challenge_iou"] is None
    assert summary["isi_iou"] == pytest.approx(0.0)
    assert summary["mciou"] == pytest.approx(0.0)


def test_a_class_only_predicted_in_the_split_counts_in_mciou_with_zero():
    # a' = a with jaw predicted on one more pixel: jaw never in the GT of the split but predicted
    # once -> jaw mean 0 enters mcIoU: (7/18 + 1/2 + 0) / 3 = 8/27. challenge IoU unchanged;
    # ISI IoU of a' = (1/2 + 0 + 0) / 3 = 1/6 -> (1/6 + 0 + 5/6) / 3 = 1/3.
    frames = dict(FRAMES)
    pred, target = FRAMES["a"]
    frames["a"] = ({**pred, 3: [(3, 5)]}, target)
    summary = scored_meter(frames).summary()
    assert summary["challenge_iou"] == pytest.approx(CHALLENGE)
    assert summary["isi_iou"] == pytest.approx(100 / 3)
    assert summary["mciou"] == pytest.approx(100 * 8 / 27)
