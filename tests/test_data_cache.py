"""The preprocessed frame cache (fedst/data/clips/cache.py, issue 60 item 4): a clip dataset that
reads it gives the items decoding gives (clips, augmentation, labels, evaluation frames), reads no
frame from its source, and stops with a CacheError naming the file, what differs and the build
command whenever the cache is missing or stale; ``python -m fedst.preprocess`` builds and checks
it from train_fed.py's overrides."""

from __future__ import annotations

import dataclasses
import os
import pickle
from pathlib import Path

import cv2
import numpy as np
import pytest
import torch
from conftest import record_reads

from fedst.app.nodes import site_node_config
from fedst.cli import compose_experiment
from fedst.config import ConfigError
from fedst.data.base import DataError
from fedst.data.clips import (
    AugmentConfig,
    BatchStream,
    ClipConfig,
    ClipDataset,
    FrameDataset,
)
from fedst.data.clips.cache import BUILD_COMMAND, CachedSource, CacheError
from fedst.data.clips.cache_build import build_site_cache
from fedst.data.generic import GenericLayoutSource
from fedst.data.registry import open_site
from fedst.experiment.roles import resume_safe_keys
from fedst.experiment.site_view import SiteNodeConfig, site_view
from fedst.preprocess import main as preprocess
from fedst.scoring.site_data import open_site_data

SPLITS = ["train", "val", "test"]
AUGMENT = AugmentConfig(rotate_limit_deg=15, scale_limit=0.1, hflip=True, color_jitter=0.2)
AUG_SEEDS = (0, 987654321)


def assert_same_items(decoded: ClipDataset, cached: ClipDataset) -> int:
    """Every sample's uint8 item (two augmentation seeds) and every frame its clips read (as
    evaluation reads it, with its native label) equal; the number of samples compared."""
    assert cached.cached is not None and decoded.cached is None
    for index in range(len(decoded)):
        for seed in AUG_SEEDS:
            clip_a, mask_a, id_a = decoded.load_raw((index, seed))
            clip_b, mask_b, id_b = cached.load_raw((index, seed))
            assert id_a == id_b
            assert torch.equal(clip_a, clip_b), f"clip of {id_a} (aug seed {seed}) differs"
            assert torch.equal(mask_a, mask_b), f"mask of {id_a} (aug seed {seed}) differs"
    plan = [
        (v, p, p in decoded.videos[v].labels)
        for v, positions in enumerate(decoded.needed_positions())
        for p in positions
    ]
    for item_a, item_b in zip(FrameDataset(decoded, plan), FrameDataset(cached, plan), strict=True):
        assert torch.equal(item_a[0], item_b[0])
        assert (item_a[1] is None) == (item_b[1] is None)
        if item_a[1] is not None:
            assert torch.equal(item_a[1], item_b[1])
    return len(decoded)


# -- the procedural benchmark --------------------------------------------------------------------


@pytest.fixture(scope="module")
def procedural_cache(tiny_data: Path, tmp_path_factory) -> tuple:
    """(config with data.cache_dir, its clip config): site A of the tiny benchmark cached at
    48x56 (its frames are 64x80: the cache holds resized pixels)."""
    cache_dir = tmp_path_factory.mktemp("frame_cache")
    cfg, _ = compose_experiment(
        [
            "experiment=tiny",
            f"data.root={tiny_data}",
            f"data.cache_dir={cache_dir}",
            "clip.image_size=[48,56]",
        ]
    )
    clip = cfg.clip_config()
    build_site_cache(cfg.data.open_decoded("A"), SPLITS, clip, cache_dir)
    return cfg, clip


def test_cached_clips_equal_decoded_clips_on_the_procedural_benchmark(procedural_cache):
    cfg, clip = procedural_cache
    assert clip.num_frames == 4 and clip.image_size == (48, 56)
    for split, augment in (("train", AUGMENT), ("test", None)):
        decoded = ClipDataset(cfg.data.open_decoded("A"), split, clip, augment, validate=False)
        cached = ClipDataset(cfg.data.open("A"), split, clip, augment, validate=False)
        assert assert_same_items(decoded, cached) >= 6
        assert tuple(cached.load_raw(0)[0].shape) == (4, 3, 48, 56)


