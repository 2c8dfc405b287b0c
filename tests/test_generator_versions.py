"""Specification of the procedural generator's versions (issue 15): version 2 adds surgical clutter
to the tissue of every real-looking site and nothing else; version 1 is still rendered bit for bit,
so results on the benchmark before issue 15 reproduce under ``data=demo_v1``."""

from __future__ import annotations

import hashlib
import json
import multiprocessing
from pathlib import Path

import cv2
import numpy as np
import pytest

from fedst.cli import compose_experiment
from fedst.config import ConfigError
from fedst.data.base import DataError
from fedst.data.procedural import LOCK_FILE, generate, render_video
from fedst.experiment import experiment_from_json

TINY_V1_DIGESTS = {
    "2fed95e7db143d7b7a67ac466e5c33e6407138c1984d9c98360c9a4be6802b86": "AVX-512 CPU (x86-64-v4)",
    "51a098e059448a6ddc88b91b6e53bc418429b3699b61d902167a458d4beb6814": "AVX2 CPU (x86-64-v3)",
}
"""benchmark_digest of the tiny preset (seed 0) as written before the oracle split and version 2
existed (commit 1a35ba5, when version 1 was the only rendering), by the CPU that renders it:
NumPy and OpenCV pick SIMD kernels by CPU, and their float results differ in the last bits
between AVX-512 and AVX2 (the second digest: commit 1a35ba5's own code rendered on an AVX2 AMD
EPYC, numpy 2.4.6, opencv 5.0.0.93, the same as the code of today)."""


def benchmark_digest(root: Path) -> str:
    """SHA-256 over every file's relative path and content (PNGs as decoded pixels and shape, so
    the digest does not depend on the PNG encoder's byte stream); the empty lock file is not
    content."""
    digest = hashlib.sha256()
    for path in sorted(p for p in root.rglob("*") if p.is_file() and p.name != LOCK_FILE):
        digest.update(str(path.relative_to(root)).encode())
        if path.suffix == ".png":
            pixels = cv2.imread(str(path), cv2.IMREAD_UNCHANGED)
            digest.update(str(pixels.shape).encode())
            digest.update(pixels.tobytes())
        else:
            digest.update(path.read_bytes())
    return digest.hexdigest()


def test_version_1_is_still_written_bit_for_bit(tmp_path: Path) -> None:
    generate(tmp_path / "tiny_v1", seed=0, preset="tiny", workers=1, progress=False, version=1)
    assert benchmark_digest(tmp_path / "tiny_v1") in TINY_V1_DIGESTS


def _video(site: str, version: int, video_id: str = "video_000") -> list[tuple]:
    return list(render_video(site, "tiny", 0, video_id, frames=3, version=version))


@pytest.mark.parametrize("site", ["A", "B", "C", "D", "E", "grasp"])
def test_version_2_changes_the_tissue_but_not_the_instruments_or_their_masks(site: str) -> None:
    v1, v2 = _video(site, 1), _video(site, 2)
    for (_, frame1, mask1), (_, frame2, mask2) in zip(v1, v2, strict=True):
        assert np.array_equal(mask1, mask2)  # same instruments, same motion, same labels
        change = np.abs(frame1.astype(int) - frame2.astype(int)).max(-1)  # (H, W) levels
        assert (change[mask1 == 0] > 10).mean() > 0.03  # the tissue changes
        # Instrument pixels away from the part borders keep their colour (anti-aliased edges
        # mix with the tissue; the sensor noise stream is the same).
        inner = cv2.erode((mask1 > 0).astype(np.uint8), np.ones((5, 5), np.uint8)) > 0
        if inner.any():
            assert np.percentile(change[inner], 90) == 0


def test_the_cartoon_server_set_is_the_same_in_both_versions() -> None:
    v1 = list(render_video("synthetic", "tiny", 0, "image_0000", version=1))
    v2 = list(render_video("synthetic", "tiny", 0, "image_0000", version=2))
    assert all(np.array_equal(a[1], b[1]) for a, b in zip(v1, v2, strict=True))


