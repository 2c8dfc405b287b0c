"""Specifications of bench/paper_scale.py's arithmetic: a round's parts from its log rows, and the
paper's round (300 x 100) extrapolated from per-unit costs, checked against hand computations."""

from __future__ import annotations

import pytest

from bench.paper_scale import PaperJob, extrapolate, round_costs

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
