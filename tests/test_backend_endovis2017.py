"""EndoVis2017 backend (site A): layout, train and test part encodings, crop, folds, errors."""

from __future__ import annotations

from pathlib import Path

import cv2
import numpy as np
import pytest

from fedst.data.base import DataError, FrameRef, LabelRef
from fedst.data.clips import ClipConfig, ClipDataset, clip_frame_positions
from fedst.data.endovis2017 import EndoVis2017Source
from fedst.data.registry import open_site

H, W = 16, 20


def write_png(path: Path, array: np.ndarray) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    if array.ndim == 3:
        array = cv2.cvtColor(array, cv2.COLOR_RGB2BGR)
    assert cv2.imwrite(str(path), array)


def frame_image(value: int, shape: tuple[int, int] = (H, W)) -> np.ndarray:
    return np.full((*shape, 3), value, dtype=np.uint8)


def instrument_masks() -> dict[str, np.ndarray]:
    """Per-folder raw masks of one training frame; see expected_train_label for the result."""
    prograsp = np.zeros((H, W), np.uint8)
    prograsp[0:2, 0:10] = 10  # shaft
    prograsp[2:4, 0:10] = 20  # wrist
    prograsp[4:6, 0:10] = 30  # clasper -> jaw in TRAIN encoding
    bipolar = np.zeros((H, W), np.uint8)  # folder without the _labels suffix
    bipolar[4:6, 5:10] = 10  # overlaps prograsp's jaw: the later folder wins -> shaft
    other = np.full((H, W), 10, np.uint8)  # Other_labels: never counted
    needle_driver = np.zeros((H, W, 3), np.uint8)  # saved 3-channel: channel 0 is read
    needle_driver[10:12, 0:4, 0] = 20
    needle_driver[12:14, 0:4, 0] = 40  # probe -> background
    needle_driver[:, :, 1] = 99  # other channels are not read
    return {
        "Left_Prograsp_Forceps_labels": prograsp,
        "Maryland_Bipolar_Forceps": bipolar,
        "Other_labels": other,
        "Right_Large_Needle_Driver_labels": needle_driver,
    }


def expected_train_label() -> np.ndarray:
    label = np.zeros((H, W), np.uint8)
    label[0:2, 0:10] = 1
    label[2:4, 0:10] = 2
    label[4:6, 0:5] = 3
    label[4:6, 5:10] = 1
    label[10:12, 0:4] = 2
    return label


def make_dataset(root: Path, sequences=range(1, 9), frames=(0, 1, 2)) -> Path:
    for k in sequences:
        sequence = root / "train" / f"instrument_dataset_{k}"
        for n in frames:
            write_png(sequence / "left_frames" / f"frame{n:03d}.png", frame_image(10 * k + n))
            for folder, mask in instrument_masks().items():
                write_png(sequence / "ground_truth" / folder / f"frame{n:03d}.png", mask)
    test = root / "test" / "instrument_dataset_1"
    test_map = np.zeros((H, W), np.uint8)
    test_map[0, :4], test_map[1, :4], test_map[2, :4], test_map[3, :4] = 30, 100, 255, 200
    for n in (225, 226):
        write_png(test / "left_frames" / f"frame{n:03d}.png", frame_image(n - 200))
        nested = root / "test_labels" / "extra" / "instrument_dataset_1" / "PartsSegmentation"
        write_png(nested / f"frame{n:03d}.png", test_map)
    return root


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> Path:
    return make_dataset(tmp_path_factory.mktemp("endovis2017"))


def test_train_split_lists_eight_sequences_at_two_hz(dataset):
    source = open_site("endovis2017", dataset, "A")
    train = source.videos("train")
    assert [v.video_id for v in train] == [f"instrument_dataset_{k}" for k in range(1, 9)]
    assert train[0].times == [0.0, 0.5, 1.0]
    assert sorted(train[0].labels) == [0, 1, 2]
    assert source.videos("val") == []


def test_train_label_combines_instrument_folders_with_train_encoding(dataset):
    source = EndoVis2017Source(dataset, "A")
    video = source.videos("train")[0]
    np.testing.assert_array_equal(source.read_label(video.labels[1]), expected_train_label())
    np.testing.assert_array_equal(source.read_frame(video.frames[1]), frame_image(11))


def test_test_maps_use_test_encoding_and_train_frames_as_context(dataset):
    source = EndoVis2017Source(dataset, "A")
    (video,) = source.videos("test")
    assert video.times == [0.0, 0.5, 1.0, 112.5, 113.0]
    assert sorted(video.labels) == [3, 4]
    label = source.read_label(video.labels[3])
    assert label[:4, 0].tolist() == [1, 2, 3, 0]  # 30 shaft, 100 wrist, 255 jaw, 200 probe -> bg
    assert label[4:].max() == 0
    assert clip_frame_positions(video.times, 3, 4, 0.2) == [2, 2, 2, 3]


