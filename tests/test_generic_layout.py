"""Specification of the generic-layout backend: what it reads, the DataError of each bad input."""

from __future__ import annotations

import json

import cv2
import numpy as np
import pytest

from fedst.data.base import DataError
from fedst.data.clips import ClipConfig, ClipDataset
from fedst.data.generic import GenericLayoutSource
from fedst.data.registry import open_site

SMALL = ClipConfig(num_frames=2, image_size=(16, 20))


def test_reads_videos_with_times_from_frame_index_and_fps(write_site):
    site = write_site("D", videos={"v1": [0, 1, 3, 4], "v2": 2}, fps=2, label_every=2)
    source = GenericLayoutSource(site.root, "D")
    v1, v2 = source.videos("train")
    assert (source.fps, source.surgery_type, source.binary) == (2, "hysterectomy", False)
    assert v1.video_id == "v1"
    assert v1.times == [0.0, 0.5, 1.5, 2.0]
    assert [f.path for f in v1.frames] == [site.frames["v1"][i] for i in (0, 1, 3, 4)]
    assert {pos: ref.path for pos, ref in v1.labels.items()} == {
        0: site.masks["v1"][0],
        3: site.masks["v1"][4],
    }
    assert sorted(v2.labels) == [0]


def test_site_dir_option_and_registry_open_the_same_site(write_site):
    site = write_site("folder_d", videos={"v1": 2})
    source = open_site("generic", site.root, "D", site_dir="folder_d")
    assert isinstance(source, GenericLayoutSource)
    assert source.name == "D"
    assert len(source.videos("val")) == 1


def test_read_frame_is_rgb_and_read_label_is_the_written_map(write_site):
    site = write_site("D", videos={"v1": 3})
    source = GenericLayoutSource(site.root, "D")
    video = source.videos("train")[0]
    rgb = source.read_frame(video.frames[2])
    assert rgb.dtype == np.uint8 and rgb.shape == (32, 40, 3)
    assert tuple(rgb[0, 0]) == (22, 90, 50)
    label = source.read_label(video.labels[2])
    assert label.shape == (32, 40)
    assert set(np.unique(label).tolist()) == {0, 1, 2, 3}


def test_missing_meta_json_names_the_file(write_site):
    site = write_site("D", videos={"v1": 2})
    (site.site_dir / "meta.json").unlink()
    with pytest.raises(DataError, match=r"meta\.json"):
        GenericLayoutSource(site.root, "D")