def _pale_background_share(site: str, version: int) -> float:
    """Share of tissue pixels (mask 0, inside the field of view) that look like the instruments'
    metal: HSV saturation below 0.25 and value above 0.5."""
    pale = total = 0
    for video_id in ("video_000", "video_001"):
        for _, frame, mask in _video(site, version, video_id):
            hsv = cv2.cvtColor(frame, cv2.COLOR_RGB2HSV).astype(np.float32) / 255
            tissue = (mask == 0) & (frame.sum(-1) > 30)
            pale += int(((hsv[..., 1] < 0.25) & (hsv[..., 2] > 0.5) & tissue).sum())
            total += int(tissue.sum())
    return pale / total


@pytest.mark.parametrize("site", ["A", "B", "D"])
def test_version_2_puts_metal_coloured_tissue_into_the_federated_sites(site: str) -> None:
    # Version 1: A, B, D tissue is saturated red / purple, so pale pixels are a few highlights (the
    # shortcut "pale = instrument"). Version 2: fascia covers ~14% of the canvas, plus paler patients.
    assert _pale_background_share(site, 1) < 0.05
    assert _pale_background_share(site, 2) > 0.07


def test_a_site_of_another_version_is_an_error_naming_the_version(tmp_path: Path) -> None:
    generate(tmp_path, seed=0, preset="tiny", sites=["A"], workers=1, progress=False, version=1)
    with pytest.raises(DataError, match=r"generator\.version: found 1, wanted 2"):
        generate(tmp_path, seed=0, preset="tiny", sites=["A"], workers=1, progress=False)
    meta = json.loads((tmp_path / "A" / "meta.json").read_text())
    assert meta["generator"]["version"] == 1  # nothing was changed


def test_an_unknown_version_is_refused_before_anything_is_written(tmp_path: Path) -> None:
    with pytest.raises(
        DataError, match=r"unknown generator version 7; choose one of \[1, 2, 3, 4\]"
    ):
        generate(tmp_path / "x", seed=0, preset="tiny", workers=1, progress=False, version=7)
    assert not (tmp_path / "x").exists()
    with pytest.raises(ConfigError, match=r"data.generator_version=7"):
        compose_experiment(["experiment=tiny", "data.generator_version=7"])


def test_the_demo_is_version_2_and_demo_v1_reproduces_the_benchmark_before_issue_15() -> None:
    demo, _ = compose_experiment(["experiment=demo"])
    old, _ = compose_experiment(["experiment=demo", "data=demo_v1"])
    assert (demo.data.generator_version, demo.data.root) == (2, "data/procedural/demo_v2")
    assert (old.data.generator_version, old.data.root) == (1, "data/procedural/demo_v1")
    assert old.data.procedural == demo.data.procedural == "demo"


def test_a_run_saved_before_generator_versions_existed_reads_as_version_1() -> None:
    cfg, _ = compose_experiment(["experiment=demo"])
    saved = json.loads(cfg.to_json())
    del saved["data"]["generator_version"]
    assert experiment_from_json(json.dumps(saved)).data.generator_version == 1
    assert experiment_from_json(cfg.to_json()).data.generator_version == 2


def _generate_tiny(root: str, barrier=None) -> None:
    if barrier is not None:  # both processes start generating at the same moment
        barrier.wait(timeout=120)
    generate(Path(root), seed=0, preset="tiny", workers=1, progress=False)


def test_two_processes_generating_one_absent_benchmark_write_it_once(tmp_path: Path) -> None:
    # Two runs started at once on a fresh machine (studies/outfed_floor/outfed_floor.py --jobs 2, two runners).
    root = tmp_path / "tiny"
    context = multiprocessing.get_context("spawn")
    barrier = context.Barrier(2)
    workers = [context.Process(target=_generate_tiny, args=(str(root), barrier)) for _ in range(2)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(timeout=300)
    assert [w.exitcode for w in workers] == [0, 0]
    reference = tmp_path / "reference"
    _generate_tiny(str(reference))
    assert benchmark_digest(root) == benchmark_digest(reference)
