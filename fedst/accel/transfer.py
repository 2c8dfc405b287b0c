"""Tensors to the host in bulk: every tensor of a nested state (dicts, lists, tuples) leaves its
device in one copy, instead of one blocking copy per tensor (a site's round: gamma_k, rho_k and
the optimizer's moments, ~1,200 tensors).

The tensors of one device are flattened to bytes and concatenated there (one kernel), the buffer
is copied to the host once (into pinned memory without blocking on CUDA, with an event recorded
behind the copy), and the host tensors are views into that buffer, each at an offset aligned to
:data:`ALIGNMENT` bytes. :meth:`HostCopy.wait` waits for the copy (a no-op on the CPU) and can
run on another thread (the site's state writer)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

ALIGNMENT = 16
"""Byte alignment of each tensor in a bulk buffer (every dtype's element size divides it)."""


def _leaves(tree: Any, found: list[torch.Tensor]) -> None:
    """Append the tensors of ``tree`` (nested dicts, lists, tuples) to ``found``, in order."""
    if isinstance(tree, torch.Tensor):
        found.append(tree)
    elif isinstance(tree, dict):
        for value in tree.values():
            _leaves(value, found)
    elif isinstance(tree, (list, tuple)):
        for value in tree:
            _leaves(value, found)


def _rebuild(tree: Any, replace: Callable[[], torch.Tensor]) -> Any:
    """``tree`` with each tensor replaced by the next of ``replace()``, in :func:`_leaves` order."""
    if isinstance(tree, torch.Tensor):
        return replace()
    if isinstance(tree, dict):
        return {key: _rebuild(value, replace) for key, value in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(_rebuild(value, replace) for value in tree)
    return tree


def _padded(nbytes: int) -> int:
    return -(-nbytes // ALIGNMENT) * ALIGNMENT


@dataclass
class HostCopy:
    """A state's tensors on their way to the host (:func:`bulk_to_host`)."""

    tree: Any
    """The state with every tensor replaced by its host copy (a view into a bulk buffer)."""
    events: list[torch.cuda.Event]
    """Recorded behind each device's copy (CUDA); the host views are valid once they complete."""
    copies: int
    """Device-to-host copies made: one per device other than the CPU."""

    def wait(self) -> Any:
        """The host state, once its copies have landed (blocks on CUDA, on this thread only)."""
        for event in self.events:
            event.synchronize()
        return self.tree


def _flat_bytes(tensors: list[torch.Tensor]) -> torch.Tensor:
    """The tensors' bytes, each padded to :data:`ALIGNMENT`, as one uint8 buffer [N] on their
    device (one concatenation)."""
    pieces = []
    for tensor in tensors:
        data = tensor.detach().contiguous().reshape(-1).view(torch.uint8)  # [numel * itemsize]
        pieces.append(data)
        pad = _padded(data.numel()) - data.numel()
        if pad:
            pieces.append(data.new_zeros(pad))
    return torch.cat(pieces) if pieces else torch.empty(0, dtype=torch.uint8)


def bulk_to_host(tree: Any) -> HostCopy:
    """Every tensor of ``tree`` copied to the host, one copy per device: dicts, lists and tuples
    are rebuilt with host tensors (dtype, shape and values kept; contiguous views into one
    buffer per device), anything else is kept as it is. CPU tensors are copied too, so the
    result never shares memory with ``tree``. On CUDA the buffer is pinned and the copy does not
    block: call :meth:`HostCopy.wait` before reading the values."""
    tensors: list[torch.Tensor] = []
    _leaves(tree, tensors)
    by_device: dict[torch.device, list[int]] = {}
    for index, tensor in enumerate(tensors):
        by_device.setdefault(tensor.device, []).append(index)
    host: list[torch.Tensor | None] = [None] * len(tensors)
    events, copies = [], 0
    for device, indices in by_device.items():
        members = [tensors[i] for i in indices]
        flat = _flat_bytes(members)  # [N] uint8 on ``device``
        if device.type == "cpu":
            buffer = flat  # a new buffer already: nothing is shared with ``tree``
        else:
            pinned = device.type == "cuda" and torch.cuda.is_available()
            buffer = torch.empty(flat.shape, dtype=torch.uint8, pin_memory=pinned)
            buffer.copy_(flat, non_blocking=pinned)
            copies += 1
            if pinned:
                event = torch.cuda.Event()
                event.record(torch.cuda.current_stream(device))
                events.append(event)
        offset = 0
        for i, tensor in zip(indices, members, strict=True):
            nbytes = tensor.numel() * tensor.element_size()
            piece = buffer[offset : offset + nbytes].view(tensor.dtype).view(tensor.shape)
            host[i] = piece
            offset += _padded(nbytes)
    replacements = iter(host)
    return HostCopy(_rebuild(tree, lambda: next(replacements)), events, copies)


def standalone(tree: Any) -> Any:
    """``tree`` with each tensor cloned into storage of its own. ``torch.save`` writes a storage
    whole: a file saved from :func:`bulk_to_host`'s views would hold the whole buffer, and so
    would a later file that saves a subset of what it loaded (fedst/runs/footprint.py)."""
    if isinstance(tree, torch.Tensor):
        return tree.clone()
    if isinstance(tree, dict):
        return {key: standalone(value) for key, value in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(standalone(value) for value in tree)
    return tree
