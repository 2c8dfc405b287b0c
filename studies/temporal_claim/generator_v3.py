"""Generator versions 3 and 4's criteria (issue 47, docs/benchmark.md "Generator version 3" and
"Generator version 4"), measured.

    python -m studies.temporal_claim.generator_v3 data [--preset demo_outfed] [--seed 0]   # items 1 and 5
    python -m studies.temporal_claim.generator_v3 model RUN [--site E]                     # items 2 and 4
    python -m studies.temporal_claim.generator_v3 data --version 4 --preset demo_outfed30  # version 4's 1 and 5

``data`` renders every video of the federated sites' train and test splits and of E's and GraSP's
test splits in memory with their ground truth (:func:`render_video_truth`, nothing written; the
generator version is ``--version``, 3 by default) and prints, per site and pooled over A-D: the share of labelled instrument pixels degraded in frame t,
the share of those recoverable from t-1..t-3 (the same instrument's same part labelled with >= 20
pixels, at most half degraded, in one of them), the share of frames with smoke, flashes per
instrument-second, the share of instrument footprint under tissue folds, and the joint speed.

``model`` scores a finished run's out-of-federation model (for method=local, its own model) on a
site's test split frame by frame, re-renders each test video's truth (the run's generator version
and preset), and prints the mean
cross-entropy and recall on degraded and on undegraded instrument pixels, and the per-video Dice
spread with its standard error over the split's videos.
"""

from __future__ import annotations

import argparse
import json
import math
from collections import defaultdict
from pathlib import Path

import numpy as np

from fedst.data.procedural.render import render_video_truth
from fedst.data.procedural.sites import PHENOMENA, PRESETS, video_ids

HISTORY = 3
MIN_PART_PIXELS = 20
FEDERATED = ("A", "B", "C", "D")


def _parts_seen(mask: np.ndarray, tool_ids: np.ndarray, degraded: np.ndarray) -> dict:
    """{(tool, label): (labelled pixels, degraded pixels)} of one frame."""
    seen = {}
    for tool in np.unique(tool_ids[tool_ids > 0]):
        for label in np.unique(mask[(tool_ids == tool) & (mask > 0)]):
            part = (tool_ids == tool) & (mask == label)
            seen[(int(tool), int(label))] = (int(part.sum()), int((part & degraded).sum()))
    return seen


def video_statistics(
    site: str,
    preset: str,
    seed: int,
    video_id: str,
    frames: int,
    speeds: list[float],
    version: int = 3,
) -> dict:
    """Counts of one video for item 1 (degraded / recoverable) and the phenomena's rates; appends
    every instrument's joint speed (px/s) at every frame to ``speeds``."""
    counts = defaultdict(float)
    history: list[dict] = []
    videos = render_video_truth(site, preset, seed, video_id, frames, version=version)
    for _, _, mask, truth in videos:
        degraded = truth.degraded(mask)
        parts = _parts_seen(mask, truth.tool_ids, degraded)
        counts["frames"] += 1
        counts["instrument"] += int((mask > 0).sum())
        counts["degraded"] += int(degraded.sum())
        counts["smoky_frames"] += bool((truth.smoke >= 0.35).any())
        counts["flashes"] += bool((truth.flash >= 0.3).any())
        counts["tool_frames"] += len(truth.blur_px)
        counts["blurred_tool_frames"] += sum(b >= 3.0 for b in truth.blur_px)
        speeds += [b / PHENOMENA.exposure_s for b in truth.blur_px]
        counts["occluded"] += int(truth.occluded.sum())
        counts["footprint"] += int((mask > 0).sum() + truth.occluded.sum())
        for key, (_, bad) in parts.items():
            if bad == 0:
                continue
            earlier = history[-HISTORY:]
            if any(
                key in past and past[key][0] >= MIN_PART_PIXELS and past[key][1] <= past[key][0] / 2
                for past in earlier
            ):
                counts["recoverable"] += bad
        history.append(parts)
    return dict(counts)


def _causes(mask: np.ndarray, truth) -> dict[str, np.ndarray]:
    """The degraded labelled pixels of a frame, and those of each cause (bool [H, W])."""
    return {"degraded": truth.degraded(mask), **truth.causes(mask)}


def data_report(preset: str, seed: int, version: int = 3) -> dict:
    spec = PRESETS[preset]
    report: dict[str, dict] = {}
    speeds: list[float] = []
    for site in (*FEDERATED, "E", "grasp"):
        ids = video_ids(site, spec)
        splits = ("train", "test") if site in FEDERATED else ("test",)
        total = defaultdict(float)
        for split in splits:
            frames = spec.sites[site].split(split).frames
            for video_id in ids[split]:
                counts = video_statistics(site, preset, seed, video_id, frames, speeds, version)
                for key, value in counts.items():
                    total[key] += value
        report[site] = dict(total)
    pooled = defaultdict(float)
    for site in FEDERATED:
        for key, value in report[site].items():
            pooled[key] += value
    report["A-D"] = dict(pooled)
    target = PHENOMENA.pixels_per_cm(spec.height, spec.width) * PHENOMENA.tip_speed_cm_s
    result = {
        "version": version,
        "sites": {},
        "median_speed_px_s": float(np.median(speeds)),
        "target_px_s": target,
    }
    for site, counts in report.items():
        c = defaultdict(float, counts)  # a small preset may have no recoverable pixel
        result["sites"][site] = {
            "degraded %": 100 * c["degraded"] / c["instrument"],
            "recoverable % of degraded": 100 * c["recoverable"] / max(c["degraded"], 1),
            "smoky frames %": 100 * c["smoky_frames"] / c["frames"],
            "frames with a flash %": 100 * c["flashes"] / c["frames"],
            "blurred instrument-frames %": 100 * c["blurred_tool_frames"] / c["tool_frames"],
            "footprint under folds %": 100 * c["occluded"] / c["footprint"],
            "frames": c["frames"],
        }
    return result


