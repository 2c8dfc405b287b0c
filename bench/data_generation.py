"""Time the procedural benchmark generator (fedst/data/procedural.py) per preset.

``python bench/data_generation.py [--full] [--workers 2] [--seed 0]`` generates every site of the
tiny and demo presets (and full with ``--full``) into a temporary folder and prints one line per
preset: wall-clock seconds, frames written and frames per second.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere, no install

from fedst.data.procedural import PRESETS, generate


def time_preset(preset: str, seed: int, workers: int) -> tuple[float, int]:
    """Seconds to generate all sites of ``preset`` from scratch, and the frames written."""
    with tempfile.TemporaryDirectory(prefix=f"fedst_{preset}_") as tmp:
        start = time.perf_counter()
        counts = generate(Path(tmp), seed, preset, workers=workers, progress=False)
        seconds = time.perf_counter() - start
    return seconds, sum(c["frames"] for c in counts.values())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--full", action="store_true", help="also time the full preset (slow)")
    parser.add_argument("--workers", type=int, default=2, help="rendering processes")
    parser.add_argument("--seed", type=int, default=0, help="benchmark seed")
    args = parser.parse_args()
    presets = ["tiny", "demo"] + (["full"] if args.full else [])
    for preset in presets:
        spec = PRESETS[preset]
        seconds, frames = time_preset(preset, args.seed, args.workers)
        print(
            f"{preset:5s} {spec.height}x{spec.width}: {seconds:6.1f} s  {frames:6d} frames  "
            f"{frames / seconds:6.1f} frames/s  (workers {args.workers})"
        )


if __name__ == "__main__":
    main()
