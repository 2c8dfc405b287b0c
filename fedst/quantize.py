"""Int8 edge model: ONNX Runtime static quantization of the exported streaming step.

    python -m fedst.export run=runs/demo/fedst_s0_8rounds site=A format=onnx-int8
    python -m fedst.export run=... site=A format=onnx-int8 calibration_frames=128 keep_fp32=[]

The fp32 graph of fedst/export.py is quantized with ``onnxruntime.quantization.quantize_static``
in the QDQ format: weights int8 per output channel, activations uint8 with ranges calibrated
(MinMax) on frames of the benchmark's **training** split (never its test split). The calibration
inputs are what the graph sees when it streams: each calibration frame with the context features
of its clip's earlier frames, produced by the fp32 graph streaming the earlier frames of the same
training video (:func:`calibration_feeds`). Quantization without calibration is refused
(:class:`CalibrationError`): there is no dynamic fallback.

Before quantization, ONNX Runtime's pre-processing fuses each Linear's MatMul and bias Add into a
Gemm, which runs as one QGemm kernel (int8 inputs, bias included, fp32 output). Int8 are the
layers with weights (:data:`DEFAULT_OP_TYPES`: Conv, Gemm, MatMul with a weight); fp32 stay:

* the graph's inputs and outputs: the feature cache of earlier frames (``context_s<i>`` in,
  ``features_s<i>`` out; ``context_decode_head`` / ``features_decode_head`` in the decode-head
  placement) holds the fp32 tensors the int8 graph computes and passes them on
  unchanged, and every fp32 op reads the fp32 tensor, not an 8-bit copy
  (:func:`fp32_readers_read_fp32`);
* every other op (LayerNorm, Softmax, GELU, Resize, ...) and the attention products of two
  activations (``Int8Options.activation_matmuls``);
* the modules in ``keep_fp32`` (:data:`DEFAULT_KEEP_FP32`: the temporal module, the reader of
  the cache), matched by the module path the torch.onnx exporter records on each node.

The sidecar ``<output>.json`` holds the fp32 sidecar's fields plus ``"quantization"``: format,
types, op types and how many ops of each run in int8, the modules kept fp32 and the calibration
set (sites, split, videos, frame count). Measured choices: docs/inference.md.
"""

from __future__ import annotations

import ast
import itertools
import json
import logging
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from fedst.data.clips import clip_frame_positions, normalize_frames, resize_frame
from fedst.errors import UserError

__all__ = [
    "CALIBRATION_SPLIT",
    "CalibrationError",
    "CalibrationVideo",
    "Int8Options",
    "Parity",
    "calibration_feeds",
    "calibration_record",
    "carry_module_paths",
    "compare_logits",
    "nodes_in_modules",
    "quantize_step",
    "quantized_op_counts",
    "training_videos",
]

log = logging.getLogger("fedst.quantize")

CALIBRATION_SPLIT = "train"
"""The split calibration frames come from; the test split is never read."""
DEFAULT_OP_TYPES = ("Conv", "MatMul", "Gemm")
"""Op types quantized: the layers with weights, which ONNX Runtime's CPU provider runs as int8
kernels (QLinearConv, QGemm, MatMulIntegerToFloat)."""
DEFAULT_KEEP_FP32 = ("net.temporal",)
"""Modules kept fp32 by default: the temporal module, the consumer of the feature cache."""
NAME_SCOPES = "pkg.torch.onnx.name_scopes"
"""Node metadata written by the torch.onnx exporter: the module path of the node, outermost
first (e.g. ``['', 'net.temporal', 'net.temporal.1', 'net.temporal.1.k', 'linear']``)."""


MIN_PIXEL_AGREEMENT = 0.90
"""Int8 parity tolerance: the share of pixels whose class (argmax) the int8 graph gives as the
fp32 graph does, on every frame. Measured with random-init networks (PVTv2-b0 at 128x160 and
512x640, the tiny test network at 64x80) on Gaussian-noise frames, the hardest case (no margin
between classes): 0.94-0.98 calibrated; 0.16-0.35 calibrated on constant frames, 0.58-0.68 on
frames scaled by 0.1. A trained demo model on its test frames: 0.998-0.999."""
MAX_LOGIT_ERROR = 0.15
"""Int8 parity tolerance: RMS(int8 logits - fp32 logits) / RMS(fp32 logits) over all frames.
Measured as above: 0.05-0.07 calibrated, 1.1-1.4 on constant frames, 0.57-0.67 on frames scaled
by 0.1; a trained demo model: 0.008-0.014."""


