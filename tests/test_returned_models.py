"""Specification of the models a run returns and scores (Algorithm 1, lines 14-17; Sec. IV-B2).

* FedST returns v_k = gamma_k^T U rho_k^T: each site's *own* shared parameters after its last
  local round (what it sent in its last reply), with its own rho_k; a site is scored with it,
  at every evaluation round, whatever the server did to gamma_g afterwards (SERQ's SC step);
* ``method.returned_model=global`` scores gamma_g U rho_k instead (the earlier behaviour);
* the out-of-federation model is sum_k n_k / n v_k over the returned models, personal parts
  included (``indicator.unseen=own``); with one-hot indicators (``auto`` = fold) each site's
  indicator is first folded into its own channel-selection bias, and ``mean`` runs the average at
  the sample-weighted mean indicator (docs/methods.md).

Tiny preset, in-process: the ClientApp's handlers are reached through Flower messages, the path
of every engine.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from flwr.app import Message

from fedst.app.inprocess import InProcessGrid
from fedst.data.procedural import generate
from fedst.federation import site as site_module
from fedst.federation import transport
from fedst.methods import method_of
from fedst.runs import Run
from fedst.training import run_training
from tests.test_federation import experiment


@pytest.fixture(scope="module")
def tiny_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("procedural") / "tiny"
    generate(root, seed=0, preset="tiny", workers=1, progress=False)
    return root


def scored_run(cfg, run_dir: Path):
    """Run ``cfg``; return the messages that crossed the grid and, per (site, round), the state
    dict of the model each site scored on its test split."""
    messages: list[tuple[str, Message]] = []
    scored: dict[tuple[str, int], dict[str, torch.Tensor]] = {}
    original_grid_init = InProcessGrid.__init__
    original_evaluate = site_module.Site.evaluate

    def recording_init(self, *args, **kwargs):
        original_grid_init(self, *args, **kwargs, observer=lambda d, m: messages.append((d, m)))

    def recording_evaluate(self, received, server_round, keep_examples=0, split="test"):
        results = original_evaluate(self, received, server_round, keep_examples, split)
        if split == "test":
            state = self.model.state_dict()
            scored[(self.name, server_round)] = {k: v.clone() for k, v in state.items()}
        return results

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(InProcessGrid, "__init__", recording_init)
        patch.setattr(site_module.Site, "evaluate", recording_evaluate)
        run_training(cfg, run_dir, progress=False)
    return messages, scored


def sent_shared(messages, site: str, server_round: int) -> dict[str, torch.Tensor]:
    """gamma_k as site ``site`` sent it in its train reply of ``server_round``."""
    for direction, message in messages:
        if (
            direction == "up"
            and message.metadata.message_type == "train"
            and message.metadata.group_id == str(server_round)
            and message.content["site"]["site"] == site
        ):
            return transport.unpack(message.content, "arrays")
    raise AssertionError(f"no train reply of site {site} in round {server_round}")


def received_shared(messages, server_round: int) -> dict[str, torch.Tensor]:
    """gamma_g as the server sent it for the evaluation of ``server_round``."""
    for direction, message in messages:
        if (
            direction == "down"
            and message.metadata.message_type == "evaluate"
            and message.metadata.group_id == str(server_round)
        ):
            return transport.unpack(message.content, "arrays")
    raise AssertionError(f"no evaluate message in round {server_round}")


@pytest.fixture(scope="module")
def fedst_two_rounds(tiny_root, tmp_path_factory):
    cfg = experiment(tiny_root, "train.eval_every=1")
    run_dir = tmp_path_factory.mktemp("runs") / "fedst"
    messages, scored = scored_run(cfg, run_dir)
    return cfg, run_dir, messages, scored


def test_a_fedst_site_is_scored_with_its_own_gamma_k_and_rho_k_after_each_round(
    fedst_two_rounds,
):
    cfg, run_dir, messages, scored = fedst_two_rounds
    partition = method_of(cfg).partition(method_of(cfg).build_model())
    assert method_of(cfg).returns_own_model and method_of(cfg).uses_serq
    for site in cfg.data.federation:
        for server_round in (1, 2):
            model = scored[(site, server_round)]
            own = sent_shared(messages, site, server_round)
            assert set(own) == set(partition.shared)
            for key, value in own.items():
                assert torch.equal(model[key], value), (site, server_round, key)
            global_shared = received_shared(messages, server_round)
            # SERQ moved gamma_g away from every gamma_k: the scored model is not gamma_g
            assert any(not torch.equal(model[k], global_shared[k]) for k in own)
        state = torch.load(run_dir / "sites" / site / "state_r0002.pt", weights_only=False)
        for key, value in state["personal"].items():
            assert torch.equal(scored[(site, 2)][key], value), (site, key)


def test_the_out_of_federation_model_is_the_sample_weighted_average_of_the_returned_models(
    fedst_two_rounds,
):
    cfg, run_dir, messages, _ = fedst_two_rounds
    cfg = with_unseen_rule(cfg, "own")
    states = site_states(cfg, run_dir)
    counts = {site: float(state["num_examples"]) for site, state in states.items()}
    assert len(set(counts.values())) > 1  # the tiny sites differ in size: weights matter
    total = sum(counts.values())
    model = Run(run_dir, cfg).outfed_model(torch.device("cpu")).state_dict()
    for part in ("shared", "personal"):
        for key in states["A"][part]:
            if not states["A"][part][key].is_floating_point():
                continue
            expected = torch.zeros_like(states["A"][part][key], dtype=torch.float64)
            for site, state in states.items():
                value = (
                    sent_shared(messages, site, 2)[key] if part == "shared" else state[part][key]
                )
                expected += counts[site] / total * value.double()
            torch.testing.assert_close(model[key].double(), expected, rtol=0, atol=1e-6)


def with_unseen_rule(cfg, rule: str):
    return dataclasses.replace(cfg, indicator=dataclasses.replace(cfg.indicator, unseen=rule))


def site_states(cfg, run_dir: Path) -> dict[str, dict]:
    return {
        site: torch.load(run_dir / "sites" / site / "state_r0002.pt", weights_only=False)
        for site in cfg.data.federation
    }


CS_WEIGHT, CS_BIAS = "channel_selection.1.fc.weight", "channel_selection.1.fc.bias"
"""The tiny network's channel selection (stage 1): W [C, C + D] on [GAP(F*), xi], b [C]."""


