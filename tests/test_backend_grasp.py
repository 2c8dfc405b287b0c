"""GraSP backend: binary labels from nested PNG masks or COCO RLE, 30 fps clip context, splits."""

from __future__ import annotations

import json
from pathlib import Path

import cv2
import numpy as np
import pytest

from fedst.data.base import DataError
from fedst.data.clips import ClipConfig, ClipDataset, clip_frame_positions
from fedst.data.grasp import GraspSource, rle_decode
from fedst.data.registry import open_site

H, W = 8, 10


def write_image(path: Path, array: np.ndarray) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    assert cv2.imwrite(str(path), array)


def runs_of(mask: np.ndarray) -> list[int]:
    """Uncompressed COCO RLE counts of a bool mask (column-major, starting with a 0-run)."""
    flat = mask.T.ravel().astype(np.uint8)
    runs, current, length = [], 0, 0
    for value in flat:
        if value == current:
            length += 1
        else:
            runs.append(length)
            current, length = value, 1
    return [*runs, length]


def compress(runs: list[int]) -> str:
    """pycocotools' rleToString: delta-coded 5-bit groups with a continuation bit."""
    chars = []
    for i, run in enumerate(runs):
        value = run - runs[i - 2] if i > 2 else run
        more = True
        while more:
            chunk = value & 0x1F
            value >>= 5
            more = value != -1 if chunk & 0x10 else value != 0
            chars.append(chr((chunk | (0x20 if more else 0)) + 48))
    return "".join(chars)


def write_frames(root: Path, case: str, count: int) -> None:
    for index in range(count):
        write_image(
            root / "frames" / case / f"{index:09d}.jpg", np.full((H, W, 3), index, np.uint8)
        )


@pytest.fixture()
def png_dataset(tmp_path) -> Path:
    root = tmp_path / "GraSP_30fps"
    for case in ("CASE001", "CASE041"):
        write_frames(root, case, 36)
    mask = np.zeros((H, W), np.uint8)
    mask[0, :3], mask[1, :3] = 3, 7  # instrument type ids -> instrument
    segmentations = root / "annotations" / "segmentations"
    write_image(segmentations / "CASE001" / "000000030.png", mask)
    write_image(segmentations / "test" / "CASE041" / "000000030.png", mask)  # one level deeper
    return tmp_path


def test_png_masks_give_binary_labels_and_default_test_cases(png_dataset):
    source = open_site("grasp", png_dataset, "grasp")
    assert source.binary
    assert [v.video_id for v in source.videos("train")] == ["CASE001"]
    assert [v.video_id for v in source.videos("test")] == ["CASE041"]
    video = source.videos("test")[0]
    label = source.read_label(video.labels[30])
    assert label[:2, :4].tolist() == [[1, 1, 1, 0], [1, 1, 1, 0]] and label[2:].max() == 0


def test_thirty_fps_context_frames_before_each_label(png_dataset):
    video = GraspSource(png_dataset, "grasp").videos("train")[0]
    assert len(video.frames) == 31 and sorted(video.labels) == [30]  # frames 0..30
    assert video.times[30] == 1.0
    positions = clip_frame_positions(video.times, 30, 4, 0.2)
    assert [video.frames[p].path.name for p in positions] == [
        "000000012.jpg",
        "000000018.jpg",
        "000000024.jpg",
        "000000030.jpg",
    ]
    short = GraspSource(png_dataset, "grasp", context_s=0.2).videos("train")[0]
    assert len(short.frames) == 7


def test_all_cases_as_test_split(png_dataset):
    source = GraspSource(png_dataset, "grasp", test_cases="all")
    assert source.videos("train") == [] and len(source.videos("test")) == 2
    clips = ClipDataset(source, "test", ClipConfig(image_size=(H, W)))
    clip, mask, _ = clips[0]
    assert clip.shape == (4, 3, H, W) and mask.max() == 1


def test_rle_decoding_matches_the_mask_in_both_forms():
    rng = np.random.default_rng(0)
    mask = rng.random((7, 5)) > 0.6
    mask[:, 0] = True  # a long run, then short ones: negative deltas in the compressed form
    runs = runs_of(mask)
    np.testing.assert_array_equal(rle_decode({"size": [7, 5], "counts": runs}), mask)
    np.testing.assert_array_equal(rle_decode({"size": [7, 5], "counts": compress(runs)}), mask)
    with pytest.raises(DataError, match=r"expected 7x5"):
        rle_decode({"size": [7, 5], "counts": [3, 4]})


def make_coco(root: Path, category: int) -> None:
    write_frames(root, "CASE047", 5)
    first, second = np.zeros((H, W), bool), np.zeros((H, W), bool)
    first[0, 0:2] = True
    second[3, 0:5] = True
    coco = {
        "categories": [{"id": i, "name": f"tool {i}"} for i in (4, 2, 7, 1, 3, 6, 5)],
        "images": [{"id": 11, "file_name": "CASE047/000000004.jpg", "height": H, "width": W}],
        "annotations": [
            {
                "id": 1,
                "image_id": 11,
                "category_id": 4,
                "segmentation": {"size": [H, W], "counts": compress(runs_of(first))},
            },
            {
                "id": 2,
                "image_id": 11,
                "category_id": category,
                "segmentation": {"size": [H, W], "counts": runs_of(second)},
            },
            {"id": 3, "image_id": 11, "category_id": 1, "segmentation": [[6, 6, 8, 6, 8, 7, 6, 7]]},
        ],
    }
    annotations = root / "annotations"
    annotations.mkdir(parents=True)
    (annotations / "grasp_short-term_test.json").write_text(json.dumps(coco))


def test_coco_rle_and_polygon_annotations_decode_to_binary(tmp_path):
    make_coco(tmp_path, category=7)
    source = GraspSource(tmp_path, "grasp", coco_files=["grasp_short-term_test.json"])
    assert source.label_source == "coco"
    (video,) = source.videos("test")
    assert video.video_id == "CASE047" and len(video.frames) == 5
    label = source.read_label(video.labels[4])
    expected = np.zeros((H, W), np.uint8)
    expected[0, 0:2] = 1
    expected[3, 0:5] = 1
    expected[6:8, 6:9] = 1
    np.testing.assert_array_equal(label, expected)


def test_coco_category_not_in_categories_is_unknown(tmp_path):
    make_coco(tmp_path, category=9)
    source = GraspSource(tmp_path, "grasp", coco_files=["grasp_short-term_test.json"])
    ref = source.videos("test")[0].labels[4]
    with pytest.raises(DataError, match=r"grasp_short-term_test.json \[11\].*category 9: 5"):
        source.read_label(ref)
    ignored = GraspSource(
        tmp_path, "grasp", coco_files=["grasp_short-term_test.json"], on_unknown_label="ignore"
    ).read_label(ref)
    assert ignored[3, :6].tolist() == [255] * 5 + [0]


def test_missing_frame_of_a_label_names_the_file(png_dataset):
    (png_dataset / "GraSP_30fps" / "frames" / "CASE001" / "000000030.jpg").unlink()
    with pytest.raises(DataError, match=r"CASE001/000000030.jpg"):
        GraspSource(png_dataset, "grasp").videos("train")
