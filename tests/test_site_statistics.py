"""Specification of fedst.data.stats and the statistics message: hand-counted numbers of a
written site, the warning that names a site whose labels use another encoding, and the server's
checks of the numbers it receives."""

from __future__ import annotations

import cv2
import numpy as np
import pytest

from fedst.data.generic import GenericLayoutSource
from fedst.data.stats import (
    encoding_warnings,
    site_statistics,
    statistics_from_record,
    statistics_to_record,
)


@pytest.fixture
def federation(write_site, tmp_path):
    """Three conftest sites A, B, C with shaft, wrist and jaw in every labelled frame."""
    for name in ("A", "B", "C"):
        write_site(name, {"v1": 6, "v2": 4}, label_every=2)
    return tmp_path


def statistics(root, name):
    return site_statistics(GenericLayoutSource(root, name), sample_frames=4)


def recode_masks(root, name, table: dict[int, int]) -> None:
    """Rewrite every mask of site ``name`` with its values mapped through ``table``."""
    for path in (root / name / "videos").rglob("masks/*.png"):
        mask = cv2.imread(str(path), cv2.IMREAD_UNCHANGED)
        out = mask.copy()
        for old, new in table.items():
            out[mask == old] = new
        cv2.imwrite(str(path), out)


def test_a_site_whose_labels_use_endovis2017_values_is_named(federation):
    recode_masks(federation, "B", {1: 10, 2: 20, 3: 30})  # EndoVis2017 train encoding
    stats = {name: statistics(federation, name) for name in ("A", "B", "C")}
    assert stats["B"]["splits"]["train"]["outside_values"] == [10, 20, 30]
    warnings = encoding_warnings(stats)
    assert warnings and all(line.startswith("site B:") for line in warnings)
    assert "[10, 20, 30], outside the classes 0..3" in warnings[0]


def test_a_site_with_a_class_merged_into_another_is_named(federation):
    recode_masks(federation, "C", {3: 2})  # jaw written as wrist
    stats = {name: statistics(federation, name) for name in ("A", "B", "C")}
    assert stats["C"]["splits"]["train"]["class_share"][3] == 0.0
    assert encoding_warnings(stats) == [
        "site C: no jaw pixel in its sampled labels while every other part-labelled site has "
        "jaw: its labels look written in another encoding (a class merged into another or "
        "numbered differently)"
    ]


def test_sites_in_one_encoding_raise_no_warning(federation):
    stats = {name: statistics(federation, name) for name in ("A", "B", "C")}
    assert encoding_warnings(stats) == []


def test_the_numbers_are_the_frames_pixels_counted_by_hand(write_site, tmp_path):
    write_site("A", {"v1": 6, "v2": 4}, label_every=2)
    source = GenericLayoutSource(tmp_path, "A")
    stats = site_statistics(source, sample_frames=1000)  # every labelled frame
    for split, numbers in stats["splits"].items():
        videos = source.videos(split)
        labelled = [(v, p) for v in videos for p in v.labels]
        masks = [cv2.imread(str(v.labels[p].path), cv2.IMREAD_UNCHANGED) for v, p in labelled]
        frames = [source.read_frame(v.frames[p]) for v, p in labelled]
        counts = np.bincount(np.concatenate([m.ravel() for m in masks]), minlength=256)
        pixels = np.concatenate([f.reshape(-1, 3) for f in frames]).astype(np.float64)
        assert numbers["frames"] == sum(len(v.frames) for v in videos)
        assert numbers["labelled_frames"] == numbers["sampled_frames"] == len(labelled)
        assert numbers["class_share"] == pytest.approx(list(counts[:4] / counts.sum()))
        assert numbers["colour_mean"] == pytest.approx(list(pixels.mean(0)))
        assert numbers["colour_std"] == pytest.approx(list(pixels.std(0)), rel=1e-6)


def test_the_wire_form_round_trips_and_bad_numbers_are_refused(write_site, tmp_path):
    write_site("A", {"v1": 6, "v2": 4}, label_every=2)
    stats = site_statistics(GenericLayoutSource(tmp_path, "A"), sample_frames=2)
    record = statistics_to_record(stats)
    assert all(isinstance(v, int | float | list) for v in record.values())
    assert statistics_from_record(record, "A") == stats
    for key, value, message in [
        ("train/labelled_frames", -1, "non-negative integer"),
        ("train/class_share", [0.5, 0.5, 0.5, 0.5], "summing to 1"),
        ("train/colour_mean", [300.0, 0.0, 0.0], r"\[0, 255\]"),
        ("train/frame_sizes", [64, 0, 1], "positive integers"),
    ]:
        with pytest.raises(ValueError, match=rf"site A: statistics field {key}=.*{message}"):
            statistics_from_record({**record, key: value}, "A")
