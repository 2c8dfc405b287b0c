"""Synthetic pre-training: the initial model v_g^0 of every method (paper Sec. IV-A: all methods
are "pre-trained on the same synthetic datasets"; Algorithm 1, line 3 for FedST's v_pre^0).

The server trains the method's network on its synthetic set (``data.server``) with L_seg on
single frames (no temporal step: the synthetic set is images), Adam at ``serq.lr`` for
``serq.pretrain_iters`` steps of ``serq.batch_size`` augmented images, from one seeded stream.
FedST's SERQ runs this same loop on v_pre and keeps v_pre (and its optimizer) for its later steps;
every other method just starts from the result. ``method.synthetic_pretraining=false`` starts
from the initialisation instead (an ablation).
"""

from __future__ import annotations

import torch
from torch import nn

from fedst.data.clips import BatchStream
from fedst.model.losses import SegmentationLoss
from fedst.progress import progress_bar


def pretrain_on_synthetic(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    stream: BatchStream,
    indicator: torch.Tensor | None,
    loss_fn: SegmentationLoss,
    iters: int,
    device: torch.device,
    progress: bool = False,
) -> float:
    """``iters`` steps of L_seg on synthetic batches (images [B, T, 3, H, W], masks [B, H, W]),
    each frame alone; returns the mean loss of the last 10 steps."""
    model.train()
    tail: list[float] = []
    for _ in progress_bar(
        range(iters), desc="synthetic pre-training", enabled=progress, leave=False
    ):
        images, masks, _ = stream.next_batch()
        logits = model(images.to(device), indicator, use_temporal=False)
        loss = loss_fn(logits, masks.to(device))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        tail = [*tail[-9:], loss.item()]
    return sum(tail) / max(len(tail), 1)
