"""Export a trained site model for edge devices: one streaming step as an ONNX graph.

    python -m fedst.export run=runs/demo/fedst_s0_8rounds site=A format=onnx
    python -m fedst.export run=runs/demo/fedst_s0_8rounds site=outfed prompt_site=E format=onnx output=e.onnx

The graph is one step of :meth:`fedst.model.network.FedSTNet.stream` with the temporal feature
cache as explicit tensors, so any ONNX runtime can stream video without Python state in the graph:

    inputs   frame            [1, 3, H, W] float32, normalised as fedst.data.clips.normalize_frames
             context_valid    [T-1] bool, oldest first; False: the clip uses the current frame
                              there (video start), and that slot of every context_s<i> is ignored
             context_s<i>     [T-1, 1, C_i, h_i, w_i] float32, for each temporal stage i: the
                              features_s<i> outputs of the earlier clip frames, oldest first
    outputs  logits           [1, K, H, W] float32
             features_s<i>    [1, C_i, h_i, w_i] float32, this frame's features for later steps

The caller keeps the cache and picks the earlier frames by time with
:class:`fedst.data.clips.FrameHistory` (frame k steps back: the latest earlier frame at or before
``t - k * interval_s``), as :class:`OnnxStreamer` does. The site indicator is a constant of the
graph (the model is the site's). H, W are fixed to the run's ``clip.image_size`` (or ``size=``);
a sidecar ``<output>.json`` records them with the clip rule, the input normalisation and the
class names.
Needs the ``export`` extra (onnx, onnxscript, onnxruntime).
"""

from __future__ import annotations

import copy
import json
import logging
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from fedst.data.base import CLASS_NAMES
from fedst.data.clips import IMAGENET_MEAN, IMAGENET_STD, FrameHistory
from fedst.model.network import FedSTNet

__all__ = ["ExportConfig", "OnnxStreamer", "StreamingStep", "cpu_copy", "export_onnx", "main"]

log = logging.getLogger("fedst.export")

FORMATS = ("onnx",)
DEFAULT_OPSET = 18


class StreamingStep(nn.Module):
    """One streaming step of ``net`` as a function of explicit tensors (the exported graph).

    ``forward(frame [1, 3, H, W], context_valid [T-1] bool, *context)`` with one context tensor
    ``[T-1, 1, C_i, h_i, w_i]`` per temporal stage -> ``(logits [1, K, H, W], *features)`` with
    ``features[i]`` = this frame's map ``[1, C_i, h_i, w_i]`` of temporal stage i.
    """

    def __init__(self, net: FedSTNet, indicator: torch.Tensor | None):
        super().__init__()
        self.net = net.eval()
        self.stages = (
            tuple(net.cfg.temporal_stages) if net.uses_temporal(net.cfg.num_frames) else ()
        )
        self.register_buffer("indicator", indicator.clone() if indicator is not None else None)

    def forward(
        self, frame: torch.Tensor, context_valid: torch.Tensor, *context: torch.Tensor
    ) -> tuple[torch.Tensor, ...]:
        feats = self.net.encoder(frame)  # 4 x [1, C_i, h_i, w_i]
        history = {}
        for stage, earlier in zip(self.stages, context, strict=True):
            current = feats[stage]
            valid = context_valid.view(-1, 1, 1, 1, 1)  # [T-1, 1, 1, 1, 1]
            chosen = torch.where(valid, earlier, current[None])  # [T-1, 1, C, h, w]
            history[stage] = [*chosen.unbind(0), current]
        size = (frame.shape[2], frame.shape[3])
        logits = self.net._decode(feats, history, self.indicator, size)
        return (logits, *(feats[s] for s in self.stages))

    def example_inputs(self, image_size: tuple[int, int]) -> tuple[torch.Tensor, ...]:
        """Inputs of the right shapes (a random frame, no valid context)."""
        frame = torch.randn(1, 3, *image_size)
        with torch.no_grad():
            feats = self.net.encoder(frame)
        earlier = self.net.cfg.num_frames - 1
        context = [torch.zeros(earlier, *feats[s].shape) for s in self.stages]
        return (frame, torch.zeros(earlier, dtype=torch.bool), *context)


def cpu_copy(net: nn.Module) -> nn.Module:
    """A copy of ``net`` whose parameters and buffers are on the CPU, made without a second copy
    on ``net``'s own device (each tensor is copied to the host once); ``net`` is left as it is."""
    memo: dict[int, Any] = {}
    for parameter in net.parameters():
        memo[id(parameter)] = nn.Parameter(
            parameter.detach().to("cpu", copy=True), requires_grad=parameter.requires_grad
        )
    for buffer in net.buffers():
        memo[id(buffer)] = buffer.detach().to("cpu", copy=True)
    return copy.deepcopy(net, memo)


