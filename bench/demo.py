"""Time and peak memory of the demo (`make demo`'s job: generate, train FedST + FedAvg, evaluate).

    .venv/bin/python -m bench.demo                 # fresh run directories under a temp folder
    .venv/bin/python -m bench.demo --keep runs/bench_demo

Runs `python -m fedst.demo` as a child process (same interpreter, in-process Flower engine, so the
child is the whole job) and reports its wall time and peak resident memory (the child's
ru_maxrss). Budget (issue: the demo): at most 15 min and 4 GB on 2 cores. The generated benchmark
in data/procedural/demo_v2 is reused when present (generation is timed by bench/data_generation.py).
"""

from __future__ import annotations

import argparse
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere, no install
from bench.scratch import scratch_dir

BUDGET_S = 15 * 60
BUDGET_GB = 4.0


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--keep",
        type=Path,
        default=None,
        help="run directory root to keep (default: a temporary one, removed at the end)",
    )
    parser.add_argument("overrides", nargs="*", help="Hydra overrides passed to the demo")
    args = parser.parse_args(argv)
    with scratch_dir("fedst_bench_demo_", args.keep) as runs:
        env = {**os.environ, "FLWR_TELEMETRY_ENABLED": "0"}
        command = [sys.executable, "-m", "fedst.demo", "--runs", str(runs), *args.overrides]
        started = time.perf_counter()
        completed = subprocess.run(command, env=env, check=False)
        seconds = time.perf_counter() - started
        if completed.returncode != 0:
            sys.exit(f"demo exit code: {completed.returncode}; its runs: {runs}")
    peak_gb = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024**2  # KiB -> GiB
    print(f"demo wall time: {seconds:.0f} s (budget {BUDGET_S} s, ratio {seconds / BUDGET_S:.2f})")
    print(
        f"demo peak RSS: {peak_gb:.2f} GB (budget {BUDGET_GB} GB, ratio {peak_gb / BUDGET_GB:.2f})"
    )
    print(f"runs: {runs}" + ("" if args.keep else " (removed; --keep DIR keeps them)"))


if __name__ == "__main__":
    main()
