"""Dataset checker: exit status, what it reports, and the problem files it names."""

from __future__ import annotations

import json
from pathlib import Path

import cv2
import numpy as np
import pytest
import yaml

from fedst.config import ConfigError
from fedst.data import check
from fedst.data.check import load_data_config, main, parse_arguments

REPO = Path(__file__).resolve().parents[1]

H, W = 8, 10
SHAFT, WRIST = (0, 255, 0), (125, 255, 12)
LABELS_JSON = [
    {"name": "background-tissue", "color": [0, 0, 0], "classid": 0},
    {"name": "instrument-shaft", "color": list(SHAFT), "classid": 1},
    {"name": "instrument-clasper", "color": [0, 255, 255], "classid": 2},
    {"name": "instrument-wrist", "color": list(WRIST), "classid": 3},
]


def write_png(path: Path, rgb: np.ndarray) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    array = cv2.cvtColor(rgb, cv2.COLOR_RGB2BGR) if rgb.ndim == 3 else rgb
    assert cv2.imwrite(str(path), array)


def make_endovis2018(root: Path) -> Path:
    label = np.zeros((H, W, 3), np.uint8)
    label[:2] = SHAFT  # 2 of 8 rows: 25 % shaft
    label[2:3] = WRIST  # 12.5 % wrist
    for folder in (root / "release_1" / "seq_1", root / "test" / "seq_1"):
        for n in range(2):
            write_png(folder / "left_frames" / f"frame{n:03d}.png", np.zeros((H, W, 3), np.uint8))
            write_png(folder / "labels" / f"frame{n:03d}.png", label)
    (root / "labels.json").write_text(json.dumps(LABELS_JSON))
    return root


def make_generic(root: Path) -> Path:
    site = root / "hyst"
    meta = {
        "fps": 5,
        "classes": ["background", "shaft", "wrist", "jaw"],
        "ignore_index": 255,
        "surgery_type": "hysterectomy",
    }
    (site / "splits").mkdir(parents=True)
    (site / "meta.json").write_text(json.dumps(meta))
    for split in ("train", "test"):
        (site / "splits" / f"{split}.txt").write_text("v1\n")
    write_png(site / "videos" / "v1" / "frames" / "000000000.png", np.zeros((H, W, 3), np.uint8))
    write_png(site / "videos" / "v1" / "masks" / "000000000.png", np.full((H, W), 3, np.uint8))
    return root


def write_config(
    path: Path,
    sites: dict[str, dict],
    federation: list[str],
    out_of_federation: tuple[str, ...] = (),
    val_split: str = "dataset",
) -> Path:
    lines = [
        f"federation: {json.dumps(federation)}",
        f"out_of_federation: {json.dumps(list(out_of_federation))}",
        "server: null",
        f"val_split: {val_split}",
        "sites:",
    ]
    lines += [f"  {name}: {json.dumps(spec)}" for name, spec in sites.items()]
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.fixture(autouse=True)
def _table_width(monkeypatch):
    """The report's table at the width of a non-terminal (shutil.get_terminal_size's fallback,
    fedst/data/check.py), whatever terminal or pytest-xdist worker runs the test: at 80 columns
    its cells wrap ("train: 1/2/2" over two lines)."""
    monkeypatch.setenv("COLUMNS", "160")


@pytest.fixture()
def good_config(tmp_path) -> Path:
    root = make_endovis2018(tmp_path / "endovis2018")
    spec = {"backend": "endovis2018", "root": str(root), "surgery_type": "nephrectomy"}
    return write_config(tmp_path / "good.yaml", {"B": spec}, ["B"])


def test_good_site_exits_zero_and_reports_counts_and_shares(good_config, capsys):
    assert main([f"data={good_config}", "max_frames=10"]) == 0
    out = capsys.readouterr().out
    assert "train: 1/2/2" in out and "test: 1/2/2" in out
    assert "2 Hz" in out and "10x8" in out
    assert "shaft 25.00" in out and "wrist 12.50" in out and "background 62.50" in out
    assert "all 1 site(s) usable" in out
    assert "label files: RGB 4; raw values: (0, 0, 0), (0, 255, 0), (125, 255, 12)" in out