@dataclass(frozen=True)
class Parity:
    """How closely int8 logits follow fp32 logits over a stream of frames."""

    pixel_agreement: float
    """Share of pixels with the same argmax class, on the frame where it is lowest."""
    mean_agreement: float
    """The same share averaged over the frames."""
    logit_error: float
    """RMS(int8 - fp32) / RMS(fp32) over every logit of every frame."""

    @property
    def within_tolerance(self) -> bool:
        return self.pixel_agreement >= MIN_PIXEL_AGREEMENT and self.logit_error <= MAX_LOGIT_ERROR

    def describe(self) -> str:
        verdict = "within" if self.within_tolerance else "OUTSIDE"
        return (
            f"pixel argmax agreement {self.mean_agreement:.4f} mean, {self.pixel_agreement:.4f} "
            f"lowest frame (>= {MIN_PIXEL_AGREEMENT}); logit error {self.logit_error:.4f} "
            f"(<= {MAX_LOGIT_ERROR}): {verdict} the tolerance"
        )


def compare_logits(fp32: Sequence[np.ndarray], int8: Sequence[np.ndarray]) -> Parity:
    """:class:`Parity` of ``int8`` against ``fp32``: per frame logits [1, K, H, W], same order."""
    if len(fp32) != len(int8) or not fp32:
        raise ValueError(f"compare_logits needs the same frames, got {len(fp32)} and {len(int8)}")
    agreement = [
        float((a.argmax(1) == b.argmax(1)).mean()) for a, b in zip(fp32, int8, strict=True)
    ]
    squared_error = sum(
        float(((a - b).astype(np.float64) ** 2).sum()) for a, b in zip(fp32, int8, strict=True)
    )
    squared = sum(float((a.astype(np.float64) ** 2).sum()) for a in fp32)
    return Parity(
        pixel_agreement=min(agreement),
        mean_agreement=float(np.mean(agreement)),
        logit_error=(squared_error / squared) ** 0.5,
    )


class CalibrationError(UserError, ValueError):
    """The int8 export has no calibration frames (none asked for, none in the training split):
    no int8 graph is written without calibrated activation ranges."""


@dataclass(frozen=True)
class Int8Options:
    """How the int8 graph is made (calibration_frames and keep_fp32 are also keys of
    fedst/export.py's ExportConfig)."""

    calibration_frames: int = 64
    """Calibration frames (each with its clip's context), spread evenly over the training
    videos of the calibration sites."""
    keep_fp32: tuple[str, ...] = DEFAULT_KEEP_FP32
    """Module paths kept fp32 (prefixes of the exporter's module paths, e.g. net.decoder)."""
    op_types: tuple[str, ...] = DEFAULT_OP_TYPES
    """Op types to quantize."""
    activation_matmuls: bool = False
    """Also quantize the MatMuls of two activations (attention scores and their product with the
    values). Off: at 512x640, 1 thread, int8 streaming was 1.26x fp32 without them, 1.17x with
    them (fp32 outputs), 0.80x with their outputs 8-bit too (docs/inference.md)."""
    float_outputs: tuple[str, ...] = ("Gemm", "MatMul")
    """Op types whose outputs stay fp32: their int8 kernel (QGemm) adds the bias and writes
    fp32, with no QuantizeLinear / DequantizeLinear pair to the fp32 op that follows."""
    reduce_range: bool = True
    """7-bit weights: no saturation in the uint8 x int8 products of x86 CPUs without VNNI (AVX2:
    VPMADDUBSW sums two products into int16), which ONNX Runtime recommends there."""


@dataclass(frozen=True)
class CalibrationVideo:
    """Frames of one training video in time order, read when streamed: ``frames`` [(time_s, the
    frame's reference in ``source``)]; ``targets``: the indices in ``frames`` whose streaming
    inputs are calibration samples (the others are only the earlier frames of their clips)."""

    source: Any
    """The site's fedst.data SiteSource (``read_frame(ref)`` -> RGB uint8 [H0, W0, 3])."""
    video_id: str
    frames: list[tuple[float, Any]]
    targets: frozenset[int]