def model_report(run_dir: Path, site: str) -> dict:
    import torch
    import torch.nn.functional as F

    from fedst.accel import resolve_device
    from fedst.runs import Run
    from fedst.scoring.evaluation import predict_test_frames
    from fedst.scoring.site_data import open_site_data

    torch.set_num_threads(1)
    run = Run(run_dir)
    cfg = run.cfg
    device = resolve_device(cfg.train.device)
    model = run.outfed_model(device)
    indicator = run.method.indicators().get(site)
    indicator = indicator.to(device) if indicator is not None else None
    data = open_site_data(cfg, site, ("test",)).test
    preset, seed, version = str(cfg.data.procedural), 0, int(cfg.data.generator_version)
    truths: dict[str, dict[int, np.ndarray]] = {}
    sums = defaultdict(float)
    per_video = defaultdict(lambda: [0.0, 0.0])  # intersection, sum of areas (binary Dice)
    for prediction in predict_test_frames(model, data, indicator, device):
        _, video_id, position = prediction.sample_id.split("/")
        if video_id not in truths:
            truths[video_id] = {
                i: _causes(mask, truth)
                for i, _, mask, truth in render_video_truth(
                    site, preset, seed, video_id, version=version
                )
            }
        causes = {k: torch.from_numpy(v) for k, v in truths[video_id][int(position)].items()}
        degraded = causes.pop("degraded")
        label = prediction.label.long()
        logits = F.interpolate(
            prediction.logits[None].float().cpu(), size=tuple(label.shape), mode="bilinear"
        )[0]
        loss = F.cross_entropy(logits[None], label[None], ignore_index=255, reduction="none")[0]
        predicted = logits.argmax(0)
        instrument = (label > 0) & (label != 255)
        groups = {"degraded": instrument & degraded, "clean": instrument & ~degraded}
        groups.update({name: instrument & where for name, where in causes.items()})
        for name, where in groups.items():
            sums[f"{name}_pixels"] += int(where.sum())
            sums[f"{name}_loss"] += float(loss[where].sum())
            sums[f"{name}_found"] += int((predicted[where] > 0).sum())
        hit = (predicted > 0) & instrument
        per_video[video_id][0] += 2 * int(hit.sum())
        per_video[video_id][1] += int((predicted > 0).sum() + instrument.sum())
    by_cause = {
        name: {
            "loss": sums[f"{name}_loss"] / max(sums[f"{name}_pixels"], 1),
            "recall %": 100 * sums[f"{name}_found"] / max(sums[f"{name}_pixels"], 1),
            "pixels": sums[f"{name}_pixels"],
        }
        for name in ("smoke", "flash", "blur")
    }
    dice = [100 * i / a for i, a in per_video.values() if a > 0]
    spread = float(np.std(dice, ddof=1)) if len(dice) > 1 else float("nan")
    return {
        "run": str(run_dir),
        "site": site,
        "version": version,
        "loss degraded": sums["degraded_loss"] / max(sums["degraded_pixels"], 1),
        "loss clean": sums["clean_loss"] / max(sums["clean_pixels"], 1),
        "recall degraded %": 100 * sums["degraded_found"] / max(sums["degraded_pixels"], 1),
        "recall clean %": 100 * sums["clean_found"] / max(sums["clean_pixels"], 1),
        "degraded pixels": sums["degraded_pixels"],
        "by cause (descriptive; a pixel may have several)": by_cause,
        "videos": len(dice),
        "per-video binary Dice mean": float(np.mean(dice)),
        "per-video binary Dice std": spread,
        "standard error": spread / math.sqrt(len(dice)),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="what", required=True)
    data = sub.add_parser("data", help="items 1 and 5, from the generator's ground truth")
    data.add_argument("--preset", default="demo_outfed")
    data.add_argument("--seed", type=int, default=0)
    data.add_argument("--version", type=int, choices=(3, 4), default=3)
    model = sub.add_parser("model", help="items 2 and 4, from a finished run")
    model.add_argument("run", type=Path)
    model.add_argument("--site", default="E")
    args = parser.parse_args(argv)
    if args.what == "data":
        print(json.dumps(data_report(args.preset, args.seed, args.version), indent=1))
    else:
        print(json.dumps(model_report(args.run, args.site), indent=1))


if __name__ == "__main__":
    main()
