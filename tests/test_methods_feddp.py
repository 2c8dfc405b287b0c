"""Specifications of FedDP (Wang et al., TMI 2023; fedst/methods/feddp.py):

* stage 1 keeps every encoder query and FedDP's channel selection at the site; the selection
  gate is sigmoid(FC([GAP(F), e]) + FC([GMP(F), e])) and F' = F + F * gate;
* stage 2's uncertainty map is the standard deviation over the sites' softmax predictions,
  divided by its maximum; its loss is Dice + lambda * uncertainty-weighted BCE;
* stage 2 is an explicit exchange: personalized parameters travel only in it (and only from and
  to sites that allow it), it is logged in comm.jsonl / wire.jsonl with its own kind, and the
  final per-site evaluation scores the tuned models.
"""

from __future__ import annotations

import functools
import math
import re

import numpy as np
import pytest
import torch
from torch import nn

from fedst import training
from fedst.app import server_app
from fedst.app.messaging import FederationError
from fedst.config import ConfigError
from fedst.experiment import RoundPolicy
from fedst.federation.site import Site
from fedst.methods import method_of
from fedst.methods.feddp import (
    ensemble_probabilities,
    tuning_loss,
    uncertainty_map,
)
from fedst.model.channel_selection import SiteChannelSelection
from fedst.model.partition import bytes_of
from fedst.model.state import state_subset
from fedst.runs import Run
from fedst.training import run_training
from tests.conftest import reply_of_one_site
from tests.test_federation import experiment, read_jsonl, tiny_root  # noqa: F401 (fixture)

STAGE = "uncertainty_tuning"
DECLINING = "D"


class FixedLogits(nn.Module):
    """A "site model" that predicts the same logits [B, C, H, W] for every clip."""

    def __init__(self, logits: list) -> None:
        super().__init__()
        self.logits = torch.tensor(logits, dtype=torch.float64)

    def forward(self, clips: torch.Tensor, indicator: torch.Tensor | None) -> torch.Tensor:
        return self.logits


LN3 = math.log(3.0)


# -- stage 2: the uncertainty map and the loss, by hand ------------------------------------------


def test_uncertainty_map_is_the_std_over_two_sites_softmax_divided_by_its_maximum():
    # two classes, three pixels [B=1, C=2, H=1, W=3]; softmax by hand:
    # site 1: (0.5, 0.5), (0.75, 0.25), (0.5, 0.5); site 2: (0.25, 0.75), (0.25, 0.75), (0.5, 0.5)
    site1 = [[[[0.0, LN3, 0.0]], [[0.0, 0.0, 0.0]]]]
    site2 = [[[[0.0, 0.0, 0.0]], [[LN3, LN3, 0.0]]]]
    clips = torch.zeros(1, 1, 3, 1, 3)
    probs = ensemble_probabilities([(FixedLogits(site1), None), (FixedLogits(site2), None)], clips)
    # std of two values is |a - b| / sqrt(2): 0.25, 0.5, 0 per pixel in both classes; max 0.5
    expected = torch.tensor([[[[0.5, 1.0, 0.0]], [[0.5, 1.0, 0.0]]]], dtype=torch.float64)
    torch.testing.assert_close(uncertainty_map(probs).double(), expected)


def test_uncertainty_map_matches_numpy_normalized_std_over_four_sites():
    generator = np.random.default_rng(3)
    logits = generator.normal(size=(4, 2, 3, 5, 6))  # [M sites, B, C, H, W]
    ensemble = [(FixedLogits(site.tolist()), None) for site in logits]
    probs = ensemble_probabilities(ensemble, torch.zeros(2, 1, 3, 5, 6))
    softmax = np.exp(logits) / np.exp(logits).sum(axis=2, keepdims=True)
    spread = softmax.std(axis=0)  # ddof 0: the normalization removes the factor
    np.testing.assert_allclose(uncertainty_map(probs).numpy(), spread / spread.max(), rtol=1e-5)


