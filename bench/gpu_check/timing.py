"""The GPU check's two timing benchmarks, each run in a process of its own by bench/gpu_check/check.py
(its ``step`` and ``stream`` subcommands): one training step of the network with none of the
options against TF32, bf16, channels_last and torch.compile; streaming inference per frame in
eager, autocast, compiled, CUDA-graph and ONNX Runtime variants. Split from bench/gpu_check/check.py
(issue 48).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import json
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from statistics import median

# -- step: one training step with and without the options ---------------------------------------


@dataclass(frozen=True)
class StepVariant:
    """One way to run the training step: autocast dtype (None: fp32), TF32, channels_last and
    torch.compile's mode (None: eager)."""

    name: str
    dtype: str | None = None
    tf32: bool = False
    channels_last: bool = False
    compile_mode: str | None = None


STEP_VARIANTS = (
    StepVariant("baseline: fp32, no TF32, eager, contiguous"),
    StepVariant("TF32", tf32=True),
    StepVariant("bf16 autocast + TF32", dtype="bf16", tf32=True),
    StepVariant("bf16 + channels_last", dtype="bf16", tf32=True, channels_last=True),
    StepVariant("bf16 + compile default", dtype="bf16", tf32=True, compile_mode="default"),
    StepVariant(
        "bf16 + channels_last + compile reduce-overhead",
        dtype="bf16",
        tf32=True,
        channels_last=True,
        compile_mode="reduce-overhead",
    ),
)
"""The baseline first: every ratio in the report is against it, measured in the same process."""

_DTYPES = {"bf16": "bfloat16", "fp16": "float16"}


def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _set_tf32(device, enabled: bool) -> None:
    """TF32 on or off through fedst.accel.set_tf32, which sets PyTorch's legacy and new switches
    alike: the new ones alone make torch.compile raise "mix of the legacy and new APIs" on
    some torch versions (2.10; the GPU machine has 2.11)."""
    from fedst.accel import set_tf32

    if device.type == "cuda":
        set_tf32(enabled)


def _autocast(device, dtype: str | None):
    import torch

    if dtype is None or device.type != "cuda":
        return contextlib.nullcontext()
    return torch.autocast("cuda", dtype=getattr(torch, _DTYPES[dtype]))


def write_json(path: Path | None, payload: dict) -> None:
    if path is not None:
        path.write_text(json.dumps(payload, indent=1, default=str))


def bench_step(
    device_name: str,
    size: tuple[int, int],
    iters: int,
    repeats: int,
    budget_s: float,
    compile_backend: str,
    out: Path | None,
) -> dict:
    """ms per training step (batch 2 of 4-frame clips, AdamW, Eq. 9 loss) of each
    :data:`STEP_VARIANTS`: each warmed up (3 steps: compiling) and timed ``repeats`` times over
    ``iters`` steps, then all timed again round-robin ``repeats`` times while 80 % of
    ``budget_s`` lasts (the minimum of the means counts). Results go to ``out`` after every
    measurement."""
    import torch

    from fedst import accel
    from fedst.model.losses import SegmentationLoss
    from fedst.model.network import NetworkConfig, build_network

    started = time.monotonic()
    device = torch.device(device_name)
    torch.manual_seed(0)
    template = build_network(NetworkConfig())
    indicator = torch.nn.functional.normalize(torch.randn(template.cfg.indicator_dim), dim=0)
    indicator = indicator.to(device)
    clips = torch.randn(2, template.cfg.num_frames, 3, *size, device=device)
    target = torch.randint(0, template.cfg.num_classes, (2, *size), device=device)
    loss_fn = SegmentationLoss(num_classes=template.cfg.num_classes)
    result: dict = {"device": str(device), "size": list(size), "batch": 2, "variants": {}}
    result["compile_backend"] = compile_backend  # eager (--cpu): dynamo's tracing, no codegen
    if device.type != "cuda":
        result["note"] = "CPU: autocast and TF32 are CUDA-only, so every variant runs in fp32"
    steps: dict[str, Callable[[], None]] = {}
    for variant in STEP_VARIANTS:
        if time.monotonic() - started > budget_s * 0.6:
            result["variants"][variant.name] = {"status": "not run: time budget"}
            continue
        net = copy.deepcopy(template).to(device).train()
        batch = clips
        if variant.channels_last:
            net = net.to(memory_format=torch.channels_last)
            # every frame [3, H, W] channels-last (as fedst.accel.clips_channels_last)
            frames = clips.flatten(0, 1).contiguous(memory_format=torch.channels_last)
            batch = frames.unflatten(0, clips.shape[:2])
        optimizer = torch.optim.AdamW(
            net.parameters(), lr=6e-5, **accel.fused_optimizer_options(device)
        )
        if variant.compile_mode is not None:
            if compile_backend == "inductor":
                net.compile(mode=variant.compile_mode)
            else:
                net.compile(backend=compile_backend)

        def step(net=net, batch=batch, optimizer=optimizer, variant=variant) -> None:
            _set_tf32(device, variant.tf32)
            optimizer.zero_grad(set_to_none=True)
            with _autocast(device, variant.dtype):
                logits = net(batch, indicator)
            loss_fn(logits.float(), target).backward()
            optimizer.step()

        warm = time.monotonic()
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        try:
            for _ in range(3):
                step()
            _sync(device)
        except Exception as err:  # a variant that cannot run is a result, not the end
            result["variants"][variant.name] = {"status": f"failed: {type(err).__name__}: {err}"}
            write_json(out, result)
            continue
        entry = {
            "status": "ok",
            "warmup_seconds": time.monotonic() - warm,
            **dataclasses.asdict(variant),
        }
        if device.type == "cuda":
            entry["peak_allocated_gib"] = torch.cuda.max_memory_allocated(device) / 1024**3
        result["variants"][variant.name] = entry
        steps[variant.name] = step
        write_json(out, result)
    # each variant is timed as soon as it is warm (a cut-off run keeps those figures), then all
    # again round-robin (the same machine state for each); the minimum mean of each counts
    for name in steps:
        _time_variant(result, name, steps[name], iters, repeats, device, out)
    for _ in range(repeats):
        if time.monotonic() - started > budget_s * 0.8:
            break
        for name in steps:
            _time_variant(result, name, steps[name], iters, 1, device, out)
    return result