def training_videos(
    sources: Sequence[Any], count: int, num_frames: int, interval_s: float
) -> list[CalibrationVideo]:
    """``count`` calibration frames evenly spread over every frame of the training videos of
    ``sources`` (fedst.data SiteSources), each with the earlier frames of its clip
    (:func:`clip_frame_positions`). Nothing is read yet: :func:`calibration_feeds` reads them."""
    if count < 1:
        raise CalibrationError(
            f"calibration_frames={count}: the int8 export needs at least one calibration frame "
            f"(static quantization has no fallback without calibrated ranges)"
        )
    videos = [(source, video) for source in sources for video in source.videos(CALIBRATION_SPLIT)]
    positions = [(v, p) for v, (_, video) in enumerate(videos) for p in range(len(video.frames))]
    if not positions:
        names = [source.name for source in sources]
        raise CalibrationError(
            f"sites {names} have no frames in their {CALIBRATION_SPLIT!r} split to calibrate the "
            f"int8 model on: give calibration_sites=[...] with training videos"
        )
    chosen = [positions[i] for i in _spread(len(positions), count)]
    out = []
    for v, (source, video) in enumerate(videos):
        targets = [p for w, p in chosen if w == v]
        if not targets:
            continue
        needed = set(targets)
        for p in targets:
            needed.update(clip_frame_positions(video.times, p, num_frames, interval_s))
        order = sorted(needed)
        out.append(
            CalibrationVideo(
                source=source,
                video_id=video.video_id,
                frames=[(video.times[p], video.frames[p]) for p in order],
                targets=frozenset(order.index(p) for p in targets),
            )
        )
    return out


def _spread(total: int, count: int) -> list[int]:
    """``min(count, total)`` indices of ``range(total)`` evenly spread, first and last included."""
    return sorted({round(x) for x in np.linspace(0, total - 1, min(count, total))})


def calibration_feeds(
    streamer: Any, videos: Sequence[CalibrationVideo]
) -> Iterator[dict[str, np.ndarray]]:
    """The graph's inputs at each target frame of ``videos``: the frame as its site stores it,
    resized to the graph's size and normalised as fedst.infer does, and its clip's context from
    the cache of ``streamer`` (the fp32 graph's fedst.onnx_stream.OnnxStreamer) streaming the
    video's frames."""
    size = tuple(streamer.meta["image_size"])
    for video in videos:
        streamer.reset()
        for index, (time_s, ref) in enumerate(video.frames):
            rgb = video.source.read_frame(ref)  # [H0, W0, 3] uint8
            frame = normalize_frames(resize_frame(rgb, size)[None]).numpy()  # [1, 3, H, W]
            feeds = streamer.feeds(frame, time_s)
            if index in video.targets:
                yield feeds
            streamer.run(feeds, time_s)


def calibration_record(sites: Sequence[str], videos: Sequence[CalibrationVideo]) -> dict:
    """The sidecar's description of a calibration set (its frame count is added when used)."""
    return {
        "sites": list(sites),
        "split": CALIBRATION_SPLIT,
        "videos": [f"{v.source.name}/{v.video_id}" for v in videos],
    }


def nodes_in_modules(model: Any, prefixes: Sequence[str]) -> list[str]:
    """Names of the nodes of ``model`` (an onnx.ModelProto from the torch.onnx exporter) inside
    a module whose path is one of ``prefixes`` or below one (:data:`NAME_SCOPES` metadata)."""
    found = []
    for node in model.graph.node:
        scopes = next((p.value for p in node.metadata_props if p.key == NAME_SCOPES), None)
        if scopes is None:
            continue
        paths = ast.literal_eval(scopes)
        if any(_within(path, prefix) for path in paths for prefix in prefixes):
            found.append(node.name)
    return found


def carry_module_paths(source: Any, target: Any) -> None:
    """Give each node of ``target`` (an onnx.ModelProto optimised from ``source``) the module
    path (:data:`NAME_SCOPES`) of the ``source`` node it comes from: the same name, or for a
    fused node "<source node>/<fusion>"."""
    paths = {
        node.name: prop.value
        for node in source.graph.node
        for prop in node.metadata_props
        if prop.key == NAME_SCOPES
    }
    for node in target.graph.node:
        path = paths.get(node.name.split("/")[0])
        if path is not None and not any(p.key == NAME_SCOPES for p in node.metadata_props):
            node.metadata_props.add(key=NAME_SCOPES, value=path)


def activation_matmuls(model: Any) -> list[str]:
    """Names of the MatMul nodes of ``model`` whose second input is not a weight (an initializer):
    attention's products of two activations. (quantize_static's MatMulConstBOnly option does
    not apply to the QDQ format in ONNX Runtime 1.32, so these are excluded by name.)"""
    weights = {i.name for i in model.graph.initializer}
    constants = {o for n in model.graph.node if n.op_type == "Constant" for o in n.output}
    return [
        n.name
        for n in model.graph.node
        if n.op_type == "MatMul" and n.input[1] not in weights | constants
    ]


