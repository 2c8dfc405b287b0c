"""CPU frames per second of PyTorch and ONNX Runtime: single-frame network and FedST streaming.

For PVTv2-b0 at 512x640 (random init; speed does not depend on the weights), batch 1:
* the single-frame network (no temporal module, no CS), in PyTorch and as an ONNX graph;
* FedST streaming (one encoder pass per frame, earlier frames' features cached): PyTorch
  ``FedSTNet.stream`` and the graph of ``fedst.export`` run by ``fedst.export.OnnxStreamer``
  (the same clip rule, feature cache kept on the host).
Times are the best of N interleaved runs (see bench/model.py: every variant sees the same machine
load); the ratios at the end come from that one run, so they are the figures to compare on a
shared machine. The last line is the largest logit difference of the two streams over 8 frames.

    .venv/bin/python -m bench.onnx                       # 512x640, 2 threads
    .venv/bin/python -m bench.onnx --size 128 160 --repeats 20
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import tempfile
from pathlib import Path

import numpy as np
import torch

from bench.model import interleaved_ms
from fedst.accel import device_name
from fedst.export import OnnxStreamer, export_onnx
from fedst.model.network import NetworkConfig, build_network

FPS_OF_VIDEO = 25.0  # stream times: frames 1/25 s apart, clip frames 0.2 s (5 frames) apart
INTERVAL_S = 0.2


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--size", type=int, nargs=2, default=(512, 640), metavar=("H", "W"))
    parser.add_argument("--repeats", type=int, default=10, help="timed runs per variant")
    parser.add_argument("--threads", type=int, default=2, help="torch and ONNX Runtime threads")
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
    frames = torch.randn(args.repeats + 16, 1, 3, *size)
    with tempfile.TemporaryDirectory() as tmp:
        fedst_onnx = export_onnx(fedst, indicator, size, INTERVAL_S, Path(tmp) / "fedst.onnx")
        single_onnx = export_onnx(single, None, size, INTERVAL_S, Path(tmp) / "single.onnx")
        ort_fedst = OnnxStreamer(fedst_onnx, threads=args.threads)
        ort_single = OnnxStreamer(single_onnx, threads=args.threads)
        torch_stream = fedst.stream(indicator, interval_s=INTERVAL_S)
        counters = {"torch": 0, "ort": 0, "ort_single": 0}

        def next_frame(name: str) -> tuple[torch.Tensor, float]:
            index = counters[name]
            counters[name] += 1
            return frames[index % len(frames)], index / FPS_OF_VIDEO

        def torch_streaming() -> None:
            frame, time_s = next_frame("torch")
            torch_stream.step(frame, time_s)

        def ort_streaming() -> None:
            frame, time_s = next_frame("ort")
            ort_fedst.step(frame.numpy(), time_s)

        def ort_single_frame() -> None:
            frame, time_s = next_frame("ort_single")
            ort_single.step(frame.numpy(), time_s)

        with torch.no_grad():
            for _ in range(int(INTERVAL_S * FPS_OF_VIDEO * 3) + 1):  # fill both caches
                torch_streaming()
                ort_streaming()
            steps = {
                "PyTorch single-frame network": lambda: single(frames[0][:, None]),
                "PyTorch FedST streaming": torch_streaming,
                "ONNX Runtime single-frame network": ort_single_frame,
                "ONNX Runtime FedST streaming": ort_streaming,
            }
            times = interleaved_ms(steps, args.repeats)
            torch_stream.reset()
            ort_fedst.reset()
            parity = max(
                float(
                    np.abs(
                        torch_stream.step(frames[i], i / FPS_OF_VIDEO).numpy()
                        - ort_fedst.step(frames[i].numpy(), i / FPS_OF_VIDEO)
                    ).max()
                )
                for i in range(8)
            )
    print(
        f"PVTv2-b0 {size[0]}x{size[1]}, batch 1, {args.threads} threads, best of {args.repeats}, "
        f"torch {torch.__version__}, onnxruntime {_ort_version()}, "
        f"CPU {device_name(torch.device('cpu'))}"
    )
    for name, (wall, cpu) in times.items():
        print(f"  {name:36s} {wall:8.1f} ms wall / {cpu:8.1f} ms CPU  {1e3 / wall:6.2f} FPS")
    fps = {name: 1e3 / wall for name, (wall, _) in times.items()}
    print(
        "ratios (same run): PyTorch streaming/single-frame "
        f"{fps['PyTorch FedST streaming'] / fps['PyTorch single-frame network']:.2f} | "
        "ONNX Runtime/PyTorch streaming "
        f"{fps['ONNX Runtime FedST streaming'] / fps['PyTorch FedST streaming']:.2f} | "
        "ONNX Runtime/PyTorch single-frame "
        f"{fps['ONNX Runtime single-frame network'] / fps['PyTorch single-frame network']:.2f}"
    )
    print(f"max |logit difference| ONNX Runtime vs PyTorch streaming, 8 frames: {parity:.2e}")


def _ort_version() -> str:
    import onnxruntime

    return onnxruntime.__version__


if __name__ == "__main__":
    main()
