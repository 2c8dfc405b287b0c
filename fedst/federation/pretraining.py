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

from fedst.accel import LossLog, Precision, optimizer_step
from fedst.data.clips import BatchStream
from fedst.model.losses import SegmentationLoss
from fedst.progress import progress_bar

TAIL = 10
"""The returned loss is the mean of the last TAIL steps."""


def pretrain_on_synthetic(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    stream: BatchStream,
    indicator: torch.Tensor | None,
    loss_fn: SegmentationLoss,
    iters: int,
    device: torch.device,
    progress: bool = False,
    precision: Precision | None = None,
    scaler: torch.amp.GradScaler | None = None,
) -> float:
    """``iters`` steps of L_seg on synthetic batches (images [B, T, 3, H, W], masks [B, H, W]),
    each frame alone; returns the mean loss of the last 10 steps.

    ``precision`` (fedst.accel.resolve_precision of ``train.amp_dtype``; None: fp32) and its
    ``scaler`` (fp16) set the mixed precision; losses stay on the device until the end.
    """
    precision = precision or Precision(device.type)
    model.train()
    losses = LossLog()
    for _ in progress_bar(
        range(iters), desc="synthetic pre-training", enabled=progress, leave=False
    ):
        images, masks, _ = stream.next_batch()
        with precision.autocast():
            logits = model(images.to(device), indicator, use_temporal=False)
        loss = loss_fn(logits.float(), masks.to(device))
        optimizer_step(loss, optimizer, scaler, model.parameters())
        losses.append(loss)
    tail = losses.values()[-TAIL:]
    return sum(tail) / max(len(tail), 1)
