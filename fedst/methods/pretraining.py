"""Synthetic pre-training: the initial model v_g^0 of every method (paper Sec. IV-A: all methods
are "pre-trained on the same synthetic datasets"; Algorithm 1, line 3 for FedST's v_pre^0).

The server trains the method's network on its synthetic set (``data.server``) with L_seg on
single frames (no temporal step: the synthetic set is images), Adam at ``pretraining.lr`` for
``pretraining.iters`` steps of ``pretraining.batch_size`` augmented images, from one seeded stream.
FedST's SERQ runs this same loop on v_pre and keeps v_pre (and its optimizer) for its later steps;
every other method just starts from the result. ``method.synthetic_pretraining=false`` starts
from the initialisation instead (an ablation).
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass

import torch
from torch import nn

from fedst.accel import LossLog, Precision, optimizer_step
from fedst.config import ConfigError
from fedst.data.clips import BatchStream, ClipDataset
from fedst.experiment import ExperimentConfig
from fedst.model.losses import SegmentationLoss
from fedst.progress import progress_bar

TAIL = 10
"""The returned loss is the mean of the last TAIL steps."""

WARMUP_ITERS = 2
"""Steps left out of :attr:`PretrainResult.steady_seconds`: the first pays the loader's start,
cuDNN's autotuning and any compilation, none of which the later steps pay again."""


@dataclass(frozen=True)
class PretrainResult:
    """What synthetic pre-training returns: its loss and its cost after warm-up."""

    loss: float
    """The mean loss of the last :data:`TAIL` steps."""
    steady_seconds: float
    """Wall time of the steps after the first :data:`WARMUP_ITERS` (0 when there are none)."""
    steady_iters: int
    """How many steps ``steady_seconds`` covers."""

    @property
    def seconds_per_iter(self) -> float | None:
        """The steady cost of one step; None when every step was a warm-up step."""
        return self.steady_seconds / self.steady_iters if self.steady_iters else None


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
) -> PretrainResult:
    """``iters`` steps of L_seg on synthetic batches (images [B, T, 3, H, W], masks [B, H, W]),
    each frame alone; returns the mean loss of the last 10 steps and the time of the steps after
    the first :data:`WARMUP_ITERS`.

    ``precision`` (fedst.accel.resolve_precision of ``train.amp_dtype``; None: fp32) and its
    ``scaler`` (fp16) set the mixed precision; losses stay on the device until the end (one
    device sync where the warm-up ends, one at the end).
    """
    precision = precision or Precision(device.type)
    model.train()
    losses = LossLog()
    steady_started = None
    for step in progress_bar(
        range(iters), desc="synthetic pre-training", enabled=progress, leave=False
    ):
        if step == WARMUP_ITERS:
            _synchronize(device)
            steady_started = time.perf_counter()
        images, masks, _ = stream.next_batch()
        with precision.autocast():
            logits = model(images.to(device), indicator, use_temporal=False)
        loss = loss_fn(logits.float(), masks.to(device))
        optimizer_step(loss, optimizer, scaler, model.parameters())
        losses.append(loss)
    tail = losses.values()[-TAIL:]  # copies the losses to the host: the device is done
    steady = 0.0 if steady_started is None else time.perf_counter() - steady_started
    return PretrainResult(
        loss=sum(tail) / max(len(tail), 1),
        steady_seconds=steady,
        steady_iters=max(iters - WARMUP_ITERS, 0),
    )


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def synthetic_stream(
    cfg: ExperimentConfig, method_name: str, device: torch.device, batch_size: int
) -> tuple[BatchStream, ClipDataset]:
    """The server's synthetic set: a seeded stream of ``batch_size`` augmented images and the
    un-augmented set (``pretraining.batch_size`` for pre-training alone, ``serq.batch_size`` for
    SERQ, which continues the same stream after its pre-training).

    Clips of one frame: the server's passes (synthetic pre-training, SERQ) run the network with
    ``use_temporal=False``, which reads only a clip's current frame, so earlier frames would be
    decoded, augmented and copied for nothing."""
    if cfg.data.server is None:
        raise ConfigError(
            f"method {method_name} starts from synthetic pre-training (and SERQ, if on) "
            f"but data.server is null: set data.server to the synthetic set, or "
            f"method.synthetic_pretraining=false (and method.serq=false)"
        )
    source = cfg.data.open(cfg.data.server)
    clip = dataclasses.replace(cfg.clip_config(), num_frames=1)
    dataset = ClipDataset(source, "train", clip, cfg.augment)
    stream = BatchStream(
        dataset,
        batch_size=batch_size,
        seed=cfg.seed * 1000 + 999,
        num_workers=cfg.train.num_workers,
        device=device,
        num_classes=cfg.network.num_classes,
    )
    return stream, ClipDataset(source, "train", clip, None, validate=False)
