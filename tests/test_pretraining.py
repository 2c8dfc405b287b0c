"""Every method starts from the same synthetic pre-training (paper Sec. IV-A), switchable."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from fedst.cli import compose_experiment
from fedst.config import ConfigError
from fedst.data.procedural import generate
from fedst.experiment import experiment_from_json
from fedst.federation.server import FederationServer


@pytest.fixture(scope="module")
def tiny_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("procedural") / "tiny"
    generate(root, seed=0, preset="tiny", workers=1, progress=False)
    return root


def initial_model(root: Path, run_dir: Path, *overrides: str) -> dict[str, torch.Tensor]:
    """v_g^0 as the server hands it out before round 1."""
    cfg, _ = compose_experiment(
        ["experiment=tiny", f"data.root={root}", "pretraining.iters=3", *overrides]
    )
    server = FederationServer(cfg, run_dir, torch.device("cpu"))
    server.initialize()
    return server.initial_payload()


def test_a_method_without_serq_starts_from_the_same_pretrained_weights_as_fedst(
    tiny_root, tmp_path
):
    """FedST pre-trains v_pre inside SERQ; the same network without SERQ must get the identical
    pre-training from the server (same stream, optimizer, steps), not another one."""
    with_serq = initial_model(tiny_root, tmp_path / "a", "method=fedst")
    without_serq = initial_model(tiny_root, tmp_path / "b", "method=fedst", "method.serq=false")
    initialisation = initial_model(
        tiny_root,
        tmp_path / "c",
        "method=fedst",
        "method.serq=false",
        "method.synthetic_pretraining=false",
    )
    assert with_serq.keys() == without_serq.keys()
    for key in with_serq:
        torch.testing.assert_close(with_serq[key], without_serq[key], rtol=0, atol=0, msg=key)
    moved = [k for k in with_serq if not torch.equal(with_serq[k], initialisation[k])]
    assert len(moved) > len(with_serq) // 2  # pre-training changed the weights


def test_the_fedavg_baseline_is_pretrained_unless_switched_off(tiny_root, tmp_path):
    pretrained = initial_model(tiny_root, tmp_path / "a", "method=fedavg")
    switched_off = initial_model(
        tiny_root, tmp_path / "b", "method=fedavg", "method.synthetic_pretraining=false"
    )
    fresh, _ = compose_experiment(["experiment=tiny", "method=fedavg"])
    from fedst.methods import method_of

    initialisation = method_of(fresh).build_model().state_dict()
    for key, value in switched_off.items():
        assert torch.equal(value, initialisation[key]), key
    assert any(not torch.equal(pretrained[k], initialisation[k]) for k in pretrained)


def test_serq_without_pretraining_is_refused():
    from fedst.config import ConfigError

    with pytest.raises(ConfigError, match="synthetic_pretraining"):
        compose_experiment(["method=fedst", "method.synthetic_pretraining=false"])


def test_pre_training_times_only_the_steps_after_warm_up(monkeypatch):
    """The pre-training cost the GPU check extrapolates (3000 iterations) leaves out the first
    WARMUP_ITERS steps, which pay the loader's start and autotuning: a step made to take 0.2 s
    for the first two calls and 0.01 s after must time about 3 x 0.01 s for 5 iterations."""
    import time

    from fedst.methods import pretraining

    delays = iter([0.2, 0.2, 0.01, 0.01, 0.01])

    class Stream:
        def next_batch(self):
            time.sleep(next(delays))
            return torch.zeros(1, 1, 3, 4, 4), torch.zeros(1, 4, 4, dtype=torch.long), None

    model = torch.nn.Conv2d(3, 2, 1)
    forward = model.forward
    monkeypatch.setattr(model, "forward", lambda x, indicator, use_temporal: forward(x[:, -1]))
    result = pretraining.pretrain_on_synthetic(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        Stream(),
        None,
        lambda logits, masks: logits.square().mean(),
        iters=5,
        device=torch.device("cpu"),
    )
    assert pretraining.WARMUP_ITERS == 2 and result.steady_iters == 3
    assert 0.03 <= result.steady_seconds < 0.2  # the 0.2 s warm-up steps are outside
    assert result.seconds_per_iter == pytest.approx(result.steady_seconds / 3)


def test_pre_training_reads_its_own_settings_not_serqs(tiny_root, tmp_path):
    """FedAvg's pre-training at pretraining.lr: a different lr gives different initial weights,
    while serq.lr (read by no step of FedAvg) changes nothing."""
    base = initial_model(tiny_root, tmp_path / "a", "method=fedavg")
    other_serq_lr = initial_model(tiny_root, tmp_path / "b", "method=fedavg", "serq.lr=0.003")
    other_lr = initial_model(tiny_root, tmp_path / "c", "method=fedavg", "pretraining.lr=0.003")
    assert all(torch.equal(base[k], other_serq_lr[k]) for k in base)
    assert any(not torch.equal(base[k], other_lr[k]) for k in base)


def test_serq_refuses_a_pre_training_lr_or_batch_size_it_would_not_continue_with():
    for override in ("pretraining.lr=0.003", "pretraining.batch_size=3"):
        with pytest.raises(ConfigError, match="SERQ continues the pre-training"):
            compose_experiment(["experiment=tiny", "method=fedst", override])
    compose_experiment(["experiment=tiny", "method=fedst", "pretraining.lr=3e-4", "serq.lr=3e-4"])


def test_a_run_saved_before_the_pretraining_group_reads_its_serq_settings_as_pretrainings():
    """config.json of a run written before issue 48 kept serq.pretrain_iters, and its pre-training
    ran at serq.batch_size and serq.lr."""
    cfg, _ = compose_experiment(["experiment=tiny", "method=fedavg"])
    saved = json.loads(cfg.to_json())
    del saved["pretraining"]
    saved["serq"] = {**saved["serq"], "pretrain_iters": 17, "batch_size": 5, "lr": 0.02}
    old = experiment_from_json(json.dumps(saved))
    assert (old.pretraining.iters, old.pretraining.batch_size, old.pretraining.lr) == (17, 5, 0.02)
    assert not hasattr(old.serq, "pretrain_iters") and old.serq.batch_size == 5