def _within(path: str, prefix: str) -> bool:
    return path == prefix or path.startswith(prefix + ".")


def quantize_step(
    fp32_path: Path,
    out_path: Path,
    feeds: Iterator[dict[str, np.ndarray]] | None,
    options: Int8Options = Int8Options(),
    calibration: dict[str, Any] | None = None,
) -> Path:
    """Write the int8 QDQ graph of the exported step ``fp32_path`` to ``out_path`` (+ ``.json``:
    the fp32 sidecar plus ``"quantization"``), its activation ranges calibrated on ``feeds``
    (the graph's inputs, e.g. :func:`calibration_feeds`); ``calibration`` describes them.

    Raises :class:`CalibrationError` when ``feeds`` is None or yields nothing: no int8 graph is
    written without calibrated ranges."""
    import onnx
    from onnxruntime.quantization import (
        CalibrationMethod,
        QuantFormat,
        QuantType,
        quant_pre_process,
        quantize_static,
    )

    first = next(feeds, None) if feeds is not None else None
    if first is None:
        raise CalibrationError(
            f"no calibration frames for the int8 export of {fp32_path.name}: static quantization "
            f"needs the activation ranges of real inputs (calibration_frames >= 1 from sites with "
            f"training videos); there is no fallback without them"
        )
    reader = _reader(itertools.chain([first], feeds))
    meta = json.loads(fp32_path.with_suffix(".json").read_text())
    out_path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".int8.", dir=out_path.parent) as tmp:
        shaped = Path(tmp) / "shaped.onnx"
        # shape inference and ONNX Runtime's basic fusions (MatMul + bias Add -> Gemm, so the
        # bias joins the int8 kernel); they drop the module paths, carried back by node name
        quant_pre_process(str(fp32_path), str(shaped))
        shaped_model = onnx.load(str(shaped))
        carry_module_paths(onnx.load(str(fp32_path)), shaped_model)
        onnx.save(shaped_model, str(shaped))
        kept = nodes_in_modules(shaped_model, options.keep_fp32)
        if not options.activation_matmuls:
            kept += [n for n in activation_matmuls(shaped_model) if n not in kept]
        staged = Path(tmp) / "int8.onnx"
        quantize_static(
            str(shaped),
            str(staged),
            reader,
            quant_format=QuantFormat.QDQ,
            op_types_to_quantize=list(options.op_types),
            per_channel=True,
            reduce_range=options.reduce_range,
            activation_type=QuantType.QUInt8,
            weight_type=QuantType.QInt8,
            nodes_to_exclude=kept,
            # MinMax keeps only each tensor's min and max per frame. Not CalibMaxIntermediateOutputs:
            # in ONNX Runtime 1.32 it drops the frames collected so far instead of folding them in
            calibrate_method=CalibrationMethod.MinMax,
            extra_options={"OpTypesToExcludeOutputQuantization": list(options.float_outputs)},
        )
        model = onnx.load(str(staged))
        exact = fp32_readers_read_fp32(model, options.op_types, set(kept), shaped_model)
        onnx.save(model, str(staged))
        quantized = quantized_op_counts(model)
        staged.replace(out_path)
    meta["quantization"] = {
        "format": "QDQ",
        "weights": "int8 per output channel" + (", 7-bit range" if options.reduce_range else ""),
        "activations": "uint8, MinMax calibration",
        "op_types": list(options.op_types),
        "quantized_ops": quantized,
        "kept_fp32_modules": list(options.keep_fp32),
        "kept_fp32_nodes": len(kept),
        "fp32": "graph inputs and outputs (the feature cache), other op types, kept modules",
        "fp32_reads_restored": exact,
        "calibration": {**(calibration or {}), "frames": reader.count},
    }
    out_path.with_suffix(".json").write_text(json.dumps(meta, indent=2))
    log.info(
        "wrote %s (%.1f MB): %d ops quantized, %d calibration frames",
        out_path,
        out_path.stat().st_size / 1e6,
        sum(quantized.values()),
        reader.count,
    )
    return out_path


def _reader(feeds: Iterator[dict[str, np.ndarray]]) -> Any:
    """A CalibrationDataReader over ``feeds`` that counts what it hands out (``.count``)."""
    from onnxruntime.quantization import CalibrationDataReader

    class StreamingCalibration(CalibrationDataReader):
        def __init__(self) -> None:
            self.count = 0

        def get_next(self) -> dict[str, np.ndarray] | None:
            item = next(feeds, None)
            self.count += item is not None
            return item

    return StreamingCalibration()