def test_meta_without_fps_names_the_file_and_key(write_site):
    site = write_site("D", videos={"v1": 2})
    meta = json.loads((site.site_dir / "meta.json").read_text())
    del meta["fps"]
    (site.site_dir / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(DataError, match=r"meta\.json.*'fps'"):
        GenericLayoutSource(site.root, "D")


def test_listed_video_without_frames_names_the_frames_folder(write_site):
    site = write_site("D", videos={"v1": 2, "v2": 2})
    for path in site.frames["v2"].values():
        path.unlink()
    for path in site.masks["v2"].values():
        path.unlink()
    source = GenericLayoutSource(site.root, "D")
    with pytest.raises(DataError, match=r"v2/frames.*no frames"):
        source.videos("train")


def test_mask_without_its_frame_names_the_mask(write_site):
    site = write_site("D", videos={"v1": 3})
    site.frames["v1"][1].unlink()
    source = GenericLayoutSource(site.root, "D")
    with pytest.raises(DataError, match=r"masks/000000001\.png: mask without its frame"):
        source.videos("train")


def test_split_listing_an_unknown_video_names_the_split_file(write_site):
    site = write_site("D", videos={"v1": 2}, splits={"train": ["v1", "ghost"]})
    source = GenericLayoutSource(site.root, "D")
    with pytest.raises(DataError, match=r"splits/train\.txt: lists unknown video 'ghost'"):
        source.videos("train")


def test_empty_split_names_the_empty_file(write_site):
    site = write_site("D", videos={"v1": 2}, splits={"train": ["v1"], "test": []})
    source = GenericLayoutSource(site.root, "D")
    assert len(source.videos("train")) == 1
    with pytest.raises(DataError, match=r"splits/test\.txt: split file is empty"):
        source.videos("test")


def test_unreadable_frame_names_the_file_at_read_time(write_site):
    site = write_site("D", videos={"v1": 3})
    site.frames["v1"][2].write_bytes(b"this is not a png")
    source = GenericLayoutSource(site.root, "D")
    video = source.videos("train")[0]
    with pytest.raises(DataError, match=r"frames/000000002\.png: unreadable"):
        source.read_frame(video.frames[2])
    dataset = ClipDataset(source, "train", clip=SMALL, validate=False)
    with pytest.raises(DataError, match=r"frames/000000002\.png: unreadable"):
        dataset[2]


def test_validation_reports_an_unreadable_frame_by_name(write_site):
    site = write_site("D", videos={"v1": 3})
    site.frames["v1"][1].write_bytes(b"\x89PNG garbage")
    with pytest.raises(DataError, match=r"frames/000000001\.png: unreadable"):
        ClipDataset(GenericLayoutSource(site.root, "D"), "train", clip=SMALL)


def test_label_value_outside_classes_names_file_and_value(write_site):
    site = write_site("D", videos={"v1": 3})
    bad = cv2.imread(str(site.masks["v1"][1]), cv2.IMREAD_UNCHANGED)
    bad[0, 0] = 7
    cv2.imwrite(str(site.masks["v1"][1]), bad)
    source = GenericLayoutSource(site.root, "D")
    with pytest.raises(DataError, match=r"masks/000000001\.png: label value\(s\) \[7\]"):
        source.read_label(source.videos("train")[0].labels[1])


def test_validation_reports_every_bad_label_in_one_error(write_site):
    site = write_site("D", videos={"v1": 4})
    for index, value in ((1, 7), (3, 9)):
        bad = cv2.imread(str(site.masks["v1"][index]), cv2.IMREAD_UNCHANGED)
        bad[-1, -1] = value
        cv2.imwrite(str(site.masks["v1"][index]), bad)
    with pytest.raises(DataError) as caught:
        ClipDataset(GenericLayoutSource(site.root, "D"), "train", clip=SMALL)
    message = str(caught.value)
    assert "2 bad label(s) of 4" in message
    assert "000000001.png: label value(s) [7]" in message
    assert "000000003.png: label value(s) [9]" in message


def test_validation_caps_the_list_of_problems(write_site):
    site = write_site("D", videos={"v1": 23}, size=(8, 10))
    for path in site.masks["v1"].values():
        cv2.imwrite(str(path), np.full((8, 10), 5, np.uint8))
    with pytest.raises(DataError, match=r"23 bad label\(s\)[\s\S]*\.\.\. and 3 more"):
        ClipDataset(GenericLayoutSource(site.root, "D"), "train", clip=SMALL)


def test_frame_and_mask_size_mismatch_names_the_mask(write_site):
    site = write_site("D", videos={"v1": 2})
    cv2.imwrite(str(site.masks["v1"][1]), np.zeros((16, 20), np.uint8))
    source = GenericLayoutSource(site.root, "D")
    with pytest.raises(DataError, match=r"masks/000000001\.png: mask size \(16, 20\) differs"):
        ClipDataset(source, "train", clip=SMALL)
    unvalidated = ClipDataset(source, "train", clip=SMALL, validate=False)
    with pytest.raises(DataError, match=r"masks/000000001\.png: mask size"):
        unvalidated[1]


def test_binary_site_labels_are_zero_one_ignore(write_site):
    site = write_site("G", videos={"v1": 2}, binary=True)
    source = GenericLayoutSource(site.root, "G")
    dataset = ClipDataset(source, "test", clip=SMALL)
    assert dataset.binary and source.classes == ("background", "instrument")
    _, mask, _ = dataset[0]
    assert set(mask.unique().tolist()) == {0, 1}
    cv2.imwrite(str(site.masks["v1"][1]), np.full((32, 40), 2, np.uint8))
    with pytest.raises(DataError, match=r"000000001\.png: label value\(s\) \[2\]"):
        ClipDataset(GenericLayoutSource(site.root, "G"), "test", clip=SMALL)


def test_ignore_value_255_is_a_valid_label(write_site):
    site = write_site("D", videos={"v1": 1})
    label = cv2.imread(str(site.masks["v1"][0]), cv2.IMREAD_UNCHANGED)
    label[:4] = 255
    cv2.imwrite(str(site.masks["v1"][0]), label)
    dataset = ClipDataset(GenericLayoutSource(site.root, "D"), "train", clip=SMALL)
    assert 255 in dataset[0][1].unique().tolist()
