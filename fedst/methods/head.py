"""The body / head split of the head-personalizing baselines (FedRep, FedAS).

The head is the segmentation network's final 1x1 classifier (``decoder.head``, fedst/model/
decoder.py): ``decoder_dim`` features per pixel at 1/4 resolution -> ``num_classes`` logits. The
body (FedRep's "representation", FedAS's "base") is everything else: encoder + decoder. The head
stays at the site; the body is shared.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from fedst.model.partition import Partition

HEAD_MODULE = "decoder.head"
"""Module path of the classifier head in :class:`fedst.model.network.FedSTNet`."""
HEAD_PREFIX = HEAD_MODULE + "."


def is_head(key: str) -> bool:
    """True for the state-dict / parameter names of the head (``decoder.head.weight``, ``.bias``)."""
    return key.startswith(HEAD_PREFIX)


def with_private_head(partition: Partition, model: nn.Module) -> Partition:
    """``partition`` of ``model`` with every head tensor moved to the personal set (it never
    travels)."""
    head = [k for k in partition.shared if is_head(k)]
    if not head and not any(is_head(k) for k in partition.personal):
        raise ValueError(
            f"the model has no {HEAD_MODULE}.* tensor to keep private (partition keys e.g. "
            f"{list(partition.shared[:3])}); the body/head split needs FedSTNet's decoder head"
        )
    personal = set(partition.personal) | set(head)
    return Partition(
        personal=tuple(k for k in model.state_dict() if k in personal),
        shared=tuple(k for k in partition.shared if k not in personal),
        fixed=partition.fixed,
    )


@contextmanager
def head_input(model: nn.Module) -> Iterator[list[torch.Tensor]]:
    """Within the block, every forward pass of ``model`` appends the head's input (the body's
    per-pixel features [B, D, h, w]) to the yielded list."""
    captured: list[torch.Tensor] = []
    head = model.get_submodule(HEAD_MODULE)
    handle = head.register_forward_pre_hook(lambda _module, args: captured.append(args[0]))
    try:
        yield captured
    finally:
        handle.remove()
