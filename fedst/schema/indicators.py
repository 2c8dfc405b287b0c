"""The site indicator xi_k as the config names it, without torch: its kinds (Table VII), the
CLIP text tower of the clip kind, and how an unseen site meets the out-of-federation model
(``indicator.unseen``); fedst/model/indicators.py computes the indicators,
fedst/model/channel_selection.py folds them."""

from __future__ import annotations

from fedst.config import ConfigError

INDICATOR_KINDS = ("clip", "onehot", "gaussian", "random")
DEFAULT_CLIP_MODEL = "ViT-B-32"
"""The open_clip text tower of the CLIP indicator: the one definition (IndicatorConfig uses it)."""
DEFAULT_CLIP_PRETRAINED = "openai"
"""Its pretrained tag (OpenAI's CLIP weights): the one definition (IndicatorConfig uses it)."""

UNSEEN_INDICATOR_RULES = ("auto", "own", "fold", "mean")
"""indicator.unseen: how the out-of-federation model meets a site outside the federation
(fedst/runs/returned.py applies the resolved rule; docs/methods.md)."""


def resolve_unseen_indicator_rule(rule: str, indicator_kind: str, feddp_embedding: bool) -> str:
    """``indicator.unseen`` resolved to own | fold | mean for a network that reads an indicator.

    auto: own for a clip indicator (an unseen site's prompt shares the sites' template) and for
    FedDP's channel selection (``feddp_embedding``: its indicator passes a ReLU, so there is no
    bias to fold it into, fedst.model.channel_selection
    NONLINEAR_INDICATOR_LAYERS); fold (fedst.model.channel_selection.fold_indicator)
    otherwise. FedDP's channel selection refuses fold and mean with a ConfigError, at composition.
    """
    if rule not in UNSEEN_INDICATOR_RULES:
        raise ConfigError(f"indicator.unseen={rule!r}; choose one of {UNSEEN_INDICATOR_RULES}")
    if rule == "auto":
        return "own" if indicator_kind == "clip" or feddp_embedding else "fold"
    if feddp_embedding and rule != "own":
        raise ConfigError(
            f"indicator.unseen={rule}: FedDP's channel selection embeds the indicator through "
            f"a ReLU and bias-free layers, so it cannot be folded or averaged into a bias; "
            f"use indicator.unseen=own"
        )
    return rule
