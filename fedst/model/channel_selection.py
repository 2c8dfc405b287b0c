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
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["ChannelSelection", "PromptBias", "expand_indicator"]


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
