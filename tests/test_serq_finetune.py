"""Specification of the server fine-tuning of Fig. 5 (``serq.mode=finetune``, the blue line):
after aggregation the global model takes one Adam step on L_seg per synthetic batch of the
round, the batches SERQ would draw, and nothing else: no EQ step (v_pre, D_sy and the feature
bank untouched) and no feature term (lambda_sc plays no part)."""

# ruff: noqa: F811 (the imported fixture tiny_root is the tests' argument)
from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from fedst.federation.server import FederationServer
from fedst.seeding import seed_everything
from tests.test_federation import (
    experiment,
    tiny_root,  # noqa: F401 (module fixture)
)

BATCHES = 2


def server_after_one_round(
    tiny_root: Path, run_dir: Path, *overrides: str
) -> tuple[FederationServer, dict, dict[str, torch.Tensor]]:
    """A server (tiny preset, no pre-training) after one server step on its own global model:
    (server, the step's stats, the global model's state before the step)."""
    cfg = experiment(
        tiny_root,
        f"serq.batches_per_round={BATCHES}",
        "serq.batch_size=2",
        "pretraining.iters=0",
        "train.num_workers=0",
        *overrides,
    )
    torch.manual_seed(0)  # the same models and D_sy for every server
    server = FederationServer(cfg, run_dir, torch.device("cpu"))
    before = copy.deepcopy(server.global_model.state_dict())
    stats = server.server_step(server.shared_payload(), server_round=1)
    return server, stats, before


def test_finetune_trains_the_global_model_with_the_segmentation_loss_on_serqs_batches(
    tiny_root, tmp_path
):
    server, stats, before = server_after_one_round(tiny_root, tmp_path / "ft", "serq.mode=finetune")
    serq = server.step.serq
    assert serq is not None

    # the same steps by hand: a fresh model from the state before, the plan SERQ draws, Adam(lr)
    # on L_seg of the global model's logits without the temporal module
    by_hand = copy.deepcopy(server.global_model)
    by_hand.load_state_dict(before)
    by_hand.train()
    optimizer = torch.optim.Adam(by_hand.parameters(), lr=server.cfg.serq.lr)
    reference = FederationServer(server.cfg, tmp_path / "ref", torch.device("cpu")).step.serq
    seed_everything(server.cfg.seed, 0x5E12, 1)
    losses = []
    for images, masks, _ in reference.augmented_batches(reference._draw_plan()):
        logits = by_hand(images, serq.indicator, use_temporal=False)
        loss = serq.loss_fn(logits, masks)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert len(losses) == BATCHES
    for key, value in server.global_model.state_dict().items():
        torch.testing.assert_close(value, by_hand.state_dict()[key], msg=key)
    assert stats["sc_loss"] == pytest.approx(sum(losses) / BATCHES)
    assert stats["eq_loss"] is None and stats["sc_feature_gap"] is None
    assert stats["descriptor_rms"] is None and stats["serq_change"] > 0


def test_finetune_leaves_eq_the_descriptor_and_the_bank_untouched(tiny_root, tmp_path):
    cfg = experiment(tiny_root, "pretraining.iters=0", "train.num_workers=0")
    torch.manual_seed(0)
    untouched = FederationServer(cfg, tmp_path / "untouched", torch.device("cpu")).step.serq
    server, _, _ = server_after_one_round(tiny_root, tmp_path / "ft", "serq.mode=finetune")
    serq = server.step.serq
    assert torch.equal(serq.domain_descriptor, untouched.domain_descriptor)
    for key, value in serq.synthetic_model.state_dict().items():
        assert torch.equal(value, untouched.synthetic_model.state_dict()[key]), key
    assert serq.feature_bank == {} and serq.pre_optimizer.state_dict()["state"] == {}


def test_lambda_sc_plays_no_part_in_finetune_but_does_in_serq(tiny_root, tmp_path):
    def global_after(mode: str, lambda_sc: float) -> dict[str, torch.Tensor]:
        server, _, _ = server_after_one_round(
            tiny_root,
            tmp_path / f"{mode}_{lambda_sc}",
            f"serq.mode={mode}",
            f"serq.lambda_sc={lambda_sc}",
        )
        return server.global_model.state_dict()

    low, high = global_after("finetune", 0.3), global_after("finetune", 30.0)
    assert all(torch.equal(low[k], high[k]) for k in low)
    low, high = global_after("serq", 0.3), global_after("serq", 30.0)
    assert not all(torch.equal(low[k], high[k]) for k in low)


def test_an_unknown_serq_mode_is_refused_naming_the_key(tiny_root):
    with pytest.raises(Exception, match=r"serq\.mode='average'.*serq.*finetune"):
        experiment(tiny_root, "serq.mode=average")
