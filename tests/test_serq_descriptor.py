"""Specification of SERQ's domain descriptor and of what the server step logs (Eq. 10-12).

In Eq. 11, D_sy enters only lambda_2 mean_{b,e}(F_sy - D_sy - F_hat_g)^2, a quadratic whose
minimiser is D* = mean_b(F_sy - F_hat_g) (derived by setting the gradient to zero, independently
of the code). With v_pre and the global model fixed the bank is fixed (Eq. 10: an EMA of a
constant), so the EQ step must carry D_sy to D*: each batch a fraction ``descriptor_step`` of the
way, D_n - D* = (1 - step)^n (D_0 - D*).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from fedst.data.procedural import generate
from fedst.federation.server import FederationServer
from tests.test_federation import experiment

TOLERANCE = 1e-4
"""|D_n - D*| / RMS(D*) allowed after the stated steps (float32 features)."""


@pytest.fixture(scope="module")
def tiny_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("procedural") / "tiny"
    generate(root, seed=0, preset="tiny", workers=1, progress=False)
    return root


def serq_server(tiny_root: Path, run_dir: Path, *overrides: str) -> FederationServer:
    cfg = experiment(
        tiny_root,
        "serq.batches_per_round=1",
        "augment.enabled=false",
        "network.drop_path_rate=0.0",  # v_pre's features are then a function of its weights
        *overrides,
    )
    return FederationServer(cfg, run_dir, torch.device("cpu"))


def test_eq_drives_the_descriptor_to_its_closed_form_optimum_on_a_fixed_bank(tiny_root, tmp_path):
    step = 0.5
    server = serq_server(tiny_root, tmp_path, f"serq.descriptor_step={step}")
    serq = server.step.serq
    for parameter in serq.synthetic_model.parameters():  # v_pre fixed: only D_sy learns
        parameter.requires_grad_(False)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():  # a global model other than v_pre, so that D* is far from zero
        for parameter in server.global_model.parameters():
            parameter.add_(0.05 * torch.randn(parameter.shape, generator=generator))
    ids = [serq.reference.sample_id(i) for i in range(3)]
    images, masks, ids = serq.canonical_view(ids)
    with torch.no_grad():
        serq.synthetic_model.train()
        _, feat_syn = serq._forward(serq.synthetic_model, images)
        server.global_model.eval()
        _, feat_global = serq._forward(server.global_model, images)
    bank = feat_global.half().float()  # F_hat_g as the bank stores it (float16; first visit)
    optimum = (feat_syn - bank).mean(dim=0)  # D* [c, h, w]
    assert serq.domain_descriptor.shape == optimum.shape
    start = serq.domain_descriptor.detach().clone()
    assert optimum.pow(2).mean().sqrt() > 0.1  # features differ: the optimum is no near-zero
    assert (start - optimum).pow(2).mean().sqrt() > 0.5 * optimum.pow(2).mean().sqrt()

    serq.explicit_quantification(server.global_model, [(images, masks, ids)])
    first = start + step * (optimum - start)  # one step: a fraction `step` of the way
    torch.testing.assert_close(serq.domain_descriptor.detach(), first, rtol=1e-4, atol=1e-5)

    for _ in range(29):
        serq.explicit_quantification(server.global_model, [(images, masks, ids)])
    error = (serq.domain_descriptor.detach() - optimum).pow(2).mean().sqrt()
    assert error / optimum.pow(2).mean().sqrt() < TOLERANCE  # (1 - 0.5)^30 ~ 1e-9 in exact maths


def test_the_descriptor_reaches_the_scale_of_the_features_it_offsets_in_one_demo_round(
    tiny_root, tmp_path
):
    """With the defaults (descriptor_step 0.1) and 20 EQ batches (the demo's round), ||D_sy||
    leaves its N(0, 0.02) initialisation: its RMS is at least a tenth of RMS(F_sy - F_hat_g)'s
    mean. Adam at lr 1e-4 (the paper's, for v_pre) could move it by 0.002 at most."""
    server = serq_server(tiny_root, tmp_path, "serq.batches_per_round=20")
    stats = server.server_step(server.shared_payload(), server_round=1)
    assert stats["descriptor_rms"] > 0.05  # init: 0.02
    assert stats["descriptor_rms"] > 0.1 * stats["synthetic_feature_rms"]


def test_the_server_step_logs_how_far_serq_moves_gamma_against_the_aggregation(tiny_root, tmp_path):
    server = serq_server(tiny_root, tmp_path)
    before = server.shared_payload()
    generator = torch.Generator().manual_seed(0)
    aggregated = {
        k: v + 0.01 * torch.randn(v.shape, generator=generator) if v.is_floating_point() else v
        for k, v in before.items()
    }
    expected_aggregation = sum(
        (aggregated[k].double() - before[k].double()).pow(2).sum()
        for k in before
        if before[k].is_floating_point()
    ).sqrt()
    stats = server.server_step(aggregated, server_round=1)
    after = server.shared_payload()
    expected_serq = sum(
        (after[k].double() - aggregated[k].double()).pow(2).sum()
        for k in before
        if before[k].is_floating_point()
    ).sqrt()
    assert stats["aggregation_change"] == pytest.approx(float(expected_aggregation), rel=1e-9)
    assert stats["serq_change"] == pytest.approx(float(expected_serq), rel=1e-9)
    assert stats["server_pull"] == pytest.approx(float(expected_serq / expected_aggregation))
    for key in ("eq_loss", "sc_loss", "descriptor_norm", "global_feature_rms", "bank_feature_rms"):
        assert stats[key] > 0, key


def test_serq_reads_the_stage_the_temporal_module_reads(tiny_root, tmp_path):
    """Sec. III-C1: "we denote F_ts as F": the features of the temporal module's stage."""
    server = serq_server(tiny_root, tmp_path)
    assert server.step.serq.feature_stage == server.cfg.network_config().temporal_stages[0] == 1
    other = serq_server(tiny_root, tmp_path / "other", "serq.feature_stage=3")
    assert other.step.serq.feature_stage == 3
