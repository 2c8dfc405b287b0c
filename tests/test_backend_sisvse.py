"""SISVSE backend (server synthetic set): category ids -> parts, 100 + id masks, single frames."""

from __future__ import annotations

from pathlib import Path

import cv2
import numpy as np
import pytest

from fedst.data.base import DataError
from fedst.data.clips import ClipConfig, ClipDataset
from fedst.data.registry import open_site
from fedst.data.sisvse import SisvseSource

H, W = 8, 40
IDS = list(range(32))
EXPECTED = [0, 3, 1, 3, 2, 1, 3, 2, 1, 3, 1, 3, 1, 3, 2, 1, 3, 2, 1] + [0] * 13


def write_image(path: Path, array: np.ndarray) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    assert cv2.imwrite(str(path), array)


def id_mask(offset: int) -> np.ndarray:
    """Column c holds category id c (0..31), stored as offset + id where the id is > 0."""
    mask = np.zeros((H, W), np.uint8)
    for category in IDS:
        mask[:, category] = category + offset if category else 0
    return mask


@pytest.fixture()
def dataset(tmp_path) -> Path:
    root = tmp_path / "miccai2022_sisvse_dataset"
    for image_set, names, offset in (
        ("manual_syn", ["a_2", "a_10"], 0),
        ("domain_random_syn", ["b_1"], 100),
        ("real", ["r_1"], 0),
    ):
        for name in names:
            write_image(root / "images" / image_set / f"{name}.jpg", np.zeros((H, W, 3), np.uint8))
            write_image(root / "semantic_masks" / image_set / f"{name}.png", id_mask(offset))
    return tmp_path


def test_synthetic_sets_are_single_frame_videos_in_train(dataset):
    source = open_site("sisvse", dataset, "synthetic")
    videos = source.videos("train")
    assert [v.video_id for v in videos] == [
        "manual_syn/a_2",
        "manual_syn/a_10",
        "domain_random_syn/b_1",
    ]
    assert all(v.times == [0.0] and list(v.labels) == [0] for v in videos)
    assert source.videos("test") == [] and source.videos("val") == []


@pytest.mark.parametrize("index", [0, 2], ids=["plain_ids", "ids_plus_100"])
def test_category_ids_map_to_parts(dataset, index):
    source = SisvseSource(dataset, "synthetic")
    label = source.read_label(source.videos("train")[index].labels[0])
    assert label[0, :32].tolist() == EXPECTED and label[:, 32:].max() == 0


def test_sets_option_selects_sets(dataset):
    source = SisvseSource(dataset, "synthetic", sets=["domain_random_syn"])
    assert [v.video_id for v in source.videos("train")] == ["domain_random_syn/b_1"]


def test_single_frame_mode_repeats_the_image(dataset):
    clips = ClipDataset(SisvseSource(dataset, "synthetic"), "train", ClipConfig(image_size=(4, 20)))
    clip, _, _ = clips[0]
    assert clip.shape == (4, 3, 4, 20)


def test_unknown_id_and_missing_image_name_the_file(dataset):
    root = dataset / "miccai2022_sisvse_dataset"
    bad = id_mask(0)
    bad[0, 35:] = 77
    write_image(root / "semantic_masks" / "manual_syn" / "a_2.png", bad)
    source = SisvseSource(dataset, "synthetic")
    with pytest.raises(DataError, match=r"a_2.png.*\{77: 5\}"):
        source.read_label(source.videos("train")[0].labels[0])
    (root / "images" / "manual_syn" / "a_10.jpg").unlink()
    with pytest.raises(DataError, match=r"a_10.png: no image"):
        SisvseSource(dataset, "synthetic").videos("train")
