"""Specification of FedLD (fedst/methods/fedld.py): the margin-control term at the sites and the
principal-direction aggregation at the server, checked against hand computations (numpy, the
release's per-site, per-direction loop) on constructed updates, plus one tiny end-to-end run."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from fedst.methods import method_of
from fedst.methods.fedld import FedLD, margin_penalty
from fedst.model.losses import SegmentationLoss
from fedst.training import run_training
from tests.conftest import train_reply
from tests.test_federation import experiment, tiny_root  # noqa: F401 (module fixture)

CURRENT = np.array([0.5, -1.0, 2.0, 0.0])
"""gamma_g^t of the constructed 4-element tensor."""
UPDATES = np.array(
    [  # three sites' updates gamma_k - gamma_g^t
        [1.0, 2.0, -0.5, 0.3],
        [0.8, 1.5, 0.4, -0.2],
        [-2.0, 0.1, 1.0, 1.2],
    ]
)


def _fedld(*overrides: str) -> FedLD:
    from fedst.cli import compose_experiment

    cfg, _ = compose_experiment(["experiment=tiny", "method=fedld", *overrides])
    method = method_of(cfg)
    assert isinstance(method, FedLD)
    return method


def _aggregate(method: FedLD, server_round: int, updates: np.ndarray, samples=(1, 1, 1)):
    """FedLD's gamma_g^{t+1} of tensor "w" (CURRENT + updates) and of a one-element tensor "s"
    (site k sends 10 * k), from constructed replies."""
    replies = [
        train_reply({"w": torch.tensor(CURRENT + u), "s": torch.tensor([10.0 * k])}, num_examples=n)
        for k, (u, n) in enumerate(zip(updates, samples, strict=True))
    ]
    current = {"w": torch.tensor(CURRENT), "s": torch.tensor([0.0])}
    out = method.aggregate(server_round, replies, current)
    return out["w"].numpy(), out["s"].numpy()


def _release_formula(updates: np.ndarray, weights: np.ndarray, fraction: float = 0.8) -> np.ndarray:
    """The release's pcgrad_svd for one tensor, written independently as its loops in numpy."""
    m = updates.shape[0]
    _, s, vt = np.linalg.svd(updates @ updates.T / m)
    k = int(m * fraction)
    w = [updates.T @ vt[j] for j in range(k)]
    for j in range(k):
        positive = sum(float(np.dot(g, w[j])) >= 0 for g in updates)
        if positive < m - positive:
            w[j] = -w[j]
    revised = []
    for g in updates:
        r = np.zeros_like(g)
        for j in range(k):
            projection = np.dot(g, w[j]) / np.dot(w[j], w[j]) * w[j]
            r += projection * s[j] / s.sum() * np.linalg.norm(g) / np.linalg.norm(projection)
        revised.append(r)
    return CURRENT + weights @ np.array(revised)


def test_fedld_aggregation_matches_a_hand_computation_of_the_release_formula():
    aggregated, _ = _aggregate(_fedld(), 2, UPDATES)
    np.testing.assert_allclose(aggregated, _release_formula(UPDATES, np.full(3, 1 / 3)), rtol=1e-6)


def test_fedld_aggregation_of_orthogonal_updates_equals_the_closed_form():
    """Orthogonal updates 3 e1, 2 e2, 1 e3: H = diag(9, 4, 1) / 3, s = (3, 4/3, 1/3), k = 2 keeps
    e1 and e2; r_1 = (3 / (14/3)) * 3 e1, r_2 = ((4/3) / (14/3)) * 2 e2, r_3 = 0 (no component on
    the kept directions): mean = (27/14 e1 + 8/14 e2) / 3."""
    updates = np.array([[3.0, 0, 0, 0], [0, 2.0, 0, 0], [0, 0, 1.0, 0]])
    aggregated, _ = _aggregate(_fedld(), 2, updates)
    expected = CURRENT + np.array([27 / 14, 8 / 14, 0, 0]) / 3
    np.testing.assert_allclose(aggregated, expected, rtol=1e-6, atol=1e-9)


def test_fedld_aggregation_differs_from_the_plain_mean_after_round_one():
    aggregated, _ = _aggregate(_fedld(), 2, UPDATES)
    plain = CURRENT + UPDATES.mean(0)
    assert np.abs(aggregated - plain).max() > 0.1


def test_round_one_is_the_plain_mean():
    aggregated, _ = _aggregate(_fedld(), 1, UPDATES)
    np.testing.assert_allclose(aggregated, CURRENT + UPDATES.mean(0), rtol=1e-6)


def test_one_element_tensors_take_the_plain_mean():
    _, scalar = _aggregate(_fedld(), 2, UPDATES)
    np.testing.assert_allclose(scalar, [(0 + 10 + 20) / 3], rtol=1e-6)


def test_sample_count_weights_weigh_the_revised_updates():
    samples = (1, 1, 2)
    method = _fedld("method.aggregation_weights=samples")
    aggregated, scalar = _aggregate(method, 2, UPDATES, samples)
    weights = np.array(samples) / sum(samples)
    np.testing.assert_allclose(aggregated, _release_formula(UPDATES, weights), rtol=1e-6)
    np.testing.assert_allclose(scalar, [(0 * 1 + 10 * 1 + 20 * 2) / 4], rtol=1e-6)


def test_margin_penalty_is_log_one_plus_the_per_pixel_squared_softmax_norm():
    uniform = torch.zeros(2, 4, 3, 5)  # softmax 1/4 everywhere: sum_c p^2 = 4 / 16
    assert margin_penalty(uniform).item() == pytest.approx(math.log(1.25))
    certain = torch.zeros(2, 4, 3, 5)
    certain[:, 1] = 100.0  # one-hot softmax: sum_c p^2 = 1
    assert margin_penalty(certain).item() == pytest.approx(math.log(2.0))
    half = torch.cat([uniform[:1], certain[:1]])  # per-pixel mean (1/4 + 1) / 2
    assert margin_penalty(half).item() == pytest.approx(math.log(1 + 0.625))


def test_site_loss_is_the_segmentation_loss_plus_lambda_times_the_margin_term():
    method = _fedld("method.options.lambda_margin=0.5")
    logits = torch.randn(2, 4, 6, 8, generator=torch.Generator().manual_seed(0))
    masks = torch.randint(0, 4, (2, 6, 8), generator=torch.Generator().manual_seed(1))

    class _Site:
        loss_fn = SegmentationLoss(lambda_dice=0.3)

    probs = logits.softmax(1)
    expected = _Site.loss_fn(logits, masks) + 0.5 * torch.log(1 + (probs**2).sum() / (2 * 6 * 8))
    assert method.local_loss(_Site(), logits, masks).item() == pytest.approx(expected.item())


def test_a_tiny_fedld_run_finishes_with_finite_metrics(tiny_root: Path, tmp_path: Path):  # noqa: F811
    cfg = experiment(tiny_root, "method=fedld", "data.out_of_federation=[]")
    run_dir = tmp_path / "fedld"
    run_training(cfg, run_dir, progress=False)
    final = json.loads((run_dir / "final.json").read_text())
    assert final["method"] == "fedld" and set(final["sites"]) == set(cfg.data.federation)
    assert all(math.isfinite(row["dice"]) for row in final["sites"].values())
    aggregation_rows = [
        json.loads(line)
        for line in (run_dir / "train.jsonl").read_text().splitlines()
        if '"aggregation_seconds"' in line
    ]
    assert [row["round"] for row in aggregation_rows] == [1, 2]
