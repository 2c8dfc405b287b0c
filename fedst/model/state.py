"""Subsets of a model's state dict: what a party copies out to send, and copies in on receipt."""

from __future__ import annotations

import torch
from torch import nn


def state_subset(model: nn.Module, keys: tuple[str, ...] | list[str]) -> dict[str, torch.Tensor]:
    """Detached CPU copies of the named state-dict entries."""
    state = model.state_dict()
    return {k: state[k].detach().to("cpu", copy=True) for k in keys}


def load_subset(model: nn.Module, values: dict[str, torch.Tensor]) -> None:
    """Copy ``values`` into the model's state in place, keeping each tensor's dtype and device."""
    state = model.state_dict()
    unknown = sorted(set(values) - set(state))
    if unknown:
        raise KeyError(f"received tensors the model does not have: {unknown[:5]}")
    with torch.no_grad():
        for key, value in values.items():
            target = state[key]
            if target.shape != value.shape:
                raise ValueError(
                    f"{key}: received shape {tuple(value.shape)}, model has {tuple(target.shape)}"
                )
            target.copy_(torch.as_tensor(value).to(dtype=target.dtype))
