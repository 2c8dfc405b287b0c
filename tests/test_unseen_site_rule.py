"""Specification of the unseen-site indicator rule (``indicator.unseen``; docs/methods.md).

* folding a frozen indicator xi into a layer that reads it linearly keeps that layer's output at
  xi and removes its dependence on the indicator: b' = b + W^xi xi, W^xi = 0;
* a one-hot site's folded bias is its bias plus its own indicator column (derived by hand);
* ``auto`` resolves to own for CLIP and for FedDP's channel selection, fold otherwise;
* FedDP's channel selection (indicator through a ReLU, no bias) refuses fold and mean.

The run-level rules (the out-of-federation model folds each site's xi_k into its own v_k before
averaging; ``mean`` runs the average at the mean indicator) are specified in
tests/test_returned_models.py on its two-round run.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from fedst.config import ConfigError
from fedst.model.channel_selection import (
    ChannelSelection,
    IndicatorFoldError,
    PromptBias,
    SiteChannelSelection,
    fold_indicator,
)
from tests.test_federation import experiment

CHANNELS, DIM = 3, 2


def _prefixed(module: torch.nn.Module, prefix: str) -> dict[str, torch.Tensor]:
    return {f"{prefix}.{k}": v.detach().clone() for k, v in module.state_dict().items()}


def _unprefixed(state: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    return {k.removeprefix(f"{prefix}."): v for k, v in state.items()}


def test_folding_keeps_the_gate_at_the_folded_indicator_and_then_ignores_the_indicator():
    torch.manual_seed(0)
    selection = ChannelSelection(CHANNELS, DIM)
    feat = torch.randn(2, CHANNELS, 4, 5)
    xi, other = torch.randn(DIM), torch.randn(DIM)
    folded = ChannelSelection(CHANNELS, DIM)
    state = fold_indicator(_prefixed(selection, "channel_selection.1"), xi)
    folded.load_state_dict(_unprefixed(state, "channel_selection.1"))
    expected = selection(feat, xi)
    torch.testing.assert_close(folded(feat, other), expected, rtol=0, atol=1e-6)
    torch.testing.assert_close(folded(feat, torch.zeros(DIM)), expected, rtol=0, atol=1e-6)
    assert not torch.allclose(selection(feat, other), expected)  # the unfolded one did depend on it


def test_a_onehot_sites_folded_bias_is_its_bias_plus_its_own_indicator_column():
    weight = torch.arange(CHANNELS * (CHANNELS + DIM), dtype=torch.float32).reshape(CHANNELS, -1)
    bias = torch.tensor([0.5, -1.0, 2.0])
    state = {"channel_selection.1.fc.weight": weight, "channel_selection.1.fc.bias": bias}
    folded = fold_indicator(state, torch.tensor([0.0, 1.0]))  # site id 1 of D = 2
    # by hand: column C + 1 = 4 of W is [4, 9, 14]; the indicator columns become zero
    assert folded["channel_selection.1.fc.bias"].tolist() == [4.5, 8.0, 16.0]
    assert folded["channel_selection.1.fc.weight"][:, :CHANNELS].equal(weight[:, :CHANNELS])
    assert folded["channel_selection.1.fc.weight"][:, CHANNELS:].abs().sum() == 0
    assert state["channel_selection.1.fc.bias"].tolist() == [0.5, -1.0, 2.0]  # input untouched


def test_prompt_bias_folds_its_projection_into_its_bias():
    torch.manual_seed(1)
    prompt = PromptBias(CHANNELS, DIM)
    torch.nn.init.normal_(prompt.proj.weight)
    torch.nn.init.normal_(prompt.proj.bias)
    feat, xi = torch.randn(1, CHANNELS, 2, 2), torch.randn(DIM)
    folded = PromptBias(CHANNELS, DIM)
    folded.load_state_dict(
        _unprefixed(fold_indicator(_prefixed(prompt, "prompt.1"), xi), "prompt.1")
    )
    torch.testing.assert_close(folded(feat, torch.randn(DIM)), prompt(feat, xi), rtol=0, atol=1e-6)


def test_keys_of_other_modules_pass_unchanged_and_a_split_layer_is_an_error():
    other = {"decoder.head.weight": torch.ones(2, 2)}
    assert (
        fold_indicator(other, torch.ones(DIM))["decoder.head.weight"]
        is other["decoder.head.weight"]
    )
    with pytest.raises(IndicatorFoldError, match=r"fc\.bias"):
        fold_indicator({"channel_selection.1.fc.weight": torch.ones(3, 5)}, torch.ones(DIM))


def test_feddp_channel_selection_cannot_be_folded():
    state = _prefixed(SiteChannelSelection(16, DIM), "channel_selection.3")
    with pytest.raises(IndicatorFoldError, match="FedDP"):
        fold_indicator(state, torch.ones(DIM))


@pytest.mark.parametrize(
    ("indicator", "expected"),
    [("clip", "own"), ("onehot", "fold"), ("gaussian", "fold"), ("random", "fold")],
)
def test_auto_is_own_for_clip_prompts_and_fold_for_the_other_kinds(tmp_path, indicator, expected):
    cfg = experiment(tmp_path, f"method.indicator={indicator}")
    assert cfg.indicator.unseen == "auto"
    assert cfg.unseen_indicator_rule() == expected


def test_an_explicit_rule_is_kept_and_a_network_without_indicator_has_none(tmp_path):
    assert experiment(tmp_path, "indicator.unseen=mean").unseen_indicator_rule() == "mean"
    assert experiment(tmp_path, "indicator.unseen=own").unseen_indicator_rule() == "own"
    assert experiment(tmp_path, "method=fedavg").unseen_indicator_rule() is None


def test_feddp_resolves_auto_to_own_and_refuses_fold(tmp_path):
    cfg = experiment(tmp_path, "method=feddp")
    assert cfg.unseen_indicator_rule() == "own"
    with pytest.raises(ConfigError, match=r"indicator\.unseen=fold"):
        dataclasses.replace(cfg, indicator=dataclasses.replace(cfg.indicator, unseen="fold"))


def test_an_unknown_rule_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match=r"indicator\.unseen='folded'"):
        experiment(tmp_path, "indicator.unseen=folded")
