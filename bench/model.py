"""Size, upload and CPU speed of the FedST network vs the single-frame FedAvg network (Table IX).

For PVTv2-b0 at the chosen input size(s) (demo 128x160, paper 512x640) this reports:
* parameters total / shared / personalized and upload per round (fp32) in MB (10^6 bytes) and MiB
  (2^20 bytes, the unit the paper's Table IX appears to use; fedst/units.py) for
  FedST (preset ``encoder_query`` + channel selection personal) and FedAvg (nothing personal; no
  temporal module, no CS);
* inference time per frame (batch 1, best of N interleaved runs) of the single-frame network (no
  temporal, no CS), the 4-frame clip network (every frame of the clip encoded) and streaming mode
  (earlier frames' features cached);
* one training step (batch 2, 4-frame clips, AdamW, Eq. 9 loss) of FedST.

Run from the repository root (2 threads, random init, nothing downloaded):

    .venv/bin/python -m bench.model                  # both sizes
    .venv/bin/python -m bench.model --size demo --repeats 20

The last two lines are ``streaming/single-frame FPS ratio: <x>`` (for the last size measured) and
``upload per round fedst/fedavg: <a> MB (<a'> MiB)/<b> MB (<b'> MiB)``. On a shared CPU the wall-clock ratio swings with
other jobs' load; the "from components" line (best-of times of the added temporal module and CS
against the single-frame network) is the load-robust figure.
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from collections.abc import Callable

import torch

from fedst.infer.latency import latency_percentiles
from fedst.model.losses import SegmentationLoss
from fedst.model.network import FedSTNet, NetworkConfig, build_network
from fedst.model.partition import PRESETS, bytes_of, count_parameters, split_state
from fedst.units import format_size

SIZES = {"demo": (128, 160), "paper": (512, 640)}


def interleaved_times(
    steps: dict[str, Callable[[], object]], repeats: int
) -> dict[str, tuple[list[float], list[float]]]:
    """Per step: (wall ms, process-CPU ms) of each of ``repeats`` round-robin runs after 1
    warm-up run of every step.

    Round-robin timing exposes every step to the same machine load."""
    for step in steps.values():
        step()
    wall: dict[str, list[float]] = {name: [] for name in steps}
    cpu: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(repeats):
        for name, step in steps.items():
            start_wall, start_cpu = time.perf_counter(), time.process_time()
            step()
            wall[name].append((time.perf_counter() - start_wall) * 1000.0)
            cpu[name].append((time.process_time() - start_cpu) * 1000.0)
    return {name: (wall[name], cpu[name]) for name in steps}


def interleaved_ms(
    steps: dict[str, Callable[[], object]], repeats: int
) -> dict[str, tuple[float, float]]:
    """Per step: (min wall ms, min process-CPU ms) of :func:`interleaved_times`: the minimum is
    the usual estimator of the unloaded time (on a shared machine the median mostly measures
    other jobs)."""
    return best_of(interleaved_times(steps, repeats))


def best_of(
    times: dict[str, tuple[list[float], list[float]]],
) -> dict[str, tuple[float, float]]:
    """(min wall ms, min CPU ms) per step of :func:`interleaved_times`."""
    return {name: (min(wall), min(cpu)) for name, (wall, cpu) in times.items()}


def print_latency_percentiles(times: dict[str, tuple[list[float], list[float]]]) -> None:
    """Per step, p50 / p90 / p99 / max wall ms of its timed runs (after the warm-up run; inputs
    in memory, as fast as possible: no read, no write, not paced). With fewer than 100 runs
    p99 interpolates between the largest two."""
    runs = min(len(wall) for wall, _ in times.values())
    print(f"  latency per frame over {runs} runs after 1 warm-up (input as fast as possible):")
    width = max(map(len, times))
    for name, (wall, _) in times.items():
        values = "  ".join(f"{k} {v:.1f}" for k, v in latency_percentiles(wall).items())
        print(f"    {name:{width}s}  {values} ms")


def parameter_report(name: str, net: FedSTNet, preset: str, personalize_cs: bool) -> int:
    """Print total / shared / personal parameter counts; return upload bytes per round."""
    part = split_state(net, PRESETS[preset], personalize_channel_selection=personalize_cs)
    total = count_parameters(net, [*part.personal, *part.shared])
    shared = count_parameters(net, part.shared)
    personal = count_parameters(net, part.personal)
    upload = bytes_of(net, part.shared)
    print(
        f"{name:7s} params total {total:,} | shared {shared:,} | personal {personal:,} "
        f"(preset {preset}, CS personal {personalize_cs}) | upload {format_size(upload)}/round"
    )
    return upload


def speed_report(
    size: tuple[int, int], fedst: FedSTNet, single: FedSTNet, repeats: int
) -> tuple[float, float]:
    """Print per-frame inference and train-step times; return (single FPS, streaming FPS)."""
    height, width = size
    torch.manual_seed(0)
    frames = torch.randn(repeats + 8, 1, 3, height, width)  # a video, batch 1
    indicator = torch.nn.functional.normalize(torch.randn(fedst.cfg.indicator_dim), dim=0)
    fedst.eval()
    single.eval()
    clip = frames[:4].transpose(0, 1)  # [4, 1, 3, H, W] -> [1, 4, 3, H, W]
    stream = fedst.stream(indicator, frame_stride=1)
    with torch.no_grad():
        for frame in frames[:4]:
            stream.step(frame)  # fill the history so every timed step uses a full clip
        stream_frames = iter(frames[4:])
        feats = fedst.encoder(frames[0])
        steps: dict[str, Callable[[], object]] = {
            "single-frame network (no temporal, no CS)": lambda: single(clip[:, -1:]),
            "FedST 4-frame clip network": lambda: fedst(clip, indicator),
            "FedST streaming (cached earlier frames)": lambda: stream.step(next(stream_frames)),
        }
        for stage, module in fedst.temporal.items():
            steps[f"  of which temporal module, stage {stage}"] = lambda m=module, s=stage: m(
                [feats[int(s)]] * fedst.cfg.num_frames
            )
        for stage, module in fedst.channel_selection.items():
            steps[f"  of which channel selection, stage {stage}"] = lambda m=module, s=stage: m(
                feats[int(s)], indicator
            )
        inference_times = interleaved_times(steps, repeats)
        inference = best_of(inference_times)
    fedst.train()
    loss_fn = SegmentationLoss(num_classes=fedst.cfg.num_classes)
    optimizer = torch.optim.AdamW(fedst.parameters(), lr=6e-5)
    batch_clips = torch.randn(2, fedst.cfg.num_frames, 3, height, width)
    target = torch.randint(0, fedst.cfg.num_classes, (2, height, width))

    def train_step() -> None:
        optimizer.zero_grad(set_to_none=True)
        loss_fn(fedst(batch_clips, indicator), target).backward()
        optimizer.step()

    train_wall, train_cpu = interleaved_ms({"train": train_step}, max(2, repeats // 2))["train"]
    print(f"{height}x{width} inference per frame, batch 1, best of {repeats} (wall / CPU ms, FPS):")
    for name, (wall, cpu) in inference.items():
        print(f"  {name:44s} {wall:8.1f} / {cpu:8.1f} ms  {1e3 / wall:6.2f} FPS")
    print_latency_percentiles(inference_times)
    print(f"  FedST training step (batch 2, 4-frame clips): {train_wall:.0f} / {train_cpu:.0f} ms")
    single_wall, single_cpu = inference["single-frame network (no temporal, no CS)"]
    stream_wall, stream_cpu = inference["FedST streaming (cached earlier frames)"]
    added = sum(wall for name, (wall, _) in inference.items() if name.startswith("  of which"))
    print(f"  streaming/single-frame ratio by CPU time: {single_cpu / stream_cpu:.2f}")
    print(
        "  streaming/single-frame ratio from components, single / (single + temporal + CS): "
        f"{single_wall / (single_wall + added):.2f}"
    )
    return 1e3 / single_wall, 1e3 / stream_wall


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--size", choices=[*SIZES, "both"], default="both", help="input size(s)")
    parser.add_argument("--repeats", type=int, default=10, help="timed runs per measurement")
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    parser.add_argument(
        "--temporal-stages",
        type=int,
        nargs="+",
        default=None,
        help="override NetworkConfig.temporal_stages (0-based) to compare choices",
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    cfg = NetworkConfig()
    if args.temporal_stages is not None:
        cfg = dataclasses.replace(cfg, temporal_stages=tuple(args.temporal_stages))
    fedst = build_network(cfg)
    single = build_network(
        dataclasses.replace(cfg, temporal=False, prompt=False, channel_selection=False)
    )
    print(
        f"PVTv2-b0, temporal stages {cfg.temporal_stages}, CS stages {cfg.cs_stages}, "
        f"{args.threads} threads"
    )
    upload_fedst = parameter_report("FedST", fedst, "encoder_query", personalize_cs=True)
    upload_fedavg = parameter_report("FedAvg", single, "none", personalize_cs=False)
    sizes = list(SIZES) if args.size == "both" else [args.size]
    ratio = float("nan")
    for name in sizes:
        single_fps, stream_fps = speed_report(SIZES[name], fedst, single, args.repeats)
        ratio = stream_fps / single_fps
    print(f"streaming/single-frame FPS ratio: {ratio:.2f}")
    print(
        f"upload per round fedst/fedavg: {format_size(upload_fedst)}/{format_size(upload_fedavg)}"
    )


if __name__ == "__main__":
    main()