def export_onnx(
    net: FedSTNet,
    indicator: torch.Tensor | None,
    image_size: tuple[int, int],
    interval_s: float,
    out_path: Path,
    opset: int = DEFAULT_OPSET,
) -> Path:
    """Write ``net``'s streaming step as ONNX to ``out_path`` (+ ``.json`` sidecar); return it.

    The graph is traced on the CPU from a copy of ``net`` (:func:`cpu_copy`): the caller's model
    keeps its device and its training mode."""
    step = StreamingStep(cpu_copy(net), indicator.cpu() if indicator is not None else None).eval()
    inputs = step.example_inputs(image_size)
    context_names = [f"context_s{s}" for s in step.stages]
    feature_names = [f"features_s{s}" for s in step.stages]
    out_path.parent.mkdir(parents=True, exist_ok=True)
    with torch.no_grad():
        program = torch.onnx.export(
            step,
            inputs,
            dynamo=True,
            input_names=["frame", "context_valid", *context_names],
            output_names=["logits", *feature_names],
            opset_version=opset,
            external_data=False,
        )
    program.save(str(out_path))
    meta = {
        "inputs": {
            name: list(t.shape)
            for name, t in zip(["frame", "context_valid", *context_names], inputs, strict=True)
        },
        "temporal_stages": list(step.stages),
        "num_frames": net.cfg.num_frames,
        "interval_s": interval_s,
        "image_size": list(image_size),
        "classes": list(CLASS_NAMES[: net.cfg.num_classes]),
        "normalization": {"scale": 1 / 255, "mean": IMAGENET_MEAN, "std": IMAGENET_STD},
        "opset": opset,
    }
    out_path.with_suffix(".json").write_text(json.dumps(meta, indent=2))
    log.info("wrote %s (%.1f MB)", out_path, out_path.stat().st_size / 1e6)
    return out_path


class OnnxStreamer:
    """Streams frames through an exported step with ONNX Runtime, keeping the feature cache.

    ``step(frame [1, 3, H, W] float32, time_s) -> logits [1, K, H, W]`` (numpy), the same clip
    rule as :class:`fedst.model.network.StreamingState` with ``interval_s``.
    """

    def __init__(self, path: Path, threads: int | None = None):
        import onnxruntime as ort

        meta = json.loads(Path(path).with_suffix(".json").read_text())
        options = ort.SessionOptions()
        if threads is not None:
            options.intra_op_num_threads = threads
            options.inter_op_num_threads = 1
        self.session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
        self.stages = meta["temporal_stages"]
        self.num_frames = meta["num_frames"]
        self.history = FrameHistory(self.num_frames, meta["interval_s"])
        self._context_shapes = {s: meta["inputs"][f"context_s{s}"] for s in self.stages}

    def reset(self) -> None:
        self.history.reset()

    def step(self, frame: np.ndarray, time_s: float) -> np.ndarray:
        earlier = self.history.context(time_s)  # T-1 x ({stage: features} | None)
        feeds: dict[str, Any] = {
            "frame": np.ascontiguousarray(frame, dtype=np.float32),
            "context_valid": np.array([e is not None for e in earlier]),
        }
        for s in self.stages:
            shape = self._context_shapes[s][1:]
            feeds[f"context_s{s}"] = np.stack(
                [np.zeros(shape, np.float32) if e is None else e[s] for e in earlier]
            )
        logits, *features = self.session.run(None, feeds)
        self.history.append(time_s, dict(zip(self.stages, features, strict=True)))
        return logits


@dataclass(frozen=True)
class ExportConfig:
    run: str
    """Run directory written by train_fed.py."""
    site: str
    """A federated site (its personalized model) or "outfed" (the out-of-federation model)."""
    format: str = "onnx"
    """Export format: onnx."""
    output: str | None = None
    """Output file (default <run>/export/<site>.onnx)."""
    prompt_site: str | None = None
    """site=outfed: the site whose indicator prompts the model (e.g. E)."""
    size: tuple[int, int] | None = None
    """(H, W) input size of the graph (default: the run's clip.image_size)."""
    opset: int = DEFAULT_OPSET
    """ONNX opset version."""


def main(argv: list[str] | None = None) -> None:
    from fedst.config import ConfigError
    from fedst.infer import InferenceError, load_site_model, parse_key_values

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        cfg = parse_key_values(ExportConfig, sys.argv[1:] if argv is None else argv, __doc__)
        if cfg.format not in FORMATS:
            raise InferenceError(f"format={cfg.format!r} is not supported; choose one of {FORMATS}")
        experiment, net, indicator = load_site_model(
            Path(cfg.run), cfg.site, cfg.prompt_site, torch.device("cpu")
        )
        out = Path(cfg.output) if cfg.output else Path(cfg.run) / "export" / f"{cfg.site}.onnx"
        size = tuple(cfg.size) if cfg.size else tuple(experiment.clip.image_size)
        export_onnx(net, indicator, size, experiment.clip.interval_s, out, cfg.opset)
    except (InferenceError, ConfigError, FileNotFoundError) as err:
        sys.exit(f"fedst.export: {err}")
    print(f"wrote {out} and {out.with_suffix('.json')}")


if __name__ == "__main__":
    main()
