"""Specification of fedst.plots: every function writes a non-empty PNG; overlays colour exactly
the pixels the mask names."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from fedst.plots import (
    BINARY_COLORS,
    PART_COLORS,
    learning_curves,
    overlay_masks,
    plot_communication,
    plot_comparison,
    plot_learning_curves,
    qualitative_grid,
)

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def assert_png(path: Path) -> None:
    assert path.is_file()
    assert path.read_bytes()[:8] == PNG_MAGIC
    assert path.stat().st_size > 1000


def metric_rows(base: float, seed: int, model: str = "personal") -> list[dict]:
    return [
        {"round": r, "site": s, "split": "test", "model": model, "dice": base + r + i, "seed": seed}
        for r in (1, 2, 3)
        for i, s in enumerate(("A", "B"))
    ]


def fake_run(method: str, seed: int, dice_a: float) -> dict:
    scores = {"dice": dice_a, "iou": dice_a / 2}
    return {
        "method": method,
        "seed": seed,
        "experiment": "demo",
        "final": {"sites": {"A": scores, "B": scores}, "out_of_federation": {"E": scores}},
    }


def test_learning_curves_overlay_methods_and_seeds(tmp_path):
    rows = {
        "fedst": metric_rows(50, 0) + metric_rows(52, 1),
        "fedavg": metric_rows(40, 0, model="global"),
    }
    assert_png(plot_learning_curves(rows, tmp_path / "curves.png"))


def test_learning_curves_accept_the_rows_of_one_run_and_ignore_outfed_rows(tmp_path):
    rows = [*metric_rows(50, 0), {"round": 3, "site": "E", "model": "outfed", "dice": 10.0}]
    assert set(learning_curves(rows)["run"]) == {"Average", "A", "B"}
    assert_png(plot_learning_curves(rows, tmp_path / "one_run.png"))


def test_learning_curve_data_average_seeds_per_round_and_sites_per_seed():
    # round 1: seed 0 has A = 51, B = 52; seed 1 has A = 53, B = 54.
    curves = learning_curves({"fedst": metric_rows(50, 0) + metric_rows(52, 1)})["fedst"]
    rounds, means, stds = curves["A"]
    assert rounds == [1, 2, 3]
    assert means[0] == pytest.approx(52.0)
    assert stds[0] == pytest.approx(2**0.5)  # sample std of (51, 53)
    rounds, means, stds = curves["Average"]
    assert means[0] == pytest.approx(52.5)  # mean of per-seed averages 51.5 and 53.5
    assert stds[0] == pytest.approx(2**0.5)


def test_learning_curves_prefer_personal_rows_and_fall_back_to_global():
    rows = metric_rows(50, 0) + metric_rows(10, 0, model="global")
    assert learning_curves(rows)["run"]["A"][1][0] == pytest.approx(51.0)
    assert learning_curves(metric_rows(10, 0, model="global"))["run"]["A"][1][0] == 11.0
    assert learning_curves(rows, model="global")["run"]["A"][1][0] == pytest.approx(11.0)


def test_learning_curves_without_test_rows_is_an_error(tmp_path):
    with pytest.raises(ValueError, match="no test rows"):
        plot_learning_curves([{"round": 1, "site": "A", "split": "val"}], tmp_path / "x.png")


def test_communication_plot_stacks_sites_per_round(tmp_path):
    rows = [
        {"round": r, "site": s, "upload_bytes": 2_000_000, "download_bytes": 3_000_000}
        for r in (1, 2, 3)
        for s in ("A", "B", "C")
    ]
    assert_png(plot_communication(rows, tmp_path / "comm.png", title="fedst"))


def test_comparison_plot_has_bars_for_every_method(tmp_path):
    runs = [fake_run("fedst", 0, 80.0), fake_run("fedst", 1, 84.0), fake_run("fedavg", 0, 70.0)]
    assert_png(plot_comparison(runs, tmp_path / "comparison.png"))


def test_overlay_blends_class_colours_exactly_on_mask_pixels():
    image = np.full((4, 5, 3), 100, dtype=np.uint8)
    mask = np.zeros((4, 5), dtype=np.int64)
    mask[0, 0], mask[1, 1], mask[2, 2], mask[3, 3] = 1, 2, 3, 255
    out = overlay_masks(image, mask, alpha=0.5)
    for value, (_, color) in PART_COLORS.items():
        row, col = np.argwhere(mask == value)[0]
        expected = np.round(0.5 * 100 + 0.5 * np.array(color)).astype(np.uint8)
        np.testing.assert_array_equal(out[row, col], expected)
    untouched = (mask == 0) | (mask == 255)
    np.testing.assert_array_equal(out[untouched], image[untouched])
    assert out.dtype == np.uint8 and out.shape == image.shape


def test_binary_overlay_uses_the_instrument_colour_and_alpha_one_paints_it():
    image = np.zeros((2, 2, 3), dtype=np.uint8)
    mask = np.array([[1, 0], [0, 0]])
    out = overlay_masks(image, mask, alpha=1.0, binary=True)
    np.testing.assert_array_equal(out[0, 0], BINARY_COLORS[1][1])
    np.testing.assert_array_equal(out[1, 1], [0, 0, 0])


@pytest.mark.parametrize(
    ("image", "mask", "message"),
    [
        (np.zeros((4, 5, 3), dtype=np.float32), np.zeros((4, 5)), "uint8"),
        (np.zeros((4, 5, 3), dtype=np.uint8), np.zeros((4, 6)), r"\(4, 6\)"),
    ],
)
def test_overlay_rejects_bad_inputs_quoting_them(image, mask, message):
    with pytest.raises(ValueError, match=message):
        overlay_masks(image, mask)


def test_qualitative_grid_has_image_gt_and_method_columns_including_binary_rows(tmp_path):
    rng = np.random.default_rng(0)
    image = rng.integers(0, 255, size=(24, 32, 3), dtype=np.uint8)
    gt = np.zeros((24, 32), dtype=np.int64)
    gt[5:15, 4:20] = 1
    gt[15:18, 4:20] = 2
    pred = np.roll(gt, 2, axis=1)
    rows = [
        ("A v1/0003", image, gt, {"local": pred, "fedst": gt}),
        ("grasp v2/0001", image, (gt > 0).astype(np.int64), {"fedst": pred}, True),
    ]
    assert_png(qualitative_grid(rows, tmp_path / "grid.png"))


def test_qualitative_grid_rejects_rows_of_the_wrong_length(tmp_path):
    with pytest.raises(ValueError, match="has 3 elements"):
        qualitative_grid([("A", np.zeros((2, 2, 3), np.uint8), None)], tmp_path / "x.png")
