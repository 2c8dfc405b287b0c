"""Specification of the diagnosis-only oracle split (issue 15): E-like training videos written
into their own folder, never into a benchmark folder, never equal to E's test videos. (That the
benchmark's bytes did not change with the feature: tests/test_generator_versions.py, version 1.)"""

from __future__ import annotations

from pathlib import Path

import cv2
import numpy as np
import pytest

from fedst.cli import compose_experiment
from fedst.data.base import DataError
from fedst.data.generic import GenericLayoutSource
from fedst.data.procedural import generate, generate_oracle_split


@pytest.fixture(scope="module")
def benchmark(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("procedural") / "tiny"
    generate(root, seed=0, preset="tiny", workers=1, progress=False)
    return root


@pytest.fixture(scope="module")
def oracle(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("procedural") / "tiny_oracle"
    generate_oracle_split(out, seed=0, preset="tiny", site="E", workers=1, progress=False)
    return out / "E_oracle"


def _frames(site_dir: Path, split: str) -> list[np.ndarray]:
    ids = (site_dir / "splits" / f"{split}.txt").read_text().split()
    return [
        cv2.imread(str(path), cv2.IMREAD_COLOR)
        for video_id in ids
        for path in sorted((site_dir / "videos" / video_id / "frames").glob("*.png"))
    ]


def test_an_oracle_split_is_never_written_into_a_benchmark_folder(benchmark):
    with pytest.raises(DataError, match=r"holds benchmark site\(s\) \['A', 'B'.*own folder"):
        generate_oracle_split(benchmark, seed=0, preset="tiny", site="E", progress=False)
    assert not (benchmark / "E_oracle").exists()


def test_the_oracle_split_has_the_training_videos_of_a_federated_site(oracle):
    source = GenericLayoutSource(oracle.parent, "E_oracle")
    # tiny preset, site A: train 2 x 6, val 1 x 6, test 1 x 6 frames, every frame labelled
    assert [len(source.videos(s)) for s in ("train", "val", "test")] == [2, 1, 1]
    assert all(len(v.labels) == 6 for s in ("train", "val", "test") for v in source.videos(s))
    assert source.surgery_type == "lobectomy" and not source.binary


def test_no_oracle_frame_is_a_frame_of_the_sites_test_videos(benchmark, oracle):
    test_frames = {f.tobytes() for f in _frames(benchmark / "E", "test")}
    oracle_frames = [f for s in ("train", "val", "test") for f in _frames(oracle, s)]
    assert len(oracle_frames) == 24
    assert not [f for f in oracle_frames if f.tobytes() in test_frames]


def test_the_oracle_videos_look_like_site_e_and_unlike_the_federated_sites(benchmark, oracle):
    def mean_colour(frames: list[np.ndarray]) -> np.ndarray:
        return np.mean([f.reshape(-1, 3).mean(0) for f in frames], axis=0)

    oracle_colour = mean_colour(_frames(oracle, "train"))
    distance = {
        site: float(np.linalg.norm(oracle_colour - mean_colour(_frames(benchmark / site, "test"))))
        for site in ("A", "B", "C", "D", "E")
    }
    assert min(distance, key=distance.get) == "E", distance


@pytest.mark.parametrize("data", ["tiny", "demo", "paper"])
def test_no_shipped_data_config_names_an_oracle_site(data):
    cfg, _ = compose_experiment([f"data={data}"])
    named = [*cfg.data.sites, *cfg.data.federation, *cfg.data.out_of_federation]
    assert not [name for name in named if name.endswith("_oracle")]