def test_a_site_alone_or_sites_that_agree_give_a_zero_uncertainty_map():
    same = [[[[1.0, 2.0]], [[0.0, -1.0]]]]
    alone = ensemble_probabilities([(FixedLogits(same), None)], torch.zeros(1, 1, 3, 1, 2))
    twice = ensemble_probabilities([(FixedLogits(same), None)] * 2, torch.zeros(1, 1, 3, 1, 2))
    assert torch.count_nonzero(uncertainty_map(alone)) == 0
    assert torch.count_nonzero(uncertainty_map(twice)) == 0


def test_tuning_loss_adds_lambda_times_the_uncertainty_weighted_bce_over_valid_pixels():
    # pixels: p = (0.25, 0.75) labelled 1, p = (0.5, 0.5) labelled 0, a third pixel ignored (255)
    logits = torch.tensor([[[[0.0, 0.0, 5.0]], [[LN3, 0.0, -5.0]]]], dtype=torch.float64)
    masks = torch.tensor([[[1, 0, 255]]])
    weights = torch.tensor([[[[0.5, 1.0, 1.0]], [[0.5, 1.0, 1.0]]]], dtype=torch.float64)
    # BCE: pixel 1 -ln(0.75) in both classes, weight 0.5; pixel 2 ln 2 in both, weight 1;
    # mean over 2 valid pixels x 2 classes
    bce = (0.5 * 2 * math.log(4 / 3) + 1.0 * 2 * math.log(2)) / 4
    with_lambda = tuning_loss(logits, masks, weights, lambda_uncertainty=2.0)
    dice_only = tuning_loss(logits, masks, weights, lambda_uncertainty=0.0)
    assert float(with_lambda - dice_only) == pytest.approx(2.0 * bce, rel=1e-9)


# -- stage 1: FedDP's channel selection and what stays private ------------------------------------


def test_feddp_channel_selection_gates_with_average_and_max_pooling_and_the_site_embedding():
    torch.manual_seed(0)
    module = SiteChannelSelection(channels=32, indicator_dim=4).double()
    feat = torch.randn(2, 32, 3, 5, dtype=torch.float64)
    site = torch.tensor([0.0, 1.0, 0.0, 0.0], dtype=torch.float64)
    e1, e2 = (module.embed[i].weight.detach().numpy() for i in (0, 2))
    w1, w2 = (module.fc[i].weight.detach().numpy() for i in (0, 2))
    x = feat.numpy()
    embedded = e2 @ np.maximum(e1 @ site.numpy(), 0)  # [C]

    def fc(pooled):  # [B, C] -> [B, C]
        joined = np.concatenate([pooled, np.tile(embedded, (len(pooled), 1))], axis=1)
        return np.maximum(joined @ w1.T, 0) @ w2.T

    gate = 1 / (1 + np.exp(-(fc(x.mean(axis=(2, 3))) + fc(x.max(axis=(2, 3))))))
    expected = x + x * gate[:, :, None, None]
    np.testing.assert_allclose(module(feat, site).detach().numpy(), expected, rtol=1e-12)


def test_feddp_keeps_encoder_queries_and_its_channel_selection_private_and_shares_the_rest(
    tiny_root,  # noqa: F811 (fixture)
):
    method = method_of(experiment(tiny_root, "method=feddp"))
    model = method.build_model()
    assert [type(m) for m in model.channel_selection.values()] == [SiteChannelSelection]
    assert not model.temporal and not model.prompt
    partition = method.partition(model)
    floats = [k for k, v in model.state_dict().items() if v.is_floating_point()]
    queries = {k for k in floats if re.fullmatch(r"encoder\..*\.attn\.q\.(weight|bias)", k)}
    selection = {k for k in floats if k.startswith("channel_selection.3.")}
    assert queries and selection
    assert set(partition.personal) == queries | selection
    assert set(partition.shared) == set(floats) - queries - selection


