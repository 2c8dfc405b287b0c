"""Textual-guided channel selection (paper Sec. III-B2, Eq. 7-8) and the "prompt only" variant.

Reading of the paper: Eq. 7 writes the indicator and the gate as R^{h x w}, but the text says the
gate "selects channels" and the FC acts on GAP(F*) (a C-vector) concatenated with a text embedding
(a D-vector). We follow FedDP's personalized channel selection: the gate is per channel, R^C,
broadcast over space in Eq. 8.

* :class:`ChannelSelection` (Table IV "CS"): gate = sigmoid(FC([GAP(F*), xi])) in (0, 1)^C;
  F' = F* + F* * gate.
* :class:`PromptBias` (Table IV row 3, "prompt without CS"): the indicator is used without a
  selection network: F' = F* + Linear(xi) as a per-channel additive bias. The linear layer starts
  at zero so the ablation starts from the unmodified features.
* :class:`SiteChannelSelection` (the FedDP baseline, ``NetworkConfig.channel_selection_kind =
  "feddp"``): FedDP's public release's personalized channel selection, with average *and* max
  pooling and an embedded site vector (see the class).

:func:`fold_indicator` folds a frozen indicator into the bias of the layers that read it
(b' = b + W^xi xi, W^xi = 0): the out-of-federation model's rule for a site whose indicator no
site trained with (fedst/runs/returned.py, docs/methods.md).
"""

from __future__ import annotations

import re
from collections.abc import Mapping

import torch
from torch import nn

from fedst.errors import UserError

__all__ = [
    "ChannelSelection",
    "IndicatorFoldError",
    "PromptBias",
    "SiteChannelSelection",
    "expand_indicator",
    "fold_indicator",
]


def expand_indicator(indicator: torch.Tensor, batch: int) -> torch.Tensor:
    """Indicator [D] or [B, D] -> [B, D] (a single site vector is shared by the batch)."""
    if indicator.dim() == 1:
        return indicator.unsqueeze(0).expand(batch, -1)  # [D] -> [B, D]
    if indicator.dim() == 2 and indicator.shape[0] == batch:
        return indicator
    raise ValueError(
        f"site indicator must be [D] or [B={batch}, D]; got shape {tuple(indicator.shape)}"
    )


class ChannelSelection(nn.Module):
    """Per-channel gate from pooled features and the site indicator (Eq. 7-8)."""

    def __init__(self, channels: int, indicator_dim: int):
        super().__init__()
        self.channels = channels
        self.indicator_dim = indicator_dim
        self.fc = nn.Linear(channels + indicator_dim, channels)

    def gate(self, feat: torch.Tensor, indicator: torch.Tensor) -> torch.Tensor:
        """Eq. 7: xi_hat = sigmoid(FC([GAP(F*), xi])); feat [B, C, h, w] -> gate [B, C]."""
        pooled = feat.mean(dim=(2, 3))  # [B, C, h, w] -> [B, C]
        indicator = expand_indicator(indicator, feat.shape[0]).to(feat)  # [B, D] on feat.device
        return torch.sigmoid(self.fc(torch.cat([pooled, indicator], dim=1)))  # [B, C+D] -> [B, C]

    def forward(self, feat: torch.Tensor, indicator: torch.Tensor) -> torch.Tensor:
        """Eq. 8: F' = F* + F* * gate; feat [B, C, h, w], indicator [D] | [B, D] -> [B, C, h, w]."""
        gate = self.gate(feat, indicator)[:, :, None, None]  # [B, C] -> [B, C, 1, 1]
        return feat + feat * gate


class PromptBias(nn.Module):
    """Table IV "prompt without CS": F' = F* + Linear(xi) as a per-channel bias."""

    def __init__(self, channels: int, indicator_dim: int):
        super().__init__()
        self.channels = channels
        self.indicator_dim = indicator_dim
        self.proj = nn.Linear(indicator_dim, channels)
        nn.init.zeros_(self.proj.weight)
        nn.init.zeros_(self.proj.bias)

    def forward(self, feat: torch.Tensor, indicator: torch.Tensor) -> torch.Tensor:
        """feat [B, C, h, w], indicator [D] | [B, D] -> [B, C, h, w]."""
        indicator = expand_indicator(indicator, feat.shape[0]).to(feat)  # [B, D] on feat.device
        return feat + self.proj(indicator)[:, :, None, None]  # [B, C] -> [B, C, 1, 1]


