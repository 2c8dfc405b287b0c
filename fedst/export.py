"""Export a trained site model for edge devices: one streaming step as an ONNX graph.

    python -m fedst.export run=runs/demo/fedst_s0_8rounds site=A format=onnx
    python -m fedst.export run=runs/demo/fedst_s0_8rounds site=outfed prompt_site=E format=onnx output=e.onnx
    python -m fedst.export run=runs/demo/fedst_s0_8rounds site=A format=onnx-int8 calibration_frames=64

The graph is one step of the model's stream (FedSTNet.stream in fedst/model/network.py) with the
temporal feature cache as explicit tensors, so any ONNX runtime can stream video without Python
state in the graph:

    inputs   frame            [1, 3, H, W] float32, normalised as fedst.data.clips.normalize_frames
             context_valid    [T-1] bool, oldest first; False: the clip uses the current frame
                              there (video start), and that slot of every context_s<i> is ignored
             context_s<i>     [T-1, 1, C_i, h_i, w_i] float32, for each temporal stage i: the
                              features_s<i> outputs of the earlier clip frames, oldest first
    outputs  logits           [1, K, H, W] float32
             features_s<i>    [1, C_i, h_i, w_i] float32, this frame's features for later steps

In the decode-head placement (network.temporal_placement=decode_head, the default) the cache holds
the decoder's fused map instead: context_decode_head [T-1, 1, D, h_0, w_0] in, features_decode_head
[1, D, h_0, w_0] out (D = network.decoder_dim, h_0 x w_0 the stride-4 map).

The caller keeps the cache and picks the earlier frames by time with FrameHistory
(fedst/data/clips/; frame k steps back: the latest earlier frame at or before
t - k * interval_s), as OnnxStreamer does. The site indicator is a constant of the graph
(the model is the site's). H, W are fixed to the run's clip.image_size (or size=); a sidecar
<output>.json records them with the clip rule, the input normalisation, the class names and the
run, site and prompt site the graph is of. format=onnx-int8 writes the same step quantized to int8
by ONNX Runtime's static quantization, calibrated on frames of the training split
(fedst/quantize.py); its sidecar also records what was quantized and the calibration set.
Default output: <run>/export/<site>.onnx, <site>.int8.onnx for int8 (site=outfed:
outfed_<prompt_site>). OnnxStreamer (fedst/onnx_stream.py) runs either in ONNX Runtime.
Needs the export extra (pip install -e '.[export]': onnx, onnxscript, onnxruntime).
"""

from __future__ import annotations

import contextlib
import copy
import json
import logging
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from fedst.data.base import CLASS_NAMES
from fedst.data.clips import IMAGENET_MEAN, IMAGENET_STD
from fedst.model.network import FedSTNet
from fedst.onnx_stream import (
    OnnxStreamer,
    SessionSettings,
    context_input_name,
    default_export_path,
    export_command,
    feature_output_name,
)
from fedst.quantize import DEFAULT_KEEP_FP32, Int8Options

__all__ = [
    "ExportConfig",
    "OnnxStreamer",
    "SessionSettings",
    "StreamingStep",
    "cpu_copy",
    "default_export_path",
    "export_command",
    "export_model",
    "export_onnx",
    "main",
]

log = logging.getLogger("fedst.export")

FORMATS = ("onnx", "onnx-int8")
DEFAULT_OPSET = 20
"""Opset 20 has GELU as one op (ONNX Runtime's Gelu kernel); at opset 18 the exporter writes it
as Div, Erf, Add, Mul, Mul, which ONNX Runtime 1.32 does not fuse (measured at 128x160, 1 thread:
20.6 vs 22.1 ms per streaming step, best of 15; docs/inference.md)."""
EXPORTER_LOGGERS = ("onnx_ir", "onnxscript")
"""Loggers of the torch.onnx exporter's graph passes: ~270 INFO lines per export (each
deduplicated initializer, each folded constant), kept at WARNING while exporting."""


