"""FedDP (Wang, Jin, Stoyanov, Wang, TMI 2023): dual personalization, two stages.

Stage 1, the federated rounds (partial averaging, :class:`~fedst.methods.base.Method`): every
encoder attention query stays at its site ("local query", partition preset ``encoder_query``),
and so does FedDP's personalized channel selection (:class:`fedst.model.channel_selection.
SiteChannelSelection`, network ``channel_selection_kind = "feddp"`` at the stages of
``options.channel_selection_stages``); everything else is averaged.

Stage 2, inter-site inconsistency-guided tuning (:meth:`FedDP.final_stage`, after the last round):
each site receives the other sites' rho_j (an explicit exchange, only between sites whose node
config allows sharing, ``share-personal``) and builds frozen copies of every site's model
v_j = gamma_g U rho_j, its own included. On each batch the uncertainty map is the standard
deviation over those models' softmax predictions, divided by its maximum over the batch
(:func:`uncertainty_map`); the site's own model is fine-tuned on

    L = Dice + lambda * mean(U * BCE(softmax(logits), onehot(masks)))        (:func:`tuning_loss`)

with a fresh Adam at ``options.tuning_lr``. The final per-site evaluation uses the tuned models.
"""

from __future__ import annotations

import copy
import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

from fedst.config import ConfigError
from fedst.methods.base import FinalStage, LocalPhase, Method, TrainingSite
from fedst.methods.reply_keys import ITERATIONS, TRAIN_LOSS
from fedst.model.losses import soft_dice_loss
from fedst.model.network import NetworkConfig
from fedst.model.state import load_subset
from fedst.schema.method_options import FedDPOptions

PROBABILITY_CLAMP = 1e-5
"""BCE clamps probabilities to [eps, 1 - eps], as the reference's weighted_bce_loss."""


class FedDP(Method):
    """Stage 1: partial averaging with private queries and channel selection; stage 2: tuning."""

    Options = FedDPOptions

    def __init__(self, cfg) -> None:
        super().__init__(cfg)
        if not (cfg.method.channel_selection and cfg.method.prompt):
            raise ConfigError(
                f"method {cfg.method.name} (algorithm feddp) uses FedDP's channel selection: set "
                f"method.channel_selection=true and method.prompt=true (got "
                f"{cfg.method.channel_selection}, {cfg.method.prompt})"
            )
        defaults = NetworkConfig()
        if cfg.network.channel_selection_kind not in (defaults.channel_selection_kind, "feddp"):
            raise ConfigError(
                f"network.channel_selection_kind={cfg.network.channel_selection_kind!r}: method "
                f"{cfg.method.name} always builds FedDP's channel selection; drop the override"
            )
        if cfg.network.cs_stages not in (defaults.cs_stages, self.options.channel_selection_stages):
            raise ConfigError(
                f"network.cs_stages={list(cfg.network.cs_stages)}: method {cfg.method.name} takes "
                f"its channel-selection stages from method.options.channel_selection_stages "
                f"({list(self.options.channel_selection_stages)}); set that instead"
            )

    def network_config(self) -> NetworkConfig:
        """The single-frame network with FedDP's channel selection at its stages."""
        return dataclasses.replace(
            super().network_config(),
            channel_selection_kind="feddp",
            cs_stages=tuple(self.options.channel_selection_stages),
        )

    def final_stage(self) -> FinalStage:
        return FinalStage(name="uncertainty_tuning", exchange_personal=True)

    def tuning_iterations(self, local_iters: int) -> int:
        return round(self.options.tuning_rounds * local_iters)

    def run_final_stage(
        self,
        site: TrainingSite,
        shared: dict[str, torch.Tensor],
        others: dict[str, dict[str, torch.Tensor]],
        server_round: int,
    ) -> dict[str, float]:
        """Freeze copies of every site's model, then tune ``site.model`` on :func:`tuning_loss`."""
        indicators = self.indicators()
        ensemble = [(_frozen(site.model), site.indicator)]
        for other, personal in sorted(others.items()):
            model = _frozen(site.model)
            load_subset(model, personal)
            ensemble.append((model, indicators.get(other)))
        iterations = self.tuning_iterations(site.cfg.train.local_iters)
        optimizer = torch.optim.Adam(site.model.parameters(), lr=self.options.tuning_lr)

        def loss_of(clips: torch.Tensor, logits: torch.Tensor, masks: torch.Tensor) -> torch.Tensor:
            with torch.no_grad():
                uncertainty = uncertainty_map(ensemble_probabilities(ensemble, clips))
            return tuning_loss(logits, masks, uncertainty, self.options.lambda_uncertainty)

        phase = LocalPhase(iterations, name="uncertainty tuning")
        losses = site.train_phase(phase, server_round, optimizer=optimizer, loss_of=loss_of)
        return {
            TRAIN_LOSS: sum(losses) / max(len(losses), 1),
            ITERATIONS: iterations,
        }


