"""Procedural multi-site surgical video benchmark, written in the generic layout (DESIGN.md sec. 5).

The command line of ``-m fedst.data.procedural`` (see the package docstring): writes a
preset's sites with :func:`~fedst.data.procedural.writer.generate`, or with ``--oracle-split SITE``
the diagnosis-only split, and prints what each site holds. The first line above is its ``--help``
description."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path

from fedst.data.procedural.sites import PRESETS, SITES
from fedst.data.procedural.writer import generate, generate_oracle_split
from fedst.errors import ArgumentParser
from fedst.schema.data import GENERATOR_VERSION, GENERATOR_VERSIONS


def main(argv: Sequence[str] | None = None) -> None:
    """CLI: ``python -m fedst.data.procedural --out DIR --seed N --preset demo``."""
    parser = ArgumentParser(
        prog="python -m fedst.data.procedural", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--out", type=Path, required=True, help="root folder of the sites")
    parser.add_argument("--seed", type=int, default=0, help="benchmark seed")
    parser.add_argument("--preset", choices=sorted(PRESETS), default="demo", help="size preset")
    parser.add_argument("--sites", default=None, help=f"comma-separated subset of {list(SITES)}")
    parser.add_argument(
        "--force",
        action="store_true",
        help="regenerate existing generated sites (deletes their videos/ and splits/)",
    )
    parser.add_argument("--workers", type=int, default=2, help="processes rendering videos")
    parser.add_argument(
        "--version",
        type=int,
        choices=sorted(GENERATOR_VERSIONS),
        default=GENERATOR_VERSION,
        help="generator version (rendering); older ones stay reproducible",
    )
    parser.add_argument(
        "--oracle-split",
        metavar="SITE",
        default=None,
        help="instead of the benchmark: write <out>/<SITE>_oracle, training videos in a test-only "
        "site's style for diagnosis only (never into a benchmark folder)",
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    if args.oracle_split is not None:
        if args.sites:
            parser.error("--oracle-split writes one site: drop --sites")
        counts = generate_oracle_split(
            args.out,
            args.seed,
            args.preset,
            args.oracle_split,
            force=args.force,
            workers=args.workers,
            version=args.version,
        )
    else:
        sites = args.sites.split(",") if args.sites else None
        counts = generate(
            args.out,
            args.seed,
            args.preset,
            sites,
            force=args.force,
            workers=args.workers,
            version=args.version,
        )
    for site, c in counts.items():
        state = "generated" if c["generated"] else "up to date"
        print(
            f"{site:>9}: {state:10} videos {c['videos']} labelled {c['labelled']} "
            f"frames {c['frames']}"
        )
