"""FedLD (Zeng, Guo, Wang, Wang, Zhou, Qu, MICCAI 2024: "Tackling data heterogeneity in federated
learning via loss decomposition"): one global model, a margin-control term at the sites and
principal-direction aggregation at the server.

Site loss (the release's ``MarginalLogLoss``, paper's lambda = 0.1)::

    L = L_seg + lambda * log(1 + ||softmax(z)||^2 / N)

with z the logits [B, C, H, W] and N = B * H * W: the release sums p_c^2 over a classification
batch; for segmentation the squared norm is divided by the number of pixels, i.e. the mean over
pixels of sum_c p_c^2 (in [1/C, 1]), so the term does not grow with the image size. L_seg is the
segmentation loss every method of this codebase uses (CE + lambda_1 Dice, Eq. 9 of FedST) in place
of the release's plain CE: the FedST paper compares all methods under one segmentation loss, so
FedLD is L_seg plus its own regularizer.

Server, per shared tensor (the release's ``svd_tools.pcgrad_svd``): with the m site updates
D = [gamma_k - gamma_g^t] (m x d),

1. H = D D^T / m (m x m) and its SVD H = E diag(s) E^T (s descending);
2. the principal directions w_j = D^T e_j (d), the top k = floor(0.8 m) of them (at least 1);
3. each w_j oriented by majority sign: flipped when more sites have d_i . w_j < 0 than >= 0
   (kept from the paper, although step 4 does not depend on the sign of w_j);
4. each site's update replaced by r_i = sum_{j<=k} (s_j / sum_l s_l) * ||d_i|| * proj_j(d_i) /
   ||proj_j(d_i)||, where proj_j(d_i) = (d_i . w_j / w_j . w_j) w_j, i.e. the unit direction
   sign(d_i . w_j) w_j / ||w_j|| scaled by the direction's singular-value share and the update's
   norm (the share's denominator sums all m singular values, as the release does);
5. gamma_g^{t+1} = gamma_g^t + mean_i r_i (uniform, as the release; ``aggregation_weights =
   samples`` weighs the mean by n_k).

Round 1 (the release: no update history yet) and one-element tensors take the plain mean of the
updates. Where the release divides by zero (a site's update orthogonal to w_j, or w_j = 0 because
the updates span fewer than k directions) the term is 0 here, and a tensor whose updates are all
zero keeps its value (the release's "history is all zero" branch takes the plain mean, also 0).
"""

from __future__ import annotations

import logging
import math

import torch
from flwr.app import Message

from fedst.config import ConfigError
from fedst.experiment import ExperimentConfig
from fedst.methods.aggregation import WEIGHT_KEYS
from fedst.methods.base import Method, TrainingSite
from fedst.schema.method_options import FedLDOptions

log = logging.getLogger(__name__)

ZERO = 1e-12
"""Relative size below which a singular value or a projection counts as zero (float64)."""


def margin_penalty(logits: torch.Tensor) -> torch.Tensor:
    """log(1 + ||softmax(logits)||^2 / N) for logits [B, C, H, W], N = B*H*W pixels; scalar."""
    probs = logits.softmax(dim=1)  # [B, C, H, W]
    per_pixel = probs.square().sum(dim=1).mean()  # mean over pixels of sum_c p_c^2
    return torch.log1p(per_pixel)


def principal_direction_update(
    updates: torch.Tensor, weights: torch.Tensor, k: int
) -> torch.Tensor:
    """FedLD's aggregated update of one tensor (steps 1-5 of the module docstring).

    updates: [m, d] site updates (float64); weights: [m] summing to 1; k: directions kept.
    Returns [d].
    """
    m = updates.shape[0]
    gram = updates @ updates.T / m  # H = D D^T / m, [m, m]
    _, singular, vh = torch.linalg.svd(gram)  # H = U diag(s) V^T, s descending
    if singular.sum() <= 0:  # every update is zero
        return torch.zeros_like(updates[0])
    directions = (updates.T @ vh.T).T[:k]  # w_j = D^T e_j, [k, d]
    dots = updates @ directions.T  # d_i . w_j, [m, k]
    flip = (dots >= 0).sum(0) < (dots < 0).sum(0)  # majority sign, ties keep
    sign = torch.where(flip, -1.0, 1.0).to(updates)
    directions, dots = directions * sign[:, None], dots * sign[None, :]
    share = singular[:k] / singular.sum()  # [k]
    lengths = directions.norm(dim=1)  # [k]
    usable = lengths > ZERO * max(float(lengths.max()), 1.0)
    unit = directions / torch.where(usable, lengths, 1.0)[:, None]  # [k, d]
    norms = updates.norm(dim=1, keepdim=True)  # ||d_i||, [m, 1]
    # proj_j(d_i) / ||proj_j(d_i)|| = sign(d_i . w_j) w_j / ||w_j|| (0 where d_i . w_j = 0)
    side = torch.sign(dots) * usable[None, :]  # [m, k]
    revised = (side * share[None, :] * norms) @ unit  # r_i, [m, d]
    return weights @ revised


class FedLD(Method):
    """FedLD: margin-control loss at the sites, principal-direction aggregation at the server."""

    Options = FedLDOptions

    def __init__(self, cfg: ExperimentConfig) -> None:
        super().__init__(cfg)
        if self.config.aggregation != "fedavg":
            raise ConfigError(
                f"method.aggregation={self.config.aggregation!r} with method.algorithm=fedld: "
                f"FedLD aggregates by principal directions (round 1: the mean); set "
                f"method.aggregation=fedavg"
            )

    def local_loss(
        self, site: TrainingSite, logits: torch.Tensor, masks: torch.Tensor
    ) -> torch.Tensor:
        """L_seg + lambda * log(1 + ||softmax(z)||^2 / N) (module docstring)."""
        return site.loss_fn(logits, masks) + self.options.lambda_margin * margin_penalty(logits)

    def principal_directions(self, sites: int) -> int:
        """k = floor(fraction * m), at least 1 (the release's int(m * 0.8) is 0 for one site)."""
        return max(1, math.floor(self.options.principal_fraction * sites))

    def aggregate(
        self,
        server_round: int,
        replies: list[Message],
        current: dict[str, torch.Tensor],
    ) -> dict[str, torch.Tensor]:
        """gamma_g^{t+1} = gamma_g^t + FedLD's update per tensor; round 1: the plain mean."""
        if server_round == 1 or not replies:
            return super().aggregate(server_round, replies, current)
        key = WEIGHT_KEYS[self.config.aggregation_weights]
        raw = torch.tensor([float(r.content["metrics"][key]) for r in replies], dtype=torch.float64)
        weights = raw / raw.sum()
        states = [r.content["arrays"].to_torch_state_dict() for r in replies]
        k = self.principal_directions(len(replies))
        aggregated = {}
        for name, value in current.items():
            base = value.detach().to(torch.float64).flatten()
            updates = torch.stack([s[name].to(torch.float64).flatten() - base for s in states])
            if base.numel() == 1:
                update = weights @ updates
            else:
                update = principal_direction_update(updates, weights, k)
            aggregated[name] = (base + update).reshape(value.shape).to(value.dtype)
        return aggregated

    def describe(self) -> dict:
        return {**super().describe(), **vars(self.options)}
