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
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["ChannelSelection", "PromptBias", "SiteChannelSelection", "expand_indicator"]


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
