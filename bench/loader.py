"""Clip loading throughput (clips/s) of ClipDataset: batch 2, 4-frame clips, augmentation on.

Default: two temporary generic-layout sites written by the test fixture writer
(tests/conftest.py): 1280x1024 frames resized to 512x640, and 128x160 frames (the demo size).
With --root/--site, the site's train split is measured at each --image-size instead.

    .venv/bin/python -m bench.loader                       # both temporary sites, 0 and 2 workers
    .venv/bin/python -m bench.loader --root data/proc --site D --image-size 128x160
"""

from __future__ import annotations

import argparse
import itertools
import logging
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))  # the fixture writer lives in tests/conftest.py

from conftest import write_generic_site  # noqa: E402

from fedst.data.clips import AugmentConfig, ClipConfig, ClipDataset, make_loader  # noqa: E402
from fedst.data.generic import GenericLayoutSource  # noqa: E402

BATCH_SIZE = 2
WARMUP_BATCHES = 2


def parse_size(text: str) -> tuple[int, int]:
    """ "HxW" -> (H, W)."""
    height, width = text.lower().split("x")
    return int(height), int(width)


def measure(dataset: ClipDataset, num_workers: int, batches: int, seed: int) -> float:
    """Clips per second over ``batches`` batches after a warm-up (worker start-up excluded)."""
    loader = make_loader(
        dataset, BATCH_SIZE, shuffle=True, num_workers=num_workers, seed=seed, drop_last=True
    )
    batches_forever = itertools.chain.from_iterable(itertools.repeat(loader))  # epoch after epoch
    for _ in range(WARMUP_BATCHES):
        next(batches_forever)
    start = time.perf_counter()
    for _ in range(batches):
        next(batches_forever)
    elapsed = time.perf_counter() - start
    return batches * BATCH_SIZE / elapsed


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", type=Path, help="generic-layout root (default: temporary sites)")
    parser.add_argument("--site", help="site folder under --root")
    parser.add_argument(
        "--image-size", type=parse_size, action="append", help="HxW network input, repeatable"
    )
    parser.add_argument("--workers", type=int, nargs="+", default=[0, 2])
    parser.add_argument("--batches", type=int, default=20, help="timed batches per setting")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)

    with tempfile.TemporaryDirectory() as tmp:
        if args.root is not None:
            if args.site is None:
                parser.error("--root needs --site")
            sizes = args.image_size or [(512, 640), (128, 160)]
            settings = [(GenericLayoutSource(args.root, args.site), size) for size in sizes]
        else:
            videos = {"v1": 8, "v2": 8}
            big = write_generic_site(Path(tmp), "big", videos, size=(1024, 1280))
            small = write_generic_site(Path(tmp), "small", videos, size=(128, 160))
            settings = [
                (GenericLayoutSource(big.root, "big"), (512, 640)),
                (GenericLayoutSource(small.root, "small"), (128, 160)),
            ]
        for source, size in settings:
            dataset = ClipDataset(source, "train", ClipConfig(image_size=size), AugmentConfig())
            frame = source.read_frame(dataset.videos[0].frames[0])
            for num_workers in args.workers:
                rate = measure(dataset, num_workers, args.batches, args.seed)
                print(
                    f"site {source.name}: frames {frame.shape[0]}x{frame.shape[1]} -> "
                    f"{size[0]}x{size[1]}, T={dataset.clip_length}, batch {BATCH_SIZE}, "
                    f"augment on, workers {num_workers}: {rate:.1f} clips/s "
                    f"({args.batches} batches)"
                )


if __name__ == "__main__":
    main()