def _frozen(model: nn.Module) -> nn.Module:
    """A frozen copy in eval mode (the reference's memory copies of the site models)."""
    frozen = copy.deepcopy(model).eval()
    frozen.requires_grad_(False)
    return frozen


def ensemble_probabilities(
    ensemble: list[tuple[nn.Module, torch.Tensor | None]], clips: torch.Tensor
) -> torch.Tensor:
    """Softmax predictions of every (model, its site's indicator): [M, B, C, H, W]."""
    device = clips.device
    return torch.stack(
        [
            model(clips, None if indicator is None else indicator.to(device)).float().softmax(1)
            for model, indicator in ensemble
        ]
    )


def uncertainty_map(probabilities: torch.Tensor) -> torch.Tensor:
    """U = std_m(P_m) / max(std_m(P_m)): probabilities [M, B, C, H, W] -> [B, C, H, W].

    Standard deviation over the M site models (torch.std, unbiased, as the reference; the
    normalization by the maximum over the whole batch makes the N vs N-1 choice irrelevant).
    All zeros when the models agree everywhere (or M = 1)."""
    if probabilities.shape[0] < 2:
        return torch.zeros_like(probabilities[0])
    spread = probabilities.std(dim=0)  # [B, C, H, W]
    peak = spread.max()
    return spread / peak if peak > 0 else spread


def tuning_loss(
    logits: torch.Tensor,
    masks: torch.Tensor,
    uncertainty: torch.Tensor,
    lambda_uncertainty: float,
    ignore_index: int = 255,
) -> torch.Tensor:
    """Dice + lambda * uncertainty-weighted BCE; logits [B, C, H, W], masks [B, H, W],
    uncertainty [B, C, H, W] -> scalar.

    BCE per class and pixel on softmax probabilities p (clamped to [1e-5, 1 - 1e-5]) against the
    one-hot masks, -(y log p + (1 - y) log(1 - p)), times U, averaged over the non-ignored pixels
    and the classes. Dice: the project's soft Dice (fedst/model/losses.py)."""
    num_classes = logits.shape[1]
    valid = (masks != ignore_index).unsqueeze(1).to(logits.dtype)  # [B, 1, H, W]
    labels = torch.where(masks == ignore_index, torch.zeros_like(masks), masks).long()
    target = F.one_hot(labels, num_classes).permute(0, 3, 1, 2).to(logits.dtype)  # [B, C, H, W]
    probs = logits.softmax(dim=1).clamp(PROBABILITY_CLAMP, 1 - PROBABILITY_CLAMP)
    bce = -(target * probs.log() + (1 - target) * (1 - probs).log())  # [B, C, H, W]
    weighted = (bce * uncertainty * valid).sum() / (valid.sum() * num_classes).clamp(min=1)
    return soft_dice_loss(logits, masks, ignore_index) + lambda_uncertainty * weighted