def _time_variant(
    result: dict, name: str, step: Callable[[], None], iters: int, repeats: int, device, out
) -> None:
    """Time ``step`` ``repeats`` x ``iters`` times; keep the lowest mean ms in the result with
    the speed-up over the baseline, and write the result."""
    best = result["variants"][name].get("ms_per_step", float("inf"))
    for _ in range(repeats):
        _sync(device)
        begin = time.perf_counter()
        for _ in range(iters):
            step()
        _sync(device)
        best = min(best, (time.perf_counter() - begin) * 1e3 / iters)
    result["variants"][name]["ms_per_step"] = best
    baseline = result["variants"].get(STEP_VARIANTS[0].name, {}).get("ms_per_step")
    for entry in result["variants"].values():
        if baseline and "ms_per_step" in entry:
            entry["speedup_vs_baseline"] = baseline / entry["ms_per_step"]
    write_json(out, result)


# -- stream: streaming inference FPS ------------------------------------------------------------


def _compile_streaming(net, backend: str, mode: str) -> None:
    """torch.compile the modules a streaming step calls (encoder, temporal modules, channel
    selection, prompts, decoder), in place, so ``StreamingState`` runs them compiled."""
    modules = [net.encoder, net.decoder, *net.temporal.values()]
    modules += [*net.channel_selection.values(), *net.prompt.values()]
    for module in modules:
        if backend == "inductor":
            module.compile(mode=mode)
        else:
            module.compile(backend=backend)


COMPARED_FRAMES = 8
"""Frames whose logits every streaming variant compares with eager fp32's."""


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def frame_time_summary(seconds: list[float]) -> dict[str, float]:
    """ms per frame at the median (p50) and 95th percentile (p95) and the FPS of each: the
    median alone hides the slow frames a viewer sees as stutter."""
    p50, p95 = median(seconds), _quantile(seconds, 0.95)
    return {"ms_p50": p50 * 1e3, "ms_p95": p95 * 1e3, "fps": 1 / p50, "fps_p95": 1 / p95}