def test_a_cached_dataset_decodes_no_frame_and_reads_no_label_for_training(
    procedural_cache, monkeypatch
):
    cfg, clip = procedural_cache
    cached = ClipDataset(cfg.data.open("A"), "train", clip, AUGMENT, validate=False)
    reads = record_reads(monkeypatch)
    for index in range(len(cached)):
        cached.load_raw((index, 1))
    for video_index, positions in enumerate(cached.needed_positions()):
        for position in positions:
            cached.read_raw_frame(cached.videos[video_index], position)
    assert reads == []


def test_training_opens_the_cache_through_data_cache_dir_and_not_by_default(procedural_cache):
    cfg, _ = procedural_cache
    opened = open_site_data(cfg, "A", ("train", "test"))
    assert isinstance(opened.source, CachedSource)
    assert opened.train.cached is not None and opened.test.cached is not None
    default, _ = compose_experiment(["experiment=tiny", f"data.root={cfg.data.root}"])
    assert default.data.cache_dir is None
    assert not isinstance(default.data.open("A"), CachedSource)
    assert "data.cache_dir" in resume_safe_keys()  # a node's folder: a resumed run may set it


def test_a_site_in_the_federation_reads_its_cache_from_its_node_config(procedural_cache):
    cfg, _ = procedural_cache
    node = site_node_config(cfg, "A")
    assert node.frame_cache == cfg.data.cache_dir
    view = site_view(cfg)
    assert view.data.cache_dir is None  # a folder of this machine: not sent to other sites
    local = SiteNodeConfig.from_node_config(node.to_node_config()).local_experiment(view, "A")
    assert local.data.cache_dir == cfg.data.cache_dir
    assert isinstance(local.data.open("A"), CachedSource)


def test_the_validation_before_training_shares_its_cache_with_decoding(generic_site, monkeypatch):
    source, clip, cache_dir = generic_site
    ClipDataset(source, "train", clip)  # validated: every file's result cached
    reads = record_reads(monkeypatch)
    ClipDataset(CachedSource(source, cache_dir), "train", clip)  # validated again, from that cache
    assert reads == []


def test_a_cached_dataset_pickles_without_its_arrays(procedural_cache):
    cfg, clip = procedural_cache
    cached = ClipDataset(cfg.data.open("A"), "train", clip, AUGMENT, validate=False)
    expected = cached.load_raw((0, 5))  # opens the memory maps in this process
    payload = pickle.dumps(cached)  # what a loader worker receives
    assert len(payload) < 100_000
    received = pickle.loads(payload)
    assert received.cached._maps == {}
    got = received.load_raw((0, 5))
    assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])


def test_a_loader_worker_sends_the_batches_decoding_sends(procedural_cache):
    cfg, clip = procedural_cache
    decoded = ClipDataset(cfg.data.open_decoded("A"), "train", clip, AUGMENT, validate=False)
    cached = ClipDataset(cfg.data.open("A"), "train", clip, AUGMENT, validate=False)
    in_process = BatchStream(decoded, batch_size=2, seed=3, num_workers=0, num_classes=4)
    worker = BatchStream(cached, batch_size=2, seed=3, num_workers=1, num_classes=4)
    try:
        for _ in range(3):
            expected, got = in_process.next_batch(), worker.next_batch()
            assert torch.equal(expected[0], got[0]) and torch.equal(expected[1], got[1])
            assert expected[2] == got[2]
    finally:
        worker.close()


# -- a real dataset's format: SAR-RARP50 (10 Hz PNG frames; 60 fps AVI frames) ---------------------


