"""Specification of the table runner (fedst.paper): one command trains the runs a table
needs, skips finished ones, resumes interrupted ones, and writes the paper's layout."""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

import pytest

from fedst import paper
from fedst.cli import compose_experiment
from fedst.data.procedural import generate
from fedst.federation import site as site_module
from fedst.paper import (
    Row,
    RunnerError,
    TableSpec,
    build_tables,
    execute,
    plan_table,
)
from fedst.report import plots, tables

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


@pytest.fixture(scope="module")
def tiny_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("runner") / "tiny"
    generate(root, seed=0, preset="tiny", workers=1, progress=False)
    return root


def csv_rows(path: Path) -> dict[str, dict[str, str]]:
    with path.open() as handle:
        return {row["method"]: row for row in csv.DictReader(handle)}


# -- end to end on the tiny preset: train, skip, resume --------------------------------------------


def test_the_runner_trains_missing_runs_skips_finished_ones_and_resumes_interrupted_ones(
    tiny_data, tmp_path, monkeypatch
):
    runs, out = tmp_path / "runs", tmp_path / "results"
    args = [
        "--runs",
        str(runs),
        "--out",
        str(out),
        "--fps-frames",
        "3",
        "--fps-warmup",
        "1",
        "seeds=0",
        "rows=local,fedavg",
        "experiment=tiny",
        f"data.root={tiny_data}",
        "progress=false",
        "train.total_iters=2",  # 2 rounds of 1 iteration, evaluated at the end only: seconds
        "train.local_iters=1",
        "train.eval_every=2",
        "pretraining.iters=1",
    ]
    trained: list[str] = []
    from fedst import training

    original_training = training.run_training

    def counting_training(cfg, run_dir, **kwargs):
        trained.append(run_dir.name)
        return original_training(cfg, run_dir, **kwargs)

    monkeypatch.setattr(training, "run_training", counting_training)
    original_round = site_module.Site.train_round

    def power_cut_in_fedavg_round_two(self, received, server_round, local_iters, **kwargs):
        if self.cfg.method.name == "fedavg" and server_round == 2:
            raise RuntimeError("power cut")
        return original_round(self, received, server_round, local_iters, **kwargs)

    # 1st invocation: Local trains; FedAvg is interrupted after round 1 (exit code 1)
    with monkeypatch.context() as patch:
        patch.setattr(site_module.Site, "train_round", power_cut_in_fedavg_round_two)
        assert paper.main(["table9", *args]) == 1
    local, fedavg = runs / "tiny" / "local_s0", runs / "tiny" / "fedavg_s0"
    assert trained == ["local_s0", "fedavg_s0"]
    assert (local / "final.json").is_file() and not (fedavg / "final.json").exists()
    local_final_mtime = (local / "final.json").stat().st_mtime_ns
    assert "FedAvg, seed 0: failed (FederationError" in (out / "tiny" / "table9.md").read_text()

    # 2nd: Local is skipped (not trained, final.json untouched); FedAvg resumes after round 1
    trained.clear()
    assert paper.main(["table9", *args]) == 0
    assert trained == ["fedavg_s0"]
    assert (local / "final.json").stat().st_mtime_ns == local_final_mtime
    rows = [json.loads(line) for line in (fedavg / "train.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rows if r["site"] == "A"] == [1, 2]  # round 1 was not retrained

    table9 = (out / "tiny" / "table9.md").read_text()
    assert "cpu (" in table9 and "1 thread(s)" in table9 and "MiB = 2^20 bytes" in table9
    fps = json.loads((fedavg / "fps.json").read_text())
    assert fps["fps"] > 0 and fps["threads"] == 1 and fps["settings"]["frames"] == 3
    by_row = csv_rows(out / "tiny" / "table9.csv")
    fedavg_final = json.loads((fedavg / "final.json").read_text())
    assert float(by_row["FedAvg"]["upload_mib_per_round_mean"]) == pytest.approx(
        fedavg_final["upload_mb_per_round"] * 1e6 / 2**20
    )
    assert float(by_row["Local Train"]["upload_mb_per_round_mean"]) == 0.0
    site_seconds = sum(r["seconds"] for r in rows if r["round"] >= 1 and r["site"] != "server")
    assert float(by_row["FedAvg"]["local_minutes_mean"]) == pytest.approx(site_seconds / 60)

    # 3rd: another table over the same runs trains nothing; its cells are the runs' final.json
    trained.clear()
    assert paper.main(["table2", *args]) == 0
    assert trained == []
    by_row = csv_rows(out / "tiny" / "table2.csv")
    assert list(by_row) == ["Local Train", "FedAvg"]  # the paper's order among the chosen rows
    for label, run_dir in (("Local Train", local), ("FedAvg", fedavg)):
        sites = json.loads((run_dir / "final.json").read_text())["sites"]
        for metric in ("dice", "hd95"):
            by_hand = sum(sites[s][metric] for s in "ABCD") / 4
            assert float(by_row[label][f"{metric}_avg_mean"]) == pytest.approx(by_hand)
            assert float(by_row[label][f"{metric}_B_mean"]) == pytest.approx(sites["B"][metric])
            assert by_row[label][f"{metric}_avg_std"] == ""  # one seed: no spread


# -- tables from finished runs, without training ---------------------------------------------------


def fake_finished_run(runs: Path, root: Path, method: str, seed: int, dice: list[float]) -> Path:
    """A finished run directory of ``method`` / ``seed`` on the tiny experiment whose sites A-D
    scored ``dice`` (IoU = dice / 2, HD95 = 100 - dice, ASSD = 10)."""
    cfg, _ = compose_experiment(
        ["experiment=tiny", f"data.root={root}", f"method={method}", f"seed={seed}"]
    )
    run = runs / "tiny" / f"{method}_s{seed}"
    run.mkdir(parents=True)
    (run / "config.json").write_text(cfg.to_json())
    (run / "config.yaml").write_text(f"seed: {seed}\n")
    (run / "metrics.jsonl").write_text("")
    (run / "comm.jsonl").write_text("")
    scores = {
        site: {"dice": d, "iou": d / 2, "hd95": 100 - d, "assd": 10.0}
        for site, d in zip("ABCD", dice, strict=True)
    }
    final = {"method": method, "seed": seed, "sites": scores, "upload_mb_per_round": 1.0}
    (run / "final.json").write_text(json.dumps(final))
    return run


SPEC = TableSpec(
    "t",
    "A test table",
    (Row("FedAvg", "fedavg"), Row("Not yet", "no_such_method"), Row("FedST (ours)", "fedst")),
    "sites",
)


def test_a_table_shows_mean_and_sample_std_over_seeds_in_the_paper_order(tmp_path):
    runs = tmp_path / "runs"
    fake_finished_run(runs, tmp_path, "fedst", 0, [80.0, 60.0, 70.0, 50.0])
    fake_finished_run(runs, tmp_path, "fedst", 1, [84.0, 70.0, 72.0, 54.0])
    fake_finished_run(runs, tmp_path, "fedavg", 0, [70.0, 50.0, 60.0, 40.0])
    fake_finished_run(runs, tmp_path, "fedavg", 1, [72.0, 52.0, 62.0, 42.0])
    plan = plan_table(SPEC, [0, 1], ["experiment=tiny", f"data.root={tmp_path}"], runs)
    assert [r.state for r in plan.runs] == ["done"] * 2 + ["unavailable"] * 2 + ["done"] * 2
    markdown, table = build_tables(plan)

    assert list(table.rows) == ["FedAvg", "Not yet", "FedST (ours)"]
    headers = [c.key for c in table.columns]
    fedst = dict(zip(headers, table.rows["FedST (ours)"], strict=True))
    # by hand: A = 80, 84 -> mean 82, sample std sqrt((4 + 4) / 1) = 2.828
    assert fedst["dice_A"].format() == "82.00 ± 2.83"
    # Avg. per run first: (80+60+70+50)/4 = 65, (84+70+72+54)/4 = 70 -> 67.5 ± sqrt(12.5) = 3.54
    assert fedst["dice_avg"].format() == "67.50 ± 3.54"
    assert fedst["hd95_avg"].format() == "32.50 ± 3.54"
    assert math.isclose(dict(zip(headers, table.rows["FedAvg"], strict=True))["iou_D"].mean, 20.5)

    # the row without a config stays, with 0 runs, n/a cells and the reason under the table
    assert table.runs["Not yet"] == 0 and all(c is None for c in table.rows["Not yet"])
    text = "\n".join(t.to_markdown() for t in markdown)
    assert "| Not yet | 0 | n/a |" in text
    assert "Not yet: not available: configs/method/no_such_method.yaml does not exist" in text
    assert "Dice (%) A" in markdown[0].to_markdown() and "HD95" not in markdown[0].to_markdown()
    assert "HD95 (px) A" in markdown[1].to_markdown()


def test_a_run_directory_of_another_config_stops_the_runner_naming_the_key(tmp_path):
    runs = tmp_path / "runs"
    fake_finished_run(runs, tmp_path, "fedst", 0, [80.0, 60.0, 70.0, 50.0])
    fake_finished_run(runs, tmp_path, "fedavg", 0, [70.0, 50.0, 60.0, 40.0])
    overrides = ["experiment=tiny", f"data.root={tmp_path}", "train.lr=0.001"]
    plan = plan_table(SPEC, [0, 1], overrides, runs)
    states = {(r.row.name, r.seed): r.state for r in plan.runs}
    assert states[("fedst", 0)] == "conflict" and states[("fedst", 1)] == "new"
    with pytest.raises(RunnerError, match=r"fedst_s0 holds a run of another config.*train\.lr"):
        execute(plan)
    # evaluation cadence and hardware do not change what a run learns: still done
    overrides = ["experiment=tiny", f"data.root={tmp_path}", "train.eval_every=2"]
    states = {(r.row.name, r.seed): r.state for r in plan_table(SPEC, [0], overrides, runs).runs}
    assert states[("fedst", 0)] == "done"


def test_the_dry_run_lists_every_run_with_its_state_and_trains_nothing(tmp_path, capsys):
    runs = tmp_path / "runs"
    fake_finished_run(runs, tmp_path, "fedst", 0, [80.0, 60.0, 70.0, 50.0])
    args = ["--runs", str(runs), "--dry-run", "seeds=0,1", "rows=local,fedst"]
    assert paper.main(["table2", *args, "experiment=tiny", f"data.root={tmp_path}"]) == 0
    listing = capsys.readouterr().out
    assert "local                              seed 0  new" in listing
    assert "fedst                              seed 0  done" in listing
    assert "fedst                              seed 1  new" in listing
    assert not (runs / "tiny" / "local_s0").exists()


def test_seeds_and_rows_are_the_runners_keys_and_the_keys_it_sets_itself_are_refused():
    seeds, rows, overrides = paper.parse_arguments(
        ["seeds=3,4", "rows=local,fedst", "experiment=demo", "method.aggregation_weights=uniform"]
    )
    assert seeds == (3, 4) and rows == ["local", "fedst"]
    assert overrides == ["experiment=demo", "method.aggregation_weights=uniform"]
    for refused in ("seed=1", "method=fedavg", "+ablation=table4_row2_ts", "resume=runs/x"):
        with pytest.raises(RunnerError, match="the runner sets"):
            paper.parse_arguments([refused])


def test_tables_of_another_runs_root_go_beside_those_runs_not_over_the_default_tables():
    assert paper.tables_root(Path("runs")) == Path("results")
    assert paper.tables_root(Path("runs/fp16")) == Path("runs/fp16/results")


# -- Fig. 5 and Fig. 7: the synthetic-data comparisons ---------------------------------------------

FIG7_METHODS = ("local", "upperbound", "fedld", "feddp", "fedavg", "fedrep", "fedas")


def test_fig7_plans_each_baseline_without_and_with_synthetic_data_and_fedst_once(tmp_path):
    base = ["experiment=tiny", f"data.root={tmp_path}"]
    plan = plan_table(paper.TABLES["fig7"], [0], base, tmp_path / "runs")
    expected = []
    for method in FIG7_METHODS:
        expected.append((f"{method}_s0", (f"method={method}", "seed=0")))
        expected.append(
            (
                f"{method}_synthetic_s0",
                (f"method={method}", "+ablation=fig7_synthetic", "seed=0", "train.total_iters=8"),
            )
        )
    expected.append(("fedst_s0", ("method=fedst", "seed=0")))
    assert [(r.run_dir.name, r.overrides) for r in plan.runs] == expected
    # the "without" bars are Table II's runs: the same directories, the same configs
    table2 = plan_table(paper.TABLES["table2"], [0], base, tmp_path / "runs")
    without = [r for r in plan.runs if not r.row.name.endswith("_synthetic")]
    assert [(r.run_dir, r.cfg) for r in without] == [(r.run_dir, r.cfg) for r in table2.runs]
    for run in plan.runs:
        synthetic = run.row.name.endswith("_synthetic")
        assert run.cfg.data.mix_synthetic == synthetic
        assert paper.synthetic_in_training(run.cfg) == (synthetic or run.row.name == "fedst")


def test_fig5_plans_its_three_lines_and_the_dry_run_lists_their_overrides(tmp_path, capsys):
    args = ["--runs", str(tmp_path / "runs"), "--dry-run", "seeds=0,1"]
    assert paper.main(["fig5", *args, "experiment=tiny", f"data.root={tmp_path}"]) == 0
    listing = capsys.readouterr().out
    for seed in (0, 1):
        assert f"[+ablation=fig5_server_finetune seed={seed}]" in listing
        assert f"[+ablation=fig5_local_synthetic seed={seed} train.total_iters=8]" in listing
        assert f"[+ablation=fig5_serq seed={seed}]" in listing
    assert "0 done, 0 resume, 6 new" in listing
    plan = plan_table(paper.TABLES["fig5"], [0], ["experiment=tiny"], tmp_path / "runs")
    lines = {r.row.name: r.cfg for r in plan.runs}
    assert [r.run_dir.name for r in plan.runs] == [
        "fig5_server_finetune_s0",
        "fig5_local_synthetic_s0",
        "fig5_serq_s0",
    ]
    finetune, local, serq = (lines[n] for n in lines)
    assert (finetune.method.serq, finetune.serq.mode, finetune.data.mix_synthetic) == (
        True,
        "finetune",
        False,
    )
    assert (local.method.serq, local.data.mix_synthetic) == (False, True)
    assert (serq.method.serq, serq.serq.mode, serq.data.mix_synthetic) == (True, "serq", False)
    for cfg in lines.values():  # FedST's RSC in every line: only the synthetic data differs
        assert cfg.method.temporal and cfg.method.prompt and cfg.method.channel_selection


@pytest.mark.parametrize(
    "overrides",
    [
        ["experiment=tiny"],
        ["experiment=demo"],
        ["experiment=paper"],
        ["experiment=tiny", "train.total_iters=6", "train.local_iters=3"],
    ],
)
def test_doubling_gives_twice_the_iterations_and_rounds_at_the_same_local_iterations(overrides):
    single = Row("FedAvg", "fedavg")
    doubled = Row("FedAvg", "fedavg_synthetic", "ablation", config="fig7_synthetic",
                  method="fedavg", iters_factor=2)  # fmt: skip
    base, _ = paper.compose_row(single, 0, overrides)
    cfg, own = paper.compose_row(doubled, 0, overrides)
    assert cfg.train.total_iters == 2 * base.train.total_iters
    assert cfg.train.rounds == 2 * base.train.rounds
    assert cfg.train.local_iters == base.train.local_iters
    assert own[-1] == f"train.total_iters={2 * base.train.total_iters}"


def test_doubling_refuses_rounds_that_do_not_follow_the_iterations(tmp_path):
    plan = plan_table(
        paper.TABLES["fig7"],
        [0],
        ["experiment=tiny", f"data.root={tmp_path}", "train.rounds=2"],
        tmp_path / "runs",
        rows=["fedavg_synthetic"],
    )
    (run,) = plan.runs
    assert run.state == "unavailable"
    assert "train.rounds=2 disagrees with train.total_iters // train.local_iters = 8 // 2 = 4" in (
        run.detail
    )


def write_finished(run: paper.PlannedRun, dice: dict[str, float]) -> None:
    """A finished run at ``run.run_dir`` of ``run.cfg``: Dice ``dice`` per site (A-D, E)."""
    run.run_dir.mkdir(parents=True)
    (run.run_dir / "config.json").write_text(run.cfg.to_json())
    (run.run_dir / "config.yaml").write_text(f"seed: {run.seed}\n")
    for name in ("metrics.jsonl", "comm.jsonl"):
        (run.run_dir / name).write_text("")
    final = {
        "method": run.cfg.method.name,
        "seed": run.seed,
        "sites": {s: {"dice": dice[s]} for s in "ABCD"},
        "out_of_federation": {"E": {"dice": dice["E"]}},
    }
    (run.run_dir / "final.json").write_text(json.dumps(final))


def test_fig7_pairs_each_methods_runs_without_and_with_synthetic_data(tmp_path):
    runs, base = tmp_path / "runs", ["experiment=tiny", f"data.root={tmp_path}"]
    rows = ["fedavg", "fedavg_synthetic", "fedst", "local_synthetic"]
    plan = plan_table(paper.TABLES["fig7"], [0, 1], base, runs, rows=rows)
    scores = {  # (row, seed) -> Dice of A, B, C, D, E
        ("fedavg", 0): [70, 50, 60, 40, 20],
        ("fedavg", 1): [72, 52, 62, 42, 22],
        ("fedavg_synthetic", 0): [60, 40, 50, 30, 30],
        ("fedavg_synthetic", 1): [64, 40, 50, 30, 34],
        ("fedst", 0): [80, 60, 70, 50, 70],
        ("local_synthetic", 0): [10, 10, 10, 10, 10],
    }
    for run in plan.runs:
        if (run.row.name, run.seed) in scores:
            write_finished(run, dict(zip("ABCDE", scores[(run.row.name, run.seed)], strict=True)))
    plan = plan_table(paper.TABLES["fig7"], [0, 1], base, runs, rows=rows)
    markdown, table = build_tables(plan)
    assert list(table.rows) == ["Local Train", "FedAvg", "FedST"]  # the paper's order
    cells = {
        label: dict(zip([c.key for c in table.columns], table.rows[label], strict=True))
        for label in table.rows
    }
    fedavg = cells["FedAvg"]
    assert fedavg["dice_A_without"].format() == "71.00 ± 1.41"
    assert fedavg["dice_A_with"].format() == "62.00 ± 2.83"
    # Avg. per run first: without (55, 57) -> 56 ± 1.41; with (45, 46) -> 45.5 ± 0.71
    assert fedavg["dice_avg_without"].format() == "56.00 ± 1.41"
    assert fedavg["dice_avg_with"].format() == "45.50 ± 0.71"
    assert fedavg["dice_E_with"].format() == "32.00 ± 2.83"
    # FedST uses the synthetic set through SERQ: its one run set is a "with" bar
    assert cells["FedST"]["dice_A_without"] is None
    assert cells["FedST"]["dice_A_with"].format() == "80.00"
    assert cells["Local Train"]["dice_B_with"].format() == "10.00"  # seed 1 not finished
    assert table.texts["FedAvg"] == ["2 / 2"] and table.texts["Local Train"] == ["0 / 1"]
    text = markdown[0].to_markdown()
    assert "train.total_iters doubled" in text and "Dice (%) A without" in text

    out = tmp_path / "results"
    written = paper.write_outputs(plan, markdown, table, out)
    assert out / "tiny" / "fig7.png" in written and (out / "tiny" / "fig7.png").stat().st_size
    header = (out / "tiny" / "fig7.csv").read_text().splitlines()[0]
    assert header.startswith("method,runs,Runs without / with,dice_A_without_mean")


def test_fig5_curve_tables_are_mean_and_std_over_seeds_at_every_evaluated_round():
    def run(seed: int, values: dict[tuple[str, int], float]) -> dict:
        rows = [
            {"site": s, "round": t, "dice": v, "model": "personal"} for (s, t), v in values.items()
        ]
        rows.append({"site": "A", "round": 2, "dice": 0.0, "model": "outfed"})  # not a curve
        return {"seed": seed, "metrics": rows}

    groups = {
        "SERQ": [
            run(0, {("A", 2): 50, ("B", 2): 70, ("A", 4): 60, ("B", 4): 80}),
            run(1, {("A", 2): 54, ("B", 2): 70, ("A", 4): 62, ("B", 4): 80}),
        ],
        "Local": [run(0, {("A", 4): 40, ("B", 4): 20})],
    }
    panels = tables.curve_tables(groups)
    assert [panel for panel, _ in panels] == ["Average", "A", "B", ""]
    average = panels[0][1]
    assert [c.header for c in average.columns] == ["r2", "r4"]
    # Average per run and round first: seed 0 (60, 70), seed 1 (62, 71)
    assert [c.format() for c in average.rows["SERQ"]] == ["61.00 ± 1.41", "70.50 ± 0.71"]
    assert average.rows["Local"][0] is None and average.rows["Local"][1].format() == "30.00"
    combined = panels[-1][1]
    assert [c.key for c in combined.columns] == [
        "dice_avg_r2", "dice_avg_r4", "dice_A_r2", "dice_A_r4", "dice_B_r2", "dice_B_r4",
    ]  # fmt: skip
    assert combined.runs == {"SERQ": 2, "Local": 1}


def test_fig5_trains_its_three_lines_and_writes_the_curves_and_their_plot(
    tiny_data, tmp_path, monkeypatch
):
    runs, out = tmp_path / "runs", tmp_path / "results"
    colors: list[dict] = []
    original_plot = plots.plot_learning_curves

    def recording_plot(series, png, **kwargs):
        if png.name == "fig5.png":  # not a run's own plots/learning_curves.png
            colors.append(kwargs["colors"])
        return original_plot(series, png, **kwargs)

    monkeypatch.setattr(plots, "plot_learning_curves", recording_plot)
    args = ["--runs", str(runs), "--out", str(out), "seeds=0", "experiment=tiny"]
    args += [f"data.root={tiny_data}", "progress=false", "pretraining.iters=1"]
    args += ["train.total_iters=2", "train.local_iters=1"]  # 2 rounds (green: 4), each evaluated
    assert paper.main(["fig5", *args]) == 0

    by_row = csv_rows(out / "tiny" / "fig5.csv")
    assert list(by_row) == ["Server fine-tuning", "Synthetic at the sites", "SERQ (FedST)"]
    assert [by_row[label]["Line"] for label in by_row] == ["blue", "green", "red"]
    green = runs / "tiny" / "fig5_local_synthetic_s0"
    metrics = [json.loads(line) for line in (green / "metrics.jsonl").read_text().splitlines()]
    for row in metrics:  # every evaluated round of every site, as logged
        if row.get("split", "test") == "test" and row.get("model") == "personal":
            cell = by_row["Synthetic at the sites"][f"dice_{row['site']}_r{row['round']}_mean"]
            assert float(cell) == pytest.approx(row["dice"])
    evaluated = {r["round"] for r in metrics if r.get("model") == "personal"}
    assert evaluated == {1, 2, 3, 4}  # doubled: 4 rounds of 1 local iteration
    assert by_row["SERQ (FedST)"]["dice_avg_r4_mean"] == ""  # SERQ ran 2 rounds
    serq = runs / "tiny" / "fig5_serq_s0" / "metrics.jsonl"
    last = [json.loads(line) for line in serq.read_text().splitlines()]
    last = [r["dice"] for r in last if r.get("model") == "personal" and r["round"] == 2]
    assert len(last) == 4
    assert float(by_row["SERQ (FedST)"]["dice_avg_r2_mean"]) == pytest.approx(sum(last) / 4)
    markdown = (out / "tiny" / "fig5.md").read_text()
    for panel in ("Average", "A", "B", "C", "D"):
        assert (
            f"### Fig. 5: learning curves of the ways to use the synthetic set (test Dice): {panel} (tiny"
            in markdown
        )
    assert (out / "tiny" / "fig5.png").stat().st_size > 0
    assert colors == [
        {"Server fine-tuning": "blue", "Synthetic at the sites": "green", "SERQ (FedST)": "red"}
    ]


def test_a_row_that_only_renames_a_finished_run_reuses_it_instead_of_training_it_again(tmp_path):
    runs = tmp_path / "runs"
    fedst = fake_finished_run(runs, tmp_path, "fedst", 0, [80.0, 60.0, 70.0, 50.0])
    spec = TableSpec(
        "t4",
        "Table IV rows 6-7",
        (
            Row("6", "table4_row6_ts_serq", "ablation"),
            Row("7 (FedST)", "table4_row7_full", "ablation"),
        ),
        "sites",
    )
    plan = plan_table(spec, [0, 1], ["experiment=tiny", f"data.root={tmp_path}"], runs)
    runs_of = {(r.row.name, r.seed): r for r in plan.runs}
    full = runs_of[("table4_row7_full", 0)]
    assert full.cfg is not None and full.cfg.method.name != "fedst"  # another name ...
    assert (full.state, full.run_dir) == ("done", fedst)  # ... the same run
    assert "same run as fedst_s0" in full.detail
    assert runs_of[("table4_row7_full", 1)].state == "new"  # no run of seed 1 to reuse
    row6 = runs_of[("table4_row6_ts_serq", 0)]  # other settings: its own run
    assert row6.state == "new" and row6.run_dir == runs / "tiny" / "table4_row6_ts_serq_s0"
