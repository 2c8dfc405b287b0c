"""CPU frames per second of PyTorch, ONNX Runtime fp32 and ONNX Runtime int8: single frame and
FedST streaming, with int8 parity; optionally ONNX Runtime's profile and a session-option study.

For PVTv2-b0 at 512x640 (random init; speed does not depend on the weights), batch 1:
* the single-frame network (no temporal module, no CS), in PyTorch and as ONNX graphs;
* FedST without the cache: PyTorch ``FedSTNet.forward`` on the frame's 4-frame clip (the four
  frames encoded on every call), the work a step would do if nothing were cached;
* FedST streaming (one encoder pass per frame, earlier frames' features cached): PyTorch
  ``FedSTNet.stream`` and the graph of ``fedst.export`` run by ``fedst.export.OnnxStreamer``
  (the same clip rule, feature cache kept on the host), fp32 and int8;
* int8: ``fedst.quantize`` (QDQ, per-channel int8 weights, uint8 activations, the temporal
  module fp32) calibrated on ``--calibration-frames`` streamed noise frames that are neither
  timed nor used for the parity check.
Times are the best of N interleaved runs (see bench/model.py: every variant sees the same machine
load); the ratios come from that one run, so they are the figures to compare on a shared machine.
Then the parity lines: the largest logit difference of ONNX Runtime fp32 and PyTorch streaming,
and the int8 stream against the fp32 stream (fedst.quantize.compare_logits) over
``--parity-frames`` frames. The exit status is 1 when either breaks its tolerance
(fp32: ONNX_ATOL; int8: fedst.quantize.MIN_PIXEL_AGREEMENT and MAX_LOGIT_ERROR).

    .venv/bin/python -m bench.onnx                       # 512x640, 2 threads
    .venv/bin/python -m bench.onnx --size 128 160 --repeats 20
    .venv/bin/python -m bench.onnx --size 128 160 --profile /tmp/ort_profile   # + top ops
    .venv/bin/python -m bench.onnx --size 128 160 --session-options            # + option study

``--profile DIR`` writes ONNX Runtime's JSON profile of fp32 and int8 streaming (``--profile-steps``
steps each) into DIR and prints the ops that took the most kernel time, by op type, by model part
(encoder, temporal, channel selection, decoder) and by node. ``--session-options`` times fp32 and
int8 streaming under each SessionSettings variant against the defaults, and the host's copies of
the context inputs alone.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import logging
import os
import re
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from bench.model import best_of, interleaved_ms, interleaved_times, print_latency_percentiles
from fedst.accel import device_name
from fedst.export import OnnxStreamer, SessionSettings, export_onnx
from fedst.model.network import NetworkConfig, build_network
from fedst.quantize import NAME_SCOPES, Int8Options, compare_logits, quantize_step

FPS_OF_VIDEO = 25.0  # stream times: frames 1/25 s apart, clip frames 0.2 s (5 frames) apart
INTERVAL_S = 0.2
ONNX_ATOL = 1e-4
"""Largest |logit difference| allowed between ONNX Runtime fp32 and PyTorch streaming (the
tolerance of tests/test_infer.py)."""
SESSION_VARIANTS = {
    "defaults": SessionSettings(),
    "spinning threads on (ORT default)": SessionSettings(spinning=True),
    "optimization=extended (no NCHWc layouts)": SessionSettings(optimization="extended"),
    "optimization=basic": SessionSettings(optimization="basic"),
    "memory arena off": SessionSettings(arena=False),
    "memory pattern off": SessionSettings(memory_pattern=False),
}
"""The SessionSettings variants of ``--session-options`` (the first: OnnxStreamer's defaults)."""
TOP_OPS = 12


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--size", type=int, nargs=2, default=(512, 640), metavar=("H", "W"))
    parser.add_argument("--repeats", type=int, default=10, help="timed runs per variant")
    parser.add_argument("--threads", type=int, default=2, help="torch and ONNX Runtime threads")
    parser.add_argument(
        "--calibration-frames", type=int, default=16, help="int8 calibration frames (streamed)"
    )
    parser.add_argument("--parity-frames", type=int, default=8, help="frames of the parity checks")
    parser.add_argument("--profile", type=Path, default=None, metavar="DIR", help="profile here")
    parser.add_argument("--profile-steps", type=int, default=5, help="profiled streaming steps")
    parser.add_argument(
        "--session-options", action="store_true", help="time each SessionSettings variant"
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    size = tuple(args.size)
    cfg = NetworkConfig()
    fedst = build_network(cfg).eval()
    single = build_network(
        dataclasses.replace(cfg, temporal=False, prompt=False, channel_selection=False)
    ).eval()
    indicator = torch.nn.functional.normalize(torch.randn(cfg.indicator_dim), dim=0)
    calibration = torch.randn(args.calibration_frames, 1, 3, *size).numpy()
    frames = torch.randn(args.repeats + 16, 1, 3, *size)
    clip = frames[: cfg.num_frames, 0][None]  # [1, T, 3, H, W]: a clip without a cache
    with tempfile.TemporaryDirectory() as tmp:
        graphs = {
            "fedst": export_onnx(fedst, indicator, size, INTERVAL_S, Path(tmp) / "fedst.onnx"),
            "single": export_onnx(single, None, size, INTERVAL_S, Path(tmp) / "single.onnx"),
        }
        for name in ("fedst", "single"):
            graphs[f"{name}_int8"] = quantize_step(
                graphs[name],
                Path(tmp) / f"{name}.int8.onnx",
                streamed_feeds(OnnxStreamer(graphs[name], threads=args.threads), calibration),
                Int8Options(calibration_frames=args.calibration_frames),
                {"frames": "Gaussian noise, not timed, not in the parity check"},
            )
        ort = {name: OnnxStreamer(path, threads=args.threads) for name, path in graphs.items()}
        torch_stream = fedst.stream(indicator, interval_s=INTERVAL_S)
        streams: dict[str, Callable[[torch.Tensor, float], object]] = {
            "torch": lambda frame, t: torch_stream.step(frame, t),
            **{name: _numpy_step(streamer) for name, streamer in ort.items()},
        }
        with torch.no_grad():
            for step in streams.values():  # fill the caches
                for index in range(int(INTERVAL_S * FPS_OF_VIDEO * 3) + 1):
                    step(frames[index], index / FPS_OF_VIDEO)
            rows = {
                "PyTorch single-frame network": lambda: single(frames[0][:, None]),
                "PyTorch FedST clip forward (4 frames, no cache)": lambda: fedst(clip, indicator),
                "PyTorch FedST streaming": _timed(streams["torch"], frames),
                "ONNX Runtime fp32 single-frame network": _timed(streams["single"], frames),
                "ONNX Runtime fp32 FedST streaming": _timed(streams["fedst"], frames),
                "ONNX Runtime int8 single-frame network": _timed(streams["single_int8"], frames),
                "ONNX Runtime int8 FedST streaming": _timed(streams["fedst_int8"], frames),
            }
            samples = interleaved_times(rows, args.repeats)
            times = best_of(samples)
            fp32_error, int8_parity = parity(
                torch_stream, ort["fedst"], ort["fedst_int8"], frames[: args.parity_frames]
            )
        print(
            f"PVTv2-b0 {size[0]}x{size[1]}, batch 1, {args.threads} threads "
            f"(of {os.cpu_count()} CPUs), best of {args.repeats}, torch {torch.__version__}, "
            f"onnxruntime {_ort_version()}, CPU {device_name(torch.device('cpu'))}"
        )
        for name, (wall, cpu) in times.items():
            print(f"  {name:48s} {wall:8.1f} ms wall / {cpu:8.1f} ms CPU  {1e3 / wall:6.2f} FPS")
        print_latency_percentiles(samples)
        print_ratios({name: 1e3 / wall for name, (wall, _) in times.items()})
        if args.session_options:
            session_option_study(graphs, frames, args.threads, args.repeats)
        if args.profile is not None:
            for name in ("fedst", "fedst_int8"):
                profile_streaming(graphs[name], graphs["fedst"], frames, args)
    print(
        f"max |logit difference| ONNX Runtime fp32 vs PyTorch streaming, {args.parity_frames} "
        f"frames: {fp32_error:.2e} (tolerance {ONNX_ATOL:.0e})"
    )
    print(f"int8 vs fp32 streaming, {args.parity_frames} frames: {int8_parity.describe()}")
    if fp32_error > ONNX_ATOL or not int8_parity.within_tolerance:
        print("parity broken: see the lines above", file=sys.stderr)
        sys.exit(1)


def streamed_feeds(streamer: OnnxStreamer, frames: np.ndarray):
    """The graph's inputs at each of ``frames`` ([N, 1, 3, H, W], 1/25 s apart), the cache filled
    by ``streamer`` (fp32) itself: calibration data shaped as in streaming."""
    for index, frame in enumerate(frames):
        feeds = streamer.feeds(frame, index / FPS_OF_VIDEO)
        yield feeds
        streamer.run(feeds, index / FPS_OF_VIDEO)


def _numpy_step(streamer: OnnxStreamer) -> Callable[[torch.Tensor, float], np.ndarray]:
    return lambda frame, t: streamer.step(frame.numpy(), t)


def _timed(step: Callable[[torch.Tensor, float], object], frames: torch.Tensor) -> Callable:
    """One streaming step per call, each on the next frame at the next time (25 fps)."""
    counter = [int(INTERVAL_S * FPS_OF_VIDEO * 3) + 1]

    def run() -> None:
        index = counter[0]
        counter[0] += 1
        step(frames[index % len(frames)], index / FPS_OF_VIDEO)

    return run


def parity(torch_stream, fp32: OnnxStreamer, int8: OnnxStreamer, frames: torch.Tensor):
    """(max |ONNX fp32 - PyTorch| logit, int8-vs-fp32 Parity) over ``frames`` streamed afresh."""
    torch_stream.reset()
    fp32.reset()
    int8.reset()
    torch_logits, fp32_logits, int8_logits = [], [], []
    for index, frame in enumerate(frames):
        time_s = index / FPS_OF_VIDEO
        torch_logits.append(torch_stream.step(frame, time_s).numpy())
        fp32_logits.append(fp32.step(frame.numpy(), time_s))
        int8_logits.append(int8.step(frame.numpy(), time_s))
    error = max(float(np.abs(a - b).max()) for a, b in zip(torch_logits, fp32_logits, strict=True))
    return error, compare_logits(fp32_logits, int8_logits)


def print_ratios(fps: dict[str, float]) -> None:
    """The speed ratios of one run (same machine load for every variant)."""

    def ratio(a: str, b: str) -> str:
        return f"{fps[a] / fps[b]:.2f}"

    torch_single, torch_stream = "PyTorch single-frame network", "PyTorch FedST streaming"
    fp32_single, fp32_stream = (
        "ONNX Runtime fp32 single-frame network",
        "ONNX Runtime fp32 FedST streaming",
    )
    int8_single, int8_stream = (
        "ONNX Runtime int8 single-frame network",
        "ONNX Runtime int8 FedST streaming",
    )
    print(
        f"ratios (same run): int8/fp32 streaming {ratio(int8_stream, fp32_stream)} | "
        f"int8/fp32 single-frame {ratio(int8_single, fp32_single)} | "
        f"ONNX Runtime fp32/PyTorch streaming {ratio(fp32_stream, torch_stream)} | "
        f"int8/PyTorch streaming {ratio(int8_stream, torch_stream)}"
    )
    print(
        f"cache saving, streaming/clip-forward FPS: PyTorch "
        f"{ratio(torch_stream, 'PyTorch FedST clip forward (4 frames, no cache)')}"
    )
    print(
        f"streaming/single-frame FPS: PyTorch {ratio(torch_stream, torch_single)} | "
        f"ONNX Runtime fp32 {ratio(fp32_stream, fp32_single)} | "
        f"ONNX Runtime int8 {ratio(int8_stream, int8_single)}"
    )


def session_option_study(
    graphs: dict[str, Path], frames: torch.Tensor, threads: int, repeats: int
) -> None:
    """Time fp32 and int8 streaming under each of SESSION_VARIANTS (interleaved, best of
    ``repeats``) and the host-side assembly of the inputs (the context copies) alone."""
    rows: dict[str, Callable[[], None]] = {}
    for graph in ("fedst", "fedst_int8"):
        for variant, settings in SESSION_VARIANTS.items():
            streamer = OnnxStreamer(graphs[graph], threads=threads, settings=settings)
            step = _timed(_numpy_step(streamer), frames)
            for _ in range(int(INTERVAL_S * FPS_OF_VIDEO * 3) + 1):
                step()
            rows[f"{'int8' if graph.endswith('int8') else 'fp32'} {variant}"] = step
    copier = OnnxStreamer(graphs["fedst"], threads=threads)
    fill = _timed(_numpy_step(copier), frames)
    for _ in range(int(INTERVAL_S * FPS_OF_VIDEO * 3) + 1):
        fill()
    later = [len(frames) * 2]

    def copies_only() -> None:  # the inputs of a frame (3 cached maps stacked), no run
        later[0] += 1
        copier.feeds(frames[0].numpy(), later[0] / FPS_OF_VIDEO)

    rows["fp32 context copies alone (OnnxStreamer.feeds)"] = copies_only
    times = interleaved_ms(rows, repeats)
    print(f"session options, FedST streaming, {threads} threads, best of {repeats}:")
    for name, (wall, cpu) in times.items():
        base = times[f"{name.split()[0]} defaults"][0]
        print(f"  {name:52s} {wall:8.2f} ms wall / {cpu:8.2f} ms CPU  {wall / base:5.2f}x time")


def profile_streaming(
    graph: Path, fp32_graph: Path, frames: torch.Tensor, args: argparse.Namespace
) -> None:
    """Stream ``--profile-steps`` frames (after the cache is full) through ``graph`` with ONNX
    Runtime's profiler on; print the top op types, model parts and nodes by kernel time."""
    args.profile.mkdir(parents=True, exist_ok=True)
    prefix = str(args.profile / graph.stem.replace(".", "_"))
    streamer = OnnxStreamer(graph, threads=args.threads, settings=SessionSettings(profile=prefix))
    step = _timed(_numpy_step(streamer), frames)
    for _ in range(int(INTERVAL_S * FPS_OF_VIDEO * 3) + 1 + args.profile_steps):
        step()
    trace = Path(streamer.session.end_profiling())
    warm_up = int(INTERVAL_S * FPS_OF_VIDEO * 3) + 1
    by_type, by_part, by_node = kernel_times(
        json.loads(trace.read_text()), module_parts(fp32_graph), skip_runs=warm_up
    )
    steps = args.profile_steps
    total = sum(by_type.values())
    kind = "int8" if "quantization" in streamer.meta else "fp32"
    print(f"profile {kind} streaming ({trace}): {total / 1e3 / steps:.1f} ms kernel time per step")
    for title, table in (("op type", by_type), ("model part", by_part), ("node", by_node)):
        print(f"  top by {title}:")
        for name, micros in table.most_common(TOP_OPS if title != "model part" else None):
            print(f"    {name:58s} {micros / 1e3 / steps:8.2f} ms  {100 * micros / total:5.1f}%")


def module_parts(fp32_graph: Path) -> dict[str, str]:
    """Node name and output name -> model part (net.encoder, net.temporal, ...) from the
    exporter's module paths in the fp32 graph. ONNX Runtime names a fused node "<node>/<fusion>",
    a node it rewrites after the node's output (``conv2d_22_nchwc``) or with a ``_token_<n>``
    suffix; :func:`_part` undoes those names."""
    import ast

    import onnx

    parts = {}
    for node in onnx.load(str(fp32_graph), load_external_data=False).graph.node:
        scopes = next((p.value for p in node.metadata_props if p.key == NAME_SCOPES), "[]")
        paths = [p for p in ast.literal_eval(scopes) if p.startswith("net.")]
        part = ".".join(paths[0].split(".")[:2]) if paths else "other"
        for name in (node.name, *node.output):
            parts.setdefault(name, part)
    return parts


def kernel_times(
    trace: list[dict], parts: dict[str, str], skip_runs: int = 0
) -> tuple[collections.Counter, collections.Counter, collections.Counter]:
    """Microseconds of kernel time by op type, by model part and by node, from a profile, after
    its first ``skip_runs`` runs (the warm-up)."""
    runs = sorted(
        e["ts"] + e["dur"] for e in trace if e.get("cat") == "Session" and e["name"] == "model_run"
    )
    start = runs[skip_runs - 1] if 0 < skip_runs <= len(runs) else 0
    by_type: collections.Counter = collections.Counter()
    by_part: collections.Counter = collections.Counter()
    by_node: collections.Counter = collections.Counter()
    for event in trace:
        if event.get("cat") != "Node" or not event["name"].endswith("_kernel_time"):
            continue
        if event["ts"] < start:
            continue
        node, op = event["name"].removesuffix("_kernel_time"), event["args"]["op_name"]
        by_type[op] += event["dur"]
        by_part[_part(node, parts)] += event["dur"]
        by_node[f"{node} ({op})"] += event["dur"]
    return by_type, by_part, by_node


def _part(node: str, parts: dict[str, str]) -> str:
    name = node.split("/")[0]
    name = re.sub(
        r"(_token_\d+|_nchwc|_QuantizeLinear|_DequantizeLinear|_quantized|_dq|_q)+$", "", name
    )
    for candidate in (name, f"node_{name}", name.removeprefix("node_")):
        if candidate in parts:
            return parts[candidate]
    return "(inserted by ONNX Runtime: layout changes, Q/DQ of inputs)"


def _ort_version() -> str:
    import onnxruntime

    return onnxruntime.__version__


if __name__ == "__main__":
    main()
