"""Specification of the table runner (fedst.experiments): one command trains the runs a table
needs, skips finished ones, resumes interrupted ones, and writes the paper's layout."""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

import pytest

from fedst import experiments
from fedst.cli import compose_experiment
from fedst.data.procedural import generate
from fedst.experiments import Row, RunnerError, TableSpec, build_tables, execute, plan_table
from fedst.federation import site as site_module

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
        "serq.pretrain_iters=1",
    ]
    trained: list[str] = []
    original_training = experiments.run_training

    def counting_training(cfg, run_dir, **kwargs):
        trained.append(run_dir.name)
        return original_training(cfg, run_dir, **kwargs)

    monkeypatch.setattr(experiments, "run_training", counting_training)
    original_round = site_module.Site.train_round

    def power_cut_in_fedavg_round_two(self, received, server_round, local_iters, **kwargs):
        if self.cfg.method.name == "fedavg" and server_round == 2:
            raise RuntimeError("power cut")
        return original_round(self, received, server_round, local_iters, **kwargs)

    # 1st invocation: Local trains; FedAvg is interrupted after round 1 (exit code 1)
    with monkeypatch.context() as patch:
        patch.setattr(site_module.Site, "train_round", power_cut_in_fedavg_round_two)
        assert experiments.main(["table9", *args]) == 1
    local, fedavg = runs / "tiny" / "local_s0", runs / "tiny" / "fedavg_s0"
    assert trained == ["local_s0", "fedavg_s0"]
    assert (local / "final.json").is_file() and not (fedavg / "final.json").exists()
    local_final_mtime = (local / "final.json").stat().st_mtime_ns
    assert "FedAvg, seed 0: failed (FederationError" in (out / "tiny" / "table9.md").read_text()

    # 2nd: Local is skipped (not trained, final.json untouched); FedAvg resumes after round 1
    trained.clear()
    assert experiments.main(["table9", *args]) == 0
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
    assert experiments.main(["table2", *args]) == 0
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
    assert experiments.main(["table2", *args, "experiment=tiny", f"data.root={tmp_path}"]) == 0
    listing = capsys.readouterr().out
    assert "local                              seed 0  new" in listing
    assert "fedst                              seed 0  done" in listing
    assert "fedst                              seed 1  new" in listing
    assert not (runs / "tiny" / "local_s0").exists()


def test_seeds_and_rows_are_the_runners_keys_and_the_keys_it_sets_itself_are_refused():
    seeds, rows, overrides = experiments.parse_arguments(
        ["seeds=3,4", "rows=local,fedst", "experiment=demo", "method.aggregation_weights=uniform"]
    )
    assert seeds == (3, 4) and rows == ["local", "fedst"]
    assert overrides == ["experiment=demo", "method.aggregation_weights=uniform"]
    for refused in ("seed=1", "method=fedavg", "+ablation=table4_row2_ts", "resume=runs/x"):
        with pytest.raises(RunnerError, match="the runner sets"):
            experiments.parse_arguments([refused])


def test_tables_of_another_runs_root_go_beside_those_runs_not_over_the_default_tables():
    assert experiments.tables_root(Path("runs")) == Path("results")
    assert experiments.tables_root(Path("runs/fp16")) == Path("runs/fp16/results")
