"""The helpers of a training step on the device: fused optimizers, ``torch.compile`` and CUDA
graphs, channels-last layouts, the backward pass and optimizer step (:func:`optimizer_step`), and
losses kept on the device between host syncs (:class:`LossLog`)."""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterable, Sequence
from typing import Any, TypeVar, cast

import torch
from torch import nn

from fedst.schema.accel import CUDA_GRAPH_MODES, compile_mode

log = logging.getLogger("fedst.accel")


def fused_optimizer_options(device: torch.device) -> dict[str, bool]:
    """Keyword arguments of ``torch.optim.Adam`` / ``AdamW`` for ``device``: the fused CUDA
    kernel (one launch for every parameter) on CUDA, the default implementation elsewhere."""
    return {"fused": True} if device.type == "cuda" else {}


_Step = TypeVar("_Step", bound=Callable[..., Any])


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
    backward_pass(loss, optimizer, scaler)
    apply_gradients(optimizer, scaler, parameters, max_grad_norm)


def _optimizers(
    optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer],
) -> list[torch.optim.Optimizer]:
    return [optimizer] if isinstance(optimizer, torch.optim.Optimizer) else list(optimizer)


def backward_pass(
    loss: torch.Tensor,
    optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer],
    scaler: torch.amp.GradScaler | None,
) -> None:
    """The first half of :func:`optimizer_step`: gradients set to None, then the backward pass
    of ``loss`` (scaled by ``scaler`` in fp16)."""
    for each in _optimizers(optimizer):
        each.zero_grad(set_to_none=True)
    if scaler is None:
        loss.backward()
    else:
        scaler.scale(loss).backward()


def apply_gradients(
    optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer],
    scaler: torch.amp.GradScaler | None,
    parameters: Iterable[torch.nn.Parameter],
    max_grad_norm: float | None = None,
) -> None:
    """The second half of :func:`optimizer_step`: unscale and clip when asked, then each
    optimizer's step (through the scaler in fp16) and the scaler's one update."""
    optimizers = _optimizers(optimizer)
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
