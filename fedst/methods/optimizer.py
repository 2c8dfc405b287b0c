"""A site's AdamW as the temporal module's reference trains it: parameter groups and the schedule.

CFFM (the public code whose r, p, window, optimizer and batch FedST's paper takes;
``local_configs/cffm/B0/cffm.b0.480x480.vspw2.160k.py``) builds AdamW(lr 6e-5, weight decay 0.01)
with ``paramwise_cfg``: every parameter of its decode head, the cross-frame block and its bias
tables included, at ``lr_mult=10``, and no weight decay on parameters whose name contains
``norm`` (mmcv matches custom keys as substrings of the name), with a linear warm-up over 1500
iterations and a poly decay. Here (``train.*``, fedst/experiment/sections.py):

* ``temporal_lr_mult`` multiplies the lr of ``temporal.*`` only. CFFM's head also holds its
  decoder and classifier; ours would be ``decoder.*``, which every method and baseline shares,
  so a 10x decoder would change FedAvg and the baselines as much as FedST (the paper gives one
  AdamW 6e-5 for all). The temporal module is the part CFFM adds, and the one issue 58 measured
  to need it (its position bias barely moved at 1x).
* ``norm_weight_decay=false`` exempts ``*norm*`` parameters from decay, as CFFM.
* ``lr_schedule=warmup_poly`` is CFFM's schedule in local iterations; ``constant`` (default) is
  what FedST's text states.

With ``temporal_lr_mult=1``, ``norm_weight_decay=true`` and a constant schedule the optimizer is
exactly the single-group AdamW of the runs before issue 58 (their saved optimizer states load).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from fedst.experiment.sections import TrainConfig

__all__ = ["TEMPORAL_PREFIX", "lr_factor", "param_groups", "set_lr_factor"]

TEMPORAL_PREFIX = "temporal."
"""Parameter names of the temporal module (FedSTNet.temporal) start with this."""
WARMUP_START = 1e-6
"""CFFM's ``warmup_ratio``: the warm-up starts at this fraction of the lr."""


def param_groups(
    named_parameters: Iterable[tuple[str, nn.Parameter]], train: TrainConfig
) -> list[dict]:
    """AdamW parameter groups: (temporal | rest) x (decay | no decay), empty groups left out.

    Each group carries ``base_lr`` (its lr before the schedule) and ``name``. With one lr and
    decay everywhere it is one group holding every parameter, as a plain ``AdamW(params)``.
    """
    groups: dict[tuple[bool, bool], list[nn.Parameter]] = {}
    for name, parameter in named_parameters:
        temporal = name.startswith(TEMPORAL_PREFIX) and train.temporal_lr_mult != 1.0
        decay = train.norm_weight_decay or "norm" not in name
        groups.setdefault((temporal, decay), []).append(parameter)
    result = []
    for (temporal, decay), params in sorted(groups.items(), reverse=True):
        lr = train.lr * (train.temporal_lr_mult if temporal else 1.0)
        result.append(
            {
                "params": params,
                "lr": lr,
                "base_lr": lr,
                "weight_decay": train.weight_decay if decay else 0.0,
                "name": f"{'temporal' if temporal else 'rest'}{'' if decay else '_no_decay'}",
            }
        )
    return result


def lr_factor(iteration: int, train: TrainConfig) -> float:
    """The schedule's factor on every group's ``base_lr`` before local iteration ``iteration``
    (0-based, counted over the whole run: ``(round - 1) * local_iters + i``).

    warmup_poly (mmcv's ``PolyLrUpdaterHook`` with linear warm-up, power 1, min 0): the poly
    factor ``1 - iteration / total_iters``, times ``1 - (1 - iteration / warmup_iters)(1 - 1e-6)``
    during the warm-up.
    """
    if train.lr_schedule == "constant":
        return 1.0
    factor = max(0.0, 1.0 - iteration / train.total_iters)
    if iteration < train.warmup_iters:
        factor *= 1.0 - (1.0 - iteration / train.warmup_iters) * (1.0 - WARMUP_START)
    return factor


def set_lr_factor(optimizer: torch.optim.Optimizer, factor: float) -> None:
    """Set every group's lr to ``base_lr x factor`` (groups without ``base_lr`` keep theirs)."""
    for group in optimizer.param_groups:
        if "base_lr" in group:
            group["lr"] = group["base_lr"] * factor
