"""How a training or evaluation step uses the device: mixed precision, TF32, cuDNN autotuning,
fused optimizers, optional ``torch.compile``, and losses kept on the device between host syncs.

The config fields (``train.amp_dtype``, ``train.compile``, ``train.tf32``,
``train.cudnn_benchmark``, ``train.deterministic``; fedst/experiment/sections.py TrainConfig) are read
once where a site or the server sets up; everything below takes plain arguments. On the CPU every
choice here is a no-op (fp32, no scaler, unfused optimizers), so CPU results do not depend on these
settings. :func:`device_facts` reads back what a process really uses (device, card, autocast dtype,
TF32, cuDNN autotuning, deterministic algorithms, compile) for its start-of-run log line and the
run's ``device.jsonl``; :class:`PhasePeaks` and :func:`memory_usage` report resident and GPU memory.

A site step with these helpers (the shape of fedst/federation/site.py and serq.py)::

    configure_device(device, tf32=cfg.tf32, cudnn_benchmark=cfg.cudnn_benchmark,
                     deterministic=cfg.deterministic)  # once
    precision = resolve_precision(cfg.amp_dtype, device)
    scaler = precision.grad_scaler()          # None unless fp16
    optimizer = torch.optim.AdamW(params, lr, weight_decay=wd, **fused_optimizer_options(device))
    losses = LossLog()
    for ...:
        with precision.autocast():
            loss = loss_fn(model(clips).float(), masks)
        optimizer_step(loss, optimizer, scaler, model.parameters(), max_grad_norm)
        losses.append(loss)                  # no .item(): stays on the device
    values = losses.values()                 # one host sync per phase
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import platform
import resource
import sys
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar, cast

import torch
from torch import nn

from fedst.config import ConfigError

__all__ = [
    "AMP_DTYPES",
    "COMPILE_MODES",
    "CUBLAS_WORKSPACE",
    "CUDA_GRAPH_MODES",
    "NATIVE_BF16_CAPABILITY",
    "REPLY_MEMORY_KEYS",
    "DeviceFacts",
    "LossLog",
    "PhasePeaks",
    "Precision",
    "begin_step",
    "clips_channels_last",
    "compile_mode",
    "configure_device",
    "cuda_unavailable_reason",
    "device_facts",
    "device_name",
    "first_non_finite",
    "fused_optimizer_options",
    "kept",
    "match_parameter_layouts",
    "maybe_compile",
    "memory_usage",
    "native_bf16",
    "optimizer_step",
    "resolve_precision",
    "set_tf32",
    "use_channels_last",
    "uses_cuda_graphs",
]

log = logging.getLogger(__name__)

AMP_DTYPES = ("auto", "bf16", "fp16", "none")
"""Values of ``train.amp_dtype``: auto (bf16 where the GPU supports it, else fp16) | bf16 | fp16
(with a GradScaler) | none (fp32)."""

_AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class Precision:
    """The resolved mixed precision of one device: autocast dtype (None: fp32) and whether the
    gradients need loss scaling (fp16 only: its 5-bit exponent underflows small gradients)."""

    device_type: str
    dtype: torch.dtype | None = None

    @property
    def enabled(self) -> bool:
        return self.dtype is not None

    @property
    def needs_scaler(self) -> bool:
        return self.dtype == torch.float16

    def autocast(self) -> contextlib.AbstractContextManager:
        """``torch.autocast`` at this dtype; a no-op context in fp32."""
        if self.dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device_type, dtype=self.dtype)

    def grad_scaler(self) -> torch.amp.GradScaler | None:
        """A fresh GradScaler for fp16, else None (bf16 and fp32 need no loss scaling)."""
        return torch.amp.GradScaler(self.device_type) if self.needs_scaler else None


def resolve_precision(
    amp_dtype: str, device: torch.device, bf16_supported: bool | None = None
) -> Precision:
    """``train.amp_dtype`` on ``device`` -> :class:`Precision`.

    Mixed precision runs on CUDA only: on any other device every setting gives fp32 (as before
    ``amp_dtype`` existed, when ``train.amp`` was "ignored on CPU"). ``auto`` picks bf16 where the
    GPU computes it natively (:func:`native_bf16`: Ampere and later), else fp16 with a GradScaler:
    never bf16 emulated in fp32 on an older card (``torch.cuda.is_bf16_supported()``'s default
    counts emulation, which runs fp32 kernels and saves nothing). ``bf16_supported`` overrides the
    query of the GPU (tests).
    """
    if amp_dtype not in AMP_DTYPES:
        raise ValueError(f"train.amp_dtype={amp_dtype!r}; choose one of {AMP_DTYPES}")
    if device.type != "cuda" or amp_dtype == "none":
        return Precision(device.type)
    if amp_dtype == "auto":
        if bf16_supported is None:
            bf16_supported = native_bf16(device)
        amp_dtype = "bf16" if bf16_supported else "fp16"
    return Precision(device.type, _AUTOCAST_DTYPES[amp_dtype])


NATIVE_BF16_CAPABILITY = 8
"""CUDA compute capability (major) from which bf16 (and TF32) run on tensor cores: Ampere."""


def native_bf16(device: torch.device) -> bool:
    """Whether ``device`` (a CUDA device) computes bf16 natively: compute capability >= 8.0
    (Ampere and later) or a ROCm GPU; what ``torch.cuda.is_bf16_supported(including_emulation=
    False)`` answers, asked of ``device`` itself rather than of the current device."""
    if torch.version.hip:
        return True
    major, _ = torch.cuda.get_device_capability(device)
    return major >= NATIVE_BF16_CAPABILITY


CUBLAS_WORKSPACE = ":4096:8"
"""``CUBLAS_WORKSPACE_CONFIG`` that deterministic runs need on CUDA >= 10.2: cuBLAS then keeps
fixed workspaces, so its results do not depend on which stream ran first (PyTorch's
"Reproducibility" notes); read when cuBLAS creates its handle, i.e. before the first matmul."""


def configure_device(
    device: torch.device, *, tf32: bool, cudnn_benchmark: bool, deterministic: bool = False
) -> None:
    """Process-wide CUDA settings (call once where the process picks its device; no-op elsewhere).

    ``tf32``: fp32 matmuls and convolutions on TF32 tensor cores (Ampere and later; 10-bit
    mantissa products, fp32 accumulation), set through both of PyTorch's switches
    (:func:`set_tf32`). ``cudnn_benchmark``: cuDNN times its convolution algorithms for each new
    input shape and keeps the fastest (our shapes are fixed per run). ``deterministic``:
    ``torch.use_deterministic_algorithms(True, warn_only=True)`` (an op without a deterministic
    CUDA kernel warns, it does not stop the run), cuDNN's deterministic algorithms without
    autotuning (``cudnn_benchmark`` is then off), and ``CUBLAS_WORKSPACE_CONFIG`` =
    :data:`CUBLAS_WORKSPACE` where the environment does not set it. False switches deterministic
    algorithms off again (the config decides). The CPU kernels a run uses are deterministic at a
    fixed thread count, so on the CPU nothing is set.
    """
    if device.type != "cuda":
        return
    set_tf32(tf32)
    if deterministic:
        if "CUBLAS_WORKSPACE_CONFIG" not in os.environ:
            if torch.cuda.is_initialized():
                log.warning(
                    "train.deterministic: CUDA was initialised before CUBLAS_WORKSPACE_CONFIG "
                    "was set; a cuBLAS handle made earlier keeps its workspace. To be sure, "
                    "start the process with CUBLAS_WORKSPACE_CONFIG=%s",
                    CUBLAS_WORKSPACE,
                )
            os.environ["CUBLAS_WORKSPACE_CONFIG"] = CUBLAS_WORKSPACE
        if cudnn_benchmark:
            log.info("train.deterministic: cudnn.benchmark off (autotuning picks per run)")
    torch.use_deterministic_algorithms(deterministic, warn_only=True)
    torch.backends.cudnn.deterministic = deterministic
    torch.backends.cudnn.benchmark = cudnn_benchmark and not deterministic


def set_tf32(enabled: bool) -> None:
    """TF32 for fp32 CUDA matmuls, convolutions and RNNs, on or off, through both of PyTorch's
    switches so that reading either gives the same answer.

    PyTorch >= 2.9 keeps a legacy state (``torch.backends.cuda.matmul.allow_tf32``,
    ``torch.backends.cudnn.allow_tf32``, ``torch.get_float32_matmul_precision()``) beside the
    per-backend ``fp32_precision`` one, and raises when the legacy state is read after only the
    new one was set (torch 2.14: "you have used mix of the legacy and new APIs"). The legacy
    setters also write the new state; setting them first and the new values after leaves both
    equal: matmul tf32 / "high" with TF32, ieee / "highest" without. oneDNN's (CPU) matmul
    precision is not touched, as ``torch.set_float32_matmul_precision`` would."""
    precision = "tf32" if enabled else "ieee"
    torch.backends.cuda.matmul.allow_tf32 = enabled
    torch.backends.cudnn.allow_tf32 = enabled
    torch.backends.cuda.matmul.fp32_precision = precision
    torch.backends.cudnn.conv.fp32_precision = precision
    torch.backends.cudnn.rnn.fp32_precision = precision


@dataclass(frozen=True)
class DeviceFacts:
    """What one process really computes with, read back after it set its device up (what the
    run logs at its start and writes to ``<run>/device.jsonl``). Fields that do not apply to
    the device (TF32, cuDNN on a CPU) are None."""

    device: str
    """The resolved torch device (e.g. "cuda:0", "cpu")."""
    card: str
    """The GPU's name (``torch.cuda.get_device_name``), or the CPU's model name."""
    autocast_dtype: str
    """bf16 | fp16 (with a GradScaler) | fp32 (no autocast)."""
    deterministic: bool
    """Deterministic algorithms on (``torch.are_deterministic_algorithms_enabled()``)."""
    compile: str
    """``train.compile`` as configured (what is compiled: fedst.accel.maybe_compile)."""
    torch_version: str
    cuda_build: str | None
    """The CUDA version torch was built with (None: a CPU-only build)."""
    threads: int
    """Intra-op CPU threads (``torch.get_num_threads()``)."""
    capability: str | None = None
    """CUDA compute capability, e.g. "9.0"."""
    tf32_matmul: str | None = None
    """fp32 matmul precision on CUDA: tf32 | ieee (``torch.backends.cuda.matmul``)."""
    tf32_conv: str | None = None
    """fp32 convolution precision in cuDNN: tf32 | ieee."""
    cudnn_benchmark: bool | None = None
    cuda_unavailable: str | None = None
    """Why no CUDA device is visible, on a CPU run (:func:`cuda_unavailable_reason`)."""

    def line(self) -> str:
        """The facts in one log line."""
        if self.device.startswith("cuda"):
            backend = (
                f"compute {self.capability}, TF32 matmul {self.tf32_matmul} conv {self.tf32_conv}, "
                f"cudnn.benchmark={self.cudnn_benchmark}"
            )
        else:
            backend = f"{self.threads} threads, no CUDA: {self.cuda_unavailable}"
        return (
            f"device {self.device} ({self.card}; {backend}), autocast {self.autocast_dtype}, "
            f"deterministic={self.deterministic}, compile={self.compile}; torch "
            f"{self.torch_version} (CUDA build {self.cuda_build})"
        )


def device_facts(device: torch.device, precision: Precision, compile: object) -> DeviceFacts:
    """:class:`DeviceFacts` of this process on ``device`` (after :func:`configure_device`);
    ``precision`` is its resolved mixed precision, ``compile`` the configured ``train.compile``."""
    dtype = {torch.bfloat16: "bf16", torch.float16: "fp16", None: "fp32"}[precision.dtype]
    facts = {
        "device": str(device),
        "card": device_name(device),
        "autocast_dtype": dtype,
        "deterministic": torch.are_deterministic_algorithms_enabled(),
        "compile": str(compile),
        "torch_version": torch.__version__,
        "cuda_build": torch.version.cuda,
        "threads": torch.get_num_threads(),
    }
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        facts.update(
            capability=f"{major}.{minor}",
            tf32_matmul=torch.backends.cuda.matmul.fp32_precision,
            tf32_conv=torch.backends.cudnn.conv.fp32_precision,
            cudnn_benchmark=torch.backends.cudnn.benchmark,
        )
    else:
        facts["cuda_unavailable"] = cuda_unavailable_reason()
    return DeviceFacts(**facts)


def resolve_device(
    name: str, require_gpu: bool = False, experiment: str = "", key: str = "train.device"
) -> torch.device:
    """``train.device`` -> the torch device: ``auto`` -> the first CUDA device when available,
    else the CPU, unless ``require_gpu`` (``train.require_gpu``: the config named ``experiment``
    is sized for a GPU), which makes a CPU fallback a ConfigError with the reason and the fix;
    ``cuda``/``cuda:N`` where CUDA is unavailable is an error. ``key``: the option the user set
    (``device`` for fedst.infer), named in the fix."""
    if name == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        if require_gpu:
            raise ConfigError(
                f"train.device=auto found no CUDA device (torch {torch.__version__}, CUDA build "
                f"{torch.version.cuda}: {cuda_unavailable_reason()}); experiment={experiment} is "
                f"sized for a GPU (train.require_gpu=true): fix the driver/install, or pass "
                f"train.device=cpu to run it on the CPU anyway"
            )
        return torch.device("cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(
            f"{key}={name!r} but CUDA is not available ({cuda_unavailable_reason()}); "
            f"use {key}=auto or {key}=cpu"
        )
    return device


def cuda_unavailable_reason() -> str:
    """Why ``torch.cuda.is_available()`` is False, in words (for an error or a log line): a
    CPU-only torch build, ``CUDA_VISIBLE_DEVICES`` hiding every GPU (e.g. a Ray actor given no
    GPU), or the CUDA initialisation warning PyTorch gives (e.g. a driver too old for the
    wheel). "CUDA is available" when it is."""
    if torch.version.cuda is None and not torch.version.hip:
        return "this torch is a CPU-only build"
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and visible.strip() in ("", "-1"):
        return f"CUDA_VISIBLE_DEVICES={visible!r} hides every GPU"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        available = torch.cuda.is_available()
    if available:
        return "CUDA is available"
    for warning in caught:
        text = str(warning.message).strip()
        if "CUDA" in text or "driver" in text.lower():
            return text.splitlines()[0]
    return "no CUDA device found (is the NVIDIA driver loaded? nvidia-smi lists the GPUs)"


def fused_optimizer_options(device: torch.device) -> dict[str, bool]:
    """Keyword arguments of ``torch.optim.Adam`` / ``AdamW`` for ``device``: the fused CUDA
    kernel (one launch for every parameter) on CUDA, the default implementation elsewhere."""
    return {"fused": True} if device.type == "cuda" else {}


COMPILE_MODES = ("none", "default", "reduce-overhead", "max-autotune")
"""Values of ``train.compile`` (``torch.compile``'s modes): none (eager) | default (Inductor's
fused kernels) | reduce-overhead (Inductor with CUDA graphs: a captured step replays with one
launch) | max-autotune (autotuned kernels, CUDA graphs; minutes of tuning at the first steps)."""

CUDA_GRAPH_MODES = ("reduce-overhead", "max-autotune")
"""The modes of :data:`COMPILE_MODES` that capture CUDA graphs (on a CUDA device)."""

_Step = TypeVar("_Step", bound=Callable[..., Any])


def compile_mode(value: str | bool) -> str:
    """``train.compile`` as a mode of :data:`COMPILE_MODES`; the former boolean reads true as
    "default" (what ``model.compile()`` did) and false as "none"."""
    if isinstance(value, bool):
        return "default" if value else "none"
    if value not in COMPILE_MODES:
        raise ValueError(f"train.compile={value!r}; choose one of {COMPILE_MODES} (or true/false)")
    return value


def maybe_compile(step: _Step, mode: str) -> _Step:
    """``step`` compiled with ``torch.compile(mode=mode)`` (``train.compile``), or ``step``
    itself when ``mode`` is "none".

    ``step`` is a training step's function (forward and loss: fedst/federation/site.py, SERQ's
    passes in fedst/methods/serq.py), so the model itself stays eager for evaluation and
    export. An ``nn.Module`` is compiled in place (``nn.Module.compile``) and returned: the
    wrapper ``torch.compile(module)`` returns would prefix every state-dict key with
    ``_orig_mod.``, which the partition rules and checkpoints would not match. With a mode of
    :data:`CUDA_GRAPH_MODES` on CUDA, a step's outputs are overwritten by its next replay: keep
    them with :func:`kept` and begin each step with :func:`begin_step`.
    """
    mode = compile_mode(mode)
    if mode == "none":
        return step
    name = type(step).__name__ if isinstance(step, nn.Module) else step.__qualname__
    log.info("torch.compile(mode=%s): %s (first steps are slower while it traces)", mode, name)
    if isinstance(step, nn.Module):
        step.compile(mode=mode)
        return step
    return cast(_Step, torch.compile(step, mode=mode))


def uses_cuda_graphs(mode: str, device: torch.device) -> bool:
    """Whether steps compiled with ``mode`` replay CUDA graphs on ``device``."""
    return device.type == "cuda" and compile_mode(mode) in CUDA_GRAPH_MODES


def begin_step(cuda_graphs: bool) -> None:
    """Mark the start of a training iteration for CUDA graphs (the previous iteration's graph
    outputs may then be overwritten); a no-op without them."""
    if cuda_graphs:
        torch.compiler.cudagraph_mark_step_begin()


def kept(value: torch.Tensor, cuda_graphs: bool) -> torch.Tensor:
    """``value`` detached, as a tensor that outlives the step: a copy where it is a CUDA
    graph's output (its memory is reused by the next replay), else ``value.detach()``."""
    return value.detach().clone() if cuda_graphs else value.detach()


