"""Accuracy of the int8 graph against the fp32 graph of one finished run, on the benchmark's test sets.

For each site (default: the run's federated sites, e.g. A-D, with their own models, then its
out-of-federation sites, e.g. E and GraSP, with the out-of-federation model prompted by the site):
export the model's streaming step with fedst/export.py's code as fp32 and as int8
(calibrated on the training split of the sites fedst.export picks: the site's own, the federated
sites' for the out-of-federation model; never a test split), stream the site's test split through
both in ONNX Runtime exactly as evaluation streams it (fedst.scoring.evaluation's plan: each
needed frame once, video by video, clip frames by time) and score each labelled frame at its
native label resolution with fedst.scoring.metrics (Dice, as the run's own evaluation). Prints one table:
Dice fp32 / int8 and their difference, the share of pixels whose argmax class agrees, the share
of frames whose argmax maps agree on every pixel, and the lowest frame's pixel agreement; then
whether int8 stays within ``--max-dice-drop`` points of fp32 on every site.

    .venv/bin/python -m bench.onnx_accuracy runs/demo/fedst_s0_<time>
    .venv/bin/python -m bench.onnx_accuracy runs/demo/fedst_s0_<time> --sites A E --max-frames 20

Exit status 1 when a site's int8 Dice is more than ``--max-dice-drop`` below fp32. Runs on the
CPU; the data roots of the run's config are read relative to the current folder (run it from the
repository root).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from fedst.data.clips import FrameDataset, normalize_clips
from fedst.export import ExportConfig, OnnxStreamer, export_model
from fedst.infer import OUTFED, load_site_model
from fedst.scoring.evaluation import evaluation_plan, native_class_map
from fedst.scoring.metrics import SegmentationMeter
from fedst.scoring.site_data import open_site_data

MAX_DICE_DROP = 1.0
"""Issue 34's target: int8 Dice within 1.0 point of fp32 on every benchmark site."""


@dataclass
class SiteAccuracy:
    site: str
    model: str
    frames: int
    dice_fp32: float
    dice_int8: float
    pixels_agreeing: float
    frames_identical: float
    lowest_frame: float

    @property
    def drop(self) -> float:
        return self.dice_fp32 - self.dice_int8


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("run", type=Path, help="a finished run directory")
    parser.add_argument("--sites", nargs="+", default=None, help="default: every benchmark site")
    parser.add_argument("--max-frames", type=int, default=None, help="test frames per site")
    parser.add_argument("--calibration-frames", type=int, default=64)
    parser.add_argument("--threads", type=int, default=None, help="ONNX Runtime threads")
    parser.add_argument("--max-dice-drop", type=float, default=MAX_DICE_DROP)
    parser.add_argument("--keep", type=Path, default=None, help="keep the graphs in this folder")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("onnxruntime").setLevel(logging.WARNING)
    torch.set_num_threads(args.threads or torch.get_num_threads())
    with tempfile.TemporaryDirectory() as tmp:
        folder = args.keep or Path(tmp)
        rows = [site_accuracy(args, site, folder) for site in sites_of(args)]
    print_table(args, rows)
    if any(row.drop > args.max_dice_drop for row in rows):
        sys.exit(1)


def sites_of(args: argparse.Namespace) -> list[str]:
    from fedst.runs.files import load_config

    cfg = load_config(args.run)
    return list(args.sites or [*cfg.data.federation, *cfg.data.out_of_federation])


