"""Specification of fedst.report.plots: each figure draws the data its name promises (read back from the
matplotlib Figure), every ``plot_*`` writes it as a PNG, overlays colour exactly the pixels the mask
names."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from fedst.report.plots import (
    BINARY_COLORS,
    PART_COLORS,
    communication_figure,
    comparison_figure,
    learning_curves,
    learning_curves_figure,
    overlay_masks,
    plot_communication,
    plot_comparison,
    plot_learning_curves,
    plot_serq,
    qualitative_figure,
    qualitative_grid,
    serq_figure,
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


def lines_by_label(ax) -> dict[str, tuple[list[float], list[float]]]:
    return {line.get_label(): (list(line.get_xdata()), list(line.get_ydata())) for line in ax.lines}


def test_learning_curves_overlay_methods_and_seeds(tmp_path):
    rows = {
        "fedst": metric_rows(50, 0) + metric_rows(52, 1),
        "fedavg": metric_rows(40, 0, model="global"),
    }
    fig = learning_curves_figure(rows)
    average, site_a, site_b = fig.axes
    assert [ax.get_title() for ax in fig.axes] == ["Average", "Site A", "Site B"]
    # round r: fedst seed 0 has A = 50 + r, B = 51 + r, seed 1 two more; fedavg A = 40 + r, B = 41 + r
    assert lines_by_label(average) == {
        "fedst": ([1, 2, 3], pytest.approx([52.5, 53.5, 54.5])),
        "fedavg": ([1, 2, 3], pytest.approx([41.5, 42.5, 43.5])),
    }
    assert lines_by_label(site_a)["fedst"][1] == pytest.approx([52.0, 53.0, 54.0])
    assert lines_by_label(site_b)["fedavg"][1] == pytest.approx([42.0, 43.0, 44.0])
    fedst_band = average.collections[0].get_paths()[0].vertices[:, 1]  # mean +- std over seeds
    assert (fedst_band.min(), fedst_band.max()) == pytest.approx((52.5 - 2**0.5, 54.5 + 2**0.5))
    colors = {ax.lines[0].get_color() for ax in fig.axes}
    assert len(colors) == 1  # a method keeps its colour in every panel
    assert_png(plot_learning_curves(rows, tmp_path / "curves.png"))


def test_learning_curves_accept_the_rows_of_one_run_and_ignore_outfed_rows(tmp_path):
    rows = [*metric_rows(50, 0), {"round": 3, "site": "E", "model": "outfed", "dice": 10.0}]
    assert set(learning_curves(rows)["run"]) == {"Average", "A", "B"}
    fig = learning_curves_figure(rows)
    assert [ax.get_title() for ax in fig.axes] == ["Average", "Site A", "Site B"]
    assert lines_by_label(fig.axes[1]) == {"run": ([1, 2, 3], pytest.approx([51.0, 52.0, 53.0]))}
    assert all(10.0 not in ax.lines[0].get_ydata() for ax in fig.axes)
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
    uploads_mb = {"A": 1.0, "B": 2.0, "C": 4.0}
    rows = [
        {"round": r, "site": s, "upload_bytes": mb * 1e6, "download_bytes": 3_000_000}
        for r in (1, 2, 3)
        for s, mb in uploads_mb.items()
        if not (r == 3 and s == "C")  # C is absent from round 3
    ]
    upload, download = communication_figure(rows, title="fedst").axes
    assert upload.get_title() == "fedst: upload" and download.get_title() == "fedst: download"
    bands = {c.get_label(): c.get_paths()[0] for c in upload.collections}
    assert list(bands) == ["Site A", "Site B", "Site C"]
    # Stacked in site order: round 1-2 A [0, 1], B [1, 3], C [3, 7]; round 3 C has zero height.
    expected = {1: {"A": (0, 1), "B": (1, 3), "C": (3, 7)}, 3: {"A": (0, 1), "B": (1, 3)}}
    expected[2] = expected[1]
    for rnd, spans in expected.items():
        for site, (low, high) in spans.items():
            band = bands[f"Site {site}"]
            assert band.contains_point((rnd, low + 0.05)) and band.contains_point(
                (rnd, high - 0.05)
            )
            assert not band.contains_point((rnd, high + 0.05)), (rnd, site)
            assert not band.contains_point((rnd, low - 0.05)), (rnd, site)
    assert not bands["Site C"].contains_point((3, 3.05))
    download_top = {c.get_label(): c.get_paths()[0] for c in download.collections}["Site C"]
    assert download_top.contains_point((1, 8.95)) and not download_top.contains_point((1, 9.05))
    assert_png(plot_communication(rows, tmp_path / "comm.png", title="fedst"))


def test_comparison_plot_has_bars_for_every_method(tmp_path):
    runs = [fake_run("fedst", 0, 80.0), fake_run("fedst", 1, 84.0), fake_run("fedavg", 0, 70.0)]
    ax = comparison_figure(runs).axes[0]
    assert [t.get_text() for t in ax.get_xticklabels()] == ["Site A", "Site B", "Avg.", "Site E"]
    bars = {c.get_label(): c for c in ax.containers if hasattr(c, "patches")}
    assert set(bars) == {"fedst", "fedavg"}
    heights = {m: [p.get_height() for p in c.patches] for m, c in bars.items()}
    assert heights == {"fedst": pytest.approx([82.0] * 4), "fedavg": pytest.approx([70.0] * 4)}
    fedst_errors = bars["fedst"].errorbar.lines[2][0].get_segments()
    assert [s[1, 1] - s[0, 1] for s in fedst_errors] == pytest.approx([2 * 8**0.5] * 4)  # +-std
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
    fig = qualitative_figure(rows)
    axes = np.array(fig.axes).reshape(2, 4)
    assert [ax.get_title() for ax in axes[0]] == ["Image", "Ground truth", "local", "fedst"]
    assert [ax.get_ylabel() for ax in axes[:, 0]] == ["A v1/0003", "grasp v2/0001"]

    def shown(ax) -> np.ndarray:
        return np.asarray(ax.images[0].get_array())

    np.testing.assert_array_equal(shown(axes[0, 0]), image)
    np.testing.assert_array_equal(shown(axes[0, 1]), overlay_masks(image, gt))
    np.testing.assert_array_equal(shown(axes[0, 2]), overlay_masks(image, pred))
    np.testing.assert_array_equal(shown(axes[0, 3]), overlay_masks(image, gt))
    # binary row: the predicted parts are shown merged as "instrument"; no "local" prediction
    merged = (pred > 0).astype(np.int64)
    np.testing.assert_array_equal(shown(axes[1, 3]), overlay_masks(image, merged, binary=True))
    assert not axes[1, 2].images and not axes[1, 2].axison
    legend = [t.get_text() for t in fig.legends[0].get_texts()]
    assert legend == ["shaft", "wrist", "jaw", "instrument"]
    assert_png(qualitative_grid(rows, tmp_path / "grid.png"))


def test_qualitative_grid_rejects_rows_of_the_wrong_length(tmp_path):
    with pytest.raises(ValueError, match="has 3 elements"):
        qualitative_grid([("A", np.zeros((2, 2, 3), np.uint8), None)], tmp_path / "x.png")


def test_the_serq_figure_draws_the_logged_magnitudes_of_every_round_and_only_with_serq(
    tmp_path: Path,
):
    rows = [
        {"round": 2, "site": "server", "descriptor_rms": 0.4, "synthetic_feature_rms": 1.1,
         "bank_feature_rms": 1.0, "global_feature_rms": 0.9, "eq_loss": 0.8, "sc_loss": 0.7,
         "server_pull": 0.5},
        {"round": 1, "site": "server", "descriptor_rms": 0.02, "synthetic_feature_rms": 1.2,
         "bank_feature_rms": 1.3, "global_feature_rms": 1.0, "eq_loss": 0.9, "sc_loss": 0.6,
         "server_pull": None},
        {"round": 1, "site": "A", "loss": 0.5},
    ]  # fmt: skip
    path = plot_serq(rows, tmp_path / "serq.png")
    assert_png(path)
    magnitudes, losses, pull = serq_figure([r for r in rows if r["site"] == "server"]).axes
    descriptor = magnitudes.get_lines()[0]
    assert list(descriptor.get_xdata()) == [1, 2]  # ordered by round
    assert list(descriptor.get_ydata()) == [0.02, 0.4]
    assert [list(line.get_ydata()) for line in losses.get_lines()] == [[0.9, 0.8], [0.6, 0.7]]
    assert list(pull.get_lines()[0].get_ydata())[1] == 0.5
    assert plot_serq([{"round": 1, "site": "server", "seconds": 1.0}], tmp_path / "no.png") is None
    assert not (tmp_path / "no.png").exists()
