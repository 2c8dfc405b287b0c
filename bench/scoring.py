"""Dice / IoU scoring of one 1080p frame: the former MONAI path against the pixel-count path.

Both score the same uint8 class map and uint8 label (1080 x 1920, 4 classes, a few instrument-part
blobs, an unlabelled border band) on the CPU, interleaved in one run on one thread:

* old: ``fedst.scoring.metrics.reference_batch_metrics(..., distances=False)``, what
  fedst.scoring.evaluation ran per frame before the counts (int64 copies, one-hot maps, MONAI's
  ``compute_dice`` / ``compute_iou``);
* new: ``overlap_scores(overlap_counts(...))``, what it runs now (on the model's device; here the
  CPU).

Prints the CPU model, the median and minimum ms per frame of each, the ratio of the medians
(issue 33's target: new <= 20 % of old) and checks that both give the same scores (to 1e-6);
exits 1 if they differ. Run from the repository root:

    OMP_NUM_THREADS=1 .venv/bin/python -m bench.scoring              # 15 repeats, ~10 s
    OMP_NUM_THREADS=1 .venv/bin/python -m bench.scoring --repeats 5
    python -m bench.scoring --device cuda --json scoring.json         # the GPU check's step

With ``--device cuda`` the new path runs on the GPU as evaluation runs it there (prediction and
label already on the device; the scores' copy to the host, one per frame, inside the timing, with
a device sync), the old path on the CPU as before; both are timed and compared the same way.
``--json`` writes the figures to a file as well.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from fedst.accel import device_name
from fedst.scoring.metrics import reference_batch_metrics
from fedst.scoring.overlap import FrameScores, overlap_counts, overlap_scores

HEIGHT, WIDTH, NUM_CLASSES, IGNORE = 1080, 1920, 4, 255


def _ellipse(rows: torch.Tensor, cols: torch.Tensor, centre, radii, angle: float) -> torch.Tensor:
    """Boolean [H, W] mask of a rotated ellipse (centre and radii in pixels, angle in radians)."""
    dy, dx = rows - centre[0], cols - centre[1]
    u = dx * math.cos(angle) + dy * math.sin(angle)
    v = -dx * math.sin(angle) + dy * math.cos(angle)
    return (u / radii[1]) ** 2 + (v / radii[0]) ** 2 <= 1.0


def realistic_maps(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(prediction, label) uint8 [H, W]: two instruments as shaft / wrist / jaw ellipses, the
    prediction offset by a few pixels with a spurious jaw blob and a missed wrist; the label has a
    10-pixel unlabelled (255) border band."""
    g = torch.Generator().manual_seed(seed)
    rows = torch.arange(HEIGHT, dtype=torch.float32)[:, None]
    cols = torch.arange(WIDTH, dtype=torch.float32)[None, :]
    label = torch.zeros(HEIGHT, WIDTH, dtype=torch.uint8)
    pred = torch.zeros(HEIGHT, WIDTH, dtype=torch.uint8)
    for k, (cy, cx, angle) in enumerate([(420.0, 700.0, 0.5), (650.0, 1300.0, -0.7)]):
        parts = [  # (class, centre offset along the tool, radii)
            (1, -260.0, (70.0, 380.0)),
            (2, 130.0, (80.0, 90.0)),
            (3, 230.0, (45.0, 70.0)),
        ]
        for cls, along, radii in parts:
            centre = (cy + along * math.sin(angle), cx + along * math.cos(angle))
            label[_ellipse(rows, cols, centre, radii, angle)] = cls
            if k == 1 and cls == 2:
                continue  # the second wrist is missed
            jitter = torch.randint(-12, 13, (2,), generator=g).float()
            shifted = (centre[0] + float(jitter[0]), centre[1] + float(jitter[1]))
            pred[_ellipse(rows, cols, shifted, (radii[0] * 0.95, radii[1] * 1.05), angle)] = cls
    pred[_ellipse(rows, cols, (150.0, 1650.0), (40.0, 55.0), 0.0)] = 3  # a false alarm
    border = 10
    label[:border], label[-border:], label[:, :border], label[:, -border:] = (IGNORE,) * 4
    return pred, label


