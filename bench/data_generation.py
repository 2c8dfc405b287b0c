"""Time the procedural benchmark generator (fedst/data/procedural/) per preset.

``python -m bench.data_generation [--full] [--workers 2] [--seed 0] [--versions 1,2]`` generates
every site of the tiny and demo presets (and full with ``--full``) into a temporary folder and
prints one line per preset and generator version: wall-clock seconds, frames written, frames per
second and, with several versions, the time relative to the first version measured in this run.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere, no install

from fedst.data.procedural import GENERATOR_VERSION, PRESETS, generate


def time_preset(preset: str, seed: int, workers: int, version: int) -> tuple[float, int]:
    """Seconds to generate all sites of ``preset`` from scratch, and the frames written."""
    with tempfile.TemporaryDirectory(prefix=f"fedst_{preset}_") as tmp:
        start = time.perf_counter()
        counts = generate(Path(tmp), seed, preset, workers=workers, progress=False, version=version)
        seconds = time.perf_counter() - start
    return seconds, sum(c["frames"] for c in counts.values())


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--full", action="store_true", help="also time the full preset (slow)")
    parser.add_argument("--workers", type=int, default=2, help="rendering processes")
    parser.add_argument("--seed", type=int, default=0, help="benchmark seed")
    parser.add_argument(
        "--versions", default=str(GENERATOR_VERSION), help="generator versions, e.g. 1,2"
    )
    args = parser.parse_args(argv)
    presets = ["tiny", "demo"] + (["full"] if args.full else [])
    versions = [int(v) for v in args.versions.split(",")]
    for preset in presets:
        spec = PRESETS[preset]
        first = None
        for version in versions:
            seconds, frames = time_preset(preset, args.seed, args.workers, version)
            first = first or seconds
            print(
                f"{preset:5s} {spec.height}x{spec.width} v{version}: {seconds:6.1f} s  "
                f"{frames:6d} frames  {frames / seconds:6.1f} frames/s  "
                f"x{seconds / first:.2f} of v{versions[0]}  (workers {args.workers})"
            )


if __name__ == "__main__":
    main()
