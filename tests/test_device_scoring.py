"""Specification of the pixel-count path of fedst.scoring.overlap: hand-counted TP / FP / FN, equality with
the MONAI reference on random and structured maps, and value checks that surface on the host."""

from __future__ import annotations

import pytest
import torch

from fedst.scoring.metrics import batch_metrics, reference_batch_metrics
from fedst.scoring.overlap import VALUE_CODES, _count_by_scatter, overlap_counts, overlap_scores

IGNORE = 255


def test_counts_match_a_hand_count_per_class():
    # 2 x 3 frame, 3 classes. class 1: pred {(0,0),(0,1)}, gt {(0,0),(1,1)} -> TP 1, FP 1, FN 1.
    # class 2: pred {(1,1),(1,2)}, gt {(0,1)} + (1,2) ignored -> TP 0, FP 1, FN 1 (the ignored
    # pixel counts in none).
    pred = torch.tensor([[[1, 1, 0], [0, 2, 2]]], dtype=torch.uint8)
    target = torch.tensor([[[1, 2, 0], [0, 1, IGNORE]]], dtype=torch.uint8)
    counts = overlap_counts(pred, target, num_classes=3)
    assert counts.counts.tolist() == [[[1, 1, 1], [0, 1, 1]]]
    assert not counts.invalid.any()
    binary = overlap_counts(pred, target, num_classes=3, binary_target=True)
    # instrument: pred {(0,0),(0,1),(1,1)} (+ (1,2) ignored), gt {(0,0),(0,1),(1,1)} -> 3, 0, 0
    assert binary.counts.tolist() == [[[3, 0, 0]]]


def test_counts_of_a_batch_stay_per_frame():
    pred = torch.tensor([[[1, 0]], [[0, 1]], [[0, 0]]], dtype=torch.uint8)
    target = torch.tensor([[[1, 1]], [[0, 0]], [[0, 0]]], dtype=torch.uint8)
    counts = overlap_counts(pred, target, num_classes=2).counts
    assert counts.tolist() == [[[1, 0, 1]], [[0, 1, 0]], [[0, 0, 0]]]
    assert overlap_scores(overlap_counts(pred, target, num_classes=2)) == [
        {1: {"dice": 2 / 3, "iou": 1 / 2, "gt_present": 1.0}},
        {1: {"dice": 0.0, "iou": 0.0, "gt_present": 0.0}},  # predicted only (challenge IoU skips)
        {},  # absent from both: skipped
    ]


def _blobs(generator: torch.Generator, batch: int, height: int, width: int, classes: int):
    """[B, H, W] int64 maps: background with a few rectangles of random foreground classes."""
    maps = torch.zeros(batch, height, width, dtype=torch.long)
    for b in range(batch):
        for _ in range(int(torch.randint(0, 5, (1,), generator=generator))):
            r0, c0 = (
                int(torch.randint(0, s - 1, (1,), generator=generator)) for s in (height, width)
            )
            r1 = r0 + 1 + int(torch.randint(0, height - r0, (1,), generator=generator))
            c1 = c0 + 1 + int(torch.randint(0, width - c0, (1,), generator=generator))
            maps[b, r0:r1, c0:c1] = int(torch.randint(1, classes, (1,), generator=generator))
    return maps


def _case(name: str):
    """(pred, target, num_classes, binary) of one named map pair (edge cases of the conventions)."""
    g = torch.Generator().manual_seed(sum(map(ord, name)))
    if name == "random-4":
        pred = torch.randint(0, 4, (3, 17, 23), generator=g)
        target = torch.randint(0, 4, (3, 17, 23), generator=g)
        target[torch.rand(target.shape, generator=g) < 0.1] = IGNORE
        return pred, target, 4, False
    if name == "blobs-4":
        pred, target = _blobs(g, 4, 30, 40, 4), _blobs(g, 4, 30, 40, 4)
        target[:, :3] = IGNORE  # an unlabelled band, predictions on it are not counted
        return pred, target, 4, False
    if name == "empty-classes":  # class 3 in neither map; class 2 only predicted; 1 only labelled
        pred = torch.zeros(2, 8, 9, dtype=torch.long)
        target = torch.zeros(2, 8, 9, dtype=torch.long)
        pred[0, 2:4, 2:5] = 2
        target[0, 5:7, 1:8] = 1
        return pred, target, 4, False
    if name == "all-ignored":  # predictions everywhere, no labelled pixel: nothing scored
        return torch.randint(0, 4, (2, 6, 7), generator=g), torch.full((2, 6, 7), IGNORE), 4, False
    if name == "prediction-only-on-ignore":
        pred = torch.zeros(1, 6, 6, dtype=torch.long)
        target = torch.zeros(1, 6, 6, dtype=torch.long)
        pred[0, 0, 0], target[0, 0, 0] = 3, IGNORE
        return pred, target, 4, False
    if name == "binary-site":  # GraSP: labels 0/1, every predicted part is instrument
        pred = _blobs(g, 3, 20, 24, 4)
        target = (_blobs(g, 3, 20, 24, 2) > 0).long()
        target[:, :, :2] = IGNORE
        return pred, target, 4, True
    if name == "six-classes":
        pred, target = _blobs(g, 3, 21, 19, 6), _blobs(g, 3, 21, 19, 6)
        return pred, target, 6, False
    raise KeyError(name)


