"""Loader throughput on real-size frames: clips/s of the EndoVis2018 backend + ClipDataset.

Writes a synthetic dataset in the exact EndoVis2018 on-disk format (1280x1024 RGB PNG frames with
textured content, RGBA colour labels, labels.json) to a temporary folder, then times batches of
4-frame clips (batch 2, 2 workers, augmentation on, frames resized to 512x640) after one warm-up
batch. Usage, from the repository root::

    python -m bench.real_loader [--batches 30] [--workers 2] [--batch-size 2]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import cv2
import numpy as np

from fedst.data.clips import AugmentConfig, ClipConfig, ClipDataset, make_loader
from fedst.data.endovis2018 import BUILTIN_COLOURS, EndoVis2018Source

FRAME_HW = (1024, 1280)
NETWORK_HW = (512, 640)
SEQUENCES = 2
FRAMES_PER_SEQUENCE = 8
NAMES = {
    (0, 0, 0): "background-tissue",
    (0, 255, 0): "instrument-shaft",
    (0, 255, 255): "instrument-clasper",
    (125, 255, 12): "instrument-wrist",
}


def write_dataset(root: Path, seed: int = 0) -> None:
    """EndoVis2018 layout: release folder / seq_k / {left_frames, labels}, plus labels.json."""
    rng = np.random.default_rng(seed)
    height, width = FRAME_HW
    entries = [
        {"name": NAMES.get(colour, f"class-{i}"), "color": list(colour), "classid": i}
        for i, colour in enumerate(BUILTIN_COLOURS)
    ]
    (root / "labels.json").write_text(json.dumps(entries))
    for k in range(1, SEQUENCES + 1):
        sequence = root / "miccai_challenge_2018_release_1" / f"seq_{k}"
        (sequence / "left_frames").mkdir(parents=True)
        (sequence / "labels").mkdir(parents=True)
        for n in range(FRAMES_PER_SEQUENCE):
            coarse = rng.integers(0, 256, (height // 16, width // 16, 3), dtype=np.uint8)
            frame = cv2.resize(coarse, (width, height), interpolation=cv2.INTER_CUBIC)
            frame = cv2.add(frame, rng.integers(0, 24, (height, width, 3), dtype=np.uint8))
            cv2.imwrite(str(sequence / "left_frames" / f"frame{n:03d}.png"), frame)
            label = np.zeros((height, width, 4), np.uint8)  # RGBA, as many real labels are
            label[:, :, 3] = 255
            x = 200 + 40 * n
            label[300:700, x : x + 300, :3] = (0, 255, 0)  # shaft
            label[300:700, x + 300 : x + 380, :3] = (125, 255, 12)  # wrist
            label[300:700, x + 380 : x + 460, :3] = (0, 255, 255)  # clasper
            cv2.imwrite(
                str(sequence / "labels" / f"frame{n:03d}.png"),
                cv2.cvtColor(label, cv2.COLOR_RGBA2BGRA),
            )


def measure(root: Path, batches: int, workers: int, batch_size: int) -> float:
    """Clips per second over ``batches`` batches after one warm-up batch."""
    source = EndoVis2018Source(root, "B")
    dataset = ClipDataset(source, "train", ClipConfig(image_size=NETWORK_HW), AugmentConfig())
    loader = make_loader(
        dataset, batch_size=batch_size, shuffle=True, num_workers=workers, seed=0, drop_last=True
    )
    batches_done, clips, start = -1, 0, 0.0
    while batches_done < batches:
        for clip_batch, mask_batch, _ in loader:
            if batches_done == -1:  # warm-up: worker start and first decode
                start = time.perf_counter()
            else:
                clips += clip_batch.shape[0]
            assert (
                clip_batch.shape[1:] == (4, 3, *NETWORK_HW) and mask_batch.shape[1:] == NETWORK_HW
            )
            batches_done += 1
            if batches_done == batches:
                break
    return clips / (time.perf_counter() - start)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, default=30, help="timed batches")
    parser.add_argument("--workers", type=int, default=2, help="DataLoader worker processes")
    parser.add_argument("--batch-size", type=int, default=2, help="clips per batch")
    args = parser.parse_args(argv)
    # OpenCV's thread pool in the parent + fork()ed DataLoader workers hung once here (workers idle
    # for 10 min); with no OpenCV threads in the parent the workers start cleanly.
    cv2.setNumThreads(0)
    with tempfile.TemporaryDirectory() as folder:
        root = Path(folder)
        write_dataset(root)
        rate = measure(root, args.batches, args.workers, args.batch_size)
    print(
        f"EndoVis2018 format {FRAME_HW[1]}x{FRAME_HW[0]} -> {NETWORK_HW[1]}x{NETWORK_HW[0]}, "
        f"4-frame clips, batch {args.batch_size}, {args.workers} workers, augmentation on: "
        f"{rate:.2f} clips/s over {args.batches} batches"
    )


if __name__ == "__main__":
    main()
