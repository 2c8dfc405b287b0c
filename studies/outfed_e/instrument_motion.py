"""How far do the benchmark's instruments move over one clip? (issue 37, "benchmark realism of motion")

    python -m studies.outfed_e.instrument_motion [--root data/procedural/demo_v2] [--sites A B C D E]

A clip spans ``(num_frames - 1) * clip.interval_s`` = 0.6 s (current frame t and t-3 at 0.2 s).
For every labelled frame t of every video whose frame t - 0.6 s exists, the instruments (label
classes 1-3, connected components of at least 20 pixels) are matched to the nearest instrument of
the earlier frame by centroid, and the centroid displacement is recorded; the jaw's (class 3)
centroid is matched the same way as the tip. Printed per site and pooled: median and 90th
percentile in native pixels, in pixels at 512x640 (native x 512 / height), and in cells of the
stride-8 map that the temporal module reads, at both sizes.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import cv2
import numpy as np

CLIP_SPAN_S = 0.6
MIN_PIXELS = 20
PAPER_HEIGHT = 512
STRIDE = 8


def centroids(mask: np.ndarray) -> np.ndarray:
    """[N, 2] (x, y) centroids of the connected components of a boolean mask (>= MIN_PIXELS)."""
    count, _, stats, centres = cv2.connectedComponentsWithStats(mask.astype(np.uint8), 8)
    keep = [i for i in range(1, count) if stats[i, cv2.CC_STAT_AREA] >= MIN_PIXELS]
    return centres[keep] if keep else np.zeros((0, 2))


def matched_displacements(now: np.ndarray, before: np.ndarray) -> list[float]:
    """Distance from each centroid of ``now`` to the nearest centroid of ``before``."""
    if len(now) == 0 or len(before) == 0:
        return []
    distance = np.linalg.norm(now[:, None, :] - before[None, :, :], axis=2)  # [N, M]
    return distance.min(axis=1).tolist()


def site_motion(site_dir: Path) -> tuple[list[float], list[float], int]:
    """(instrument displacements, tip displacements, native height) of one site in native px."""
    meta = json.loads((site_dir / "meta.json").read_text())
    step = round(CLIP_SPAN_S * float(meta["fps"]))
    bodies: list[float] = []
    tips: list[float] = []
    height = 0
    for video in sorted((site_dir / "videos").iterdir()):
        masks = sorted((video / "masks").glob("*.png"))
        frames = {int(p.stem): p for p in masks}
        for index, path in frames.items():
            if index - step not in frames:
                continue
            now = cv2.imread(str(path), cv2.IMREAD_UNCHANGED)
            before = cv2.imread(str(frames[index - step]), cv2.IMREAD_UNCHANGED)
            height = now.shape[0]
            instrument = lambda m: (m > 0) & (m != 255)  # noqa: E731
            bodies += matched_displacements(
                centroids(instrument(now)), centroids(instrument(before))
            )
            tips += matched_displacements(centroids(now == 3), centroids(before == 3))
    return bodies, tips, height


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--root", type=Path, default=Path("data/procedural/demo_v2"))
    parser.add_argument("--sites", nargs="*", default=["A", "B", "C", "D", "E"])
    args = parser.parse_args(argv)
    print(
        "| site | part | n | median px (native) | p90 px | median px at 512x640 | "
        "median cells (native) | median cells at 512x640 |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    pooled: dict[str, list[float]] = {"instrument": [], "tip (jaw)": []}
    height = 0
    for site in args.sites:
        bodies, tips, height = site_motion(args.root / site)
        for part, values in (("instrument", bodies), ("tip (jaw)", tips)):
            pooled[part] += values
            _line(site, part, values, height)
    for part, values in pooled.items():
        _line("all", part, values, height)


def _line(site: str, part: str, values: list[float], height: int) -> None:
    if not values:
        print(f"| {site} | {part} | 0 | - | - | - | - | - |")
        return
    scale = PAPER_HEIGHT / height
    median, p90 = float(np.median(values)), float(np.percentile(values, 90))
    print(
        f"| {site} | {part} | {len(values)} | {median:.1f} | {p90:.1f} | {median * scale:.1f} | "
        f"{median / STRIDE:.2f} | {median * scale / STRIDE:.2f} |"
    )


if __name__ == "__main__":
    main()