def use_channels_last(model: nn.Module, device: torch.device, enabled: bool) -> bool:
    """``train.channels_last``: on a CUDA device, the model's 4-D parameters and buffers in
    ``torch.channels_last`` (in place; values and state-dict keys unchanged), so cuDNN runs
    its convolutions in NHWC without converting layouts. Returns whether it is on.

    A no-op on the CPU (logged): CPU runs keep today's NCHW kernels, so their results do not
    depend on this switch. Feed the model :func:`clips_channels_last`'s clips.
    """
    if not enabled:
        return False
    if device.type != "cuda":
        log.info("train.channels_last: ignored on %s (CUDA only; the CPU keeps NCHW)", device)
        return False
    model.to(memory_format=torch.channels_last)
    return True


def match_parameter_layouts(optimizer: torch.optim.Optimizer) -> None:
    """Give every optimizer state tensor shaped like its parameter the parameter's memory
    layout (in place), e.g. Adam's moments loaded from a checkpoint of a run without
    ``train.channels_last``: fused kernels read a parameter and its states as flat arrays."""
    for group in optimizer.param_groups:
        for parameter in group["params"]:
            state = optimizer.state.get(parameter, {})
            for key, value in state.items():
                if (
                    isinstance(value, torch.Tensor)
                    and value.shape == parameter.shape
                    and value.stride() != parameter.stride()
                ):
                    state[key] = torch.empty_like(parameter, dtype=value.dtype).copy_(value)


