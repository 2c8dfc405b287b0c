"""Specification of FedAS (Yang, Huang, Ye, CVPR 2024; fedst/methods/fedas.py): before adopting
the received base a site aligns it to its local model's pixel-level class prototypes (not in its
first round: it has no local base yet), its reply carries the trace of its empirical Fisher, and
the server weights the bases by those traces. Constructed tensors, then the tiny preset."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch import nn

from fedst.cli import compose_experiment
from fedst.config import ConfigError
from fedst.federation.site import Site
from fedst.methods import method_of
from fedst.methods.fedas import (
    align_base,
    alignment_loss,
    class_prototypes,
    fisher_trace,
    pixel_features,
)
from tests import test_methods_fedrep
from tests.conftest import sent_keys, train_reply
from tests.test_aggregation import GAMMAS, SAMPLES
from tests.test_federation import experiment
from tests.test_methods_fedrep import HEAD_KEYS, recorded_run

tiny_root = test_methods_fedrep.tiny_root  # the tiny procedural benchmark, once per module


class _LinearNet(nn.Module):
    """features f = W x per pixel (1x1 conv, no bias), then the head: logits = V f + b."""

    def __init__(self, weight: np.ndarray, head_weight: np.ndarray, head_bias: np.ndarray):
        super().__init__()
        self.decoder = nn.Module()
        self.decoder.body = nn.Conv2d(weight.shape[1], weight.shape[0], 1, bias=False)
        self.decoder.head = nn.Conv2d(head_weight.shape[1], head_weight.shape[0], 1)
        with torch.no_grad():
            self.decoder.body.weight.copy_(torch.tensor(weight)[..., None, None])
            self.decoder.head.weight.copy_(torch.tensor(head_weight)[..., None, None])
            self.decoder.head.bias.copy_(torch.tensor(head_bias))

    def forward(self, clips: torch.Tensor, indicator=None) -> torch.Tensor:
        return self.decoder.head(self.decoder.body(clips[:, -1]))  # [B, 3, H, W] -> [B, K, H, W]


IGNORE = 255
# one clip of one frame, 2 x 2 pixels of 3 channels; labels 0 1 / 1 ignored
PIXELS = np.array([[1.0, 0.0, 2.0], [0.0, 1.0, 1.0], [2.0, 1.0, 0.0], [5.0, 5.0, 5.0]])
LABELS = np.array([0, 1, 1, IGNORE])
W = np.array([[1.0, -1.0, 0.5], [0.0, 2.0, 1.0]])  # D = 2 features
HEAD_W, HEAD_B = np.array([[1.0, 0.0], [0.0, 1.0]]), np.array([0.0, 0.0])


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    clips = torch.tensor(PIXELS.T.reshape(1, 1, 3, 2, 2), dtype=torch.float32)
    masks = torch.tensor(LABELS.reshape(1, 2, 2))
    return clips, masks


def test_prototypes_are_the_mean_feature_of_each_class_over_its_labelled_pixels():
    net = _LinearNet(W, HEAD_W, HEAD_B).float()
    prototypes, counts = class_prototypes(net, [_batch()], None, num_classes=3, ignore_index=IGNORE)
    features = PIXELS @ W.T  # [4, D]
    np.testing.assert_allclose(counts.numpy(), [1, 2, 0])  # class 2 absent, pixel 4 ignored
    np.testing.assert_allclose(prototypes[0].numpy(), features[0], rtol=1e-6)
    np.testing.assert_allclose(prototypes[1].numpy(), features[1:3].mean(0), rtol=1e-6)


def test_one_alignment_step_is_sgd_on_the_per_class_mse_to_the_prototypes():
    net = _LinearNet(W, HEAD_W, HEAD_B).float()
    prototypes = np.array([[0.5, 1.0], [-1.0, 2.0], [9.0, 9.0]])
    counts = torch.tensor([1.0, 2.0, 0.0])  # class 2 has no prototype: never a target
    lr = 0.1
    align_base(net, [_batch()], torch.tensor(prototypes).float(), counts, None, lr, IGNORE)
    # by hand: L = sum_c 1/(n_c D) sum_{i in c} ||W x_i - p_c||^2 over labelled pixels, so
    # dL/dW = sum_c 2/(n_c D) sum_{i in c} (W x_i - p_c) x_i^T
    grad = np.zeros_like(W)
    for c, pixels in ((0, [0]), (1, [1, 2])):
        for i in pixels:
            residual = W @ PIXELS[i] - prototypes[c]
            grad += 2.0 / (len(pixels) * W.shape[0]) * np.outer(residual, PIXELS[i])
    expected = W - lr * grad
    got = net.decoder.body.weight.detach()[..., 0, 0].double().numpy()
    np.testing.assert_allclose(got, expected, rtol=1e-5)
    np.testing.assert_array_equal(net.decoder.head.weight.detach()[..., 0, 0].numpy(), HEAD_W)


def test_the_fisher_trace_is_the_summed_squared_gradient_norm_of_the_pixel_nll():
    # W = 0 and V = 0: the logits are the head bias b at every pixel, so the only non-zero
    # gradient of the mean pixel NLL is d/db = softmax(b) - (label frequencies)
    bias = np.array([0.5, -1.0, 0.0])
    net = _LinearNet(np.zeros((2, 3)), np.zeros((3, 2)), bias).float()
    second = (_batch()[0], torch.tensor([[[2, 2], [0, IGNORE]]]))
    trace, used = fisher_trace(net, [_batch(), second], None, IGNORE)
    softmax = np.exp(bias) / np.exp(bias).sum()
    expected = sum(
        np.sum((softmax - np.bincount(labels, minlength=3) / len(labels)) ** 2)
        for labels in ([0, 1, 1], [2, 2, 0])
    )
    assert used == 2
    assert trace == pytest.approx(expected, rel=1e-5)


def test_the_server_weights_each_base_by_its_fisher_trace_over_the_sum_of_traces():
    traces = [1.0, 3.0, 4.0]
    # by hand: (1 * [1, 10] + 3 * [2, 0] + 4 * [6, 2]) / 8
    expected = [(1 * 1 + 3 * 2 + 4 * 6) / 8, (1 * 10 + 3 * 0 + 4 * 2) / 8]  # [3.875, 2.25]
    replies = [
        train_reply({"w": torch.tensor(g)}, n, **{"fisher-trace": f})
        for g, n, f in zip(GAMMAS, SAMPLES, traces, strict=True)
    ]
    cfg, _ = compose_experiment(["experiment=tiny", "method=fedas"])
    aggregated = method_of(cfg).aggregate(1, replies, {"w": torch.zeros(2)})["w"].numpy()
    np.testing.assert_allclose(aggregated, expected)


def test_fisher_weights_are_refused_for_a_method_whose_replies_carry_no_fisher_trace():
    with pytest.raises(ConfigError, match="'fisher-trace', which the replies"):
        compose_experiment(
            ["experiment=tiny", "method=fedavg", "method.aggregation_weights=fisher"]
        )


@pytest.fixture
def trained_site(tiny_root, tmp_path):
    """Site A of a tiny FedAS run after its first round (2 local iterations)."""
    cfg = experiment(
        tiny_root,
        "method=fedas",
        "method.options.prototype_batches=2",
        "method.options.align_iters=3",
        "method.options.fisher_batches=2",
    )
    site = Site("A", cfg, tmp_path, torch.device("cpu"))
    initial = {k: v.clone() for k, v in method_of(cfg).build_model().state_dict().items()}
    site.train_round(initial, server_round=1, local_iters=2)
    return cfg, site, initial


def _alignment_mse(site: Site, base: dict[str, torch.Tensor], batch, prototypes, counts) -> float:
    """The alignment loss (per-class mean squared distance of each pixel's features to its
    class prototype) on ``batch`` with ``base`` in the site's model, in eval mode."""
    site.model.load_state_dict({**site.model.state_dict(), **base})
    site.model.eval()
    clips, masks = batch
    with torch.no_grad():
        features, labels = pixel_features(site.model, clips, masks, None)
        return alignment_loss(features, labels, prototypes, counts, IGNORE).item()


