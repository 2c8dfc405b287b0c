"""What the pre-training data validation costs (fedst/data/validation.py), for docs/data.md.

    python -m bench.validation_cost --demo-root data/procedural/demo_v2

1. The demo benchmark: every site train_fed.py validates for the demo experiment (A-D train and
   test, E and grasp test, the server's synthetic train split), first with an empty cache, then
   cached. The benchmark is generated first where absent.
2. The decode time of one frame at the paper datasets' resolutions (1280x1024 PNG as in
   EndoVis2017/2018 and SISVSE, 1920x1080 PNG as SAR-RARP50's rgb/ frames, 1280x1024 JPEG), one
   thread, on a textured frame with sensor noise (so the PNG is about as large as a real one).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import cv2
import numpy as np


def demo_cost(root: Path) -> None:
    from fedst.cli import compose_experiment
    from fedst.data.procedural import generate
    from fedst.data.site_checks import validate_experiment_data

    generate(root, seed=0, preset="demo", progress=False)
    cfg, _ = compose_experiment(["experiment=demo", "data=demo", f"data.root={root}"])
    sites = [*cfg.data.federation, *cfg.data.out_of_federation, cfg.data.server]
    with tempfile.TemporaryDirectory() as cache:
        os.environ["FEDST_CACHE_DIR"] = cache
        for label in ("first (empty cache)", "cached"):
            started = time.perf_counter()
            validate_experiment_data(cfg.data, cfg.clip_config(), sites)
            print(f"demo benchmark, {label}: {time.perf_counter() - started:.2f} s")
        entries = [json.loads(f.read_text())["entries"] for f in Path(cache).rglob("*.json")]
        frames = sum(k.startswith("frame|") for e in entries for k in e)
        labels = sum(k.startswith("label|") for e in entries for k in e)
        print(f"demo benchmark: {frames} frames decoded, {labels} labels read (160x128 px)")


def decode_cost(repeats: int) -> None:
    cv2.setNumThreads(1)
    rng = np.random.default_rng(0)
    for (height, width), suffix in (
        ((1024, 1280), ".png"),
        ((1080, 1920), ".png"),
        ((1024, 1280), ".jpg"),
    ):
        base = rng.integers(0, 255, (height // 16, width // 16, 3), dtype=np.uint8)
        image = cv2.resize(base, (width, height), interpolation=cv2.INTER_CUBIC).astype(np.float32)
        image += rng.normal(0, 3, image.shape)  # sensor noise: real frames do not compress flat
        image = np.clip(image, 0, 255).astype(np.uint8)
        with tempfile.TemporaryDirectory() as folder:
            path = Path(folder) / f"frame{suffix}"
            cv2.imwrite(str(path), image)
            started = time.perf_counter()
            for _ in range(repeats):
                frame = cv2.imread(str(path), cv2.IMREAD_COLOR)
                cv2.cvtColor(frame, cv2.COLOR_BGR2RGB)
            seconds = (time.perf_counter() - started) / repeats
            size = path.stat().st_size / 1e6
        print(f"decode {width}x{height} {suffix} ({size:.1f} MB): {seconds * 1000:.1f} ms/frame")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--demo-root", type=Path, default=Path("data/procedural/demo_v2"))
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args(argv)
    demo_cost(args.demo_root)
    decode_cost(args.repeats)


if __name__ == "__main__":
    main()