def test_unknown_colour_makes_the_site_unusable_and_names_the_file(good_config, capsys):
    bad = good_config.parent / "endovis2018" / "release_1" / "seq_1" / "labels" / "frame001.png"
    label = np.zeros((H, W, 3), np.uint8)
    label[0, :4] = (9, 9, 9)
    write_png(bad, label)
    assert main([f"data={good_config}", "--max-frames", "10"]) == 1
    out = capsys.readouterr().out
    assert f"{bad}" in out and "(9, 9, 9): 4" in out and "unusable site(s): ['B']" in out


def test_ignored_unknown_colour_is_still_reported(good_config, capsys):
    bad = good_config.parent / "endovis2018" / "test" / "seq_1" / "labels" / "frame000.png"
    label = np.zeros((H, W, 3), np.uint8)
    label[0, :3] = (9, 9, 9)
    write_png(bad, label)
    text = good_config.read_text().replace('"options"', '"x"')
    text = text.replace(
        '"surgery_type": "nephrectomy"}',
        '"surgery_type": "nephrectomy", "options": {"on_unknown_label": "ignore"}}',
    )
    good_config.write_text(text)
    assert main([f"data={good_config}"]) == 0
    out = capsys.readouterr().out
    assert "WARNING" in out and str(bad) in out and "(9, 9, 9): 3" in out


def test_corrupt_frame_and_size_mismatch_are_errors_with_their_files(good_config, capsys):
    seq = good_config.parent / "endovis2018" / "release_1" / "seq_1"
    (seq / "left_frames" / "frame000.png").write_bytes(b"garbage")
    write_png(seq / "left_frames" / "frame001.png", np.zeros((H, W + 2, 3), np.uint8))
    assert main([f"data={good_config}"]) == 1
    out = capsys.readouterr().out
    assert "frame000.png: cannot decode" in out
    assert "size mismatch" in out and str(seq / "labels" / "frame001.png") in out


def test_missing_root_and_empty_required_split_are_errors(tmp_path, capsys):
    root = make_endovis2018(tmp_path / "ev18")
    for n in range(2):
        (root / "test" / "seq_1" / "labels" / f"frame{n:03d}.png").unlink()
    sites = {
        "B": {"backend": "endovis2018", "root": str(root), "surgery_type": "nephrectomy"},
        "A": {"backend": "endovis2017", "root": str(tmp_path / "nowhere"), "surgery_type": "x"},
    }
    config = write_config(tmp_path / "c.yaml", sites, ["A", "B"])
    assert main([f"data={config}", "site=B"]) == 1
    out = capsys.readouterr().out
    assert "split test is empty" in out
    assert "WARNING" in out and "labels: 2 frame(s) without a label" in out
    assert main([f"data={config}", "site=A"]) == 1
    assert "nowhere" in capsys.readouterr().out


def test_generic_sites_are_checked_through_the_registry(tmp_path, capsys):
    root = make_generic(tmp_path / "yt")
    spec = {
        "backend": "generic",
        "root": str(root),
        "surgery_type": "hysterectomy",
        "options": {"site_dir": "hyst"},
    }
    config = write_config(tmp_path / "g.yaml", {"D": spec}, ["D"])
    assert main([f"data={config}"]) == 0
    out = capsys.readouterr().out
    assert "jaw 100.00" in out and "single images" in out


def test_bad_arguments_are_config_errors_naming_the_fix(good_config):
    """Raised to the entry point's boundary: one line and exit status 2
    (tests/test_user_mistakes.py runs them as commands)."""
    with pytest.raises(ConfigError, match=r"data=tinyy: .* \(did you mean 'tiny'\?\)"):
        main(["data=tinyy"])
    with pytest.raises(ConfigError, match=r"site=Z: not in the data config"):
        main([f"data={good_config}", "site=Z"])
    with pytest.raises(ConfigError, match=r"unknown argument 'frames'"):
        main(["frames=3"])


