"""Data reliability: user data is never deleted, every frame a clip uses is decoded before
training, every configured site is validated up front, and bad files are named."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import cv2
import numpy as np
import pytest

from fedst.cli import compose_experiment
from fedst.config import ConfigError
from fedst.data.base import MAX_FPS, MIN_FPS, DataError
from fedst.data.check import main as check_main
from fedst.data.clips import ClipConfig, ClipDataset
from fedst.data.generic import GenericLayoutSource
from fedst.data.procedural import GENERATOR_VERSION, generate
from fedst.data.validation import MIN_FRAME_SIDE
from fedst.federation.server import FederationServer
from fedst.training import prepare_benchmark, prepare_run, run_training

REPO = Path(__file__).resolve().parents[1]


def test_a_split_file_with_non_utf8_bytes_is_an_error_naming_the_file(write_site):
    site = write_site("D", videos={"v1": 3})
    split = site.site_dir / "splits" / "train.txt"
    split.write_bytes(b"v1\n\xff\xfe\n")
    with pytest.raises(DataError) as caught:
        GenericLayoutSource(site.root, "D").videos("train")
    assert str(split) in str(caught.value) and "UTF-8" in str(caught.value)


def test_a_malformed_data_yaml_exits_two_with_the_file_named(tmp_path):
    config = tmp_path / "broken.yaml"
    config.write_text("federation: [A, B\nsites:\n  A: {backend: generic\n")
    with pytest.raises(ConfigError, match=re.escape(str(config))):  # check_main raises it ...
        check_main([f"data={config}"])
    done = subprocess.run(  # ... and the entry point prints it in one line, exit 2
        [sys.executable, "-m", "fedst.data.check", f"data={config}"],
        cwd=Path(__file__).resolve().parents[1],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 2, done.stderr[-2000:]
    (line,) = done.stderr.strip().splitlines()
    assert line.startswith("python -m fedst.data.check: error: ") and str(config) in line


# -- item 1: the benchmark is generated only where absent; user data is never deleted --------------


@pytest.fixture(scope="module")
def tiny_benchmark(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("bench") / "tiny"
    generate(root, seed=0, preset="tiny", workers=1, progress=False)
    return root


@pytest.fixture()
def tiny_copy(tiny_benchmark: Path, tmp_path: Path) -> Path:
    root = tmp_path / "tiny"
    shutil.copytree(tiny_benchmark, root)
    return root


def tiny_experiment(root: Path):
    return compose_experiment(["experiment=tiny", f"data.root={root}"])[0]


def test_a_benchmark_of_another_seed_stops_the_run_and_keeps_every_file(tiny_copy, tmp_path):
    meta_path = tiny_copy / "A" / "meta.json"
    meta = json.loads(meta_path.read_text())
    meta["generator"]["seed"] = 7  # as if generated with another seed
    meta_path.write_text(json.dumps(meta))
    user_file = tiny_copy / "A" / "videos" / "my_annotations.txt"
    user_file.write_text("hours of work")
    files_before = sorted(p for p in tiny_copy.rglob("*"))
    with pytest.raises(DataError) as caught:
        run_training(tiny_experiment(tiny_copy), tmp_path / "run", progress=False)
    message = str(caught.value)
    assert str(tiny_copy / "A") in message
    assert "generator.seed: found 7, wanted 0" in message and "regenerate=true" in message
    assert sorted(p for p in tiny_copy.rglob("*")) == files_before
    assert user_file.read_text() == "hours of work"


def test_an_edited_meta_json_is_named_not_overwritten(tiny_copy, tmp_path):
    meta_path = tiny_copy / "B" / "meta.json"
    meta = json.loads(meta_path.read_text())
    meta["surgery_type"] = "cholecystectomy"
    meta_path.write_text(json.dumps(meta))
    with pytest.raises(DataError, match="surgery_type: found 'cholecystectomy'"):
        prepare_benchmark(tiny_experiment(tiny_copy), progress=False)
    assert json.loads(meta_path.read_text())["surgery_type"] == "cholecystectomy"


def test_regenerate_rewrites_on_purpose_and_the_run_records_its_benchmark(tiny_copy, tmp_path):
    meta_path = tiny_copy / "A" / "meta.json"
    meta = json.loads(meta_path.read_text())
    meta["generator"]["seed"] = 7
    meta_path.write_text(json.dumps(meta))
    shutil.rmtree(tiny_copy / "E")  # an absent site is generated without asking
    prepare_run(tiny_experiment(tiny_copy), tmp_path / "run", regenerate=True)
    record = prepare_benchmark(tiny_experiment(tiny_copy), progress=False)  # now matches: no-op
    assert json.loads(meta_path.read_text())["generator"]["seed"] == 0
    assert (tiny_copy / "E" / "meta.json").is_file()
    saved = json.loads((tmp_path / "run" / "benchmark.json").read_text())
    assert saved == record
    assert saved["seed"] == 0 and saved["preset"] == "tiny"
    assert saved["sites"]["A"] == {"seed": 0, "preset": "tiny", "version": GENERATOR_VERSION}


def test_a_folder_without_meta_json_is_never_written_into(tmp_path):
    (tmp_path / "A" / "videos").mkdir(parents=True)
    (tmp_path / "A" / "videos" / "mine.png").write_bytes(b"x")
    with pytest.raises(DataError, match=r"without meta\.json"):
        generate(tmp_path, 0, "tiny", ["A"], workers=1, progress=False)
    assert (tmp_path / "A" / "videos" / "mine.png").read_bytes() == b"x"


# -- item 2: every frame a clip uses is decoded in full; tiny frames and bad frame rates -----------

CLIP4 = ClipConfig(num_frames=4, interval_s=0.2, image_size=(32, 40))


@pytest.fixture(autouse=True)
def _private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("FEDST_CACHE_DIR", str(tmp_path / "cache"))


def truncate(path: Path, keep: float = 0.6) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])


def test_a_truncated_jpeg_frame_is_an_error_naming_the_file(write_site):
    site = write_site("D", videos={"v1": 4}, size=(64, 80), frame_suffix=".jpg")
    bad = site.frames["v1"][2]
    truncate(bad)
    assert cv2.imread(str(bad)) is not None  # OpenCV alone decodes it (half grey), only warning
    with pytest.raises(DataError) as caught:
        ClipDataset(GenericLayoutSource(site.root, "D"), "train", clip=CLIP4)
    assert f"{bad}: truncated image (JPEG" in str(caught.value)


def test_a_truncated_png_used_only_as_clip_context_is_found_before_training(write_site):
    site = write_site("D", videos={"v1": 5}, label_every=2)  # frames 1 and 3: context only
    bad = site.frames["v1"][3]
    truncate(bad)
    source = GenericLayoutSource(site.root, "D")
    assert 3 not in {p for v in source.videos("train") for p in v.labels}
    with pytest.raises(DataError, match=re.escape(str(bad))):
        ClipDataset(source, "train", clip=CLIP4)


def test_a_labelled_png_missing_its_end_chunk_is_an_error_naming_the_file(write_site):
    site = write_site("D", videos={"v1": 2})
    bad = site.frames["v1"][1]
    bad.write_bytes(bad.read_bytes()[:-12])  # drop the IEND chunk: the header still reads
    with pytest.raises(DataError, match=re.escape(f"{bad}: ")):
        ClipDataset(GenericLayoutSource(site.root, "D"), "train", clip=CLIP4)


def test_a_one_pixel_frame_and_mask_are_rejected_with_the_minimum(write_site):
    site = write_site("D", videos={"v1": 2})
    cv2.imwrite(str(site.frames["v1"][1]), np.zeros((1, 1, 3), np.uint8))
    cv2.imwrite(str(site.masks["v1"][1]), np.zeros((1, 1), np.uint8))
    with pytest.raises(DataError) as caught:
        ClipDataset(GenericLayoutSource(site.root, "D"), "train", clip=CLIP4)
    message = str(caught.value)
    assert f"{site.frames['v1'][1]}: frame of 1x1 px" in message
    assert f"at least {MIN_FRAME_SIDE} px" in message


@pytest.mark.parametrize("fps", ["NaN", "Infinity", "0", "-5", "1e9"])
def test_a_non_finite_or_implausible_fps_is_an_error_naming_meta_json(write_site, fps):
    site = write_site("D", videos={"v1": 2})
    meta_path = site.site_dir / "meta.json"
    meta_path.write_text(meta_path.read_text().replace('"fps": 5', f'"fps": {fps}'))
    assert json.loads(meta_path.read_text())["fps"] is not None  # Python's json reads all of them
    with pytest.raises(DataError) as caught:
        GenericLayoutSource(site.root, "D")
    assert str(meta_path) in str(caught.value) and f"[{MIN_FPS}, {MAX_FPS}]" in str(caught.value)


def test_validation_is_paid_once_and_redone_for_a_changed_file(write_site, monkeypatch):
    site = write_site("D", videos={"v1": 4})
    decoded: list[Path] = []
    original = GenericLayoutSource.read_frame

    def counting(self, ref):
        decoded.append(ref.path)
        return original(self, ref)

    monkeypatch.setattr(GenericLayoutSource, "read_frame", counting)
    ClipDataset(GenericLayoutSource(site.root, "D"), "train", clip=CLIP4)
    assert sorted(set(decoded)) == sorted(site.frames["v1"].values())
    decoded.clear()
    ClipDataset(GenericLayoutSource(site.root, "D"), "train", clip=CLIP4)
    assert decoded == []  # cached: nothing decoded again
    changed = site.frames["v1"][2]
    truncate(changed)
    with pytest.raises(DataError, match=re.escape(str(changed))):
        ClipDataset(GenericLayoutSource(site.root, "D"), "train", clip=CLIP4)
    assert decoded == [changed]


# -- item 4: every configured site is validated before training, all problems at once ------------


def data_yaml(tmp_path: Path, root: Path) -> Path:
    text = (REPO / "configs" / "data" / "tiny.yaml").read_text()
    text = text.replace("root: data/procedural/tiny", f"root: {root}")
    path = tmp_path / "tiny_here.yaml"
    path.write_text(text)
    return path


def test_every_sites_problems_are_reported_before_any_training(tiny_copy, tmp_path, monkeypatch):
    context_only = tiny_copy / "C" / "videos" / "video_000" / "frames" / "000000001.png"
    truncate(context_only)  # federated site C: a frame used only as clip context
    bad_mask = next((tiny_copy / "E" / "videos").glob("*/masks/000000003.png"))
    cv2.imwrite(str(bad_mask), np.full((64, 80), 9, np.uint8))  # out-of-federation site E

    def no_training(*args, **kwargs):
        raise AssertionError("training started before the data was validated")

    monkeypatch.setattr(FederationServer, "initialize", no_training)
    monkeypatch.setattr(FederationServer, "load", no_training)
    with pytest.raises(DataError) as caught:
        run_training(tiny_experiment(tiny_copy), tmp_path / "run", progress=False)
    message = str(caught.value)
    assert "site C (federation), split train" in message and str(context_only) in message
    assert "site E (out_of_federation), split test" in message and str(bad_mask) in message
    assert not (tmp_path / "run" / "checkpoints").exists()

    # the checker finds the same errors (shared code) and exits 1
    assert check_main([f"data={data_yaml(tmp_path, tiny_copy)}"]) == 1
