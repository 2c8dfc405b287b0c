"""The process's device: ``train.device`` resolved (:func:`resolve_device`), its process-wide
CUDA settings (TF32, cuDNN autotuning, deterministic algorithms) and the facts read back for the
run log (:class:`DeviceFacts`)."""

from __future__ import annotations

import logging
import os
import platform
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

from fedst.accel.precision import Precision
from fedst.config import ConfigError
from fedst.schema.accel import check_device_name

log = logging.getLogger("fedst.accel")

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
    (``device`` for fedst.infer), named in the fix; a name other than auto, cpu, cuda or cuda:N
    is a ConfigError too (fedst.schema.accel.check_device_name)."""
    check_device_name(key, name)
    if name == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        if require_gpu:
            raise ConfigError(
                f"{key}=auto found no CUDA device (torch {torch.__version__}, CUDA build "
                f"{torch.version.cuda}: {cuda_unavailable_reason()}); experiment={experiment} is "
                f"sized for a GPU (train.require_gpu=true): fix the driver/install, or pass "
                f"{key}=cpu to run it on the CPU anyway"
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