def clips_channels_last(clips: torch.Tensor) -> torch.Tensor:
    """clips [B, T, 3, H, W] -> the same values with every frame [3, H, W] in channels-last
    order (strides of a dense [B*T, 3, H, W] channels_last tensor; one copy)."""
    frames = clips.flatten(0, 1).contiguous(memory_format=torch.channels_last)  # [B*T, 3, H, W]
    return frames.unflatten(0, clips.shape[:2])


def optimizer_step(
    loss: torch.Tensor,
    optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer],
    scaler: torch.amp.GradScaler | None,
    parameters: Iterable[torch.nn.Parameter],
    max_grad_norm: float | None = None,
) -> None:
    """Backward pass and one optimizer step, without a host sync (clipping included).

    With a ``scaler`` (fp16) the loss is scaled, the gradients unscaled before clipping, and a
    step with non-finite gradients is skipped by the scaler (which then lowers its scale).

    ``optimizer`` may be several optimizers of one loss (SERQ's EQ step: v_pre's Adam and D_sy's
    SGD): each is zeroed, then stepped once in order after the one backward pass; one scaler
    serves them all and updates its scale once (PyTorch AMP, "multiple optimizers").
    """
    optimizers = [optimizer] if isinstance(optimizer, torch.optim.Optimizer) else list(optimizer)
    for each in optimizers:
        each.zero_grad(set_to_none=True)
    if scaler is None:
        loss.backward()
    else:
        scaler.scale(loss).backward()
    if max_grad_norm is not None:
        if scaler is not None:
            for each in optimizers:
                scaler.unscale_(each)
        torch.nn.utils.clip_grad_norm_(list(parameters), max_grad_norm)
    for each in optimizers:
        if scaler is None:
            each.step()
        else:
            scaler.step(each)
    if scaler is not None:
        scaler.update()


