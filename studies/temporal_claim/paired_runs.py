"""Paired differences between two settings over seeds, and the verdict of a paired t rule.

    .venv/bin/python -m studies.temporal_claim.paired_runs --pair 'row 2 - row 1' \\
        runs/issue47_v4/demo/table4_row2_ts runs/issue47_v4/demo/table4_row1_baseline [--seeds 0,1,2]
    .venv/bin/python -m studies.temporal_claim.paired_runs --ts-protocol runs/issue47_v4 runs/issue47_v4_controls

A setting is a run folder without its seed suffix: ``PREFIX_s{seed}`` is its run of that seed (the
layout the paper runner (fedst.paper) writes). Per seed s, d_s = value(a, s) - value(b, s) of each
metric (Dice: the federated sites' mean, E and GraSP, the model each run returns at its last
round, as final.json holds it). With n seeds, mean d, its standard deviation (n - 1) and the
two-sided 5 % half-width t(0.975, n - 1) * std / sqrt(n) (4.303 * std / sqrt(3) at three seeds):
"effect" when |mean d| is above it, "unresolved" otherwise; fewer than ``--min-seeds`` seeds give
no verdict. ``--ts-protocol`` names the four pairs of the TS protocol in studies/temporal_claim/README.md ("The TS
claim on generator version 3", addendum 1).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from scipy import stats

from fedst.report.results import RunError, load_run, run_average, site_value

FEDERATED_SITES = ("A", "B", "C", "D")
METRICS: dict[str, Callable[[dict], float | None]] = {
    "A-D mean": lambda run: run_average(run, FEDERATED_SITES, "dice"),
    "E": lambda run: site_value(run, "out_of_federation", "E", "dice"),
    "GraSP": lambda run: site_value(run, "out_of_federation", "grasp", "dice"),
}
"""Dice (%) of a loaded run (:func:`fedst.report.results.load_run`) by column name."""


def ts_protocol_pairs(main: Path, controls: Path) -> list[tuple[str, Path, Path]]:
    """The TS protocol's four comparisons (a - b), as setting prefixes under its two folders."""
    demo, ctrl = main / "demo", controls / "demo"
    return [
        ("row 2 - row 1", demo / "table4_row2_ts", demo / "table4_row1_baseline"),
        ("FedST - FedAvg", demo / "fedst", demo / "fedavg"),
        ("row 2 - row 2 at interval_s=0", demo / "table4_row2_ts", ctrl / "table4_row2_ts"),
        ("FedAvg + TS - FedAvg", ctrl / "fedavg", demo / "fedavg"),
    ]


@dataclasses.dataclass(frozen=True)
class Verdict:
    """The paired rule on differences d_s: mean, std (n - 1), t half-width and its reading."""

    seeds: int
    mean: float
    std: float | None
    half_width: float | None
    reading: str


def paired_verdict(differences: Sequence[float], min_seeds: int = 3) -> Verdict:
    """Two-sided paired t test at 5 % on ``differences`` (one per seed): "effect, positive",
    "effect, negative" or "unresolved"; "no verdict (n seeds)" below ``min_seeds``."""
    n = len(differences)
    if n == 0:
        return Verdict(0, math.nan, None, None, "no seed with both runs")
    mean = sum(differences) / n
    if n < 2:
        return Verdict(n, mean, None, None, f"no verdict ({n} seed)")
    std = math.sqrt(sum((d - mean) ** 2 for d in differences) / (n - 1))
    half_width = float(stats.t.ppf(0.975, n - 1)) * std / math.sqrt(n)
    if n < min_seeds:
        reading = f"no verdict ({n} seeds)"
    elif abs(mean) > half_width:
        reading = "effect, positive" if mean > 0 else "effect, negative"
    else:
        reading = "unresolved"
    return Verdict(n, mean, std, half_width, reading)


def seed_runs(prefix: Path, seeds: Sequence[int]) -> tuple[dict[int, dict], dict[int, str]]:
    """The finished runs ``PREFIX_s{seed}`` by seed, and why each other seed has none."""
    runs, absent = {}, {}
    for seed in seeds:
        run_dir = prefix.parent / f"{prefix.name}_s{seed}"
        if not run_dir.is_dir():
            absent[seed] = "no run"
            continue
        try:
            runs[seed] = load_run(run_dir)
        except RunError:
            absent[seed] = "not finished"
    return runs, absent


def seed_differences(
    runs_a: Mapping[int, dict], runs_b: Mapping[int, dict], value: Callable[[dict], float | None]
) -> dict[int, float]:
    """d_s = value(a, s) - value(b, s) for every seed both settings have a value of."""
    differences = {}
    for seed in sorted(set(runs_a) & set(runs_b)):
        a, b = value(runs_a[seed]), value(runs_b[seed])
        if a is not None and b is not None:
            differences[seed] = a - b
    return differences


def _conditions(runs: Mapping[int, dict], absent: Mapping[int, str]) -> str:
    """Last round and code commit of each run (to see that a pair compares like with like),
    and the seeds without a finished run."""
    parts = {seed: f"s{seed}: {why}" for seed, why in absent.items()}
    for seed, run in runs.items():
        code = run["final"].get("code") or {}
        commit = str(code.get("commit", "?"))[:7] + ("+dirty" if code.get("dirty") else "")
        parts[seed] = f"s{seed}: round {run['final'].get('rounds', '?')}, {commit}"
    return "; ".join(parts[seed] for seed in sorted(parts))


def report(pairs: Sequence[tuple[str, Path, Path]], seeds: Sequence[int], min_seeds: int) -> str:
    lines = []
    for label, prefix_a, prefix_b in pairs:
        (runs_a, absent_a), (runs_b, absent_b) = (
            seed_runs(prefix_a, seeds),
            seed_runs(prefix_b, seeds),
        )
        lines += [f"{label}", f"  a = {prefix_a}_s*  ({_conditions(runs_a, absent_a)})"]
        lines += [f"  b = {prefix_b}_s*  ({_conditions(runs_b, absent_b)})"]
        for name, value in METRICS.items():
            differences = seed_differences(runs_a, runs_b, value)
            verdict = paired_verdict(list(differences.values()), min_seeds)
            per_seed = ", ".join(f"s{s} {d:+.2f}" for s, d in differences.items()) or "-"
            bound = "" if verdict.half_width is None else f" (half-width {verdict.half_width:.2f})"
            mean = "" if verdict.seeds == 0 else f"; mean {verdict.mean:+.2f}{bound}"
            lines.append(f"  {name:<9} d: {per_seed}{mean}: {verdict.reading}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> str:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--pair", nargs=3, action="append", default=[], metavar=("LABEL", "A", "B"),
        help="a comparison a - b: its label and the two settings' run-folder prefixes",
    )  # fmt: skip
    parser.add_argument(
        "--ts-protocol", nargs=2, type=Path, metavar=("MAIN", "CONTROLS"),
        help="the TS protocol's four pairs under its main and controls folders",
    )  # fmt: skip
    parser.add_argument("--seeds", default="0,1,2", help="comma-separated seeds (default 0,1,2)")
    parser.add_argument("--min-seeds", type=int, default=3, help="fewer give no verdict")
    args = parser.parse_args(argv)
    pairs = [(label, Path(a), Path(b)) for label, a, b in args.pair]
    if args.ts_protocol:
        pairs += ts_protocol_pairs(*args.ts_protocol)
    if not pairs:
        parser.error("name a comparison: --pair LABEL A B or --ts-protocol MAIN CONTROLS")
    seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    text = report(pairs, seeds, args.min_seeds)
    print(text)
    return text


if __name__ == "__main__":
    main()
