"""Cost of one FedST temporal module (Eq. 3-4) per PVTv2-b0 stage, to choose which stages get it.

For each input size and each PVTv2-b0 stage (stride 4, 8, 16, 32; dims 32, 64, 160, 256; heads
1, 2, 5, 8) this builds one ``TemporalCrossAttention`` with the paper's defaults and measures the
forward FLOPs (torch FlopCounterMode; independent of machine load), the
median (and minimum) wall time of forward (no grad) and of forward + backward on random 4-frame
inputs, the minimum single-thread process CPU time of forward + backward, and its parameter
count. The machine's load average is printed with the table: on a shared machine the minima and
the CPU time are better estimates of the module's own cost than the medians. Run from the
repository root:

    .venv/bin/python -m bench.temporal                 # 128x160 and 512x640, batch 2, 2 threads
    .venv/bin/python -m bench.temporal --sizes 128x160 --repeats 3
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import timm
import torch
from torch.utils.flop_counter import FlopCounterMode

from fedst.model.temporal import TemporalCrossAttention

PVT_V2_B0_STAGES = ((4, 32, 1), (8, 64, 2), (16, 160, 5), (32, 256, 8))  # (stride, dim, heads)


@dataclass(frozen=True)
class StageCost:
    """Measured cost of one temporal module at one encoder stage."""

    image_size: tuple[int, int]
    stage: int
    map_size: tuple[int, int]
    dim: int
    heads: int
    parameters: int
    forward_gflop: float
    forward_ms: tuple[float, float]  # wall time, (median, min)
    train_step_ms: tuple[float, float]  # wall time, (median, min)
    train_step_cpu_ms: float  # process CPU time with one thread, min


def time_ms(
    step: Callable[[], None], repeats: int, clock: Callable[[], float] = time.perf_counter
) -> tuple[float, float]:
    """(median, min) of ``clock`` time of ``step`` in ms over ``repeats`` runs after a warm-up."""
    step()
    times = []
    for _ in range(repeats):
        start = clock()
        step()
        times.append((clock() - start) * 1000.0)
    return statistics.median(times), min(times)


def single_thread_cpu_ms(step: Callable[[], None], repeats: int) -> float:
    """Min process CPU time of ``step`` in ms with one torch thread (robust to machine load)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return time_ms(step, repeats, clock=time.process_time)[1]
    finally:
        torch.set_num_threads(threads)


def measure_stage(
    image_size: tuple[int, int], stage: int, batch: int, repeats: int, num_frames: int = 4
) -> StageCost:
    stride, dim, heads = PVT_V2_B0_STAGES[stage]
    # Stage maps of PVTv2 use overlapping patch embeddings with padding: ceil(size / stride).
    h, w = -(-image_size[0] // stride), -(-image_size[1] // stride)
    torch.manual_seed(0)
    module = TemporalCrossAttention(dim, heads)
    frames = [torch.randn(batch, dim, h, w) for _ in range(num_frames)]

    def forward() -> None:
        with torch.no_grad():
            module(frames)

    def train_step() -> None:
        module.zero_grad(set_to_none=True)
        module(frames).sum().backward()

    with FlopCounterMode(display=False) as flop_counter:
        forward()

    return StageCost(
        image_size=image_size,
        stage=stage + 1,
        map_size=(h, w),
        dim=dim,
        heads=heads,
        parameters=sum(p.numel() for p in module.parameters()),
        forward_gflop=flop_counter.get_total_flops() / 1e9,
        forward_ms=time_ms(forward, repeats),
        train_step_ms=time_ms(train_step, repeats),
        train_step_cpu_ms=single_thread_cpu_ms(train_step, repeats),
    )


def encoder_reference(
    image_size: tuple[int, int], batch: int, repeats: int, num_frames: int = 4
) -> str:
    """GFLOP, parameters and 1-thread CPU time of a random-init timm PVTv2-b0 encoder on a clip."""
    encoder = timm.create_model("pvt_v2_b0", pretrained=False, num_classes=0)
    images = torch.randn(batch * num_frames, 3, *image_size)
    with FlopCounterMode(display=False) as flop_counter, torch.no_grad():
        encoder.forward_features(images)

    def train_step() -> None:
        encoder.zero_grad(set_to_none=True)
        encoder.forward_features(images).sum().backward()

    parameters = sum(p.numel() for p in encoder.parameters())
    cpu_ms = single_thread_cpu_ms(train_step, repeats)
    return (
        f"reference: PVTv2-b0 encoder on {batch} x {num_frames} frames of "
        f"{image_size[0]}x{image_size[1]}: {flop_counter.get_total_flops() / 1e9:.3f} fwd GFLOP, "
        f"{parameters:,} params, fwd+bwd CPU ms, 1 thread: {cpu_ms:.1f}"
    )


def format_table(costs: list[StageCost], batch: int, threads: int, load: str) -> str:
    lines = [
        f"TemporalCrossAttention per PVTv2-b0 stage (r=(49,20,6,7), p=(7,4,2,1), s=7), "
        f"batch {batch}, 4 frames, {threads} threads; ms as median (min); load average {load}",
        "| input | stage | map | dim | heads | params | fwd GFLOP | forward ms | fwd+bwd ms "
        "| fwd+bwd CPU ms, 1 thread |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for cost in costs:
        lines.append(
            f"| {cost.image_size[0]}x{cost.image_size[1]} | {cost.stage} "
            f"| {cost.map_size[0]}x{cost.map_size[1]} | {cost.dim} | {cost.heads} "
            f"| {cost.parameters:,} | {cost.forward_gflop:.3f} "
            f"| {cost.forward_ms[0]:.1f} ({cost.forward_ms[1]:.1f}) "
            f"| {cost.train_step_ms[0]:.1f} ({cost.train_step_ms[1]:.1f}) "
            f"| {cost.train_step_cpu_ms:.1f} |"
        )
    return "\n".join(lines)


def parse_size(text: str) -> tuple[int, int]:
    try:
        height, width = (int(part) for part in text.lower().split("x"))
    except ValueError as err:
        raise argparse.ArgumentTypeError(f"size '{text}' must look like HEIGHTxWIDTH") from err
    return height, width


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--sizes",
        type=parse_size,
        nargs="+",
        default=[(128, 160), (512, 640)],
        help="input image sizes HEIGHTxWIDTH",
    )
    parser.add_argument("--batch", type=int, default=2, help="clips per batch (paper: 2)")
    parser.add_argument("--repeats", type=int, default=7, help="timed runs per measurement")
    parser.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    costs = [
        measure_stage(size, stage, args.batch, args.repeats)
        for size in args.sizes
        for stage in range(len(PVT_V2_B0_STAGES))
    ]
    load = " ".join(f"{value:.1f}" for value in os.getloadavg())
    print(format_table(costs, args.batch, args.threads, load))
    for size in args.sizes:
        print(encoder_reference(size, args.batch, repeats=min(args.repeats, 2)))


if __name__ == "__main__":
    main()