class StreamingStep(nn.Module):
    """One streaming step of ``net`` as a function of explicit tensors (the exported graph).

    ``forward(frame [1, 3, H, W], context_valid [T-1] bool, *context)`` with one context tensor
    ``[T-1, 1, C, h, w]`` per key of the feature cache -> ``(logits [1, K, H, W], *features)``
    with ``features[i]`` this frame's map ``[1, C, h, w]`` of key i. The keys are what
    :class:`fedst.model.network.StreamingState` caches: the temporal stages' encoder maps (the
    encoder placement), or ``"decode_head"``, the decoder's fused map [1, D, h_0, w_0] that CFFM's
    block reads (the decode-head placement); none without the temporal module.
    """

    def __init__(self, net: FedSTNet, indicator: torch.Tensor | None):
        super().__init__()
        self.net = net.eval()
        self.keys = net.cache_keys if net.uses_temporal(net.cfg.num_frames) else ()
        self.register_buffer("indicator", indicator.clone() if indicator is not None else None)

    def cached(self, feats: list[torch.Tensor]) -> list[torch.Tensor]:
        """This frame's maps per key (:meth:`FedSTNet.cached_maps`), from its 4 encoder maps."""
        if not self.keys:
            return []
        return list(self.net.cached_maps(feats, self.indicator).values())

    def forward(
        self, frame: torch.Tensor, context_valid: torch.Tensor, *context: torch.Tensor
    ) -> tuple[torch.Tensor, ...]:
        feats = self.net.encoder(frame)  # 4 x [1, C_i, h_i, w_i]
        own = self.cached(feats)
        history = {}
        for key, current, earlier in zip(self.keys, own, context, strict=True):
            valid = context_valid.view(-1, 1, 1, 1, 1)  # [T-1, 1, 1, 1, 1]
            chosen = torch.where(valid, earlier, current[None])  # [T-1, 1, C, h, w]
            history[key] = [*chosen.unbind(0), current]
        size = (frame.shape[2], frame.shape[3])
        logits = self.net._decode(feats, history, self.indicator, size)
        return (logits, *own)

    def example_inputs(self, image_size: tuple[int, int]) -> tuple[torch.Tensor, ...]:
        """Inputs of the right shapes (a random frame, no valid context)."""
        frame = torch.randn(1, 3, *image_size)
        with torch.no_grad():
            own = self.cached(self.net.encoder(frame))
        earlier = self.net.cfg.num_frames - 1
        context = [torch.zeros(earlier, *o.shape) for o in own]
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
    source: dict[str, Any] | None = None,
) -> Path:
    """Write ``net``'s streaming step as ONNX to ``out_path`` (+ ``.json`` sidecar); return it.
    ``source`` (run, site, prompt_site) is recorded in the sidecar.

    The graph is traced on the CPU from a copy of ``net`` (:func:`cpu_copy`): the caller's model
    keeps its device and its training mode."""
    traced = cpu_copy(net)
    traced.prepare_temporal(image_size)  # the temporal layout as constants, not traced arithmetic
    step = StreamingStep(traced, indicator.cpu() if indicator is not None else None).eval()
    inputs = step.example_inputs(image_size)
    context_names = [context_input_name(key) for key in step.keys]
    feature_names = [feature_output_name(key) for key in step.keys]
    out_path.parent.mkdir(parents=True, exist_ok=True)
    with torch.no_grad(), _exporter_warnings_only():
        program = torch.onnx.export(
            step,
            inputs,
            dynamo=True,
            input_names=["frame", "context_valid", *context_names],
            output_names=["logits", *feature_names],
            opset_version=opset,
            external_data=False,
            verbose=False,  # no "[torch.onnx] ... ✅" progress prints; failures still raise
        )
    program.save(str(out_path))
    meta = {
        "inputs": {
            name: list(t.shape)
            for name, t in zip(["frame", "context_valid", *context_names], inputs, strict=True)
        },
        "temporal_stages": list(step.keys),  # the cache's keys: stages, or ["decode_head"]
        "num_frames": net.cfg.num_frames,
        "interval_s": interval_s,
        "image_size": list(image_size),
        "classes": list(CLASS_NAMES[: net.cfg.num_classes]),
        "normalization": {"scale": 1 / 255, "mean": IMAGENET_MEAN, "std": IMAGENET_STD},
        "opset": opset,
        "source": source,
    }
    out_path.with_suffix(".json").write_text(json.dumps(meta, indent=2))
    log.info("wrote %s (%.1f MB)", out_path, out_path.stat().st_size / 1e6)
    return out_path