CASES = [
    "random-4",
    "blobs-4",
    "empty-classes",
    "all-ignored",
    "prediction-only-on-ignore",
    "binary-site",
    "six-classes",
]


def _assert_scores_close(actual, expected):
    assert len(actual) == len(expected)
    for got, want in zip(actual, expected, strict=True):
        assert got.keys() == want.keys()
        for c in want:
            assert got[c].keys() == want[c].keys()
            for metric, value in want[c].items():
                assert got[c][metric] == pytest.approx(value, rel=1e-6, abs=1e-9), (c, metric)


@pytest.mark.parametrize("name", CASES)
@pytest.mark.parametrize("dtype", [torch.uint8, torch.long], ids=["uint8", "int64"])
def test_counting_path_equals_the_monai_reference(name, dtype):
    pred, target, num_classes, binary = _case(name)
    pred, target = pred.to(dtype), target.to(dtype)
    expected = reference_batch_metrics(
        pred, target, num_classes, binary_target=binary, distances=False
    )
    counted = overlap_scores(overlap_counts(pred, target, num_classes, binary_target=binary))
    _assert_scores_close(counted, expected)


@pytest.mark.filterwarnings("ignore:.*always_return_as_numpy.*:FutureWarning")
@pytest.mark.parametrize("name", ["blobs-4", "empty-classes", "binary-site"])
def test_batch_metrics_with_distances_equals_the_monai_reference(name):
    pred, target, num_classes, binary = _case(name)
    expected = reference_batch_metrics(pred, target, num_classes, binary_target=binary)
    _assert_scores_close(batch_metrics(pred, target, num_classes, binary_target=binary), expected)


@pytest.mark.parametrize(
    ("pred", "target", "message"),
    [
        ([[0, 4]], [[0, 0]], r"pred holds class value\(s\) \[4\] outside 0..3 \(frame b\)"),
        ([[0, 0]], [[0, 7]], r"got value\(s\) \[7\] \(frame b\)"),
        ([[0, 0]], [[0, -1]], r"got value\(s\) \['<0 or >255'\] \(frame b\)"),
        ([[0, 0]], [[0, 300]], r"got value\(s\) \['<0 or >255'\] \(frame b\)"),
    ],
    ids=["pred-4", "label-7", "label-negative", "label-300"],
)
def test_out_of_range_values_raise_on_the_host_naming_value_and_frame(pred, target, message):
    good = torch.zeros(1, 1, 2, dtype=torch.long)
    pred = torch.cat([good, torch.tensor([pred])])
    target = torch.cat([good, torch.tensor([target])])
    counts = overlap_counts(pred, target, num_classes=4)  # no error yet: nothing read back
    with pytest.raises(ValueError, match=message):
        overlap_scores(counts, ["a", "b"])


def test_ignore_index_that_is_a_class_or_beyond_uint8_is_refused():
    maps = torch.zeros(1, 2, 2, dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"ignore_index=2 must be a value in \[num_classes=4"):
        overlap_counts(maps, maps, num_classes=4, ignore_index=2)
    with pytest.raises(ValueError, match="ignore_index=300"):
        overlap_counts(maps, maps, num_classes=4, ignore_index=300)


def test_the_sync_free_cuda_histogram_equals_bincount():
    """The CUDA path counts with scatter_add_ (bincount syncs there); same counts on the CPU."""
    g = torch.Generator().manual_seed(3)
    codes = torch.randint(0, VALUE_CODES**2, (5000,), generator=g, dtype=torch.int32)
    codes[:100] = VALUE_CODES**2 - 1  # the last bin
    assert torch.equal(
        _count_by_scatter(codes, VALUE_CODES**2), torch.bincount(codes, minlength=VALUE_CODES**2)
    )


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: counts on the GPU")
def test_counts_on_cuda_equal_counts_on_the_cpu():
    pred, target, num_classes, _ = _case("blobs-4")
    pred, target = pred.to(torch.uint8), target.to(torch.uint8)
    on_cpu = overlap_counts(pred, target, num_classes)
    on_gpu = overlap_counts(pred.cuda(), target.cuda(), num_classes)
    assert on_gpu.counts.is_cuda
    assert torch.equal(on_gpu.cpu().counts, on_cpu.counts)
    assert torch.equal(on_gpu.cpu().invalid, on_cpu.invalid)
