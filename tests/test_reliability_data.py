"""Data reliability: user data is never deleted, every frame a clip uses is decoded before
training, every configured site is validated up front, and bad files are named."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from fedst.cli import compose_experiment
from fedst.data.base import DataError
from fedst.data.check import main as check_main
from fedst.data.generic import GenericLayoutSource
from fedst.data.procedural import GENERATOR_VERSION, generate
from fedst.training import prepare_benchmark, run_training


def test_a_split_file_with_non_utf8_bytes_is_an_error_naming_the_file(write_site):
    site = write_site("D", videos={"v1": 3})
    split = site.site_dir / "splits" / "train.txt"
    split.write_bytes(b"v1\n\xff\xfe\n")
    with pytest.raises(DataError) as caught:
        GenericLayoutSource(site.root, "D").videos("train")
    assert str(split) in str(caught.value) and "UTF-8" in str(caught.value)


def test_a_malformed_data_yaml_exits_two_with_the_file_named(tmp_path, capsys):
    config = tmp_path / "broken.yaml"
    config.write_text("federation: [A, B\nsites:\n  A: {backend: generic\n")
    assert check_main([f"data={config}"]) == 2
    assert str(config) in capsys.readouterr().err


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
        prepare_benchmark(tiny_experiment(tiny_copy), tmp_path / "run", progress=False)
    assert json.loads(meta_path.read_text())["surgery_type"] == "cholecystectomy"


def test_regenerate_rewrites_on_purpose_and_the_run_records_its_benchmark(tiny_copy, tmp_path):
    meta_path = tiny_copy / "A" / "meta.json"
    meta = json.loads(meta_path.read_text())
    meta["generator"]["seed"] = 7
    meta_path.write_text(json.dumps(meta))
    shutil.rmtree(tiny_copy / "E")  # an absent site is generated without asking
    record = prepare_benchmark(
        tiny_experiment(tiny_copy), tmp_path / "run", regenerate=True, progress=False
    )
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
