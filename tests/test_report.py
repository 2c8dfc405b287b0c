"""Specification of fedst.report: run directories -> mean ± std tables in markdown and CSV."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

from fedst.report.results import RunError, Stat, find_runs, load_runs
from fedst.report.tables import (
    comm_table,
    comparison_table,
    main,
    outfed_table,
    sites_table,
    write_tables,
)


def make_run(
    root: Path,
    name: str,
    method: str,
    seed: int,
    dice: dict[str, float],
    outfed_dice: dict[str, float] | None = None,
    upload_mb: float = 12.5,
) -> Path:
    """A complete fake run directory; IoU = dice / 2, HD95 = 100 - dice, ASSD = 10."""

    def scores(value: float) -> dict[str, float]:
        return {"dice": value, "iou": value / 2, "hd95": 100 - value, "assd": 10.0}

    run = root / name
    run.mkdir(parents=True)
    (run / "config.yaml").write_text(f"method:\n  name: {method}\nseed: {seed}\nexperiment: demo\n")
    metrics = [
        {"round": r, "site": s, "split": "test", "model": "personal", "num_frames": 4, **scores(v)}
        for r in (1, 2)
        for s, v in dice.items()
    ]
    (run / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in metrics))
    comm = [
        {"round": r, "site": s, "upload_bytes": 1000, "download_bytes": 2000}
        for r in (1, 2)
        for s in dice
    ]
    (run / "comm.jsonl").write_text("".join(json.dumps(c) + "\n" for c in comm))
    final = {
        "method": method,
        "seed": seed,
        "sites": {s: scores(v) for s, v in dice.items()},
        "out_of_federation": {s: scores(v) for s, v in (outfed_dice or {}).items()},
        "upload_mb_per_round": upload_mb,
        "download_mb_per_round": 2 * upload_mb,
    }
    (run / "final.json").write_text(json.dumps(final))
    return run


@pytest.fixture
def multirun(tmp_path: Path) -> Path:
    """Two seeds of fedst and one fedavg run, laid out like a Hydra multirun directory."""
    root = tmp_path / "multirun"
    make_run(root, "0", "fedst", 0, {"A": 80.0, "B": 60.0}, {"E": 50.0, "grasp": 90.0})
    make_run(root, "1", "fedst", 1, {"A": 84.0, "B": 70.0}, {"E": 54.0, "grasp": 92.0})
    make_run(root, "2", "fedavg", 0, {"A": 70.0, "B": 50.0}, {"E": 20.0, "grasp": 30.0}, 19.7)
    hydra = root / "0" / ".hydra"
    hydra.mkdir()
    (hydra / "config.yaml").write_text("seed: 0\n")
    return root


def test_multirun_directory_yields_each_run_once_and_not_hydra_folders(multirun):
    assert [p.name for p in find_runs([multirun])] == ["0", "1", "2"]
    runs = load_runs([multirun])
    assert [(r["method"], r["seed"], r["experiment"]) for r in runs] == [
        ("fedst", 0, "demo"),
        ("fedst", 1, "demo"),
        ("fedavg", 0, "demo"),
    ]


@pytest.mark.parametrize(
    ("values", "text"),
    [
        ([80.0, 84.0], "82.00 ± 2.83"),  # sample std (ddof=1): sqrt((2^2 + 2^2) / 1)
        ([70.0], "70.00"),
        ([1.0, None, 3.0], "2.00 ± 1.41"),
    ],
)
def test_stat_prints_mean_and_sample_std(values, text):
    assert str(Stat.of(values)) == text


def test_sites_table_has_mean_std_per_site_and_an_average_of_per_run_averages(multirun):
    table = sites_table(load_runs([multirun]), metrics=("dice", "hd95"))
    headers = [c.header for c in table.columns]
    assert headers == [
        "Dice (%) A",
        "Dice (%) B",
        "Dice (%) Avg.",
        "HD95 (px) A",
        "HD95 (px) B",
        "HD95 (px) Avg.",
    ]
    assert table.runs == {"fedst": 2, "fedavg": 1}
    fedst = [str(c) for c in table.rows["fedst"]]
    # per-run averages: (80 + 60) / 2 = 70 and (84 + 70) / 2 = 77 -> 73.5 ± 4.95
    assert fedst[:3] == ["82.00 ± 2.83", "65.00 ± 7.07", "73.50 ± 4.95"]
    assert fedst[3] == "18.00 ± 2.83"
    assert [str(c) for c in table.rows["fedavg"]][:3] == ["70.00", "50.00", "60.00"]


def test_markdown_bolds_the_best_mean_per_column_direction_aware(multirun):
    markdown = sites_table(load_runs([multirun]), metrics=("dice", "hd95")).to_markdown()
    fedst_line = next(line for line in markdown.splitlines() if line.startswith("| fedst"))
    fedavg_line = next(line for line in markdown.splitlines() if line.startswith("| fedavg"))
    assert "| fedst | 2 | **82.00 ± 2.83** |" in fedst_line
    assert "**18.00 ± 2.83**" in fedst_line  # lower HD95 is better
    assert "**" not in fedavg_line
    assert "ddof=1" in markdown


def test_csv_has_numeric_mean_and_std_columns_with_empty_std_for_single_runs(multirun, tmp_path):
    path = sites_table(load_runs([multirun]), metrics=("dice",)).to_csv(tmp_path / "sites.csv")
    with path.open() as handle:
        rows = list(csv.DictReader(handle))
    assert list(rows[0]) == [
        "method",
        "runs",
        "dice_A_mean",
        "dice_A_std",
        "dice_B_mean",
        "dice_B_std",
        "dice_avg_mean",
        "dice_avg_std",
    ]
    assert rows[0]["method"] == "fedst"
    assert float(rows[0]["dice_A_mean"]) == pytest.approx(82.0)
    assert float(rows[0]["dice_A_std"]) == pytest.approx(2.8284271)
    assert rows[1]["dice_A_std"] == ""


def test_outfed_and_comparison_tables_cover_out_of_federation_sites(multirun):
    runs = load_runs([multirun])
    outfed = outfed_table(runs, metrics=("dice", "iou"))
    assert [c.key for c in outfed.columns] == ["dice_E", "iou_E", "dice_grasp", "iou_grasp"]
    assert str(outfed.rows["fedst"][0]) == "52.00 ± 2.83"
    comparison = comparison_table(runs)
    assert [c.key for c in comparison.columns] == [
        "dice_A",
        "iou_A",
        "dice_B",
        "iou_B",
        "dice_avg",
        "iou_avg",
        "dice_E",
        "iou_E",
        "dice_grasp",
        "iou_grasp",
    ]
    assert str(comparison.rows["fedavg"][-2]) == "30.00"


def test_comm_table_reports_megabytes_and_mebibytes_per_round_and_rounds(multirun):
    table = comm_table(load_runs([multirun]))
    # upload MB, upload MiB, download MB, download MiB, rounds; 12.5e6 B / 2^20 = 11.9209 MiB,
    # 25e6 B / 2^20 = 23.8419 MiB (the fake runs' final.json has MB only: MiB is converted)
    assert [str(c) for c in table.rows["fedst"]] == [
        "12.50 ± 0.00",
        "11.92 ± 0.00",
        "25.00 ± 0.00",
        "23.84 ± 0.00",
        "2.00 ± 0.00",
    ]
    assert [c.header for c in table.columns][:2] == ["Upload (MB / round)", "Upload (MiB / round)"]
    assert str(table.rows["fedavg"][0]) == "19.70"
    assert "MiB = 2^20 bytes" in table.to_markdown()


def test_incomplete_run_is_an_error_naming_the_missing_file_or_skipped_on_request(multirun):
    (multirun / "1" / "final.json").unlink()
    with pytest.raises(RunError, match=r"1: incomplete run, missing final\.json"):
        load_runs([multirun])
    runs = load_runs([multirun], skip_incomplete=True)
    assert [(r["method"], r["seed"]) for r in runs] == [("fedst", 0), ("fedavg", 0)]


def test_corrupt_jsonl_line_is_an_error_naming_file_and_line(multirun):
    with (multirun / "2" / "metrics.jsonl").open("a") as handle:
        handle.write("{not json\n")
    with pytest.raises(RunError, match=r"metrics\.jsonl:5: not valid JSON"):
        load_runs([multirun / "2"])


def test_directory_without_runs_is_an_error(tmp_path):
    with pytest.raises(RunError, match="no run directory below it"):
        find_runs([tmp_path])


def test_write_tables_writes_markdown_and_csv_per_table(multirun, tmp_path):
    paths = write_tables(load_runs([multirun]), tmp_path / "out")
    assert sorted(p.name for p in paths) == sorted(
        [
            f"{n}.{ext}"
            for n in ("sites", "outfed", "comparison", "challenge", "comm")
            for ext in ("md", "csv")
        ]
        + ["tables.md"]
    )
    assert all(p.stat().st_size > 0 for p in paths)


def test_cli_prints_markdown_and_writes_tables_and_plots(multirun, tmp_path, capsys):
    out = tmp_path / "report"
    written = main([str(multirun), "--out", str(out)])
    printed = capsys.readouterr().out
    assert "| fedst | 2 |" in printed
    assert (out / "comparison.csv").is_file()
    assert {p.name for p in written} >= {
        "learning_curves.png",
        "comparison.png",
        "communication_fedst.png",
        "communication_fedavg.png",
    }