def textured(seed: int, shape: tuple[int, int]) -> np.ndarray:
    """A smooth random RGB texture (bilinear resizing changes it visibly)."""
    rng = np.random.default_rng(seed)
    small = rng.integers(0, 256, (shape[0] // 4, shape[1] // 4, 3), dtype=np.uint8)
    return cv2.resize(small, (shape[1], shape[0]), interpolation=cv2.INTER_CUBIC)


def write_sarrarp50(root: Path, shape: tuple[int, int] = (48, 64)) -> Path:
    """train1/video_01: 10 Hz PNG frames (indices 0..120 by 6), masks at 0, 60, 120;
    test/video_41: a 60 fps MJPG AVI of 70 frames, masks at 0 and 60."""
    height, width = shape
    mask = np.zeros(shape, np.uint8)
    mask[5:15, 10:30], mask[20:30, 30:50], mask[32:40, 5:20] = 3, 2, 1  # SAR ids: shaft/wrist/jaw
    video = root / "train1" / "video_01"
    for index in range(0, 121, 6):
        path = video / "rgb" / f"{index:09d}.png"
        path.parent.mkdir(parents=True, exist_ok=True)
        assert cv2.imwrite(str(path), textured(index, shape))
    avi = root / "test" / "video_41"
    avi.mkdir(parents=True)
    writer = cv2.VideoWriter(
        str(avi / "video_left.avi"), cv2.VideoWriter_fourcc(*"MJPG"), 60.0, (width, height)
    )
    for index in range(70):
        writer.write(textured(1000 + index, shape))
    writer.release()
    for folder, indices in ((video, (0, 60, 120)), (avi, (0, 60))):
        for index in indices:
            path = folder / "segmentation" / f"{index:09d}.png"
            path.parent.mkdir(parents=True, exist_ok=True)
            assert cv2.imwrite(str(path), mask)
    return root


def test_cached_clips_equal_decoded_clips_on_a_sarrarp50_dataset(tmp_path):
    root = write_sarrarp50(tmp_path / "sarrarp50")
    source = open_site("sarrarp50", root, "C")
    clip = ClipConfig(num_frames=4, interval_s=0.2, image_size=(36, 40))
    build_site_cache(source, ["train", "test"], clip, tmp_path / "cache")
    cached_source = CachedSource(source, tmp_path / "cache")
    compared = 0
    for split, augment in (("train", AUGMENT), ("test", None), ("test", AUGMENT)):
        decoded = ClipDataset(source, split, clip, augment, validate=False)
        cached = ClipDataset(cached_source, split, clip, augment, validate=False)
        assert any(len(p) > 1 for p in cached.needed_positions())  # clips read unlabelled frames
        compared += assert_same_items(decoded, cached)
    assert compared == 3 + 2 + 2


# -- a stale or missing cache is an error, never a fallback --------------------------------------


@pytest.fixture
def generic_site(write_site, tmp_path) -> tuple[GenericLayoutSource, ClipConfig, Path]:
    """A 12-frame generic-layout site (every 3rd frame labelled) cached at 16x20, 4-frame clips."""
    written = write_site("S", {"v1": 12}, size=(32, 40), label_every=3)
    source = GenericLayoutSource(written.root, "S")
    clip = ClipConfig(num_frames=4, interval_s=0.2, image_size=(16, 20))
    build_site_cache(source, ["train"], clip, tmp_path / "cache")
    return source, clip, tmp_path / "cache"


def test_a_missing_cache_stops_naming_the_manifest_and_the_build_command(generic_site, tmp_path):
    source, clip, _ = generic_site
    with pytest.raises(CacheError) as raised:
        ClipDataset(CachedSource(source, tmp_path / "elsewhere"), "train", clip, validate=False)
    message = str(raised.value)
    assert f"{tmp_path / 'elsewhere'}/S/16x20/manifest.json is missing" in message
    assert BUILD_COMMAND in message and "data.cache_dir=" in message


def test_another_input_size_stops_naming_the_sizes_the_cache_holds(generic_site):
    source, _, cache_dir = generic_site
    other = ClipConfig(num_frames=4, interval_s=0.2, image_size=(24, 20))
    with pytest.raises(CacheError, match=r"at 24x20: .* \(it holds sizes \['16x20'\]\)"):
        ClipDataset(CachedSource(source, cache_dir), "train", other, validate=False)


def test_other_preprocessing_settings_stop_naming_what_differs(generic_site, monkeypatch):
    source, clip, cache_dir = generic_site
    monkeypatch.setattr(cv2, "__version__", "0.0.1")
    with pytest.raises(CacheError, match=r"other preprocessing settings \(opencv: built with '"):
        ClipDataset(CachedSource(source, cache_dir), "train", clip, validate=False)


def test_a_changed_source_file_stops_naming_the_file(generic_site):
    source, clip, cache_dir = generic_site
    ClipDataset(CachedSource(source, cache_dir), "train", clip, validate=False)  # up to date
    frame = source.videos("train")[0].frames[4].path  # an unlabelled clip frame
    stat = frame.stat()
    os.utime(frame, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))
    with pytest.raises(CacheError) as raised:
        ClipDataset(CachedSource(source, cache_dir), "train", clip, validate=False)
    assert f"source file {frame} changed since the cache was built" in str(raised.value)
    assert BUILD_COMMAND in str(raised.value)
    frame.unlink()
    with pytest.raises(CacheError, match=f"source file {frame} cannot be read"):
        ClipDataset(CachedSource(source, cache_dir), "train", clip, validate=False)


def test_a_clip_reading_a_frame_the_cache_lacks_stops(generic_site, tmp_path):
    source, clip, cache_dir = generic_site
    single = dataclasses.replace(clip, num_frames=1)  # the labelled frames alone: a subset
    assert ClipDataset(CachedSource(source, cache_dir), "train", single, validate=False).cached
    build_site_cache(source, ["train"], single, tmp_path / "single")
    with pytest.raises(
        CacheError, match=r"lacks frame position\(s\) \[1, 2, 4, 5, 7\] .*'num_frames': 1,"
    ):
        ClipDataset(CachedSource(source, tmp_path / "single"), "train", clip, validate=False)


def test_a_video_listed_differently_is_not_found_in_the_cache(generic_site):
    source, clip, cache_dir = generic_site
    frames = source.site_root / "videos" / "v1" / "frames"
    (frames / "000000013.png").write_bytes((frames / "000000011.png").read_bytes())
    # one more frame: the video's listing, hence its key, changes
    fresh = GenericLayoutSource(source.site_root.parent, "S")
    with pytest.raises(CacheError, match="video 'v1' is not in the cache"):
        ClipDataset(CachedSource(fresh, cache_dir), "train", clip, validate=False)


def test_a_label_of_another_size_stops_the_build_as_it_stops_the_loader(write_site, tmp_path):
    written = write_site("S", {"v1": 4}, size=(32, 40))
    assert cv2.imwrite(str(written.masks["v1"][2]), np.zeros((30, 40), np.uint8))
    source = GenericLayoutSource(written.root, "S")
    clip = ClipConfig(num_frames=2, interval_s=0.2, image_size=(16, 20))
    decoded = ClipDataset(source, "train", clip, validate=False)
    with pytest.raises(DataError) as loader_error:
        decoded.load_raw(2)
    with pytest.raises(DataError) as build_error:
        build_site_cache(source, ["train"], clip, tmp_path / "cache")
    assert str(build_error.value) == str(loader_error.value)
    assert "mask size (30, 40) differs from frame size (32, 40)" in str(build_error.value)
    assert not (tmp_path / "cache" / "S" / "16x20" / "manifest.json").exists()


def test_a_second_build_keeps_unchanged_videos_and_rewrites_changed_ones(write_site, tmp_path):
    written = write_site("S", {"v1": 6, "v2": 6}, size=(32, 40))
    source = GenericLayoutSource(written.root, "S")
    clip = ClipConfig(num_frames=2, interval_s=0.2, image_size=(16, 20))
    first = build_site_cache(source, ["train"], clip, tmp_path / "cache")
    assert (first.videos_written, first.videos_kept, first.frames) == (2, 0, 12)
    again = build_site_cache(source, ["train"], clip, tmp_path / "cache")
    assert (again.videos_written, again.videos_kept) == (0, 2)
    stat = written.frames["v2"][3].stat()
    os.utime(written.frames["v2"][3], ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    third = build_site_cache(source, ["train"], clip, tmp_path / "cache")
    assert (third.videos_written, third.videos_kept) == (1, 1)
    assert len(list(third.folder.glob("*.npy"))) == 4  # the replaced video's old files are gone
    ClipDataset(CachedSource(source, tmp_path / "cache"), "train", clip, validate=False)


# -- the command -----------------------------------------------------------------------------------


def test_the_command_builds_the_cache_training_reads_and_check_finds_what_is_missing(
    tiny_data, tmp_path, capsys
):
    common = ["experiment=tiny", f"data.root={tiny_data}", f"data.cache_dir={tmp_path}"]
    assert preprocess(["build", "--sites", "A,synthetic", *common]) == 0
    printed = capsys.readouterr().out
    assert "site A (test, train, val): " in printed and "site synthetic (train): " in printed
    assert preprocess(["check", "--sites", "A,synthetic", *common]) == 0
    assert preprocess(["check", "--sites", "A,B", *common]) == 1
    printed = capsys.readouterr().out
    assert "site A split train: 12 samples, cache up to date" in printed
    assert (
        f"site B split train: STALE: site 'B' split 'train': data.cache_dir={tmp_path}" in printed
    )
    with pytest.raises(ConfigError, match=r"data\.cache_dir is not set"):
        preprocess(["build", "experiment=tiny", f"data.root={tiny_data}"])
