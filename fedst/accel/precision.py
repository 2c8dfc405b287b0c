"""Mixed precision of a device: ``train.amp_dtype`` resolved to an autocast dtype and whether
the gradients need loss scaling (fp16)."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from fedst.schema.accel import AMP_DTYPES

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