@pytest.mark.parametrize(
    ("override", "named"),
    [
        ("network.cs_stages=[2]", "method.options.channel_selection_stages"),
        ("method.channel_selection=false", "method.channel_selection=true"),
    ],
)
def test_feddp_refuses_network_settings_it_would_not_build(
    tiny_root,  # noqa: F811 (fixture)
    override,
    named,
):
    with pytest.raises(ConfigError, match=re.escape(named)):
        experiment(tiny_root, "method=feddp", override)


# -- stage 2 over the wire: a one-round run where site D does not share -------------------------


@pytest.fixture(scope="module")
def feddp_run(tiny_root, tmp_path_factory):  # noqa: F811 (fixture)
    """One FedDP round and stage 2 in-process, every message audited (wire.jsonl); site D's
    node config says share-personal=false."""
    cfg = experiment(tiny_root, "method=feddp", "train.total_iters=2", "train.local_iters=2")
    run_dir = tmp_path_factory.mktemp("runs") / "feddp"

    def node_config(cfg, site, **settings):
        return original(cfg, site, **settings, share_personal=site != DECLINING)

    original = training.site_node_config
    audited = functools.partial(server_app.make_server_app, policy=RoundPolicy(audit=True))
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(training, "site_node_config", node_config)
        patch.setattr(training, "make_server_app", audited)
        final = run_training(cfg, run_dir, progress=False)
    return cfg, run_dir, final


def personal_bytes(cfg) -> int:
    method = method_of(cfg)
    model = method.build_model()
    return bytes_of(model, method.partition(model).personal)


def test_feddp_run_ends_with_the_tuned_models_scored_and_finite_metrics(feddp_run):
    cfg, run_dir, final = feddp_run
    assert (run_dir / "final.json").is_file() and (run_dir / "plots/communication.png").is_file()
    stage_rows = [r for r in read_jsonl(run_dir / "metrics.jsonl") if r["round"] == 2]
    assert sorted(r["site"] for r in stage_rows) == ["A", "B", "C", "D"]
    assert final["rounds"] == 1
    for row in stage_rows:
        assert final["sites"][row["site"]]["dice"] == row["dice"]
        assert all(math.isfinite(row[m]) for m in ("dice", "iou", "hd95", "assd"))
    trained = {r["site"]: r for r in read_jsonl(run_dir / "train.jsonl") if r.get("stage")}
    assert {s: r["iterations"] for s, r in trained.items()} == dict.fromkeys("ABCD", 2)
    assert all(math.isfinite(r["loss"]) for r in trained.values())
    # the model scored at the end (and averaged out of federation) is the tuned one: its shared
    # tensors are its own, no longer the server's gamma_g
    checkpoint = torch.load(run_dir / "checkpoints/server.pt", weights_only=False)
    assert checkpoint["round"] == 2 and checkpoint["extra"]["final_stage"] == STAGE
    tuned = torch.load(run_dir / "sites/A/state_r0002.pt", weights_only=False)
    assert tuned["whole_model"]
    model = Run(run_dir, cfg).site_model("A", torch.device("cpu"))
    live = state_subset(model, list(tuned["personal"]))
    assert all(torch.equal(live[k], v) for k, v in tuned["personal"].items())
    shared = checkpoint["shared_keys"]
    assert any(not torch.equal(live[k], checkpoint["global_model"][k]) for k in shared)