class SiteChannelSelection(nn.Module):
    """FedDP's personalized channel selection (Wang et al., TMI 2023, public release):

    e = W_e2 ReLU(W_e1 xi)                                   (site embedding, [B, C])
    gate = sigmoid(FC([GAP(F), e]) + FC([GMP(F), e])),  FC = W_2 ReLU(W_1 .)   ([B, C])
    F' = F + F * gate

    GAP / GMP: global average / max pooling over space; one FC (hidden C // 16) serves both
    pooled vectors; no biases, as in the release (there 1x1 convolutions on 1x1 maps).
    """

    REDUCTION = 16
    """Hidden width of FC: C // REDUCTION (at least 1)."""

    def __init__(self, channels: int, indicator_dim: int):
        super().__init__()
        self.channels = channels
        self.indicator_dim = indicator_dim
        hidden = max(1, channels // self.REDUCTION)
        self.embed = nn.Sequential(
            nn.Linear(indicator_dim, channels, bias=False),
            nn.ReLU(),
            nn.Linear(channels, channels, bias=False),
        )
        self.fc = nn.Sequential(
            nn.Linear(2 * channels, hidden, bias=False),
            nn.ReLU(),
            nn.Linear(hidden, channels, bias=False),
        )

    def gate(self, feat: torch.Tensor, indicator: torch.Tensor) -> torch.Tensor:
        """feat [B, C, h, w], indicator [D] | [B, D] -> gate [B, C] in (0, 1)."""
        indicator = expand_indicator(indicator, feat.shape[0]).to(feat)  # [B, D]
        embedded = self.embed(indicator)  # [B, D] -> [B, C]
        average = feat.mean(dim=(2, 3))  # [B, C]
        maximum = feat.amax(dim=(2, 3))  # [B, C]
        logits = self.fc(torch.cat([average, embedded], dim=1)) + self.fc(
            torch.cat([maximum, embedded], dim=1)
        )  # [B, 2C] -> [B, C], twice
        return torch.sigmoid(logits)

    def forward(self, feat: torch.Tensor, indicator: torch.Tensor) -> torch.Tensor:
        """F' = F + F * gate; feat [B, C, h, w], indicator [D] | [B, D] -> [B, C, h, w]."""
        return feat + feat * self.gate(feat, indicator)[:, :, None, None]


INDICATOR_LAYERS = re.compile(
    r"^(?P<module>(?:channel_selection\.\d+\.fc|prompt\.\d+\.proj))\.weight$"
)
"""State-dict keys of the weights that read the indicator linearly, with a bias beside them:
ChannelSelection's ``fc`` (W = [W^F | W^xi] on [GAP(F*), xi]) and PromptBias's ``proj`` (W^xi)."""
NONLINEAR_INDICATOR_LAYERS = re.compile(r"^channel_selection\.\d+\.embed\.")
"""FedDP's site embedding: the indicator passes a ReLU before a bias-free layer (cannot fold)."""


class IndicatorFoldError(UserError, ValueError):
    """A state whose indicator path cannot be folded into a bias (the message says why)."""


def fold_indicator(
    state: Mapping[str, torch.Tensor], indicator: torch.Tensor
) -> dict[str, torch.Tensor]:
    """``state`` with the frozen indicator xi [D] folded into each indicator-fed layer's bias.

    For every ``channel_selection.<s>.fc`` (Eq. 7, W [C, C+D] on [GAP(F*), xi]) and
    ``prompt.<s>.proj`` (W [C, D] on xi): b' = b + W^xi xi and W^xi := 0, with W^xi the last D
    columns. The layer then gives at any indicator what it gave at xi, so the folded network needs
    no indicator input. Other keys are returned unchanged (a partial state works: a site's rho_k).
    Arithmetic in fp64, results in each tensor's dtype.
    """
    if indicator.dim() != 1:
        raise IndicatorFoldError(
            f"fold_indicator: indicator must be [D], got {tuple(indicator.shape)}"
        )
    nonlinear = sorted(k for k in state if NONLINEAR_INDICATOR_LAYERS.match(k))
    if nonlinear:
        raise IndicatorFoldError(
            f"{nonlinear[0]}: FedDP's channel selection embeds the indicator through a ReLU and "
            f"bias-free layers, so it cannot be folded into a bias; use indicator.unseen=own"
        )
    folded = dict(state)
    dim = indicator.numel()
    for key, weight in state.items():
        match = INDICATOR_LAYERS.match(key)
        if match is None:
            continue
        bias_key = f"{match['module']}.bias"
        if bias_key not in state:
            raise IndicatorFoldError(
                f"{key} is in the state but {bias_key} is not: the fold needs both in one part"
            )
        if weight.shape[-1] < dim:
            raise IndicatorFoldError(
                f"{key} has {weight.shape[-1]} input columns, fewer than the indicator's {dim}"
            )
        w_xi = weight[:, -dim:].double()  # [C, D]
        bias = state[bias_key]
        folded[bias_key] = (bias.double() + w_xi @ indicator.double().to(w_xi.device)).to(
            bias.dtype
        )
        new_weight = weight.clone()
        new_weight[:, -dim:] = 0
        folded[key] = new_weight
    return folded