def bench_stream(
    device_name: str,
    size: tuple[int, int],
    frames: int,
    budget_s: float,
    compile_backend: str,
    out: Path | None,
) -> dict:
    """Frames per second of FedST streaming (one encoder pass per frame, earlier frames'
    features cached; ``FedSTNet.stream``) at ``size``, batch 1, a host sync after every frame
    (a viewer needs each frame's logits), p50 and p95 per frame: eager fp32, bf16 and fp16
    autocast, compiled (fp32 and bf16), compiled with CUDA graphs (``reduce-overhead``, bf16),
    and ONNX Runtime (on a GPU only with its CUDA provider; the CPU provider with ``--cpu``).
    Each variant's logits of the first :data:`COMPARED_FRAMES` frames are compared with eager
    fp32's (``max_abs_diff_vs_eager_fp32``): a fast variant with wrong output shows."""
    import torch

    from fedst.model.network import NetworkConfig, build_network

    started = time.monotonic()
    device = torch.device(device_name)
    torch.manual_seed(0)
    net = build_network(NetworkConfig()).eval().to(device)
    indicator = torch.nn.functional.normalize(torch.randn(net.cfg.indicator_dim), dim=0).to(device)
    video = torch.randn(8, 1, 3, *size, device=device)
    result: dict = {"device": str(device), "size": list(size), "frames": frames, "variants": {}}
    interval_s, fps_of_video = 0.2, 25.0
    reference: list = []

    def run(name: str, stream_net, dtype: str | None, warmup: int, graphs: bool = False) -> None:
        if time.monotonic() - started > budget_s * 0.7:
            result["variants"][name] = {"status": "not run: time budget"}
            write_json(out, result)
            return
        try:
            logits, times = [], []
            with torch.no_grad(), _autocast(device, dtype):
                # the compared frames first, from a fresh stream (the same history as eager's)
                for repeat in range(2):
                    state = stream_net.stream(indicator, interval_s=interval_s)
                    for index in range(COMPARED_FRAMES if repeat == 0 else warmup + frames):
                        if graphs:
                            torch.compiler.cudagraph_mark_step_begin()
                        begin = time.perf_counter()
                        output = state.step(video[index % len(video)], index / fps_of_video)
                        _sync(device)
                        if repeat == 0:
                            logits.append(output.float().cpu())
                        else:
                            times.append(time.perf_counter() - begin)
            entry = {"status": "ok", **frame_time_summary(times[warmup:])}
            entry["first_frames_seconds"] = sum(times[:warmup])
            if not reference:
                reference.extend(logits)
            entry["max_abs_diff_vs_eager_fp32"] = max(
                float((a - b).abs().max()) for a, b in zip(logits, reference, strict=True)
            )
            result["variants"][name] = entry
        except Exception as err:
            result["variants"][name] = {"status": f"failed: {type(err).__name__}: {err}"}
        write_json(out, result)

    _set_tf32(device, False)
    run("eager fp32", net, None, warmup=4)  # the reference: fp32 without TF32
    _set_tf32(device, True)
    if device.type == "cuda":
        run("eager fp32 + TF32", net, None, warmup=4)
        run("eager bf16 autocast", net, "bf16", warmup=4)
        run("eager fp16 autocast", net, "fp16", warmup=4)
    compiled = copy.deepcopy(net)
    _compile_streaming(compiled, compile_backend, "default")
    run(f"compiled fp32 ({compile_backend})", compiled, None, warmup=8)
    if device.type == "cuda":
        run(f"compiled bf16 ({compile_backend})", compiled, "bf16", warmup=8)
        graphed = copy.deepcopy(net)
        _compile_streaming(graphed, compile_backend, "reduce-overhead")
        run("CUDA graphs bf16 (reduce-overhead)", graphed, "bf16", warmup=8, graphs=True)
    else:
        result["variants"]["CUDA graphs (reduce-overhead)"] = {"status": "skipped: needs CUDA"}
    _bench_onnx(net.cpu(), indicator.cpu(), size, frames, device, result, out)
    return result


def _bench_onnx(net, indicator, size, frames, device, result: dict, out: Path | None) -> None:
    """ONNX Runtime streaming of ``fedst.export``'s graph: on a GPU with its CUDA provider only
    (the CPU provider there would time the 16 host cores, not the card); on the CPU with the CPU
    provider."""
    name = "ONNX Runtime"
    try:
        import numpy as np
        import onnxruntime as ort

        from fedst.export import OnnxStreamer, export_onnx

        available = ort.get_available_providers()
        if device.type == "cuda" and "CUDAExecutionProvider" not in available:
            result["variants"][name] = {
                "status": f"skipped: this onnxruntime has no CUDAExecutionProvider ({available})"
            }
            write_json(out, result)
            return
        provider = "CUDAExecutionProvider" if device.type == "cuda" else "CPUExecutionProvider"
        name = f"ONNX Runtime {provider}"
        with tempfile.TemporaryDirectory() as tmp:
            path = export_onnx(net, indicator, size, 0.2, Path(tmp) / "fedst.onnx")
            streamer = OnnxStreamer(path)
            # OnnxStreamer builds a CPU session; the same graph on the chosen provider
            streamer.session = ort.InferenceSession(str(path), providers=[provider])
            frame = np.random.default_rng(0).standard_normal((1, 3, *size), dtype=np.float32)
            times = []
            for index in range(4 + frames):
                begin = time.perf_counter()
                streamer.step(frame, index / 25.0)
                times.append(time.perf_counter() - begin)
        result["variants"][name] = {
            "status": "ok",
            **frame_time_summary(times[4:]),
            "providers_available": available,
        }
    except Exception as err:
        result["variants"][name] = {"status": f"failed: {type(err).__name__}: {err}"}
    write_json(out, result)