def test_the_first_round_adopts_the_received_model_as_is(trained_site, tmp_path):
    cfg, _, initial = trained_site
    fresh = Site("B", cfg, tmp_path / "B", torch.device("cpu"))
    # a received model unlike the site's own initialisation (which equals ``initial``)
    received = {k: v + 0.5 if v.is_floating_point() else v for k, v in initial.items()}
    fresh.train_round(received, server_round=1, local_iters=0)  # no local base: no alignment
    for key, value in fresh.model.state_dict().items():
        assert torch.equal(value, received[key]), key


def test_alignment_moves_the_received_base_towards_the_local_prototypes_before_training(
    trained_site,
):
    _, site, initial = trained_site
    method = site.method
    local_base = {k: v.clone() for k, v in method.local_base.items()}
    assert set(local_base) == set(site.partition.shared)
    received = {k: initial[k] for k in site.partition.shared}  # a global base != the local one
    site.model.load_state_dict({**site.model.state_dict(), **local_base})
    prototypes, counts = class_prototypes(
        site.model, method._batches(site, 2, 1, 2), None, 4, IGNORE
    )
    site.train_round(received, server_round=2, local_iters=0)  # adoption only, no training
    adopted = {k: site.model.state_dict()[k].clone() for k in site.partition.shared}
    moved = [k for k in received if not torch.equal(adopted[k], received[k])]
    assert len(moved) > len(received) // 2  # alignment changed the received base
    held_out = next(method._batches(site, 99, 1, 1))  # a batch the alignment did not step on
    before = _alignment_mse(site, received, held_out, prototypes, counts)
    after = _alignment_mse(site, adopted, held_out, prototypes, counts)
    assert after < before


def test_a_restarted_site_aligns_from_the_local_base_on_its_disk(trained_site, tmp_path):
    cfg, site, _ = trained_site
    restarted = Site("A", cfg, tmp_path, torch.device("cpu"))  # a new process after round 1
    restarted.restore(1)
    assert restarted.method.local_base is not None
    for key, value in site.method.local_base.items():
        assert torch.equal(restarted.method.local_base[key], value), key


def test_fedas_replies_carry_a_positive_fisher_trace_and_a_tiny_run_finishes(tiny_root, tmp_path):
    cfg = experiment(
        tiny_root,
        "method=fedas",
        "method.options.prototype_batches=1",
        "method.options.align_iters=1",
        "method.options.fisher_batches=1",
    )
    final, messages = recorded_run(cfg, tmp_path / "run")
    train_replies = [m for d, m in messages if d == "up" and m.metadata.message_type == "train"]
    assert len(train_replies) == 4 * 2
    for reply in train_replies:
        trace = reply.content["metrics"]["fisher-trace"]
        assert math.isfinite(trace) and trace > 0
        assert not sent_keys(reply) & HEAD_KEYS
    assert (tmp_path / "run" / "final.json").is_file()
    assert all(math.isfinite(v["dice"]) for v in final["sites"].values())
