"""Specification of what a fedst.report table row may pool, which folders it reads, how it rounds,
and the one-line errors of its subcommands (msf, matrix): runs whose configs differ in more than
the seed get rows of their own, folders that are not finished runs are named (or skipped with
--skip-incomplete), and every printed score is rounded once from its unrounded value."""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path

import pytest

from fedst.cli import compose_experiment
from fedst.experiment import ExperimentConfig
from fedst.report.results import RunError, Stat, group_by_method, load_runs
from fedst.report.selection import SUBCOMMANDS, matrix_markdown
from fedst.report.tables import comparison_table, main, sites_table
from fedst.runs.layout import SELECTION_FILE
from fedst.runs.model_selection import SelectionError
from fedst.scoring.formatting import format_score


@pytest.fixture(scope="module")
def configs() -> dict[str, ExperimentConfig]:
    """Typed configs of the tiny experiment as train_fed.py composes them."""

    def compose(*overrides: str) -> ExperimentConfig:
        return compose_experiment(["experiment=tiny", *overrides])[0]

    return {
        "2 rounds": compose(),
        # the same learning config, computed elsewhere and evaluated at another cadence
        "2 rounds, elsewhere": compose("train.device=cpu", "train.eval_every=2", "seed=7"),
        "4 rounds": compose("train.total_iters=8"),
        "5 rounds, D held out": compose(
            "train.total_iters=10", "train.val_every=1", "selection.held_out_site=D"
        ),
        "fedavg": compose("method=fedavg"),
        "validation every round": compose("train.val_every=1"),
        "validation after round 5": compose("train.val_every=5"),
    }


def write_run(
    root: Path,
    name: str,
    cfg: ExperimentConfig,
    seed: int,
    dice: dict[str, float],
    val_rounds: tuple[int, ...] = (),
) -> Path:
    """A finished run directory as train_fed.py leaves it (config.json / .yaml, metrics.jsonl,
    comm.jsonl, final.json), with the given final Dice per site (IoU = Dice / 2) and validation
    rows of site A at ``val_rounds``."""
    run = root / name
    run.mkdir(parents=True)
    (run / "config.json").write_text(cfg.to_json())
    (run / "config.yaml").write_text(f"seed: {seed}\n")
    rows = [
        {"round": 1, "site": s, "split": "test", "model": "personal", "dice": v, "iou": v / 2}
        for s, v in dice.items()
    ]
    rows += [
        {"round": t, "site": "A", "split": "val", "model": "personal", "dice": 1.0, "iou": 0.5}
        for t in val_rounds
    ]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    comm = {"round": 1, "site": "A", "upload_bytes": 1000, "download_bytes": 2000}
    (run / "comm.jsonl").write_text(json.dumps(comm) + "\n")
    final = {
        "method": cfg.method.name,
        "seed": seed,
        "experiment": cfg.name,
        "rounds": cfg.train.rounds,
        "sites": {s: {"dice": v, "iou": v / 2} for s, v in dice.items()},
        "out_of_federation": {},
    }
    (run / "final.json").write_text(json.dumps(final))
    return run


# -- what a row pools ----------------------------------------------------------------------------


def test_a_row_pools_only_runs_whose_configs_differ_in_the_seed_alone(configs, tmp_path):
    """Three seeds of one config, and runs of 4 rounds and of 5 rounds with D held out: one row of
    three runs and one row per other config, labelled with the keys that differ."""
    write_run(tmp_path, "s0", configs["2 rounds"], 0, {"A": 70.0})
    write_run(tmp_path, "s1", configs["2 rounds"], 1, {"A": 74.0})
    write_run(tmp_path, "s2", configs["2 rounds, elsewhere"], 2, {"A": 81.0})
    write_run(tmp_path, "r4", configs["4 rounds"], 0, {"A": 10.0})
    write_run(tmp_path, "r5", configs["5 rounds, D held out"], 0, {"A": 20.0})
    write_run(tmp_path, "fedavg", configs["fedavg"], 0, {"A": 30.0})
    table = sites_table(load_runs([tmp_path]), metrics=("dice",))
    keys = "data.federation={}, selection.held_out_site={}, train.rounds={}, train.total_iters={}"
    fedst_2 = f"fedst [{keys.format('[A, B, C, D]', 'null', 2, 4)}]"
    fedst_4 = f"fedst [{keys.format('[A, B, C, D]', 'null', 4, 8)}]"
    fedst_5 = f"fedst [{keys.format('[A, B, C]', 'D', 5, 10)}]"
    assert table.runs == {fedst_2: 3, "fedavg": 1, fedst_4: 1, fedst_5: 1}
    # seeds 0-2: mean (70 + 74 + 81) / 3 = 75; sample std sqrt((25 + 1 + 36) / 2) = sqrt(31)
    pooled = table.rows[fedst_2][0]
    assert (pooled.mean, pooled.n) == (75.0, 3)
    assert pooled.std == pytest.approx(math.sqrt(31))
    assert str(pooled) == "75.00 ± 5.57"
    assert [str(table.rows[label][0]) for label in (fedst_4, fedst_5, "fedavg")] == [
        "10.00",
        "20.00",
        "30.00",
    ]