@contextlib.contextmanager
def _exporter_warnings_only() -> Iterator[None]:
    """EXPORTER_LOGGERS at WARNING inside the block (their warnings and errors still show;
    our own loggers and Python warnings are untouched), their own levels restored after."""
    loggers = [logging.getLogger(name) for name in EXPORTER_LOGGERS]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(max(logger.getEffectiveLevel(), logging.WARNING))
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels, strict=True):
            logger.setLevel(level)


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
    """[H, W] input size of the graph, e.g. size=[512,640] (default: the run's clip.image_size)."""
    opset: int = DEFAULT_OPSET
    """ONNX opset version."""
    calibration_frames: int = Int8Options.calibration_frames
    """format=onnx-int8: frames of the training split (never the test split) the activation
    ranges are calibrated on, each streamed with its clip's earlier frames."""
    calibration_sites: tuple[str, ...] | None = None
    """format=onnx-int8: the sites whose training split is read (default: the site itself; for
    site=outfed the federated sites)."""
    keep_fp32: tuple[str, ...] = DEFAULT_KEEP_FP32
    """format=onnx-int8: module paths kept fp32, e.g. [net.temporal,net.decoder] ([]: quantize
    every Conv / MatMul / Gemm)."""


def export_model(cfg: ExportConfig, experiment: Any, net: FedSTNet, indicator: Any) -> Path:
    """Write the graph ``cfg`` asks for of the run's model ``net`` (and its sidecar); return its
    path. format=onnx-int8: the training frames are read first (a site without any stops before
    the export), then the fp32 graph is exported to a temporary folder and quantized."""
    from fedst.quantize import (
        calibration_feeds,
        calibration_record,
        quantize_step,
        training_videos,
    )

    run = Path(cfg.run)
    out = (
        Path(cfg.output)
        if cfg.output
        else default_export_path(run, cfg.site, cfg.prompt_site, cfg.format)
    )
    size = tuple(cfg.size) if cfg.size else tuple(experiment.clip.image_size)
    source = {"run": str(run), "site": cfg.site, "prompt_site": cfg.prompt_site}
    interval_s = experiment.clip.interval_s
    if cfg.format == "onnx":
        return export_onnx(net, indicator, size, interval_s, out, cfg.opset, source)
    sites = list(cfg.calibration_sites or calibration_sites_of(experiment, cfg.site))
    unknown = [s for s in sites if s not in experiment.data.sites]
    if unknown:
        from fedst.infer import InferenceError

        raise InferenceError(
            f"calibration_sites={sites}: {unknown} not a site of run {run}; its sites are "
            f"{sorted(experiment.data.sites)}"
        )
    videos = training_videos(
        [experiment.data.open(s) for s in sites],
        cfg.calibration_frames,
        experiment.clip_config().num_frames,
        interval_s,
    )
    options = Int8Options(calibration_frames=cfg.calibration_frames, keep_fp32=cfg.keep_fp32)
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".fp32.", dir=out.parent) as tmp:
        fp32 = export_onnx(
            net, indicator, size, interval_s, Path(tmp) / "fp32.onnx", cfg.opset, source
        )
        feeds = calibration_feeds(OnnxStreamer(fp32), videos)
        return quantize_step(fp32, out, feeds, options, calibration_record(sites, videos))


def calibration_sites_of(experiment: Any, site: str) -> list[str]:
    """The sites an int8 model of ``site`` is calibrated on by default: a federated site's own
    training split (what that hospital holds), the federated sites' for site=outfed."""
    from fedst.infer import OUTFED

    return list(experiment.data.federation) if site == OUTFED else [site]


def main(argv: list[str] | None = None) -> None:
    from fedst.infer import InferenceError, load_site_model, parse_key_values

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        cfg = parse_key_values(
            ExportConfig, sys.argv[1:] if argv is None else argv, __doc__, "python -m fedst.export"
        )
        if cfg.format not in FORMATS:
            raise InferenceError(f"format={cfg.format!r} is not supported; choose one of {FORMATS}")
        experiment, net, indicator = load_site_model(
            Path(cfg.run), cfg.site, cfg.prompt_site, torch.device("cpu")
        )
        out = export_model(cfg, experiment, net, indicator)
    except FileNotFoundError as err:  # a path the user gave: one line through the boundary
        raise InferenceError(str(err)) from err
    print(f"wrote {out} and {out.with_suffix('.json')}")


if __name__ == "__main__":
    from fedst.errors import run_entry_point

    run_entry_point(main, "python -m fedst.export")
