"""Specifications of what a run writes about itself: a log readable in a file (no progress bars
into a non-terminal, one line per round) and the server step's timing in train.jsonl / the report.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from fedst.report import results, tables

REPO = Path(__file__).resolve().parents[1]
ROUNDS = 2  # configs/experiment/tiny.yaml


def test_no_progress_bar_is_written_into_a_non_terminal(tiny_cli_run):
    stderr = tiny_cli_run.stderr
    assert "\r" not in stderr
    assert "it/s" not in stderr and "s/it" not in stderr  # no tqdm status line either


def test_a_non_terminal_log_has_one_line_per_round(tiny_cli_run):
    stderr = tiny_cli_run.stderr
    lines = re.findall(r"round (\d+)/(\d+) done in [\d.]+ s", stderr)
    assert lines == [(str(r), str(ROUNDS)) for r in range(1, ROUNDS + 1)]


def test_train_log_times_the_aggregation_and_serq_steps_of_every_round(tiny_cli_run):
    run_dir = tiny_cli_run.run_dir
    rows = [json.loads(line) for line in (run_dir / "train.jsonl").read_text().splitlines()]
    server = {r["round"]: r for r in rows if r["site"] == "server" and r["round"] >= 1}
    assert sorted(server) == list(range(1, ROUNDS + 1))
    for row in server.values():
        assert row["eq_seconds"] > 0 and row["sc_seconds"] > 0 and row["aggregation_seconds"] > 0
        parts = row["aggregation_seconds"] + row["eq_seconds"] + row["sc_seconds"]
        assert parts <= row["seconds"]  # the step's total covers its parts
        assert row["checkpoint_seconds"] > 0 and row["checkpoint_bytes"] > 0  # the round's save
    table = tables.timing_table(results.load_runs([run_dir]))
    assert [c.key for c in table.columns][-1] == "serq_over_site"
    assert table.rows["fedst"][-1] is not None


def test_train_log_gives_each_round_its_loader_wait_evaluation_time_and_memory(tiny_cli_run):
    """What bench/paper_scale.py reads: the share of a site's round spent waiting for batches,
    the evaluation's wall time and frames, the whole round, and the process's memory."""
    run_dir = tiny_cli_run.run_dir
    rows = [json.loads(line) for line in (run_dir / "train.jsonl").read_text().splitlines()]
    sites = [r for r in rows if r["site"] != "server"]
    assert len(sites) == 4 * ROUNDS
    for row in sites:
        assert 0 < row["loader_seconds"] < row["seconds"]
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    server = [r for r in rows if r["site"] == "server" and r["round"] >= 1]
    for row in server:  # tiny: eval_every 1
        frames = sum(m["num_frames"] for m in metrics if m["round"] == row["round"])
        assert row["evaluation_frames"] == frames > 0
        assert 0 < row["evaluation_seconds"] < row["round_seconds"]
        assert row["seconds"] + row["evaluation_seconds"] < row["round_seconds"]
        assert 0 < row["rss_bytes"] <= row["peak_rss_bytes"]
        phases = [row[f"{p}_peak_rss_bytes"] for p in PHASES]
        assert 0 < max(phases) <= row["peak_rss_bytes"]


PHASES = ("train", "server_step", "evaluation", "checkpoint")
CAN_RESET_PEAK = os.access("/proc/self/clear_refs", os.W_OK)
MB = 1024**2


PHASE_PEAK_SCRIPT = """
import gc, json, types
from fedst.accel import PhasePeaks, memory, memory_usage
MB = 1024**2
# where ru_maxrss follows the kernel's reset (as in a plain Python process here), the run's peak
# must come from the mark PhasePeaks keeps: report ru_maxrss as the kernel's mark
memory.resource = types.SimpleNamespace(
    RUSAGE_SELF=0, getrusage=lambda who: types.SimpleNamespace(ru_maxrss=memory._kernel_peak_rss() // 1024)
)
gc.collect()
peaks = PhasePeaks()
with peaks.phase("large"):
    block = bytearray(b"x") * (100 * MB)  # 100 MB, every page written
    del block
with peaks.phase("small"):
    block = bytearray(b"x") * (10 * MB)
    del block
print(json.dumps({**peaks.row(), "run_peak": memory_usage()["peak_rss_bytes"]}))
"""


@pytest.mark.skipif(not CAN_RESET_PEAK, reason="needs Linux's /proc/self/clear_refs")
def test_a_phase_peak_is_what_that_phase_held_and_the_run_peak_survives_the_resets():
    """In a process of its own: a long test session's freed memory and garbage collection would
    move the resident size under the phases."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, "-c", PHASE_PEAK_SCRIPT], env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr[-2000:]
    row = json.loads(done.stdout)
    # the large phase's 100 MB is not counted in the small phase that came after it
    assert row["large_peak_rss_bytes"] - row["small_peak_rss_bytes"] > 80 * MB
    assert row["run_peak"] >= row["large_peak_rss_bytes"]


def test_the_run_peak_is_never_below_a_phase_peak_when_the_kernels_mark_reads_lower_later(
    monkeypatch,
):
    """The kernel folds the resident size into VmHWM lazily, so a reading after a phase can be
    below the one at its end (seen in CI: 94 KB); ru_maxrss lags as well. Readings in MB: 100 at
    the phase's start, 500 at its end, 300 when the run's figures are read."""
    from types import SimpleNamespace

    from fedst.accel import PhasePeaks, memory, memory_usage

    readings = iter([100 * MB, 500 * MB, 300 * MB])
    monkeypatch.setattr(memory, "_kernel_peak_rss", lambda: next(readings))
    monkeypatch.setattr(memory, "_reset_kernel_peak_rss", lambda: True)
    monkeypatch.setattr(memory, "_resident_bytes", lambda: 200 * MB)
    monkeypatch.setattr(memory, "_HIGHEST_RSS_MARK", 0)
    ru_maxrss = SimpleNamespace(ru_maxrss=300 * 1024)  # KiB: the lagging 300 MB
    monkeypatch.setattr(memory.resource, "getrusage", lambda who: ru_maxrss)
    peaks = PhasePeaks()
    with peaks.phase("train"):
        pass
    assert peaks.row()["train_peak_rss_bytes"] == 500 * MB
    assert memory_usage()["peak_rss_bytes"] == 500 * MB


def _run(seed: int, train_rows: list[dict]) -> dict:
    return {"method": "fedst", "seed": seed, "experiment": "x", "final": {}, "train": train_rows}


def test_the_report_gives_serq_time_per_round_over_the_mean_site_round():
    rows = [
        {"round": 0, "site": "server", "synthetic_pretrain_loss": 1.0},  # pre-training: not a round
        {"round": 1, "site": "A", "seconds": 2.0},
        {"round": 1, "site": "B", "seconds": 4.0},
        {"round": 1, "site": "server", "seconds": 7.5, "aggregation_seconds": 0.5,
         "eq_seconds": 3.0, "sc_seconds": 3.0},
        {"round": 2, "site": "A", "seconds": 2.0},
        {"round": 2, "site": "B", "seconds": 4.0},
        {"round": 2, "site": "server", "seconds": 11.5, "aggregation_seconds": 0.5,
         "eq_seconds": 5.0, "sc_seconds": 5.0},
    ]  # fmt: skip
    table = tables.timing_table([_run(0, rows)])
    cells = dict(zip([c.key for c in table.columns], table.rows["fedst"], strict=True))
    # by hand: sites (2 + 4 + 2 + 4) / 4 = 3 s; SERQ (6 + 10) / 2 = 8 s; server (7.5 + 11.5) / 2
    assert cells["site_seconds"].mean == pytest.approx(3.0)
    assert cells["serq_seconds"].mean == pytest.approx(8.0)
    assert cells["server_seconds"].mean == pytest.approx(9.5)
    assert cells["aggregation_seconds"].mean == pytest.approx(0.5)
    assert cells["serq_over_site"].mean == pytest.approx(8.0 / 3.0)