def test_keys_that_only_change_where_and_when_a_run_computes_never_split_a_row(configs, tmp_path):
    write_run(tmp_path, "here", configs["2 rounds"], 0, {"A": 60.0})
    write_run(tmp_path, "elsewhere", configs["2 rounds, elsewhere"], 1, {"A": 64.0})
    groups = group_by_method(load_runs([tmp_path]))
    assert {label: len(runs) for label, runs in groups.items()} == {"fedst": 2}


def test_runs_sharing_a_seed_are_named_once_in_one_warning(configs, tmp_path, caplog):
    """Two runs of seed 0 with different scores (an identical copy counts once instead:
    tests/test_user_mistakes.py)."""
    first = write_run(tmp_path, "a", configs["2 rounds"], 0, {"A": 60.0})
    rerun = write_run(tmp_path, "rerun_of_a", configs["2 rounds"], 0, {"A": 61.0})
    write_run(tmp_path, "b", configs["2 rounds"], 1, {"A": 64.0})
    with caplog.at_level(logging.WARNING):
        main([str(tmp_path), "--out", str(tmp_path / "report")])
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1
    assert str(first) in warnings[0] and str(rerun) in warnings[0] and "seed 0" in warnings[0]


def test_a_copy_of_a_run_is_named_in_one_warning_and_counted_once(configs, tmp_path, caplog):
    first = write_run(tmp_path, "a", configs["2 rounds"], 0, {"A": 60.0})
    copy = write_run(tmp_path, "copy_of_a", configs["2 rounds"], 0, {"A": 60.0})
    with caplog.at_level(logging.WARNING):
        runs = load_runs([tmp_path])
    assert [run["path"] for run in runs] == [first]
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert warnings == [
        f"{copy}: a copy of {first} (same method, seed, config and scores); counted once"
    ]


# -- folders that are not finished runs ---------------------------------------------------------


@pytest.fixture
def demo_folder(configs, tmp_path) -> dict[str, Path]:
    """runs/demo as `make demo` and a user leave it: two finished runs, the demo's comparison
    folder, an empty Hydra job folder (.hydra and an empty log), a random folder and a file."""
    root = tmp_path / "demo"
    paths = {
        "fedst": write_run(root, "fedst_s0_2rounds", configs["2 rounds"], 0, {"A": 70.0}),
        "fedavg": write_run(root, "fedavg_s0_2rounds", configs["fedavg"], 0, {"A": 60.0}),
        "comparison": root / "comparison",
        "empty hydra job": root / "2026-01-01_10-00-00",
        "random folder": root / "random",
        "file": root / "notes.txt",
    }
    paths["comparison"].mkdir()
    (paths["comparison"] / "comparison.md").write_text("| method |\n")
    (paths["comparison"] / "comparison.csv").write_text("method\n")
    (paths["empty hydra job"] / ".hydra").mkdir(parents=True)
    (paths["empty hydra job"] / ".hydra" / "config.yaml").write_text("seed: 0\n")
    (paths["empty hydra job"] / "train_fed.log").write_text("")
    paths["random folder"].mkdir()
    paths["file"].write_text("notes\n")
    return paths


def test_folders_that_are_not_finished_runs_are_skipped_with_one_line_each(demo_folder, caplog):
    every = sorted(demo_folder.values())  # what the shell makes of runs/demo/*
    with caplog.at_level(logging.WARNING):
        written = main([*map(str, every), "--skip-incomplete", "--no-plots"])
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    skipped = ("comparison", "empty hydra job", "random folder", "file")
    assert len(warnings) == len(skipped)
    for name in skipped:
        assert sum(str(demo_folder[name]) in line for line in warnings) == 1, name
    assert all("\n" not in line for line in warnings)
    table = (written[0].parent / "tables.md").read_text()
    assert "| fedst | 1 |" in table and "| fedavg | 1 |" in table
    assert written[0].parent == demo_folder["fedavg"] / "report"  # not in a skipped folder


@pytest.mark.parametrize("name", ["comparison", "empty hydra job", "random folder", "file"])
def test_a_folder_that_is_not_a_finished_run_is_a_one_line_error_naming_it_and_the_flag(
    demo_folder, name
):
    with pytest.raises(RunError) as refused:
        main([str(demo_folder["fedst"]), str(demo_folder[name]), "--no-plots"])
    message = str(refused.value)
    assert "\n" not in message
    assert str(demo_folder[name]) in message and "--skip-incomplete" in message


# -- the subcommands' errors --------------------------------------------------------------------


def one_line(error: pytest.ExceptionInfo) -> str:
    message = str(error.value)
    assert "\n" not in message
    return message


