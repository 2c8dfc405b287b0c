"""How a training or evaluation step uses the device: mixed precision, TF32, cuDNN autotuning,
fused optimizers, optional ``torch.compile``, and losses kept on the device between host syncs.

The config fields (``train.amp_dtype``, ``train.compile``, ``train.tf32``,
``train.cudnn_benchmark``; fedst/experiment/config.py TrainConfig) are read once where a site or the
server sets up; everything below takes plain arguments. On the CPU every choice here is a no-op
(fp32, no scaler, unfused optimizers), so CPU results do not depend on these settings.

A site step with these helpers (the shape of fedst/federation/site.py and serq.py)::

    configure_device(device, tf32=cfg.tf32, cudnn_benchmark=cfg.cudnn_benchmark)  # once
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
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

__all__ = [
    "AMP_DTYPES",
    "LossLog",
    "Precision",
    "configure_device",
    "device_name",
    "first_non_finite",
    "fused_optimizer_options",
    "maybe_compile",
    "memory_usage",
    "optimizer_step",
    "resolve_precision",
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
    ``amp_dtype`` existed, when ``train.amp`` was "ignored on CPU"). ``auto`` picks bf16 when the
    GPU supports it (Ampere and later), else fp16 with a GradScaler. ``bf16_supported`` overrides
    the query of the GPU (tests).
    """
    if amp_dtype not in AMP_DTYPES:
        raise ValueError(f"train.amp_dtype={amp_dtype!r}; choose one of {AMP_DTYPES}")
    if device.type != "cuda" or amp_dtype == "none":
        return Precision(device.type)
    if amp_dtype == "auto":
        if bf16_supported is None:
            bf16_supported = torch.cuda.is_bf16_supported()
        amp_dtype = "bf16" if bf16_supported else "fp16"
    return Precision(device.type, _AUTOCAST_DTYPES[amp_dtype])


def configure_device(device: torch.device, *, tf32: bool, cudnn_benchmark: bool) -> None:
    """Process-wide CUDA settings (call once where the process picks its device; no-op elsewhere).

    ``tf32``: fp32 matmuls and convolutions on TF32 tensor cores (Ampere and later; 10-bit
    mantissa products, fp32 accumulation). ``cudnn_benchmark``: cuDNN times its convolution
    algorithms for each new input shape and keeps the fastest (our shapes are fixed per run).
    """
    if device.type != "cuda":
        return
    precision = "tf32" if tf32 else "ieee"
    torch.backends.cuda.matmul.fp32_precision = precision
    torch.backends.cudnn.conv.fp32_precision = precision
    torch.backends.cudnn.benchmark = cudnn_benchmark
    log.info("CUDA: fp32 matmul/conv precision %s, cudnn.benchmark=%s", precision, cudnn_benchmark)


def fused_optimizer_options(device: torch.device) -> dict[str, bool]:
    """Keyword arguments of ``torch.optim.Adam`` / ``AdamW`` for ``device``: the fused CUDA
    kernel (one launch for every parameter) on CUDA, the default implementation elsewhere."""
    return {"fused": True} if device.type == "cuda" else {}


def maybe_compile(model: nn.Module, enabled: bool) -> nn.Module:
    """``model.compile()`` in place when ``enabled`` (``train.compile``); returns ``model``.

    In place (``nn.Module.compile``), not ``torch.compile(model)``: the wrapper the latter returns
    prefixes every state-dict key with ``_orig_mod.``, which the partition rules and checkpoints
    would not match. Only ``model(...)`` (training's forward) is compiled; streaming evaluation
    calls the submodules directly and stays eager.
    """
    if enabled:
        model.compile()
        log.info(
            "torch.compile: %s compiled (first steps are slower while it traces)",
            type(model).__name__,
        )
    return model


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
"""The process's high-water mark as it stood at the latest :class:`PhasePeaks` reset (resetting
the kernel's mark also resets ``ru_maxrss``, so the whole-run peak is kept here)."""


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


class PhasePeaks:
    """The peak resident memory of each phase of a round, for the run log:
    ``with peaks.phase("train"): ...`` then ``peaks.row()`` -> ``{"train_peak_rss_bytes": ...}``.

    Each phase lowers the kernel's high-water mark to the resident size at its start and reads it
    at its end, so a phase's figure is the most this process held during that phase (in the
    in-process engine the sites live in this process too: the whole job's). Off Linux, or where
    the kernel refuses the reset, :meth:`row` is empty: no figure rather than a wrong one."""

    def __init__(self) -> None:
        self.peaks: dict[str, int] = {}

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        measured = _reset_kernel_peak_rss()
        try:
            yield
        finally:
            peak = _kernel_peak_rss() if measured else None
            if peak is not None:
                self.peaks[name] = max(self.peaks.get(name, 0), peak)

    def row(self) -> dict[str, int]:
        return {f"{name}_peak_rss_bytes": peak for name, peak in self.peaks.items()}


def _resident_bytes() -> int | None:
    """This process's resident size now (/proc/self/statm; None off Linux)."""
    try:  # /proc/self/statm: pages of [size, resident, ...]
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def memory_usage() -> dict[str, int]:
    """This process's memory for the run log: ``rss_bytes`` (resident now, Linux only),
    ``peak_rss_bytes`` (the most it has held so far) and, with CUDA, ``cuda_peak_bytes`` (the
    most tensors have held on the current device). In the in-process engine the sites live in
    this process too, so these are the whole job's figures."""
    usage: dict[str, int] = {}
    resident = _resident_bytes()
    if resident is not None:
        usage["rss_bytes"] = resident
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    peak = peak if sys.platform == "darwin" else peak * 1024
    peak = max(peak, _PEAK_BEFORE_RESETS)  # PhasePeaks' resets lower ru_maxrss too
    # the kernel updates its high-water mark lazily: it can lag the resident size just read
    usage["peak_rss_bytes"] = max(peak, usage.get("rss_bytes", 0))
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        usage["cuda_peak_bytes"] = torch.cuda.max_memory_allocated()
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
