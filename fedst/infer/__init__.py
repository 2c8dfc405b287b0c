"""Run a trained site model on a video, frame by frame: overlay video, label maps, timing log.

    python -m fedst.infer run=runs/demo/fedst_s0_8rounds site=A input=case12.mp4
    python -m fedst.infer run=runs/demo/fedst_s0_8rounds site=A input=frames/ fps=25 labels=true
    python -m fedst.infer run=runs/demo/fedst_s0_8rounds site=outfed prompt_site=E input=0   # camera 0
    python -m fedst.infer run=runs/demo/fedst_s0_8rounds site=A input=case12.mp4 guard=dad     # corrected
    python -m fedst.infer run=runs/demo/fedst_s0_8rounds site=A input=case12.mp4 runtime=onnx-int8 threads=2
    python -m fedst.infer run=runs/demo/fedst_s0_8rounds site=A input=case12.mp4 realtime=true  # paced

Frames are read with OpenCV and streamed through the model (FedSTNet.stream in
fedst/model/network.py): each frame is encoded once, and the temporal module's earlier frames are
chosen by time as in training, clip.interval_s apart (the latest earlier frame at or before
t - k * interval_s; the current frame before the video's start; FrameHistory in
fedst/data/clips/). A frame's time is index / fps for a video file (its own frame rate, or
fps=) and a frame folder (fps= required), and the arrival time for a camera. Each frame is
resized to the run's clip.image_size and normalised as in training; the logits are resized back
to the frame's own size (bilinear) before the argmax, so overlays and label maps have the
input's resolution.

Writes into output= (default <run>/infer/<site>_<input name>/): overlay.mp4 (shaft / wrist / jaw
in the colours of fedst/report/plots.py, with a legend), timing.csv (per frame: read, network, write and
total ms; with realtime=true total runs from the frame's arrival), labels/<frame>.png (uint8 class maps 0..3, with labels=true) and summary.json (with
guard=dad: which DAD correction ran; "network": the runtime that ran, e.g. onnx-int8, and its
graph file; "latency_ms": p50 / p90 / p99 / max of each stage over the frames after
warmup_frames; "realtime" and "dropped_frames"). realtime=true reads a file at its frame rate as a
camera delivers it (a frame that arrives while the pipeline is busy replaces the waiting one and
counts as dropped); by default every frame is read as fast as possible. runtime=onnx / onnx-int8 runs the graph exported by fedst/export.py (format=onnx
/ onnx-int8) in ONNX Runtime on the CPU instead of PyTorch. Each file is written under a
temporary name and renamed when the run is complete, so a failed run leaves the folder as it
was. A progress bar shows the running FPS. Bad input (a file that is not a video, a frame-size change, a missing key) stops
with one line naming the file or key and the fix.

Modules of the package: command.py (InferConfig, InferenceError, key=value parsing shared with
fedst.export), video.py (the input's frames), streaming.py (the site model or exported graph and
the frame loop), outputs.py (overlay, label maps, timing and summary, staged until complete).

Layer: an entry point; imports fedst.runs, fedst.report, fedst.guard, fedst.onnx_stream and below.
"""

from __future__ import annotations

import logging
import sys

from fedst.infer.command import InferConfig, InferenceError, key_value_help, parse_key_values
from fedst.infer.latency import format_latency
from fedst.infer.outputs import StagedOutputs, draw_legend
from fedst.infer.streaming import OUTFED, dad_correction, load_site_model, run_inference
from fedst.infer.video import VideoInput, open_input

__all__ = [
    "OUTFED",
    "InferConfig",
    "InferenceError",
    "StagedOutputs",
    "VideoInput",
    "dad_correction",
    "draw_legend",
    "key_value_help",
    "load_site_model",
    "main",
    "open_input",
    "parse_key_values",
    "run_inference",
]

COMMAND_HELP = __doc__.partition("\nModules of the package")[0]
"""The command's part of the docstring: what ``--help`` prints."""


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        cfg = parse_key_values(
            InferConfig,
            sys.argv[1:] if argv is None else argv,
            COMMAND_HELP,
            "python -m fedst.infer",
        )
        summary = run_inference(cfg)
    except FileNotFoundError as err:  # a path the user gave: one line through the boundary
        raise InferenceError(str(err)) from err
    print(
        f"{summary['frames']} frames {summary['frame_size'][1]}x{summary['frame_size'][0]}: "
        f"{summary['fps_overall']:.2f} FPS overall, network {summary['fps_network_mean']:.2f} FPS; "
        f"wrote {summary['overlay']}"
    )
    pacing = (
        f"realtime (paced at {summary['fps_input']:g} fps): {summary['dropped_frames']} frame(s) "
        "dropped"
        if summary["realtime"]
        else "as fast as possible (realtime=false)"
    )
    print(f"input {pacing}")
    if summary["latency_ms"] is not None:
        print(f"latency per frame after {summary['warmup_frames']} warm-up frame(s):")
        for line in format_latency(summary["latency_ms"]):
            print(f"  {line}")