def test_arguments_accept_hydra_and_dash_forms():
    assert parse_arguments(["data=paper", "+site=A", "--max-frames", "7"]) == {
        "data": "paper",
        "site": "A",
        "max_frames": "7",
    }
    assert parse_arguments(["--max-frames=3"]) == {"max_frames": "3"}


def test_paper_config_loads_with_the_paper_sites():
    config = load_data_config("paper")
    assert config.federation == ("A", "B", "C", "D")
    assert config.out_of_federation == ("E", "grasp") and config.server == "synthetic"
    assert config.sites["A"].root == "data/endovis2017"
    assert {s.backend for s in config.sites.values()} == {
        "endovis2017",
        "endovis2018",
        "sarrarp50",
        "generic",
        "grasp",
        "sisvse",
    }


def test_without_data_the_checker_checks_train_feds_default_data_and_help_says_which(
    monkeypatch, capsys
):
    """The data config train_fed.py uses by default (configs/config.yaml's defaults list) is the
    one checked without ``data=`` (right after ``make demo``: the benchmark it generated), and
    --help names it."""
    defaults = yaml.safe_load((REPO / "configs" / "config.yaml").read_text())["defaults"]
    (train_fed_default,) = [
        entry["data"] for entry in defaults if isinstance(entry, dict) and "data" in entry
    ]
    asked = []

    def load(spec: str):
        asked.append(spec)
        raise ConfigError("stop here")

    monkeypatch.setattr(check, "load_data_config", load)
    with pytest.raises(ConfigError, match="stop here"):
        main([])
    assert asked == [train_fed_default]
    assert main(["--help"]) == 0
    usage = capsys.readouterr().out.split("\n\n")[0]
    assert f"default: {train_fed_default}" in usage


def generic_site(root: Path, splits: dict[str, str]) -> dict:
    """A generic-layout site of one labelled frame in video v1 at ``root``, with the split files
    ``splits`` (split -> its text; "" is an empty split file), as a data config's site entry."""
    make_generic(root)
    for split in ("train", "val", "test"):
        path = root / "hyst" / "splits" / f"{split}.txt"
        path.unlink(missing_ok=True)
        if split in splits:
            path.write_text(splits[split])
    return {
        "backend": "generic",
        "root": str(root),
        "surgery_type": "hysterectomy",
        "options": {"site_dir": "hyst"},
    }


def test_only_the_splits_a_sites_config_uses_are_checked(tmp_path, capsys):
    """An out-of-federation site is read in its test split only: its empty train and val split
    files (as the shipped benchmark's E and grasp have) give no warning. A federated site also
    uses its val split (validation, with data.val_split=dataset): an empty one is a warning
    naming the file, and none where data.val_split=train carves validation from training."""
    complete = generic_site(tmp_path / "a", {"train": "v1\n", "val": "v1\n", "test": "v1\n"})
    held_out = generic_site(tmp_path / "e", {"train": "", "val": "", "test": "v1\n"})
    sites = {"A": complete, "E": held_out}
    config = write_config(tmp_path / "e.yaml", sites, ["A"], out_of_federation=("E",))
    assert main([f"data={config}", "site=E"]) == 0
    out = capsys.readouterr().out
    assert "WARNING" not in out, out
    assert "train: not used" in out and "val: not used" in out and "test: 1/1/1" in out

    federated = generic_site(tmp_path / "d", {"train": "v1\n", "val": "", "test": "v1\n"})
    empty_val = tmp_path / "d" / "hyst" / "splits" / "val.txt"
    config = write_config(tmp_path / "d.yaml", {"D": federated}, ["D"])
    assert main([f"data={config}"]) == 0
    warnings = [line for line in capsys.readouterr().out.splitlines() if "WARNING" in line]
    assert len(warnings) == 1 and f"{empty_val}: split file is empty" in warnings[0], warnings
    carved = write_config(tmp_path / "d_carved.yaml", {"D": federated}, ["D"], val_split="train")
    assert main([f"data={carved}"]) == 0
    assert "WARNING" not in capsys.readouterr().out
