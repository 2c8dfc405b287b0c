"""Specification of fedst.scoring.metrics: hand-computed Dice / IoU / HD95 / ASSD and their conventions."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from monai.metrics import compute_average_surface_distance, compute_hausdorff_distance

from fedst.scoring.metrics import SegmentationMeter, batch_metrics, frame_metrics

IGNORE = 255


def label_map(height: int, width: int, pixels: dict[int, list[tuple[int, int]]]) -> torch.Tensor:
    """A [H, W] long map, background 0, with the listed (row, col) pixels set to each class."""
    out = torch.zeros(height, width, dtype=torch.long)
    for value, coords in pixels.items():
        for row, col in coords:
            out[row, col] = value
    return out


# 4 predicted pixels vs 6 ground-truth pixels, 3 shared: Dice = 2*3/(4+6), IoU = 3/(4+6-3).
PRED_4 = [(1, 1), (1, 2), (1, 3), (3, 5)]
GT_6 = [(1, 1), (1, 2), (1, 3), (2, 1), (2, 2), (2, 3)]


@pytest.mark.parametrize(
    ("pred_pixels", "gt_pixels", "dice", "iou"),
    [
        (PRED_4, GT_6, 0.6, 3 / 7),
        (GT_6, GT_6, 1.0, 1.0),
        ([(0, 0)], [(5, 7)], 0.0, 0.0),
        ([(0, 0), (0, 1)], [(0, 0)], 2 / 3, 1 / 2),
    ],
)
def test_dice_and_iou_match_hand_counts(pred_pixels, gt_pixels, dice, iou):
    scores = frame_metrics(
        label_map(6, 8, {1: pred_pixels}), label_map(6, 8, {1: gt_pixels}), num_classes=2
    )
    assert scores[1]["dice"] == pytest.approx(dice)
    assert scores[1]["iou"] == pytest.approx(iou)


@pytest.mark.parametrize("shift", [1, 3, 5])
def test_single_pixels_shifted_by_d_have_hd95_and_assd_equal_to_d(shift):
    pred = label_map(8, 10, {1: [(2, 2)]})
    target = label_map(8, 10, {1: [(2, 2 + shift)]})
    scores = frame_metrics(pred, target, num_classes=2)
    assert scores[1]["hd95"] == pytest.approx(shift)
    assert scores[1]["assd"] == pytest.approx(shift)


def test_vertical_line_shifted_sideways_by_d_has_every_distance_d():
    pred = label_map(10, 10, {1: [(r, 2) for r in range(1, 8)]})
    target = label_map(10, 10, {1: [(r, 6) for r in range(1, 8)]})
    scores = frame_metrics(pred, target, num_classes=2)
    assert scores[1]["hd95"] == pytest.approx(4.0)
    assert scores[1]["assd"] == pytest.approx(4.0)


def test_hd95_takes_the_worse_direction_and_assd_pools_both_directions():
    # pred edge {(0,0)}; gt edges {(0,0), (0,3)}. pred->gt distances [0]; gt->pred [0, 3].
    # HD95 = max(q95([0]), q95([0, 3])) = 0.95 * 3 (linear interpolation); ASSD = mean(0, 0, 3).
    pred = label_map(4, 6, {1: [(0, 0)]})
    target = label_map(4, 6, {1: [(0, 0), (0, 3)]})
    scores = frame_metrics(pred, target, num_classes=2)
    assert scores[1]["hd95"] == pytest.approx(2.85)
    assert scores[1]["assd"] == pytest.approx(1.0)


@pytest.mark.filterwarnings("ignore:.*always_return_as_numpy.*:FutureWarning")
def test_distances_equal_monai_public_functions_on_irregular_shapes():
    generator = torch.Generator().manual_seed(0)
    target = torch.zeros(1, 24, 30, dtype=torch.long)
    target[0, 4:14, 3:20] = 1
    target[0, 14:18, 5:12] = 2
    target[0, 18:21, 6:9] = 3
    pred = torch.roll(target, shifts=(2, -3), dims=(1, 2))
    noise = torch.rand(1, 24, 30, generator=generator) < 0.03
    pred[noise] = 3
    ours = batch_metrics(pred, target)[0]
    pred_onehot = F.one_hot(pred, 4).permute(0, 3, 1, 2).float()
    target_onehot = F.one_hot(target, 4).permute(0, 3, 1, 2).float()
    hd95 = compute_hausdorff_distance(pred_onehot, target_onehot, percentile=95)[0]
    assd = compute_average_surface_distance(pred_onehot, target_onehot, symmetric=True)[0]
    for c in (1, 2, 3):
        assert ours[c]["hd95"] == pytest.approx(float(hd95[c - 1]), rel=1e-5)
        assert ours[c]["assd"] == pytest.approx(float(assd[c - 1]), rel=1e-5)


def test_class_absent_from_prediction_and_target_is_skipped_not_scored_one():
    pred = label_map(4, 6, {1: [(1, 1)]})
    target = label_map(4, 6, {1: [(1, 1)]})
    assert set(frame_metrics(pred, target)) == {1}


@pytest.mark.parametrize(
    ("pred_pixels", "gt_pixels", "gt_present"),
    [({}, {2: [(1, 1)]}, 1.0), ({2: [(1, 1)]}, {}, 0.0)],
    ids=["missed", "false-alarm"],
)
def test_one_sided_class_scores_zero_overlap_and_the_image_diagonal(
    pred_pixels, gt_pixels, gt_present
):
    scores = frame_metrics(label_map(4, 6, pred_pixels), label_map(4, 6, gt_pixels))
    assert scores[2] == {
        "dice": 0.0,
        "iou": 0.0,
        "gt_present": gt_present,
        "hd95": pytest.approx(math.sqrt(4**2 + 6**2)),
        "assd": pytest.approx(math.sqrt(4**2 + 6**2)),
    }


def test_ignore_pixels_count_neither_as_false_positive_nor_as_surface():
    # Predicted class 1 on 3 pixels; one of them is an ignore pixel in the ground truth.
    pred = label_map(4, 6, {1: [(1, 1), (1, 2), (3, 5)]})
    target = label_map(4, 6, {1: [(1, 1), (1, 2)], IGNORE: [(3, 5), (0, 0)]})
    scores = frame_metrics(pred, target, num_classes=2)
    assert scores[1]["dice"] == pytest.approx(1.0)
    assert scores[1]["hd95"] == pytest.approx(0.0)


def test_prediction_only_on_ignore_pixels_leaves_class_skipped():
    pred = label_map(4, 6, {3: [(0, 0)]})
    target = label_map(4, 6, {IGNORE: [(0, 0)]})
    assert frame_metrics(pred, target) == {}


def test_binary_target_merges_predicted_parts_into_one_instrument_class():
    pred = label_map(4, 6, {1: [(1, 1)], 2: [(1, 2)], 3: [(1, 3)]})
    target = label_map(4, 6, {1: [(1, 1), (1, 2), (1, 3)]})
    scores = frame_metrics(pred, target, binary_target=True)
    assert set(scores) == {1}
    assert scores[1]["dice"] == pytest.approx(1.0)
    assert frame_metrics(pred, target)[1]["dice"] == pytest.approx(0.5)  # parts kept apart


def test_numpy_integer_maps_give_the_same_scores_as_tensors():
    pred = label_map(6, 8, {1: PRED_4})
    target = label_map(6, 8, {1: GT_6})
    from_numpy = frame_metrics(pred.numpy().astype(np.uint8), target.numpy().astype(np.uint8))
    assert from_numpy == frame_metrics(pred, target)


@pytest.mark.parametrize(
    ("pred", "target", "message"),
    [
        (torch.zeros(4, 6), torch.zeros(4, 6, dtype=torch.long), "dtype torch.float32"),
        (torch.zeros(4, 6, dtype=torch.long), torch.zeros(4, 5, dtype=torch.long), r"\(1, 4, 5\)"),
        (torch.full((4, 6), 4), torch.zeros(4, 6, dtype=torch.long), r"value\(s\) \[4\]"),
        (torch.zeros(4, 6, dtype=torch.long), torch.full((4, 6), 7), r"value\(s\) \[7\]"),
        (torch.zeros(2, 4, 6, dtype=torch.long), torch.zeros(2, 4, 6, dtype=torch.long), "[H, W]"),
    ],
    ids=["float-pred", "shape-mismatch", "pred-class-out-of-range", "bad-label", "batch-given"],
)
def test_bad_inputs_raise_errors_that_quote_the_value(pred, target, message):
    with pytest.raises(ValueError, match=message):
        frame_metrics(pred, target)


def test_meter_averages_per_class_over_scored_frames_then_over_classes():
    # frame a: shaft perfect (dice 1), wrist missed (dice 0); frame b: shaft dice 0.5, no wrist.
    # Jaw never appears. shaft = (100 + 50) / 2 = 75 %, wrist = 0 %, overall = (75 + 0) / 2.
    pred = torch.stack(
        [
            label_map(4, 6, {1: [(0, 0), (0, 1)]}),
            label_map(4, 6, {1: [(2, 2)]}),
        ]
    )
    target = torch.stack(
        [
            label_map(4, 6, {1: [(0, 0), (0, 1)], 2: [(3, 3)]}),
            label_map(4, 6, {1: [(2, 2), (2, 3), (2, 4)]}),
        ]
    )
    meter = SegmentationMeter()
    meter.update(pred[:1], target[:1], ["a"])
    meter.update(pred[1:], target[1:], ["b"])
    summary = meter.summary()
    assert summary["num_frames"] == 2
    assert summary["per_class"]["shaft"]["frames"] == 2
    assert summary["per_class"]["shaft"]["dice"] == pytest.approx(75.0)
    assert summary["per_class"]["wrist"]["frames"] == 1
    assert summary["per_class"]["wrist"]["dice"] == pytest.approx(0.0)
    assert summary["per_class"]["jaw"] == {
        "dice": None,
        "iou": None,
        "hd95": None,
        "assd": None,
        "frames": 0,
    }
    assert summary["dice"] == pytest.approx(37.5)
    assert summary["hd95"] == pytest.approx(
        (summary["per_class"]["shaft"]["hd95"] + math.sqrt(4**2 + 6**2)) / 2
    )


def test_meter_per_frame_rows_list_each_scored_class_in_percent():
    meter = SegmentationMeter(num_classes=2, class_names=("background", "tool"))
    meter.update(label_map(6, 8, {1: PRED_4})[None], label_map(6, 8, {1: GT_6})[None], ["v1/0003"])
    meter.update(torch.zeros(1, 6, 8, dtype=torch.long), torch.zeros(1, 6, 8, dtype=torch.long))
    rows = meter.per_frame()
    assert len(rows) == 1
    assert rows[0]["sample_id"] == "v1/0003"
    assert rows[0]["class"] == "tool"
    assert rows[0]["dice"] == pytest.approx(60.0)
    assert meter.num_frames == 2
    assert meter.summary()["dice"] == pytest.approx(60.0)


def test_binary_meter_names_its_only_class_instrument():
    meter = SegmentationMeter(binary_target=True)
    meter.update(label_map(4, 6, {3: [(1, 1)]})[None], label_map(4, 6, {1: [(1, 1)]})[None])
    assert list(meter.summary()["per_class"]) == ["instrument"]


def test_empty_meter_summary_and_wrong_id_count_are_errors():
    meter = SegmentationMeter()
    with pytest.raises(ValueError, match="before any update"):
        meter.summary()
    with pytest.raises(ValueError, match="2 sample_ids for a batch of 1"):
        meter.update(
            torch.zeros(1, 4, 6, dtype=torch.long),
            torch.zeros(1, 4, 6, dtype=torch.long),
            ["a", "b"],
        )


@pytest.mark.parametrize(
    ("num_classes", "pred", "target", "expected"),
    [
        # class 1: pred {(0,0)}, gt {(0,0),(0,1)} -> Dice 2/3, IoU 1/2; class 2: pred
        # {(0,1),(1,0)}, gt {(1,0)} -> 2/3, 1/2; the ignored pixel (1,1) counts for neither
        (3, [[1, 2], [2, 0]], [[1, 1], [2, 255]], {1: (2 / 3, 1 / 2), 2: (2 / 3, 1 / 2)}),
        # class 4: pred 2 pixels, gt 1, shared 1 -> 2/3, 1/2; class 5: pred 1, gt 2, shared 1
        # -> 2/3, 1/2; classes 1-3 absent from both: not scored
        (
            6,
            [[0, 5, 0], [0, 4, 4]],
            [[0, 5, 5], [0, 0, 4]],
            {4: (2 / 3, 1 / 2), 5: (2 / 3, 1 / 2)},
        ),
    ],
    ids=["3-classes", "6-classes"],
)
def test_the_network_class_count_is_the_scored_class_count(num_classes, pred, target, expected):
    pred, target = torch.tensor(pred), torch.tensor(target)
    scores = frame_metrics(pred, target, num_classes=num_classes)
    assert set(scores) == set(expected)
    for c, (dice, iou) in expected.items():
        assert scores[c]["dice"] == pytest.approx(dice) and scores[c]["iou"] == pytest.approx(iou)
    meter = SegmentationMeter(num_classes=num_classes, distances=False)
    meter.update(pred[None], target[None])
    summary = meter.summary()
    assert list(summary["per_class"]) == [f"class_{c}" for c in range(1, num_classes)]
    assert summary["dice"] == pytest.approx(100 * 2 / 3)
    assert summary["hd95"] is None and summary["assd"] is None  # distances not computed
    assert [r for r in meter.per_frame() if "hd95" in r] == []
