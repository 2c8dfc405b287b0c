"""The device settings a config names, without torch: ``train.device`` (:func:`check_device_name`,
resolved by fedst/accel/device.py), ``train.amp_dtype`` (:data:`AMP_DTYPES`, resolved by
fedst/accel/precision.py) and ``train.compile`` (:data:`COMPILE_MODES`, applied by
fedst/accel/steps.py)."""

from __future__ import annotations

import re

from fedst.config import ConfigError

DEVICE_NAME = re.compile(r"auto|cpu|cuda(:\d+)?")
"""The values of ``train.device`` (and fedst.infer's ``device``): auto | cpu | cuda | cuda:N."""


def check_device_name(key: str, name: object) -> None:
    """ConfigError unless ``name`` is a device :data:`DEVICE_NAME` allows: checked when the config
    is read (without torch), so a mistyped device ends in one line before anything is built."""
    if not isinstance(name, str) or DEVICE_NAME.fullmatch(name) is None:
        raise ConfigError(f"{key}={name!r}; choose auto, cpu, cuda or cuda:N (N: the GPU's index)")


AMP_DTYPES = ("auto", "bf16", "fp16", "none")
"""Values of ``train.amp_dtype``: auto (bf16 where the GPU supports it, else fp16) | bf16 | fp16
(with a GradScaler) | none (fp32)."""

COMPILE_MODES = ("none", "default", "reduce-overhead", "max-autotune")
"""Values of ``train.compile`` (``torch.compile``'s modes): none (eager) | default (Inductor's
fused kernels) | reduce-overhead (Inductor with CUDA graphs: a captured step replays with one
launch) | max-autotune (autotuned kernels, CUDA graphs; minutes of tuning at the first steps)."""

CUDA_GRAPH_MODES = ("reduce-overhead", "max-autotune")
"""The modes of :data:`COMPILE_MODES` that capture CUDA graphs (on a CUDA device)."""


def compile_mode(value: str | bool) -> str:
    """``train.compile`` as a mode of :data:`COMPILE_MODES`; the former boolean reads true as
    "default" (what ``model.compile()`` did) and false as "none"."""
    if isinstance(value, bool):
        return "default" if value else "none"
    if value not in COMPILE_MODES:
        raise ValueError(f"train.compile={value!r}; choose one of {COMPILE_MODES} (or true/false)")
    return value