def test_clip_frames_are_nearest_earlier_frames_at_two_hz(dataset):
    video = EndoVis2017Source(dataset, "A").videos("train")[0]
    # t = 1.0 s: targets 0.4 / 0.6 / 0.8 s -> frames at 0.0 / 0.5 / 0.5 s
    assert clip_frame_positions(video.times, 2, 4, 0.2) == [0, 1, 1, 2]
    assert clip_frame_positions(video.times, 0, 4, 0.2) == [0, 0, 0, 0]


def test_fold_holds_out_its_sequences_as_val(dataset):
    source = EndoVis2017Source(dataset, "A", fold=1)
    assert [v.video_id for v in source.videos("val")] == [
        "instrument_dataset_2",
        "instrument_dataset_5",
    ]
    assert len(source.videos("train")) == 6


def test_clip_dataset_reads_endovis2017(dataset):
    clips = ClipDataset(EndoVis2017Source(dataset, "A"), "test", ClipConfig(image_size=(8, 10)))
    clip, mask, sample_id = clips[0]
    assert clip.shape == (4, 3, 8, 10) and mask.shape == (8, 10)
    assert sample_id == "A/instrument_dataset_1/3"


def test_crop_takes_the_official_window(tmp_path):
    image = np.zeros((1080, 1920, 3), np.uint8)
    image[28, 320] = (200, 100, 50)
    image[28 + 1023, 320 + 1279] = (1, 2, 3)
    write_png(tmp_path / "left_frames" / "frame000.png", image)
    mask = np.zeros((1080, 1920), np.uint8)
    mask[28:30, 320:322] = 30
    write_png(tmp_path / "ground_truth" / "Tool_labels" / "frame000.png", mask)
    source = EndoVis2017Source(tmp_path, "A", crop=True)
    frame = source.read_frame(FrameRef(tmp_path / "left_frames" / "frame000.png"))
    assert frame.shape == (1024, 1280, 3)
    assert source.frame_size(FrameRef(tmp_path / "left_frames" / "frame000.png")) == (1024, 1280)
    assert frame[0, 0].tolist() == [200, 100, 50] and frame[-1, -1].tolist() == [1, 2, 3]
    label = source.read_label(LabelRef(tmp_path / "ground_truth", key="frame000.png"))
    assert label.shape == (1024, 1280) and label[:2, :2].tolist() == [[3, 3], [3, 3]]
    assert label.sum() == 12


def test_crop_of_a_wrong_size_frame_names_the_file(dataset):
    source = EndoVis2017Source(dataset, "A", crop=True)
    ref = source.videos("train")[0].frames[0]
    with pytest.raises(DataError, match=r"frame000.png.*1920x1080"):
        source.read_frame(ref)


def test_unknown_mask_value_is_an_error_or_ignored(tmp_path):
    mask = np.zeros((H, W), np.uint8)
    mask[0, 0:3] = 50
    write_png(tmp_path / "ground_truth" / "Tool_labels" / "frame000.png", mask)
    ref = LabelRef(tmp_path / "ground_truth", key="frame000.png")
    with pytest.raises(DataError, match=r"ground_truth \[frame000.png\].*50 in Tool_labels: 3"):
        EndoVis2017Source(tmp_path, "A").read_label(ref)
    label = EndoVis2017Source(tmp_path, "A", on_unknown_label="ignore").read_label(ref)
    assert label[0, :4].tolist() == [255, 255, 255, 0]


def test_instrument_masks_of_different_sizes_name_the_file(tmp_path):
    write_png(tmp_path / "ground_truth" / "A_labels" / "frame000.png", np.zeros((H, W), np.uint8))
    write_png(tmp_path / "ground_truth" / "B_labels" / "frame000.png", np.zeros((H, 8), np.uint8))
    with pytest.raises(DataError, match=r"size mismatch: .*B_labels/frame000.png"):
        EndoVis2017Source(tmp_path, "A").read_label(
            LabelRef(tmp_path / "ground_truth", key="frame000.png")
        )


def test_corrupt_frame_names_the_file(tmp_path):
    path = tmp_path / "left_frames" / "frame000.png"
    path.parent.mkdir(parents=True)
    path.write_bytes(b"not a png")
    with pytest.raises(DataError, match=r"frame000.png: cannot decode"):
        EndoVis2017Source(tmp_path, "A").read_frame(FrameRef(path))


def test_unknown_option_and_missing_root_are_explained(tmp_path):
    with pytest.raises(DataError, match=r"unknown option.*'crp'.*allowed options"):
        EndoVis2017Source(tmp_path, "A", crp=True)
    with pytest.raises(DataError, match=r"missing_root"):
        EndoVis2017Source(tmp_path / "missing_root", "A")
