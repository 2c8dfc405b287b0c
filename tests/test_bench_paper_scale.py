"""Specifications of bench/paper_scale.py's arithmetic (bench/round_costs.py): a round's parts
from its log rows, and the paper's round (300 x 100) extrapolated from per-unit costs, checked
against hand computations."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from bench.environment import REPO, child_environment
from bench.paper_scale import GpuSampler, summarise
from bench.round_costs import (
    PaperJob,
    evaluation_rounds,
    extrapolate,
    pretraining_cost,
    round_costs,
    training_rounds,
)

MB = 1e6


def _rows(number: int, site_seconds: float, loader: float, eval_frames: int) -> list[dict]:
    sites = [
        {"round": number, "site": s, "iterations": 4, "seconds": site_seconds,
         "loader_seconds": loader}
        for s in "ABCD"
    ]  # fmt: skip
    server = {
        "round": number,
        "site": "server",
        "aggregation_seconds": 0.5,
        "eq_seconds": 6.0,
        "sc_seconds": 2.0,
        "checkpoint_seconds": 3.0,
        "server_checkpoint_bytes": 100 * MB,
        "bank_bytes_written": 8 * MB,
        "bank_entries_written": 8,
        "round_seconds": 60.0,
        "rss_bytes": 2e9,
        "peak_rss_bytes": 2.5e9,
    }
    if eval_frames:
        server |= {"evaluation_seconds": 8.0, "evaluation_frames": eval_frames}
    return [*sites, server]


def test_a_round_s_parts_come_from_its_site_and_server_rows():
    rows = [{"round": 0, "site": "server", "pretrain_seconds": 9.0, "pretrain_iters": 3}]
    rows += _rows(1, site_seconds=10.0, loader=1.0, eval_frames=0)
    (cost,) = round_costs(rows, serq_batches=4)
    # by hand: compute 4 x (10 - 1) = 36 s, loader 4 x 1 = 4 s
    assert cost.site_compute == pytest.approx(36.0) and cost.loader_wait == pytest.approx(4.0)
    assert cost.site_iterations == 16 and cost.serq_batches == 4
    # other = 60 - 36 - 4 - 0.5 - 6 - 2 - 3 - 0 (no evaluation) = 8.5 s
    assert cost.other == pytest.approx(8.5)


def test_the_paper_round_scales_each_part_by_its_own_unit():
    costs = round_costs(
        _rows(2, site_seconds=10.0, loader=1.0, eval_frames=16)
        + _rows(3, site_seconds=10.0, loader=1.0, eval_frames=0),
        serq_batches=4,
    )
    job = PaperJob(checkpoint_every=1)
    paper = extrapolate(costs, pretrain_seconds_per_iter=3.0, job=job)
    # per site iteration: compute 9 / 4 = 2.25 s, wait 0.25 s; 4 sites x 100 iterations
    assert paper.site_compute == pytest.approx(400 * 2.25)
    assert paper.loader_wait == pytest.approx(400 * 0.25)
    # SERQ: 8 s per 4 batches = 2 s per batch; 100 batches
    assert paper.serq == pytest.approx(200.0)
    # checkpoint: server.pt 100 MB + 200 entries x 1 MB; 3 s per 108 MB written
    assert paper.checkpoint_bytes == pytest.approx(300 * MB)
    assert paper.checkpoint == pytest.approx(300 * 3.0 / 108)
    # evaluation: 8 s / 16 frames = 0.5 s per frame, 3718 frames every 10 rounds
    assert paper.evaluation == pytest.approx(0.5 * 3718 / 10)
    # other: 60 - 36 - 4 - 0.5 - 8 - 3 - (8 or 0) = 0.5 or 8.5 s, mean 4.5 s
    assert paper.other == pytest.approx(4.5)
    round_s = 900 + 100 + 0.5 + 200 + 300 * 3.0 / 108 + 185.9 + 4.5
    assert paper.wall == pytest.approx(round_s)
    assert paper.run_hours == pytest.approx((300 * round_s + 3000 * 3.0) / 3600)
    assert paper.bank_ram_bytes == pytest.approx(3600 * MB)


def test_a_checkpoint_every_k_rounds_writes_server_pt_once_and_the_bank_s_changes_of_k_rounds():
    rows = _rows(2, site_seconds=10.0, loader=1.0, eval_frames=0)
    rows += _rows(3, site_seconds=10.0, loader=1.0, eval_frames=16)
    rows[4] |= {"checkpoint_seconds": 0.0, "server_checkpoint_bytes": 0, "bank_bytes_written": 0,
                "bank_entries_written": 0}  # round 2: no checkpoint  # fmt: skip
    costs = round_costs(rows, serq_batches=4)
    # by hand, per checkpoint: server.pt 100 MB + the entries of k rounds (1 MB each);
    # k = 10: 2000 entries -> 2100 MB / 10 = 210 MB per round; k = 30: all 3600 -> 3700 / 30
    for k, per_round in ((10, 210 * MB), (30, 3700 * MB / 30)):
        paper = extrapolate(costs, pretrain_seconds_per_iter=0.0, job=PaperJob(checkpoint_every=k))
        assert paper.checkpoint_bytes == pytest.approx(per_round)
        assert paper.checkpoint == pytest.approx(per_round * 3.0 / (108 * MB))


def test_the_gpu_busy_fraction_averages_only_the_samples_inside_the_steady_rounds():
    gpu = GpuSampler(Path("unused.jsonl"))
    # rounds end at 10 s (round 0: pre-training), 20 s (round 1) and 30 s (round 2)
    gpu.round_ends = {0: 10.0, 1: 20.0, 2: 30.0}
    gpu.samples = [(5.0, 0.0, 100.0), (15.0, 50.0, 200.0), (25.0, 80.0, 300.0),
                   (29.0, 100.0, 400.0), (35.0, 0.0, 500.0)]  # fmt: skip
    # round 2 alone: the samples at 25 and 29 s, (80 + 100) / 2 = 90 %
    assert gpu.busy_fraction([2]) == pytest.approx(0.90)
    # rounds 1 and 2: 15, 25 and 29 s, (50 + 80 + 100) / 3
    assert gpu.busy_fraction([1, 2]) == pytest.approx(230 / 300)
    assert gpu.busy_fraction([3]) is None  # a round that never ended has no window
    assert gpu.peak_memory_mib() == 500.0


def test_the_summary_reports_the_evaluation_s_share_and_the_device_facts():
    costs = round_costs(
        _rows(2, site_seconds=10.0, loader=1.0, eval_frames=16)
        + _rows(3, site_seconds=10.0, loader=1.0, eval_frames=0),
        serq_batches=4,
    )
    paper = extrapolate(costs, pretrain_seconds_per_iter=3.0, job=PaperJob(checkpoint_every=1))
    gpu = GpuSampler(Path("unused.jsonl"))
    config = {"train": {"device": "cpu", "amp_dtype": "auto", "tf32": True, "compile": "none"}}
    summary = summarise(costs, costs, paper, gpu, config, peak_rss_bytes=2.5e9)
    # by hand: round 2 evaluates for 8 s of its 60 s; the steady rounds (2 and 3) are 120 s, of
    # which SERQ 2 x 8 s and the loader 2 x 4 s
    assert summary["measured_shares"]["evaluation (its rounds)"] == pytest.approx(8 / 60)
    assert summary["measured_shares"]["SERQ (EQ + SC)"] == pytest.approx(16 / 120)
    assert summary["measured_shares"]["loader wait"] == pytest.approx(8 / 120)
    assert summary["ms_per_site_step"] == pytest.approx(1e3 * 72 / 32)  # 2 x 36 s, 2 x 16 iters
    # the paper's round (test above): evaluation 0.5 s x 3718 frames / 10 of the round
    assert summary["paper_round_shares"]["evaluation (amortised)"] == pytest.approx(
        185.9 / paper.wall
    )
    assert summary["paper_run_hours"] == pytest.approx(paper.run_hours)
    assert summary["gpu_busy_fraction"] is None  # no samples without nvidia-smi
    facts = summary["device_facts"]
    # on the CPU autocast and TF32 do nothing: fp32, TF32 off, whatever the config asks
    assert (facts["device"], facts["dtype"], facts["tf32"]) == ("cpu", "fp32", False)
    assert facts["compile"] == "none"


def test_the_training_child_keeps_the_pythonpath_it_inherits():
    # on the GPU machine the carried wheels are reachable only through PYTHONPATH (/tmp/site):
    # a child that sees the repository alone dies at `import hydra`
    wheels = "/tmp/site"
    env = child_environment({"PYTHONPATH": f"{wheels}{os.pathsep}/opt/other", "HOME": "/root"})
    assert env["PYTHONPATH"].split(os.pathsep) == [str(REPO), wheels, "/opt/other"]
    assert env["HOME"] == "/root" and env["FLWR_TELEMETRY_ENABLED"] == "0"
    assert child_environment({})["PYTHONPATH"] == str(REPO)


def _with_checkpoint(rows: list[dict], saved: bool) -> list[dict]:
    if not saved:
        rows[-1] |= {"checkpoint_seconds": 0.0, "server_checkpoint_bytes": 0,
                     "bank_bytes_written": 0, "bank_entries_written": 0}  # fmt: skip
    return rows


def test_the_busy_window_holds_only_rounds_that_train_neither_first_last_evaluating_nor_saving():
    # rounds 1..6: 1 warms up, 3 evaluates, 4 saves a checkpoint, 6 is the last (evaluates, saves)
    rows: list[dict] = []
    for number, frames, saved in ((1, 0, False), (2, 0, False), (3, 16, False), (4, 0, True),
                                  (5, 0, False), (6, 16, True)):  # fmt: skip
        rows += _with_checkpoint(_rows(number, 10.0, 1.0, frames), saved)
    costs = round_costs(rows, serq_batches=4)
    assert [c.round for c in training_rounds(costs)] == [2, 5]
    # the evaluation's cost per frame comes from round 3, not from the last round (which also
    # scores HD95 / ASSD); with the last round alone evaluating, from that one
    assert [c.round for c in evaluation_rounds(costs)] == [3]
    assert [c.round for c in evaluation_rounds([costs[0], costs[-1]])] == [6]


def test_pretraining_costs_the_steps_after_warm_up_where_the_run_logged_them():
    row = {"pretrain_seconds": 30.0, "pretrain_iters": 12}  # 12 steps, the first slow
    assert pretraining_cost(row)[0] == pytest.approx(2.5)  # older runs: every step, an upper bound
    row |= {"pretrain_steady_seconds": 5.0, "pretrain_steady_iters": 10}
    per, what = pretraining_cost(row)
    assert per == pytest.approx(0.5) and "after warm-up" in what
    assert pretraining_cost(None) == (0.0, "no pre-training")
