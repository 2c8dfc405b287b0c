"""Specification of studies/temporal_claim/paired_runs.py, the paired t rule the TS protocol (studies/temporal_claim/README.md) reads
its verdicts with: differences are paired by seed, a verdict needs three seeds, and "effect"
means |mean d| above t(0.975, n - 1) * std / sqrt(n) (4.303 at two degrees of freedom, from a
printed t table, not from the code under test)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from studies.temporal_claim.paired_runs import main, paired_verdict, seed_differences

T_975_2DF = 4.303  # Student's t, two-sided 5 %, 2 degrees of freedom (printed tables)


def test_three_seeds_inside_the_t_half_width_are_unresolved():
    """d = 1, 2, 3: mean 2, std 1, half-width 4.303 / sqrt(3) = 2.484 > 2."""
    verdict = paired_verdict([1.0, 2.0, 3.0])
    assert verdict.mean == pytest.approx(2.0)
    assert verdict.std == pytest.approx(1.0)
    assert verdict.half_width == pytest.approx(T_975_2DF / math.sqrt(3), abs=1e-3)
    assert verdict.reading == "unresolved"


def test_three_seeds_beyond_the_half_width_are_an_effect_with_its_sign():
    """d = 2.9, 3.0, 3.1: std 0.1, half-width 0.248 < 3; the same negated is negative."""
    assert paired_verdict([2.9, 3.0, 3.1]).reading == "effect, positive"
    assert paired_verdict([-2.9, -3.0, -3.1]).reading == "effect, negative"


def test_fewer_than_three_seeds_give_no_verdict_however_large_the_difference():
    assert paired_verdict([10.0, 10.1]).reading == "no verdict (2 seeds)"
    assert paired_verdict([10.0]).reading == "no verdict (1 seed)"


def test_differences_pair_runs_of_the_same_seed_only():
    """Seed 0 only in a, seed 2 only in b: the one pair is seed 1's, 5 - 2."""
    runs_a = {0: {"v": 1.0}, 1: {"v": 5.0}}
    runs_b = {1: {"v": 2.0}, 2: {"v": 9.0}}
    assert seed_differences(runs_a, runs_b, lambda run: run["v"]) == {1: 3.0}


def write_finished_run(run_dir: Path, seed: int, e_dice: float, rounds: int = 20) -> None:
    """The files fedst.report.results.load_run needs of a finished run (no config.json: its
    round count is then final.json's alone)."""
    run_dir.mkdir(parents=True)
    (run_dir / "config.yaml").write_text(f"seed: {seed}\n")
    (run_dir / "metrics.jsonl").write_text("")
    (run_dir / "comm.jsonl").write_text("")
    sites = {site: {"dice": 70.0} for site in "ABCD"}
    final = {
        "method": "fedst",
        "seed": seed,
        "rounds": rounds,
        "sites": sites,
        "out_of_federation": {"E": {"dice": e_dice}, "grasp": {"dice": 90.0}},
        "code": {"commit": "0123456789abcdef", "dirty": False},
    }
    (run_dir / "final.json").write_text(json.dumps(final))


def test_the_report_reads_e_per_seed_from_the_runs_and_names_an_unfinished_seed(tmp_path):
    """a - b on E: seeds 0 and 1 finished (+3, +5), seed 2 of b has no final.json: two pairs,
    no verdict, and the missing seed is named."""
    for seed, (e_a, e_b) in enumerate([(40.0, 37.0), (41.0, 36.0), (39.0, None)]):
        write_finished_run(tmp_path / f"a_s{seed}", seed, e_a)
        if e_b is None:
            (tmp_path / f"b_s{seed}").mkdir()
        else:
            write_finished_run(tmp_path / f"b_s{seed}", seed, e_b)
    text = main(["--pair", "a - b", str(tmp_path / "a"), str(tmp_path / "b")])
    e_line = next(line for line in text.splitlines() if line.strip().startswith("E "))
    assert "s0 +3.00, s1 +5.00;" in e_line
    assert "mean +4.00" in e_line
    assert "no verdict (2 seeds)" in e_line
    assert "s2: not finished" in text
