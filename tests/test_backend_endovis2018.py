"""EndoVis2018 backend (site B): release folders, exact RGB(A) colour labels, repairs, errors."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import cv2
import numpy as np
import pytest

from fedst.data.base import DataError
from fedst.data.clips import ClipConfig, ClipDataset
from fedst.data.endovis2018 import BUILTIN_COLOURS, EndoVis2018Source
from fedst.data.registry import open_site

H, W = 12, 16
SHAFT, CLASPER, WRIST, KIDNEY = (0, 255, 0), (0, 255, 255), (125, 255, 12), (255, 55, 0)
LABELS_JSON = [
    {"name": "background-tissue", "color": [0, 0, 0], "classid": 0},
    {"name": "instrument-shaft", "color": list(SHAFT), "classid": 1},
    {"name": "instrument-clasper", "color": list(CLASPER), "classid": 2},
    {"name": "instrument-wrist", "color": list(WRIST), "classid": 3},
    {"name": "kidney-parenchyma", "color": list(KIDNEY), "classid": 4},
]


def write_png(path: Path, array: np.ndarray) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    if array.ndim == 3:
        code = cv2.COLOR_RGBA2BGRA if array.shape[2] == 4 else cv2.COLOR_RGB2BGR
        array = cv2.cvtColor(array, code)
    assert cv2.imwrite(str(path), array)


def colour_label(rgba: bool) -> np.ndarray:
    label = np.zeros((H, W, 4 if rgba else 3), np.uint8)
    label[0, :, :3], label[1, :, :3], label[2, :, :3], label[3, :, :3] = (
        SHAFT,
        CLASPER,
        WRIST,
        KIDNEY,
    )
    if rgba:
        label[:, :, 3] = 255
    return label


EXPECTED_ROWS = [1, 3, 2, 0]


def write_sequence(folder: Path, frames: int, rgba: bool) -> None:
    for n in range(frames):
        write_png(folder / "left_frames" / f"frame{n:03d}.png", np.full((H, W, 3), n, np.uint8))
        write_png(folder / "labels" / f"frame{n:03d}.png", colour_label(rgba))


@pytest.fixture()
def dataset(tmp_path) -> Path:
    write_sequence(tmp_path / "miccai_challenge_2018_release_1" / "seq_1", 3, rgba=True)
    write_sequence(tmp_path / "miccai_challenge_2018_release_1" / "seq_2", 2, rgba=False)
    write_sequence(tmp_path / "miccai_challenge_release_2" / "seq_10", 2, rgba=True)
    write_sequence(tmp_path / "test" / "some_release" / "seq_1", 2, rgba=False)
    labels_json = tmp_path / "miccai_challenge_2018_release_1" / "labels.json"
    labels_json.write_text(json.dumps(LABELS_JSON))
    return tmp_path


def test_sequences_are_found_in_any_release_folder(dataset):
    source = open_site("endovis2018", dataset, "B")
    assert [v.video_id for v in source.videos("train")] == ["seq_1", "seq_2", "seq_10"]
    assert [v.video_id for v in source.videos("test")] == ["test_seq_1"]
    assert source.videos("train")[0].times == [0.0, 0.5, 1.0]
    assert source.videos("val") == []


@pytest.mark.parametrize("video_index", [0, 1], ids=["rgba", "rgb"])
def test_colour_labels_decode_exactly(dataset, video_index):
    source = EndoVis2018Source(dataset, "B")
    video = source.videos("train")[video_index]
    label = source.read_label(video.labels[0])
    assert label[:, 0].tolist() == [*EXPECTED_ROWS, *([0] * (H - 4))]
    assert source.read_frame(video.frames[1]).shape == (H, W, 3)


def test_near_colour_is_unknown_and_named_with_file_and_count(dataset):
    label_file = dataset / "miccai_challenge_release_2" / "seq_10" / "labels" / "frame001.png"
    label = colour_label(rgba=False)
    label[5, :3] = (0, 254, 0)  # one step from shaft: exact matching must reject it
    write_png(label_file, label)
    source = EndoVis2018Source(dataset, "B")
    ref = source.videos("train")[2].labels[1]
    with pytest.raises(DataError, match=r"seq_10/labels/frame001.png.*\(0, 254, 0\): 3"):
        source.read_label(ref)
    ignored = EndoVis2018Source(dataset, "B", on_unknown_label="ignore").read_label(ref)
    assert ignored[5, :4].tolist() == [255, 255, 255, 0]


def test_repaired_labels_replace_the_originals(dataset):
    repaired = colour_label(rgba=False)
    repaired[0] = CLASPER  # the shaft row becomes clasper
    write_png(dataset / "repairs" / "seq_1" / "labels" / "frame002.png", repaired)
    source = EndoVis2018Source(dataset, "B")
    video = source.videos("train")[0]
    assert video.labels[2].path == dataset / "repairs" / "seq_1" / "labels" / "frame002.png"
    assert source.read_label(video.labels[2])[0, 0] == 3
    assert [v.video_id for v in source.videos("train")] == ["seq_1", "seq_2", "seq_10"]
    unrepaired = EndoVis2018Source(dataset, "B", repairs=False).videos("train")[0]
    assert unrepaired.labels[2].path.parent.parent.name == "seq_1"


def test_missing_labels_json_is_an_error_unless_builtin(dataset):
    (dataset / "miccai_challenge_2018_release_1" / "labels.json").unlink()
    with pytest.raises(DataError, match=r"no labels.json.*labels_json: builtin"):
        EndoVis2018Source(dataset, "B")
    source = EndoVis2018Source(dataset, "B", labels_json="builtin")
    assert source.colours == BUILTIN_COLOURS
    assert source.read_label(source.videos("train")[0].labels[0])[:4, 0].tolist() == EXPECTED_ROWS


def test_duplicate_sequence_is_an_error(dataset):
    shutil.copytree(
        dataset / "miccai_challenge_2018_release_1" / "seq_2",
        dataset / "miccai_challenge_release_2" / "seq_2",
    )
    with pytest.raises(DataError, match=r"seq_2 found twice"):
        EndoVis2018Source(dataset, "B").videos("train")


def test_clip_dataset_reads_endovis2018(dataset):
    clips = ClipDataset(EndoVis2018Source(dataset, "B"), "train", ClipConfig(image_size=(6, 8)))
    assert len(clips) == 7
    clip, mask, _ = clips[2]
    assert clip.shape == (4, 3, 6, 8) and set(mask.unique().tolist()) <= {0, 1, 2, 3}