def fp32_readers_read_fp32(
    model: Any, op_types: Sequence[str], kept: set[str], unquantized: Any | None = None
) -> int:
    """Rewire a QDQ ``model`` (in place) so that quantization noise reaches only the ops that run
    in int8; return how many inputs and outputs were rewired.

    quantize_static quantizes a tensor once for all its readers: when one reader is an int8 op
    (e.g. the next stage's Conv reading ``features_s1``), every other reader gets the
    QuantizeLinear-DequantizeLinear copy too, and so does a graph output of that name: the
    feature cache and the temporal module (kept fp32) would read 8-bit values. Here every reader
    that is not an int8 op, and every graph output, reads the fp32 tensor again where it exists in
    fp32 (its producer is an fp32 op or a graph input). The outputs of int8 ops exist only
    quantized once ONNX Runtime fuses them (QLinearConv), so their readers are left as they are.

    A weight is quantized in place (its initializer replaced by the 8- or 32-bit one): where an
    fp32 op reads it too (the exporter shares one initializer among equal constants, e.g. the
    zero bias of a Conv and of a LayerNorm), that reader gets the weight's fp32 values back from
    ``unquantized`` (the model before quantization), added as an initializer ``<name>_fp32``.
    """
    nodes = list(model.graph.node)
    producer = {out: node for node in nodes for out in node.output}
    weights = {init.name for init in model.graph.initializer}

    def int8(node: Any) -> bool:
        return node.op_type in op_types and node.name not in kept

    fp32_of = {}  # DequantizeLinear output -> the fp32 tensor quantized into it
    for node in nodes:
        if node.op_type != "DequantizeLinear":
            continue
        quantize = producer.get(node.input[0])
        if quantize is None or quantize.op_type != "QuantizeLinear":
            continue
        source = quantize.input[0]
        origin = producer.get(source)
        if source not in weights and (origin is None or not int8(origin)):
            fp32_of[node.output[0]] = source
    if unquantized is not None:  # quantized weights read by fp32 ops: their fp32 values
        import onnx

        originals = {init.name: init for init in unquantized.graph.initializer}
        present = {init.name for init in model.graph.initializer}
        for node in nodes:
            if node.op_type != "DequantizeLinear" or node.input[0] not in weights:
                continue
            original = node.input[0].removesuffix("_quantized")
            if original == node.input[0] or original not in originals:
                continue
            restored = f"{original}_fp32"  # the DequantizeLinear's output holds the old name
            fp32_of[node.output[0]] = restored
            if restored not in present:
                initializer = onnx.TensorProto()
                initializer.CopyFrom(originals[original])
                initializer.name = restored
                model.graph.initializer.append(initializer)
                present.add(restored)
    rewired = 0
    for node in nodes:
        if node.op_type in ("QuantizeLinear", "DequantizeLinear") or int8(node):
            continue
        for index, name in enumerate(node.input):
            if name in fp32_of:
                node.input[index] = fp32_of[name]
                rewired += 1
    for output in model.graph.output:
        if output.name not in fp32_of:
            continue
        # the quantizer renamed the producer's output and gave the graph output's name to the
        # DequantizeLinear: give the name back to the fp32 tensor, a new one to the copy
        fp32, copy = fp32_of[output.name], output.name + "_dequantized"
        for node in nodes:
            node.input[:] = [copy if i == output.name else i for i in node.input]
            node.output[:] = [copy if o == output.name else o for o in node.output]
        for node in nodes:
            node.input[:] = [output.name if i == fp32 else i for i in node.input]
            node.output[:] = [output.name if o == fp32 else o for o in node.output]
        rewired += 1
    return rewired


def quantized_op_counts(model: Any) -> dict[str, int]:
    """Op type -> number of nodes of a QDQ ``model`` whose every input is a DequantizeLinear
    output: the ops ONNX Runtime runs as int8 kernels (QLinearConv, QLinearMatMul, ...)."""
    dequantized = {n.output[0] for n in model.graph.node if n.op_type == "DequantizeLinear"}
    counts: dict[str, int] = {}
    for node in model.graph.node:
        inputs = [i for i in node.input if i]
        if node.op_type not in ("QuantizeLinear", "DequantizeLinear") and all(
            i in dequantized for i in inputs
        ):
            counts[node.op_type] = counts.get(node.op_type, 0) + 1
    return dict(sorted(counts.items()))