class LossLog:
    """Per-iteration losses kept on the device; :meth:`values` copies them to the host at once.

    ``loss.item()`` every iteration makes the host wait for the GPU each step; a launch-bound
    network (PVTv2-b0) then idles the GPU between steps. Checking finiteness on the collected
    values at the end of a phase stops a diverged run one phase later than a per-step check, but
    before anything is saved (a site saves after its phases), so the same checkpoint is kept.
    """

    def __init__(self) -> None:
        self._losses: list[torch.Tensor] = []

    def __len__(self) -> int:
        return len(self._losses)

    def append(self, loss: torch.Tensor) -> None:
        """Record a scalar loss (detached; no host sync)."""
        self._losses.append(loss.detach().float().reshape(()))

    def values(self) -> list[float]:
        """Every recorded loss as Python floats (one device-to-host copy)."""
        if not self._losses:
            return []
        return torch.stack(self._losses).cpu().tolist()


def first_non_finite(values: Sequence[float]) -> int | None:
    """Index of the first NaN or infinite value in ``values`` (None: all finite)."""
    return next((i for i, v in enumerate(values) if not math.isfinite(v)), None)


_PEAK_BEFORE_RESETS = 0
"""The process's resident high-water mark as it stood at the latest :class:`PhasePeaks` reset
(resetting the kernel's mark also resets ``ru_maxrss``, so the whole-run peak is kept here)."""

