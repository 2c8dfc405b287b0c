"""The runner's command line: plan a table's runs, train them, write the table (see the package
docstring for the command and its arguments)."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from pathlib import Path

from fedst.cli import setup_logging
from fedst.errors import ArgumentParser
from fedst.paper.planning import describe, execute, parse_arguments, plan_table
from fedst.paper.tables import TABLES
from fedst.paper.writing import FpsSettings, build_tables, write_outputs

log = logging.getLogger("fedst.paper")

DESCRIPTION = (
    "One command per table of the paper: train the runs a table needs, then write the table."
)

# -- CLI ------------------------------------------------------------------------------------------


DEFAULT_RUNS = Path("runs")


def tables_root(runs: Path) -> Path:
    """Where the tables go without ``--out``: ``results`` for the default runs root, otherwise
    ``<runs>/results``, so that tables of another set of runs (``--runs runs/fp16``) never
    overwrite the default runs' ``results/<experiment>/<table>.md``."""
    return Path("results") if runs == DEFAULT_RUNS else runs / "results"


def main(argv: Sequence[str] | None = None) -> int:
    tokens = list(sys.argv[1:] if argv is None else argv)
    key_values = [t for t in tokens if "=" in t and not t.startswith("-")]  # anywhere on the line
    parser = ArgumentParser(
        prog="python -m fedst.paper",
        usage="%(prog)s TABLE [--dry-run] [--runs DIR] [--out DIR] [--fps-*] [seeds=0,1,2] "
        "[rows=NAME,NAME] [Hydra overrides]",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Tables: " + ", ".join(f"{n} ({s.caption})" for n, s in TABLES.items()),
    )
    parser.add_argument("table", choices=list(TABLES))
    parser.add_argument("--dry-run", action="store_true", help="list the runs; train nothing")
    parser.add_argument("--runs", type=Path, default=DEFAULT_RUNS, help="root of run directories")
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        help="root of the tables (default: results, or <runs>/results with another --runs)",
    )
    # the FPS column of table9: each run's model of its first federated site streams that site's
    # test videos frame by frame (batch 1, on the run's train.device; fedst.paper.writing)
    for setting, what in (
        ("frames", "frames timed per run"),
        ("warmup", "frames run before the timed ones, not timed"),
        ("threads", "torch CPU threads while timing"),
    ):
        parser.add_argument(
            f"--fps-{setting}",
            type=int,
            default=getattr(FpsSettings, setting),
            metavar="N",
            help=f"table9's FPS: {what} (default: %(default)s)",
        )
    # a mistake (RunnerError, ConfigError) ends in the entry point's one line, exit status 2
    seeds, rows, overrides = parse_arguments(key_values)
    parser.set_defaults(seeds=seeds, rows=rows, overrides=overrides)
    options = parser.parse_args([t for t in tokens if t not in key_values])
    plan = plan_table(TABLES[options.table], seeds, overrides, options.runs, rows)
    setup_logging()  # configures Flower's logger too: once the arguments and rows are checked
    print(describe(plan))
    if options.dry_run:
        return 0
    failures = execute(plan)
    fps = FpsSettings(options.fps_frames, options.fps_warmup, options.fps_threads)
    markdown, csv_table = build_tables(plan, failures, fps)
    written = write_outputs(plan, markdown, csv_table, options.out or tables_root(options.runs))
    print()
    print("\n".join(t.to_markdown() for t in markdown))
    for path in written:
        print(f"wrote {path}")
    return 1 if failures else 0
