"""A whole training iteration compiled: :class:`CompiledStep` (issue 60, item 2).

What ``train.compile`` compiles in a site's iteration and in SERQ's EQ and SC batches: the
objective (forward pass and loss) through ``torch.compile``, whose AOTAutograd backward graph is
compiled with it, so the backward pass of ``loss.backward()`` runs the compiled graph too; with
``reduce-overhead`` on CUDA both are captured as CUDA graphs and replayed with one launch each.
The optimizer step stays beside the graphs: the fused AdamW / Adam kernels of
:func:`~fedst.accel.steps.fused_optimizer_options` are a few launches for every parameter, and a
compiled optimizer step would recompile whenever the learning rate (a Python float that the
warm-up and poly schedules change every iteration) changes.

Static input buffers: each tensor argument is copied into a buffer this step owns (one per
argument position, reallocated only when the shape, dtype, device or strides change), and the
compiled objective always reads those buffers. Under CUDA graphs the buffers are marked as static
addresses, so the graph reads them in place (the copy here replaces the graph's own copy of
every non-static input); the loader's batch may be freed or reused as soon as the copy is queued.

Fallback: in a CUDA-graph mode, a failure in the first :data:`FALLBACK_WINDOW` iterations (the
compile, the warm-up run and the capture happen there) before the optimizer step is logged as a
warning with its error, and the step recompiles its objective in ``default`` mode (Inductor
without CUDA graphs) and runs the same iteration again: the arithmetic is the same, only the
launches differ; :attr:`CompiledStep.mode` and :attr:`CompiledStep.fallback_reason` say what ran.
A failure after the window, or in ``default`` mode, is raised.

Cold model: a model compiled before any eager run must hold its index layouts already
(``FedSTNet.prepare_temporal``; fedst/model/temporal_cffm.py), which the site calls before
building its step.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

from fedst.accel.steps import (
    CUDA_GRAPH_MODES,
    apply_gradients,
    backward_pass,
    begin_step,
    compile_mode,
    kept,
    maybe_compile,
    uses_cuda_graphs,
)

log = logging.getLogger("fedst.accel")

FALLBACK_WINDOW = 3
"""Iterations of a CUDA-graph mode in which a failure falls back to ``default`` mode: the first
call compiles and warms up, the next ones record the graphs (torch's CUDA graph trees)."""

Objective = Callable[..., Any]
"""A step's forward pass and loss: tensors (and modules, flags) -> a scalar loss or a tuple whose
first item is the loss (the others: detached statistics or None)."""


class CompiledStep:
    """One training iteration (forward, loss, backward, optimizer step) with ``objective``
    compiled per ``mode`` (``train.compile``) and its tensor inputs in static buffers.

    ``mode="none"`` runs ``objective`` eagerly on the inputs as given (no buffer, no copy).
    """

    def __init__(self, objective: Objective, mode: str | bool, device: torch.device) -> None:
        self.objective = objective
        self.device = device
        self.requested_mode = compile_mode(mode)
        """``train.compile`` as configured."""
        self.mode = self.requested_mode
        """The mode that runs: :attr:`requested_mode`, or ``default`` after a fallback."""
        self.fallback_reason: str | None = None
        """Why a CUDA-graph mode fell back to ``default`` (the error's type and message)."""
        self._compiled = maybe_compile(objective, self.mode)
        self._buffers: dict[int, tuple[tuple, torch.Tensor]] = {}
        """Argument position -> (the argument's shape, dtype, device, strides; its buffer)."""
        self._iterations = 0

    @property
    def cuda_graphs(self) -> bool:
        """Whether the step replays CUDA graphs (its outputs are then copied to keep)."""
        return uses_cuda_graphs(self.mode, self.device)

    def static_inputs(self, args: Sequence[Any]) -> tuple[Any, ...]:
        """``args`` with every tensor copied into this step's buffer for its position (queued
        without a host wait); other arguments (modules, flags, None) as they are."""
        if self.mode == "none":
            return tuple(args)
        inputs = []
        for position, value in enumerate(args):
            if not isinstance(value, torch.Tensor):
                inputs.append(value)
                continue
            signature = (tuple(value.shape), value.dtype, value.device, value.stride())
            held = self._buffers.get(position)
            if held is None or held[0] != signature:
                buffer = torch.empty_like(value, memory_format=torch.preserve_format)
                if self.cuda_graphs:  # read in place by the graphs: no copy of their own
                    torch._dynamo.mark_static_address(buffer)
                held = self._buffers[position] = (signature, buffer)
            held[1].copy_(value, non_blocking=True)
            inputs.append(held[1])
        return tuple(inputs)

    def __call__(self, *args: Any) -> tuple[Any, ...]:
        """The objective on ``args`` (through the static buffers), as a tuple."""
        outputs = self._compiled(*self.static_inputs(args))
        return outputs if isinstance(outputs, tuple) else (outputs,)

    def step(
        self,
        args: Sequence[Any],
        optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer],
        scaler: torch.amp.GradScaler | None,
        parameters: Iterable[torch.nn.Parameter],
        max_grad_norm: float | None = None,
    ) -> tuple[torch.Tensor | None, ...]:
        """One iteration on ``args``: the objective, the backward pass of its loss (its first
        output) and the optimizers' step (:func:`~fedst.accel.steps.optimizer_step`'s
        semantics, no host sync). Returns the objective's outputs detached, copied out of the
        graphs' memory where they are CUDA graph outputs (valid after the next iteration)."""
        begin_step(self.cuda_graphs)
        try:
            outputs = self._forward_backward(args, optimizer, scaler)
        except Exception as error:  # compile / capture failures; see the module docstring
            if self.mode not in CUDA_GRAPH_MODES or self._iterations >= FALLBACK_WINDOW:
                raise
            self._fall_back(error)
            outputs = self._forward_backward(args, optimizer, scaler)
        apply_gradients(optimizer, scaler, parameters, max_grad_norm)
        self._iterations += 1
        return tuple(None if o is None else kept(o, self.cuda_graphs) for o in outputs)

    def _forward_backward(
        self,
        args: Sequence[Any],
        optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer],
        scaler: torch.amp.GradScaler | None,
    ) -> tuple[Any, ...]:
        outputs = self(*args)
        backward_pass(outputs[0], optimizer, scaler)
        return outputs

    def _fall_back(self, error: Exception) -> None:
        self.fallback_reason = f"{type(error).__name__}: {error}".splitlines()[0][:500]
        log.warning(
            "torch.compile(mode=%s) of %s failed at iteration %d (%s); compiling it in mode "
            "default instead (same arithmetic, no CUDA graphs)",
            self.mode,
            getattr(self.objective, "__qualname__", type(self.objective).__name__),
            self._iterations + 1,
            self.fallback_reason,
        )
        self.mode = "default"
        self._buffers.clear()  # unmarked buffers for the graphs of default mode
        self._compiled = maybe_compile(self.objective, self.mode)