_CUDA_PEAKS_BEFORE_RESETS = [0, 0]
"""The current CUDA device's peak allocated and reserved bytes as they stood at the latest
:class:`PhasePeaks` reset (``torch.cuda.reset_peak_memory_stats`` forgets them)."""


class _PhaseMarks:
    """The high-water marks of one phase in progress: resident bytes (None: not measured) and
    the CUDA device's peak allocated / reserved bytes (None: CUDA not in use)."""

    def __init__(self, rss: bool) -> None:
        self.rss: int | None = 0 if rss else None
        self.cuda: list[int] | None = None

    def credit(self, rss: int | None, cuda: tuple[int, int] | None) -> None:
        if self.rss is not None and rss is not None:
            self.rss = max(self.rss, rss)
        if cuda is not None:
            self.cuda = [max(a, b) for a, b in zip(self.cuda or (0, 0), cuda, strict=True)]


_OPEN_PHASES: list[_PhaseMarks] = []
"""Phases in progress in this process, outermost first. A phase nested in another (in the
in-process engine a site's round runs inside the server's "train" phase) resets the marks; the
marks are credited to every open phase first, so the outer phase's figure still covers it."""


def _cuda_peaks() -> tuple[int, int] | None:
    """(peak allocated, peak reserved) bytes of the current CUDA device since its last reset;
    None where this process has not initialised CUDA (a CPU run: no figure, never zero)."""
    if not torch.cuda.is_initialized():
        return None
    return torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved()