def site_accuracy(args: argparse.Namespace, site: str, folder: Path) -> SiteAccuracy:
    """Export ``site``'s model as fp32 and int8 into ``folder`` and score both on its test set."""
    from fedst.runs.files import load_config

    federated = site in load_config(args.run).data.federation
    model_site, prompt = (site, None) if federated else (OUTFED, site)
    experiment, net, indicator = load_site_model(args.run, model_site, prompt, torch.device("cpu"))
    graphs = {}
    for fmt in ("onnx", "onnx-int8"):
        name = f"{model_site}_{prompt}" if prompt else model_site
        cfg = ExportConfig(
            run=str(args.run),
            site=model_site,
            prompt_site=prompt,
            format=fmt,
            output=str(folder / f"{name}{'.int8' if fmt == 'onnx-int8' else ''}.onnx"),
            calibration_frames=args.calibration_frames,
        )
        graphs[fmt] = export_model(cfg, experiment, net, indicator)
    dataset = open_site_data(experiment, site, ("test",)).test
    streams = {fmt: OnnxStreamer(path, threads=args.threads) for fmt, path in graphs.items()}
    meters = {
        fmt: SegmentationMeter(
            num_classes=net.cfg.num_classes, binary_target=dataset.binary, distances=False
        )
        for fmt in streams
    }
    agreeing, pixels, identical, lowest, frames = 0, 0, 0, 1.0, 0
    plan = evaluation_plan(dataset, args.max_frames, temporal=bool(streams["onnx"].stages))
    loader = FrameDataset(dataset, plan)  # uint8 [3, H, W] frames, native labels (project code)
    current = None
    for item in range(len(loader)):
        frame, label, index = loader[item]
        video_index, position, labelled = plan[index]
        if video_index != current:
            for stream in streams.values():
                stream.reset()
            current = video_index
        time_s = dataset.videos[video_index].times[position]
        inputs = normalize_clips(frame)[None].numpy()  # [1, 3, H, W]
        logits = {fmt: stream.step(inputs, time_s) for fmt, stream in streams.items()}
        if not labelled:
            continue
        sample = f"{site}/{dataset.videos[video_index].video_id}/{position}"
        maps = {}
        for fmt, value in logits.items():
            maps[fmt] = native_class_map(torch.from_numpy(value[0]), tuple(label.shape))
            meters[fmt].update(maps[fmt][None], label[None], [sample])
        same = (maps["onnx"] == maps["onnx-int8"]).float()
        agreeing += int(same.sum())
        pixels += same.numel()
        identical += bool(same.all())
        lowest = min(lowest, float(same.mean()))
        frames += 1
    dice = {fmt: meter.summary()["dice"] for fmt, meter in meters.items()}
    return SiteAccuracy(
        site=site,
        model=site if federated else f"{OUTFED} prompted with {site}",
        frames=frames,
        dice_fp32=dice["onnx"],
        dice_int8=dice["onnx-int8"],
        pixels_agreeing=agreeing / pixels,
        frames_identical=identical / frames,
        lowest_frame=lowest,
    )


def print_table(args: argparse.Namespace, rows: list[SiteAccuracy]) -> None:
    reference = _final_dice(args.run)
    print(
        f"int8 vs fp32 ONNX Runtime on the test sets of {args.run} "
        f"({args.calibration_frames} calibration frames of the training split"
        f"{f', first {args.max_frames} test frames per site' if args.max_frames else ''}):"
    )
    print(
        "| site | model | frames | Dice fp32 | Dice int8 | int8 - fp32 | pixels agreeing "
        "| frames identical | lowest frame | run's own Dice (final.json) |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for row in rows:
        own = reference.get(row.site)
        print(
            f"| {row.site} | {row.model} | {row.frames} | {row.dice_fp32:.2f} | "
            f"{row.dice_int8:.2f} | {-row.drop:+.2f} | {100 * row.pixels_agreeing:.2f} % | "
            f"{100 * row.frames_identical:.1f} % | {100 * row.lowest_frame:.2f} % | "
            f"{'-' if own is None else f'{own:.2f}'} |"
        )
    worst = max(rows, key=lambda row: row.drop)
    verdict = "yes" if worst.drop <= args.max_dice_drop else "NO"
    print(
        f"int8 within {args.max_dice_drop} Dice point of fp32 on every site: {verdict} "
        f"(lowest int8 - fp32: {-worst.drop:+.2f} at {worst.site})"
    )


def _final_dice(run: Path) -> dict[str, float]:
    """Each site's Dice as the run's own (PyTorch) evaluation recorded it, when it did."""
    path = run / "final.json"
    if not path.is_file():
        return {}
    final = json.loads(path.read_text())
    scored = {**final.get("sites", {}), **final.get("out_of_federation", {})}
    return {site: float(v["dice"]) for site, v in scored.items() if v.get("dice") is not None}


if __name__ == "__main__":
    main()
