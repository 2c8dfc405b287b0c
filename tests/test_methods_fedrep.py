"""Specification of FedRep (Collins et al. 2021; fedst/methods/fedrep.py): the head (the final
1x1 classifier) is private, the body shared; each round trains the head with the body frozen,
then the body with the head frozen; only the body travels. Tiny preset, in-process."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from flwr.app import Message

from fedst.app.inprocess import InProcessGrid
from fedst.config import ConfigError
from fedst.data.procedural import generate
from fedst.experiment import ExperimentConfig
from fedst.federation import site as site_module
from fedst.federation.site import Site
from fedst.methods import method_of
from fedst.training import run_training
from tests.conftest import sent_keys
from tests.test_federation import experiment

HEAD_KEYS = {"decoder.head.weight", "decoder.head.bias"}
"""The final 1x1 classifier of fedst/model/decoder.py (FPNDecoder.head)."""


@pytest.fixture(scope="module")
def tiny_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("procedural") / "tiny"
    generate(root, seed=0, preset="tiny", workers=1, progress=False)
    return root


def recorded_run(cfg: ExperimentConfig, run_dir: Path) -> tuple[dict, list[tuple[str, Message]]]:
    """``run_training`` of ``cfg`` with every message that crossed the grid, as (direction,
    message); direction "down" (server to site) or "up"."""
    messages: list[tuple[str, Message]] = []
    original = InProcessGrid.__init__

    def recording_init(self, *args, **kwargs):
        original(self, *args, **kwargs, observer=lambda d, m: messages.append((d, m)))

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(InProcessGrid, "__init__", recording_init)
        final = run_training(cfg, run_dir, progress=False)
    return final, messages


def test_the_head_is_the_private_part_and_the_body_all_the_rest(tiny_root):
    method = method_of(experiment(tiny_root, "method=fedrep"))
    model = method.build_model()
    partition = method.partition(model)
    assert set(partition.personal) == HEAD_KEYS
    floats = {k for k, v in model.state_dict().items() if v.is_floating_point()}
    assert set(partition.shared) == floats - HEAD_KEYS


def test_the_body_trains_every_methods_local_iterations_after_as_many_head_iterations(tiny_root):
    """Identical schedules (FedST Sec. IV-A): the body, FedRep's federated model, gets E updates
    a round like every method's model; the head phase comes first (default: E iterations)."""
    method = method_of(experiment(tiny_root, "method=fedrep"))
    for local_iters in (100, 20, 1):
        phases = method.local_phases(local_iters)
        assert [(p.name, p.iterations) for p in phases] == [
            ("head", local_iters),
            ("body", local_iters),
        ]
    explicit = method_of(experiment(tiny_root, "method=fedrep", "method.options.head_iters=3"))
    assert [(p.name, p.iterations) for p in explicit.local_phases(20)] == [
        ("head", 3),
        ("body", 20),
    ]
    with pytest.raises(ConfigError, match="head_iters"):
        experiment(tiny_root, "method=fedrep", "method.options.head_iters=-1")


def test_the_body_is_frozen_during_head_iterations_and_the_head_during_body_iterations(
    tiny_root, tmp_path
):
    cfg = experiment(tiny_root, "method=fedrep", "method.options.head_iters=1")
    site = Site("A", cfg, tmp_path, torch.device("cpu"))
    snapshots: list[tuple[str, dict[str, torch.Tensor]]] = []
    original = site_module.Site.train_phase

    def recording_phase(self, phase, server_round):
        before = {k: v.clone() for k, v in self.model.state_dict().items()}
        losses = original(self, phase, server_round)
        snapshots.append((phase.name, before))
        snapshots.append((phase.name, {k: v.clone() for k, v in self.model.state_dict().items()}))
        return losses

    received = {k: v.clone() for k, v in method_of(cfg).build_model().state_dict().items()}
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(site_module.Site, "train_phase", recording_phase)
        site.train_round(received, server_round=1, local_iters=2)
    assert [name for name, _ in snapshots] == ["head", "head", "body", "body"]
    floats = [k for k, v in received.items() if v.is_floating_point()]
    body = [k for k in floats if k not in HEAD_KEYS]

    def changed(before: dict, after: dict, keys: list[str]) -> set[str]:
        return {k for k in keys if not torch.equal(before[k], after[k])}

    head_before, head_after = snapshots[0][1], snapshots[1][1]
    assert changed(head_before, head_after, body) == set()  # body frozen in the head phase
    assert changed(head_before, head_after, sorted(HEAD_KEYS)) == HEAD_KEYS
    body_before, body_after = snapshots[2][1], snapshots[3][1]
    assert changed(body_before, body_after, sorted(HEAD_KEYS)) == set()  # head frozen
    assert len(changed(body_before, body_after, body)) > len(body) // 2  # the body trains


def test_only_the_body_travels_and_a_tiny_fedrep_run_finishes(tiny_root, tmp_path):
    cfg = experiment(tiny_root, "method=fedrep")
    final, messages = recorded_run(cfg, tmp_path / "run")
    partition = method_of(cfg).partition(method_of(cfg).build_model())
    train_replies = [m for d, m in messages if d == "up" and m.metadata.message_type == "train"]
    assert len(train_replies) == 4 * 2  # 4 sites, 2 rounds
    for reply in train_replies:
        keys = sent_keys(reply)
        assert keys == set(partition.shared)
        assert not keys & HEAD_KEYS
    assert (tmp_path / "run" / "final.json").is_file()
    assert sorted(final["sites"]) == ["A", "B", "C", "D"]
    assert all(math.isfinite(v["dice"]) for v in final["sites"].values())