def old_path(pred: torch.Tensor, label: torch.Tensor) -> list[FrameScores]:
    return reference_batch_metrics(pred[None], label[None], NUM_CLASSES, distances=False)


def new_path(pred: torch.Tensor, label: torch.Tensor) -> list[FrameScores]:
    return overlap_scores(overlap_counts(pred[None], label[None], NUM_CLASSES))


def same_scores(a: list[FrameScores], b: list[FrameScores], rel: float = 1e-6) -> bool:
    """Same frames, classes and metrics, values equal to ``rel``."""
    return all(
        fa.keys() == fb.keys()
        and all(
            fa[c].keys() == fb[c].keys()
            and all(math.isclose(fa[c][m], fb[c][m], rel_tol=rel) for m in fa[c])
            for c in fa
        )
        for fa, fb in zip(a, b, strict=True)
    ) and len(a) == len(b)


def time_interleaved(
    paths: dict[str, Callable[[], object]], repeats: int
) -> dict[str, dict[str, list[float]]]:
    """Wall and process-CPU ms per call of each path ({name: {"wall": [...], "cpu": [...]}}),
    alternating the paths in every repeat (one warm-up call each). On one thread the CPU time
    is the better estimate on a shared, loaded machine."""
    times: dict[str, dict[str, list[float]]] = {name: {"wall": [], "cpu": []} for name in paths}
    for fn in paths.values():
        fn()
    for _ in range(repeats):
        for name, fn in paths.items():
            wall, cpu = time.perf_counter(), time.process_time()
            fn()
            times[name]["cpu"].append((time.process_time() - cpu) * 1e3)
            times[name]["wall"].append((time.perf_counter() - wall) * 1e3)
    return times


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repeats", type=int, default=15, help="timed calls of each path")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    parser.add_argument("--device", default="cpu", help="where the new path runs (cpu | cuda)")
    parser.add_argument("--json", type=Path, default=None, help="also write the figures here")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    pred, label = realistic_maps()
    pred_on_device, label_on_device = pred.to(device), label.to(device)

    def new_on_device() -> list[FrameScores]:
        scores = new_path(pred_on_device, label_on_device)  # overlap_scores copies to the host
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return scores

    old, new = old_path(pred, label), new_on_device()
    equal = same_scores(old, new)
    times = time_interleaved(
        {"old": lambda: old_path(pred, label), "new": new_on_device}, args.repeats
    )
    median = {name: {k: statistics.median(v) for k, v in t.items()} for name, t in times.items()}
    print(
        f"CPU: {device_name(torch.device('cpu'))}; torch {torch.__version__}, {torch.get_num_threads()} thread(s)"
    )
    print(f"load average: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print(
        f"frame {HEIGHT}x{WIDTH}, {NUM_CLASSES} classes, {args.repeats} repeats, ms per frame; "
        f"new path on {device_name(device)}"
    )
    for name, label_text in (("old", "MONAI one-hot (old)"), ("new", "pixel counts (new)")):
        print(
            f"  {label_text:<20} wall median {median[name]['wall']:8.2f} "
            f"min {min(times[name]['wall']):8.2f} | CPU median {median[name]['cpu']:8.2f} "
            f"min {min(times[name]['cpu']):8.2f}"
        )
    for kind in ("wall", "cpu"):
        ratio = median["new"][kind] / median["old"][kind]
        print(f"  ratio new/old ({kind} medians): {100 * ratio:.1f} % (target <= 20 %)")
    print(
        f"  scores equal: {equal}  (Dice of old: {[round(v['dice'], 6) for v in old[0].values()]})"
    )
    if args.json is not None:
        figures = {
            "device": str(device),
            "card": device_name(device),
            "frame": [HEIGHT, WIDTH],
            "repeats": args.repeats,
            "ms_per_frame_new_median": median["new"]["wall"],
            "ms_per_frame_new_min": min(times["new"]["wall"]),
            "ms_per_frame_old_cpu_median": median["old"]["wall"],
            "ratio_new_over_old": median["new"]["wall"] / median["old"]["wall"],
            "scores_equal": equal,
        }
        args.json.write_text(json.dumps(figures, indent=1))
    if not equal:
        print(f"  new scores differ: {new[0]}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