def _credit_open_phases() -> tuple[int | None, tuple[int, int] | None]:
    """Credit the current marks to every open phase and to the whole-run marks; returns them."""
    global _PEAK_BEFORE_RESETS
    rss, cuda = _kernel_peak_rss(), _cuda_peaks()
    for marks in _OPEN_PHASES:
        marks.credit(rss, cuda)
    if cuda is not None:
        _CUDA_PEAKS_BEFORE_RESETS[:] = [
            max(a, b) for a, b in zip(_CUDA_PEAKS_BEFORE_RESETS, cuda, strict=True)
        ]
    return rss, cuda


def _kernel_peak_rss() -> int | None:
    """VmHWM of /proc/self/status in bytes (the resident high-water mark), None off Linux."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024  # kB
    except (OSError, ValueError, IndexError):
        pass
    return None


def _reset_kernel_peak_rss() -> bool:
    """Lower the kernel's high-water mark to the resident size now (``echo 5 >
    /proc/self/clear_refs``, Linux >= 4.0), keeping the old mark in :data:`_PEAK_BEFORE_RESETS`.
    False when the kernel does not allow it."""
    global _PEAK_BEFORE_RESETS
    before = _kernel_peak_rss()
    if before is None:
        return False
    try:
        with open("/proc/self/clear_refs", "w") as clear_refs:
            clear_refs.write("5")
    except OSError:
        return False
    _PEAK_BEFORE_RESETS = max(_PEAK_BEFORE_RESETS, before)
    return True


REPLY_MEMORY_KEYS = {
    "cuda-peak-allocated-bytes": "cuda_peak_allocated_bytes",
    "cuda-peak-reserved-bytes": "cuda_peak_reserved_bytes",
}
"""A site's GPU memory in its train reply (:meth:`PhasePeaks.reply_metrics`) -> its train.jsonl
field. Absent from a reply (and the row) where the site computes on the CPU."""


class PhasePeaks:
    """The peak memory of each phase of a round, for the run log:
    ``with peaks.phase("train"): ...`` then ``peaks.row()`` ->
    ``{"train_peak_rss_bytes": ..., "train_cuda_peak_allocated_bytes": ...,
    "train_cuda_peak_reserved_bytes": ...}``.

    Resident memory (``rss``): each phase lowers the kernel's high-water mark to the resident
    size at its start and reads it at its end, so a phase's figure is the most this process held
    during that phase (in the in-process engine the sites live in this process too: the whole
    job's). Off Linux, or where the kernel refuses the reset, there is no such figure rather than
    a wrong one. GPU memory: the current CUDA device's peak allocated (tensors) and reserved
    (PyTorch's caching allocator: what the device lends the process) bytes, reset at each phase's
    start (``torch.cuda.reset_peak_memory_stats``); absent where the process has not initialised
    CUDA. Phases may nest (in-process, a site's round inside the server's "train")."""

    def __init__(self, rss: bool = True) -> None:
        self.rss = rss
        self.peaks: dict[str, int] = {}
        self.cuda: dict[str, tuple[int, int]] = {}

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        _credit_open_phases()  # before the resets: the enclosing phases keep what they saw
        measured = self.rss and _reset_kernel_peak_rss()
        if torch.cuda.is_initialized():
            torch.cuda.reset_peak_memory_stats()
        marks = _PhaseMarks(rss=measured)
        _OPEN_PHASES.append(marks)
        try:
            yield
        finally:
            _credit_open_phases()
            _OPEN_PHASES.remove(marks)
            if marks.rss is not None:
                self.peaks[name] = max(self.peaks.get(name, 0), marks.rss)
            if marks.cuda is not None:
                allocated, reserved = self.cuda.get(name, (0, 0))
                self.cuda[name] = (max(allocated, marks.cuda[0]), max(reserved, marks.cuda[1]))

    def row(self) -> dict[str, int]:
        """Every phase's figures as run-log fields (a phase without one has no field)."""
        row = {f"{name}_peak_rss_bytes": peak for name, peak in self.peaks.items()}
        for name, (allocated, reserved) in self.cuda.items():
            row[f"{name}_cuda_peak_allocated_bytes"] = allocated
            row[f"{name}_cuda_peak_reserved_bytes"] = reserved
        return row

    def reply_metrics(self, name: str) -> dict[str, int]:
        """Phase ``name``'s GPU peaks as a site's reply metrics (:data:`REPLY_MEMORY_KEYS`);
        empty without CUDA."""
        if name not in self.cuda:
            return {}
        return dict(zip(REPLY_MEMORY_KEYS, self.cuda[name], strict=True))


def _resident_bytes() -> int | None:
    """This process's resident size now (/proc/self/statm; None off Linux)."""
    try:  # /proc/self/statm: pages of [size, resident, ...]
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def memory_usage() -> dict[str, int]:
    """This process's memory for the run log: ``rss_bytes`` (resident now, Linux only),
    ``peak_rss_bytes`` (the most it has held so far) and, where it has initialised CUDA, the
    current device's ``cuda_allocated_bytes`` / ``cuda_reserved_bytes`` (now) and
    ``cuda_peak_bytes`` / ``cuda_peak_reserved_bytes`` (the most allocated to tensors / reserved
    by the caching allocator so far); the CUDA fields are absent on a CPU run, never zero. In the
    in-process engine the sites live in this process too, so these are the whole job's figures."""
    usage: dict[str, int] = {}
    resident = _resident_bytes()
    if resident is not None:
        usage["rss_bytes"] = resident
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    peak = peak if sys.platform == "darwin" else peak * 1024
    peak = max(peak, _PEAK_BEFORE_RESETS)  # PhasePeaks' resets lower ru_maxrss too
    # the kernel updates its high-water mark lazily: it can lag the resident size just read
    usage["peak_rss_bytes"] = max(peak, usage.get("rss_bytes", 0))
    _, cuda = _credit_open_phases()
    if cuda is not None:
        usage["cuda_allocated_bytes"] = torch.cuda.memory_allocated()
        usage["cuda_reserved_bytes"] = torch.cuda.memory_reserved()
        usage["cuda_peak_bytes"], usage["cuda_peak_reserved_bytes"] = _CUDA_PEAKS_BEFORE_RESETS
    return usage


_LIBC_MALLOC_TRIM = None
"""glibc's ``malloc_trim`` (None until first looked up; False where there is none)."""


def release_free_memory() -> int | None:
    """Give the heap's free pages back to the operating system (glibc ``malloc_trim(0)``);
    returns how many bytes of resident memory that released, or None where it cannot be done
    (not glibc, or no /proc/self/statm).

    Why: a training step at 512x640 (PVTv2-b0, 2 clips x 4 frames) allocates and frees about 3 GB
    of activations on the CPU. glibc keeps most of those freed pages in its heap, since tensors
    above its (dynamic, up to 32 MB) mmap threshold are not unmapped when freed. So the process
    stays at about 2.5 GB between steps where 0.9 GB is live. In the in-process engine four
    sites, the SERQ step and evaluation leave their arenas behind one after another. Called
    where a site's work for a message ends and after the server step (fedst/app), it changes no
    result, only the resident memory between phases (docs/paper-scale.md)."""
    global _LIBC_MALLOC_TRIM
    if _LIBC_MALLOC_TRIM is None:
        _LIBC_MALLOC_TRIM = False
        if sys.platform.startswith("linux"):
            try:
                import ctypes

                _LIBC_MALLOC_TRIM = ctypes.CDLL("libc.so.6").malloc_trim
            except (OSError, AttributeError):  # musl and others: no malloc_trim
                pass
    before = _resident_bytes()
    if not _LIBC_MALLOC_TRIM or before is None:
        return None
    _LIBC_MALLOC_TRIM(0)
    return max(0, before - (_resident_bytes() or before))


def device_name(device: torch.device) -> str:
    """The GPU's name, or the CPU's model name (/proc/cpuinfo) for a CPU device: what a
    benchmark prints beside its times."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown CPU"