def test_sites_that_share_receive_the_others_personal_parameters_and_a_decliner_is_left_out(
    feddp_run,
):
    cfg, run_dir, final = feddp_run
    train = read_jsonl(run_dir / "train.jsonl")
    ensemble = {r["site"]: r["ensemble_size"] for r in train if r.get("stage") == STAGE}
    assert ensemble == {"A": 3, "B": 3, "C": 3, "D": 1}
    rows = {r["site"]: r for r in read_jsonl(run_dir / "comm.jsonl") if r.get("kind") == STAGE}
    rho = personal_bytes(cfg)
    sent = {s: r["personal_upload_param_bytes"] for s, r in rows.items()}
    received = {s: r["personal_download_param_bytes"] for s, r in rows.items()}
    assert sent == {"A": rho, "B": rho, "C": rho, "D": 0}
    assert received == {"A": 2 * rho, "B": 2 * rho, "C": 2 * rho, "D": 0}
    assert all(r["round"] == 2 for r in rows.values())
    assert final["final_stage"]["kind"] == STAGE
    assert final["final_stage"]["personal_download_mb_per_site"] == pytest.approx(1.5 * rho / 1e6)
    # the per-round figures count the federated rounds only
    assert final["upload_mb_per_round"] == pytest.approx(
        np.mean([r["upload_param_bytes"] for r in read_jsonl(run_dir / "comm.jsonl")[:4]]) / 1e6
    )


def test_personal_parameters_travel_only_in_the_stage_two_exchange(feddp_run):
    cfg, run_dir, _ = feddp_run
    method = method_of(cfg)
    personal = set(method.partition(method.build_model()).personal)
    carriers = set()
    for row in read_jsonl(run_dir / "wire.jsonl"):
        for record, shapes in row.get("arrays", {}).items():
            names = {key.split("/", 1)[-1] for key in shapes}
            if names & personal:
                carriers.add((row["type"], row["direction"], record, row["round"]))
            if record == "personal" and row["direction"] == "down":
                assert not any(key.startswith(f"{DECLINING}/") for key in shapes)
    assert carriers == {
        ("train", "down", "arrays", 1),  # the server's own initial model v_g^0
        ("query.personal_exchange", "up", "personal", 2),
        ("train.final_stage", "down", "personal", 2),
    }
    stage_downs = [
        r for r in read_jsonl(run_dir / "wire.jsonl") if r["type"] == "train.final_stage"
    ]
    with_personal = [r for r in stage_downs if "personal" in r.get("arrays", {})]
    assert len(with_personal) == 3  # A, B and C; D shared nothing and receives nothing


def test_a_site_refuses_to_exchange_personal_parameters_for_a_method_without_the_exchange(
    tiny_root,  # noqa: F811 (fixture)
    tmp_path,
):
    cfg = experiment(tiny_root)  # FedST
    reply = reply_of_one_site(cfg, tmp_path, "query.personal_exchange", **{"server-round": 0})
    assert reply.has_error()
    assert "refusing query.personal_exchange" in reply.error.reason


def test_a_run_interrupted_in_stage_two_resumes_into_it_and_finishes_once(
    tiny_root,  # noqa: F811 (fixture)
    tmp_path,
):
    """Device: train.device=auto (CUDA where present) with the tiny experiment's
    train.deterministic=true, so the equality holds bit for bit on the CPU and on one GPU."""
    cfg = experiment(
        tiny_root,
        "method=feddp",
        "train.total_iters=2",
        "train.local_iters=2",
        "data.out_of_federation=[]",
    )
    run_dir = tmp_path / "run"

    def power_cut(self, shared, others, server_round):
        raise RuntimeError("site lost power in stage 2")

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(Site, "final_stage", power_cut)
        with pytest.raises(FederationError, match="lost power"):
            run_training(cfg, run_dir, progress=False)
    assert torch.load(run_dir / "checkpoints/server.pt", weights_only=False)["round"] == 1
    final = run_training(cfg, run_dir, progress=False)
    stage = [r for r in read_jsonl(run_dir / "train.jsonl") if r.get("stage") == STAGE]
    assert sorted(r["site"] for r in stage) == ["A", "B", "C", "D"]
    scored = [r for r in read_jsonl(run_dir / "metrics.jsonl") if r["round"] == 2]
    assert sorted(r["site"] for r in scored) == ["A", "B", "C", "D"]
    assert final["final_stage"]["kind"] == STAGE
