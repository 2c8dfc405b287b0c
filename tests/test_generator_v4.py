"""Generator version 4 (issue 47, docs/benchmark.md "Generator version 4"): version 3's images and
masks; motion blur degrades only the pixels it changes; E's and GraSP's test splits have 30
videos; version 3 written bit for bit as before; data=demo_v4 selectable, not the default."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest

from fedst.data.procedural import generate
from fedst.data.procedural.phenomena import BLUR_CHANGES
from fedst.data.procedural.render import render_video_truth
from fedst.data.procedural.sites import PHENOMENA
from studies.temporal_claim.generator_v3 import data_report
from tests.test_generator_v3 import _has_avx512, check_outfed_demo
from tests.test_generator_versions import benchmark_digest

TINY_V3_DIGESTS = {
    "adc3342d9b38d925daab3be8d6584d0d42fc3e97ba38343af2bafceddb46ea39": "AVX-512 CPU (x86-64-v4)",
}
"""benchmark_digest of the tiny preset (seed 0, version 3) at commit 4e97d70, before version 4
existed, rendered on an AVX-512 Intel Xeon (see TINY_V1_DIGESTS on CPUs)."""

VIDEOS, FRAMES = 4, 40
NO_SMOKE_NOR_FLASH = dataclasses.replace(PHENOMENA, smoke_per_s=0.0, flash_per_s=0.0)
"""Motion blur (and folds) alone, so every degraded pixel is the blur's."""


def _render(version: int, style=NO_SMOKE_NOR_FLASH, site: str = "B") -> list:
    return [
        list(
            render_video_truth(
                site, "tiny", 0, f"video_{v:03d}", FRAMES, version=version, phenomena=style
            )
        )
        for v in range(VIDEOS)
    ]


@pytest.fixture(scope="module")
def blurred_and_sharp() -> tuple[list, list]:
    """Site B (no camera blur, so a pixel the motion blur left alone is equal in both renderings)
    with motion blur, and the same videos without it (exposure 0: the mid-exposure pose only)."""
    return _render(4), _render(4, dataclasses.replace(NO_SMOKE_NOR_FLASH, exposure_s=0.0))


@pytest.mark.skipif(not _has_avx512(), reason="digest pinned on an AVX-512 CPU")
def test_version_3_is_still_written_bit_for_bit(tmp_path: Path) -> None:
    generate(tmp_path / "tiny_v3", seed=0, preset="tiny", workers=1, progress=False, version=3)
    assert benchmark_digest(tmp_path / "tiny_v3") in TINY_V3_DIGESTS


@pytest.mark.parametrize("site", ["A", "E", "grasp"])
def test_version_4_renders_version_3s_images_and_masks(site: str) -> None:
    v3 = render_video_truth(site, "tiny", 0, "video_000", 8, version=3)
    v4 = render_video_truth(site, "tiny", 0, "video_000", 8, version=4)
    for (_, frame3, mask3, truth3), (_, frame4, mask4, truth4) in zip(v3, v4, strict=True):
        assert np.array_equal(frame3, frame4) and np.array_equal(mask3, mask4)
        assert truth3.blur_change is None and truth4.blur_change is not None


def test_motion_blur_degrades_only_the_labelled_pixels_it_changes(blurred_and_sharp) -> None:
    blurred, sharp = blurred_and_sharp
    inside = outside = unchanged = 0
    changes: list[np.ndarray] = []
    for video, sharp_video in zip(blurred, sharp, strict=True):
        for (_, frame, mask, truth), (_, sharp_frame, sharp_mask, _) in zip(
            video, sharp_video, strict=True
        ):
            assert np.array_equal(mask, sharp_mask)  # the label is the mid-exposure pose
            degraded = truth.degraded(mask)
            assert not (degraded & (mask == 0)).any()  # a subset of the labelled footprint
            assert np.array_equal(degraded, (truth.blur_change >= BLUR_CHANGES) & (mask > 0))
            change = np.abs(frame.astype(int) - sharp_frame.astype(int))  # (H, W, 3) levels
            same = (change.max(-1) == 0) & (mask > 0)
            assert not degraded[same].any()  # a pixel the blur left alone is not degraded
            changes.append(change.mean(-1)[degraded])
            for index, length in enumerate(truth.blur_px, start=1):
                footprint = (truth.tool_ids == index) & (mask > 0)
                if length >= 3.0 and footprint.any():  # version 3's "whole footprint" case
                    inside += int((footprint & degraded).sum())
                    outside += int((footprint & ~degraded).sum())
                    unchanged += int((footprint & same).sum())
    # Blurred instruments keep pixels that are not degraded (version 3 counted them all), among
    # them pixels the blur did not change at all; the degraded ones did change in the frame.
    assert inside > 0 and outside > 0 and unchanged > 0
    assert np.median(np.concatenate(changes)) >= 0.5 * BLUR_CHANGES * 255


def test_version_3_keeps_counting_a_blurred_instruments_whole_footprint() -> None:
    for *_, mask, truth in _render(3)[0]:
        for index, length in enumerate(truth.blur_px, start=1):
            footprint = (truth.tool_ids == index) & (mask > 0)
            if length >= 3.0:
                assert truth.degraded(mask)[footprint].all()


def test_the_criterion_script_measures_version_4_with_its_blur_rule() -> None:
    v3, v4 = data_report("tiny", 0, version=3), data_report("tiny", 0, version=4)
    assert (v3["version"], v4["version"]) == (3, 4)
    assert v3["median_speed_px_s"] == v4["median_speed_px_s"]  # the same videos
    assert v4["sites"]["A-D"]["degraded %"] != v3["sites"]["A-D"]["degraded %"]  # its rule


def test_demo_v4_is_selectable_with_30_video_outfed_test_splits_and_not_the_default() -> None:
    check_outfed_demo(4, 30)