def test_msf_of_a_run_without_validation_rounds_is_a_one_line_error_naming_run_and_fix(
    configs, tmp_path
):
    never = write_run(tmp_path, "never", configs["2 rounds"], 0, {"A": 1.0})
    validated = write_run(
        tmp_path, "validated", configs["validation every round"], 0, {"A": 1.0}, (1, 2)
    )
    with pytest.raises(SelectionError) as refused:
        main(["msf", str(validated), str(never)])  # every run is checked before any is scored
    assert not (validated / SELECTION_FILE).exists()
    message = one_line(refused)
    assert f"msf: {never} scored no validation round (train.val_every=null" in message
    assert "train.val_every=<k>" in message
    too_late = write_run(tmp_path, "too_late", configs["validation after round 5"], 0, {"A": 1.0})
    with pytest.raises(SelectionError) as refused:
        main(["msf", str(too_late)])
    assert "train.val_every=5, train.rounds=2" in one_line(refused)
    assert not (too_late / SELECTION_FILE).exists()


def test_matrix_rule_cbe_without_a_held_out_site_is_a_one_line_error_naming_run_and_fix(
    configs, tmp_path
):
    never = write_run(tmp_path, "never", configs["2 rounds"], 0, {"A": 1.0})
    with pytest.raises(SelectionError) as refused:
        main(["matrix", str(never), "--rule", "cbe"])
    message = one_line(refused)
    assert f"matrix --rule cbe: {never} has no held-out site" in message
    assert "use --rule last," in message and "selection.held_out_site=<site>" in message
    validated = write_run(
        tmp_path, "validated", configs["validation every round"], 0, {"A": 1.0}, (1, 2)
    )
    with pytest.raises(SelectionError) as refused:
        main(["matrix", str(validated), "--rule", "cbe"])
    assert "use --rule last, val or mixed" in one_line(refused)
    with pytest.raises(SelectionError) as refused:
        main(["matrix", str(never), "--rule", "val"])
    assert "scored no validation round" in one_line(refused)


def test_matrix_of_a_rule_the_saved_selection_lacks_is_a_one_line_error(configs, tmp_path):
    run = write_run(tmp_path, "run", configs["5 rounds, D held out"], 0, {"A": 1.0}, (1,))
    (run / SELECTION_FILE).parent.mkdir()
    choice = {"sites": {"A": 1, "B": 1, "C": 1}, "outfed": 1}
    (run / SELECTION_FILE).write_text(json.dumps({"choices": {"last": choice, "mixed": choice}}))
    with pytest.raises(SelectionError) as refused:
        main(["matrix", str(run), "--rule", "cbe"])
    assert "holds no choice of that rule (it has last, mixed)" in one_line(refused)


@pytest.mark.parametrize("command", [["msf"], ["matrix"], ["matrix", "--rule", "val"]])
def test_a_subcommand_on_a_folder_that_is_not_a_finished_run_is_a_one_line_run_error(
    configs, tmp_path, command
):
    with pytest.raises(RunError) as refused:
        main([command[0], str(tmp_path / "nothing"), *command[1:]])
    assert "is not a run directory (no config.json)" in one_line(refused)
    unfinished = write_run(tmp_path, "unfinished", configs["validation every round"], 0, {})
    (unfinished / "final.json").unlink()
    with pytest.raises(RunError) as refused:
        main([command[0], str(unfinished), *command[1:]])
    assert f"{unfinished} is not a finished run (no final.json)" in one_line(refused)


def test_help_lists_every_subcommand_with_its_one_line(capsys):
    with pytest.raises(SystemExit) as done:
        main(["--help"])
    assert done.value.code == 0
    printed = capsys.readouterr().out
    for name, text in SUBCOMMANDS.items():
        assert any(line.split() == [name, *text.split()] for line in printed.splitlines()), name
    assert "--skip-incomplete" in printed and "not finished runs" in " ".join(printed.split())


# -- rounding -----------------------------------------------------------------------------------


def test_a_printed_score_is_its_unrounded_value_rounded_once(configs, tmp_path):
    """Sites 1.006, 1.006, 1.006, 1.0: their mean 1.0045 prints 1.00 (averaging the rounded
    sites would give (3 * 1.01 + 1.00) / 4 = 1.0075 -> 1.01); the README's C, 72.136, prints
    72.14 in a table and in the matrix, as format_score does."""
    dice = {"A": 1.006, "B": 1.006, "C": 1.006, "D": 1.0}
    write_run(tmp_path, "run", configs["2 rounds"], 0, dice)
    cells = [str(cell) for cell in comparison_table(load_runs([tmp_path])).rows["fedst"]]
    assert cells[::2] == ["1.01", "1.01", "1.01", "1.00", "1.00"]  # Dice A-D, then Avg.
    assert str(Stat.of([72.136])) == format_score(72.136) == "72.14"
    matrix = {"rule": "last", "rounds": {"A": 2}, "models": ["A"], "sites": ["A", "B"]}
    markdown = matrix_markdown({**matrix, "dice": [[72.136, None]]})
    assert markdown.splitlines()[-1] == "| A | **72.14** | n/a |"
