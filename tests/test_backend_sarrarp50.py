"""SAR-RARP50 backend (site C): masks at 1 Hz, clip frames from rgb/ (10 Hz) or the 60 fps AVI."""

from __future__ import annotations

from pathlib import Path

import cv2
import numpy as np
import pytest

from fedst.data.base import DataError
from fedst.data.clips import ClipConfig, ClipDataset, clip_frame_positions
from fedst.data.registry import open_site
from fedst.data.sarrarp50 import SarRarp50Source

H, W = 32, 40
VIDEO_FRAMES = 70


def write_png(path: Path, array: np.ndarray) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    assert cv2.imwrite(str(path), array)


def class_mask() -> np.ndarray:
    """Row r holds class id r (0..9); rows 10+ are background."""
    mask = np.zeros((H, W), np.uint8)
    for value in range(10):
        mask[value] = value
    return mask


EXPECTED_ROWS = [0, 3, 2, 1, 0, 0, 0, 0, 0, 0]  # 1 clasper -> jaw, 2 wrist, 3 shaft, 4-9 -> bg


def brightness(index: int) -> int:
    return 3 * index


def write_video(path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    writer = cv2.VideoWriter(str(path), cv2.VideoWriter_fourcc(*"MJPG"), 60.0, (W, H))
    assert writer.isOpened()
    for index in range(VIDEO_FRAMES):
        writer.write(np.full((H, W, 3), brightness(index), np.uint8))
    writer.release()


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("sarrarp50")
    rgb_video = root / "train1" / "video_01"
    for index in range(0, 121, 6):  # 10 Hz frames from the toolkit
        write_png(rgb_video / "rgb" / f"{index:09d}.png", np.full((H, W, 3), index, np.uint8))
    for index in (0, 60, 120):  # 1 Hz masks
        write_png(rgb_video / "segmentation" / f"{index:09d}.png", class_mask())
    avi_video = root / "test" / "video_41"
    write_video(avi_video / "video_left.avi")
    for index in (0, 60):
        write_png(avi_video / "segmentation" / f"{index:09d}.png", class_mask())
    return root


def test_rgb_frames_give_ten_hz_clips_at_index_over_sixty(dataset):
    source = open_site("sarrarp50", dataset, "C")
    (video,) = source.videos("train")
    assert video.video_id == "train1/video_01"
    assert len(video.frames) == 21 and video.times[:3] == [0.0, 0.1, 0.2]
    assert sorted(video.labels) == [0, 10, 20]
    positions = clip_frame_positions(video.times, 10, 4, 0.2)
    assert [video.frames[p].path.name for p in positions] == [
        "000000024.png",
        "000000036.png",
        "000000048.png",
        "000000060.png",
    ]
    assert source.read_frame(video.frames[10])[0, 0].tolist() == [60, 60, 60]
    assert source.videos("val") == []


def test_mask_ids_map_to_parts(dataset):
    source = SarRarp50Source(dataset, "C")
    label = source.read_label(source.videos("train")[0].labels[10])
    assert label[:10, 0].tolist() == EXPECTED_ROWS and label[10:].max() == 0


def test_video_frames_are_decoded_when_there_is_no_rgb_folder(dataset):
    source = SarRarp50Source(dataset, "C")
    (video,) = source.videos("test")
    indices = [f.video_frame for f in video.frames]
    assert indices == list(range(0, VIDEO_FRAMES, 6))
    assert all(f.path.name == "video_left.avi" for f in video.frames)
    label_position = indices.index(60)
    assert video.times[label_position] == 1.0
    positions = clip_frame_positions(video.times, label_position, 4, 0.2)
    assert [indices[p] for p in positions] == [24, 36, 48, 60]
    for index in (48, 12, 60):  # out of order: seeks backwards and forwards
        frame = source.read_frame(video.frames[indices.index(index)])
        assert frame.shape == (H, W, 3)
        assert abs(float(frame.mean()) - brightness(index)) < 3  # MJPG is lossy


def test_every_video_frame_with_step_one(dataset):
    source = SarRarp50Source(dataset, "C", video_frame_step=1)
    (video,) = source.videos("test")
    assert len(video.frames) == VIDEO_FRAMES and video.times[12] == 0.2


def test_clip_dataset_reads_video_frames(dataset):
    clips = ClipDataset(SarRarp50Source(dataset, "C"), "test", ClipConfig(image_size=(H, W)))
    clip, mask, sample_id = clips[1]
    assert clip.shape == (4, 3, H, W) and sample_id == "C/test/video_41/10"
    assert mask[:10, 0].tolist() == EXPECTED_ROWS


def test_unknown_mask_value_names_the_file(tmp_path):
    video = tmp_path / "train2" / "video_7"
    write_png(video / "rgb" / "000000000.png", np.zeros((H, W, 3), np.uint8))
    bad = class_mask()
    bad[20, :5] = 12
    write_png(video / "segmentation" / "000000000.png", bad)
    source = SarRarp50Source(tmp_path, "C")
    with pytest.raises(DataError, match=r"video_7/segmentation/000000000.png.*\{12: 5\}"):
        source.read_label(source.videos("train")[0].labels[0])


def test_missing_frame_without_video_names_the_file(tmp_path):
    video = tmp_path / "train1" / "video_2"
    write_png(video / "rgb" / "000000000.png", np.zeros((H, W, 3), np.uint8))
    write_png(video / "segmentation" / "000000060.png", class_mask())
    with pytest.raises(DataError, match=r"rgb/000000060.png"):
        SarRarp50Source(tmp_path, "C").videos("train")