def test_with_onehot_indicators_each_site_folds_its_own_indicator_column_before_averaging(
    fedst_two_rounds,
):
    cfg, run_dir, _, _ = fedst_two_rounds
    assert cfg.method.indicator == "onehot" and cfg.unseen_indicator_rule() == "fold"  # auto
    states = site_states(cfg, run_dir)
    counts = {site: float(state["num_examples"]) for site, state in states.items()}
    total = sum(counts.values())
    order = method_of(cfg).site_order()
    model = Run(run_dir, cfg).outfed_model(torch.device("cpu")).state_dict()
    channels = states["A"]["personal"][CS_BIAS].numel()
    # by hand: xi_k = e_{id(k)}, so W^xi_k xi_k is column C + id(k) of W_k
    expected_bias = sum(
        counts[s]
        / total
        * (
            st["personal"][CS_BIAS].double()
            + st["personal"][CS_WEIGHT][:, channels + order.index(s)].double()
        )
        for s, st in states.items()
    )
    expected_feature_part = sum(
        counts[s] / total * st["personal"][CS_WEIGHT][:, :channels].double()
        for s, st in states.items()
    )
    torch.testing.assert_close(model[CS_BIAS].double(), expected_bias, rtol=0, atol=1e-6)
    torch.testing.assert_close(
        model[CS_WEIGHT][:, :channels].double(), expected_feature_part, rtol=0, atol=1e-6
    )
    assert model[CS_WEIGHT][:, channels:].abs().sum() == 0  # the average reads no indicator
    # everything else is the plain sample-weighted average
    plain = (
        Run(run_dir, with_unseen_rule(cfg, "own")).outfed_model(torch.device("cpu")).state_dict()
    )
    for key, value in plain.items():
        if key not in (CS_WEIGHT, CS_BIAS):
            torch.testing.assert_close(model[key], value, rtol=0, atol=1e-6)


def test_the_mean_rule_runs_the_average_at_the_sample_weighted_mean_indicator(fedst_two_rounds):
    cfg, run_dir, _, _ = fedst_two_rounds
    states = site_states(cfg, run_dir)
    counts = {site: float(state["num_examples"]) for site, state in states.items()}
    total = sum(counts.values())
    order = method_of(cfg).site_order()
    plain = (
        Run(run_dir, with_unseen_rule(cfg, "own")).outfed_model(torch.device("cpu")).state_dict()
    )
    model = (
        Run(run_dir, with_unseen_rule(cfg, "mean")).outfed_model(torch.device("cpu")).state_dict()
    )
    channels = plain[CS_BIAS].numel()
    # by hand: xi_bar = sum_k n_k / n e_{id(k)}, so W_bar xi_bar weighs W_bar's site columns
    expected_bias = plain[CS_BIAS].double() + sum(
        counts[s] / total * plain[CS_WEIGHT][:, channels + order.index(s)].double() for s in states
    )
    torch.testing.assert_close(model[CS_BIAS].double(), expected_bias, rtol=0, atol=1e-6)
    assert model[CS_WEIGHT][:, channels:].abs().sum() == 0


def test_returned_model_global_scores_gamma_g_with_each_sites_rho_k(tiny_root, tmp_path):
    cfg = experiment(
        tiny_root,
        "method.returned_model=global",
        "train.eval_every=1",
        "train.keep_resume_state=true",  # the states as training wrote them (finished: no gamma_k)
    )
    messages, scored = scored_run(cfg, tmp_path / "run")
    for site in cfg.data.federation:
        global_shared = received_shared(messages, 2)
        for key, value in global_shared.items():
            assert torch.equal(scored[(site, 2)][key], value), (site, key)
        state = torch.load(tmp_path / "run" / "sites" / site / "state_r0002.pt", weights_only=False)
        for key, value in state["personal"].items():
            assert torch.equal(scored[(site, 2)][key], value), (site, key)
        # the site still keeps what it sent: gamma_k, not gamma_g
        for key, value in sent_shared(messages, site, 2).items():
            assert torch.equal(state["shared"][key], value), (site, key)


def test_each_method_returns_what_its_paper_returns(tiny_root):
    own = {"fedst", "local", "upperbound"}
    for name in ("fedst", "fedavg", "fedld", "fedrep", "fedas", "feddp", "local", "upperbound"):
        method = method_of(experiment(tiny_root, f"method={name}"))
        assert method.returns_own_model == (name in own), name
    ablation = method_of(experiment(tiny_root, "+ablation=table4_row1_baseline"))
    assert ablation.returns_own_model  # Table IV's rows are FedST's settings: Algorithm 1
