"""Shared tensors on the wire: cast to the transport precision for the message, restored to fp32
at the receiver (``comm.precision``: fp32 | fp16 | bf16).

Both directions carry gamma in the chosen precision; the server restores every reply to fp32
*before* aggregating, so the mean (or median, or a baseline's rule) is computed in fp32, and sites
load the received values into their fp32 models. NumPy has no bfloat16, so bf16 tensors travel as
their raw 16-bit patterns (an int16 view, 2 bytes per value like fp16) and are viewed back on
arrival; only floating-point tensors ever travel, so an int16 array in a bf16 message is always
such a pattern.
"""

from __future__ import annotations

import torch
from flwr.app import ArrayRecord

_WIRE_DTYPE = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def encode(state: dict[str, torch.Tensor], precision: str) -> ArrayRecord:
    """``state`` (float tensors) as an ArrayRecord in ``precision``; keys and order unchanged."""
    dtype = _WIRE_DTYPE[precision]
    wire = {}
    for key, value in state.items():
        cast = value.detach().to("cpu", dtype)
        wire[key] = cast.view(torch.int16) if dtype is torch.bfloat16 else cast
    return ArrayRecord(wire)


def decode(record: ArrayRecord, precision: str) -> dict[str, torch.Tensor]:
    """The tensors of a message in fp32 (what :func:`encode` sent, up to the cast's rounding)."""
    state = record.to_torch_state_dict()
    if precision == "bf16":
        state = {
            k: v.view(torch.bfloat16) if v.dtype == torch.int16 else v for k, v in state.items()
        }
    return {k: v.float() if v.is_floating_point() else v for k, v in state.items()}
