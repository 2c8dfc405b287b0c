"""Specification of aggregation weights: FedST averages gamma uniformly (Algorithm 1, line 8),
the FedAvg baseline by sample count; a site reply carries its sample count n_k and no weight of
its own (the server computes every weight, issue 59)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from flwr.app import Message, MessageType

from fedst.cli import compose_experiment
from fedst.config import ConfigError
from fedst.methods import Method, method_of
from tests.conftest import reply_of_one_site, train_reply, write_generic_site

# three sites: gamma values and training-sample counts
GAMMAS = [np.array([1.0, 10.0]), np.array([2.0, 0.0]), np.array([6.0, 2.0])]
SAMPLES = [1, 1, 2]
UNIFORM_MEAN = [(1 + 2 + 6) / 3, (10 + 0 + 2) / 3]  # [3.0, 4.0]
SAMPLE_MEAN = [(1 * 1 + 2 * 1 + 6 * 2) / 4, (10 * 1 + 0 * 1 + 2 * 2) / 4]  # [3.75, 3.5]


def _site_reply(gamma: np.ndarray, num_examples: int) -> Message:
    """A train reply with the metrics every ClientApp reply carries."""
    return train_reply({"w": torch.tensor(gamma)}, num_examples)


def _aggregate(method_overrides: list[str]) -> np.ndarray:
    cfg, _ = compose_experiment(["experiment=tiny", *method_overrides])
    replies = [_site_reply(g, n) for g, n in zip(GAMMAS, SAMPLES, strict=True)]
    return method_of(cfg).aggregate(1, replies, {"w": torch.zeros(2)})["w"].numpy()


def test_fedst_averages_gamma_uniformly_as_algorithm_1_line_8():
    np.testing.assert_allclose(_aggregate(["method=fedst"]), UNIFORM_MEAN)


def test_the_fedavg_baseline_weights_gamma_by_sample_count():
    np.testing.assert_allclose(_aggregate(["method=fedavg"]), SAMPLE_MEAN)


def test_the_weighting_is_a_config_value():
    np.testing.assert_allclose(
        _aggregate(["method=fedst", "method.aggregation_weights=samples"]), SAMPLE_MEAN
    )
    np.testing.assert_allclose(
        _aggregate(["method=fedavg", "method.aggregation_weights=uniform"]), UNIFORM_MEAN
    )


def test_trimmed_mean_drops_the_extreme_sites_of_each_coordinate_before_averaging():
    """Flower's FedTrimmedAvg, fed.trim_fraction = 0.2 of 5 sites: one value cut at each end.
    Coordinate 0: 0, 1, 2, 6, 100 -> (1 + 2 + 6) / 3 = 3 (the median would be 2, the mean 21.8);
    coordinate 1: 5, -50, 4, 3, 2 -> (3 + 4 + 2) / 3 = 3."""
    cfg, _ = compose_experiment(
        ["experiment=tiny", "method.aggregation=trimmed_mean", "fed.trim_fraction=0.2"]
    )
    columns = [(0.0, 5.0), (1.0, -50.0), (2.0, 4.0), (6.0, 3.0), (100.0, 2.0)]
    replies = [_site_reply(np.array(c), 1) for c in columns]
    aggregated = method_of(cfg).aggregate(1, replies, {"w": torch.zeros(2)})["w"].numpy()
    np.testing.assert_allclose(aggregated, [3.0, 3.0])


@pytest.mark.parametrize("aggregation", ["fedmedian", "trimmed_mean"])
def test_a_weighted_median_or_trimmed_mean_is_refused(aggregation):
    with pytest.raises(
        ConfigError, match=r"is unweighted; set method\.aggregation_weights=uniform"
    ):
        compose_experiment(
            [f"method.aggregation={aggregation}", "method.aggregation_weights=samples"]
        )


class _TinyModel(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.bias = torch.nn.Parameter(torch.zeros(4, 1, 1))

    def forward(self, clips: torch.Tensor, indicator=None) -> torch.Tensor:
        batch, _, _, height, width = clips.shape
        return self.bias.expand(batch, 4, height, width)  # [B, 4, H, W]


def test_a_site_train_reply_carries_its_sample_count_and_no_weight(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    write_generic_site(tmp_path, "A", videos={"v1": 3}, size=(32, 40))
    cfg, _ = compose_experiment(
        [
            "experiment=tiny",
            f"data.root={tmp_path}",
            "data.procedural=null",
            "data.federation=[A]",
            "data.out_of_federation=[]",
            "data.server=null",
            "method=fedavg",  # nothing personalized: the tiny model's one tensor is shared
        ]
    )
    monkeypatch.setattr(Method, "build_model", lambda _method: _TinyModel())
    reply = reply_of_one_site(  # round 1 carries the server's whole initial model
        cfg,
        tmp_path,
        MessageType.TRAIN,
        dict(_TinyModel().state_dict()),
        **{"server-round": 1, "local-iters": 1},
    )
    assert not reply.has_error(), reply.error.reason
    metrics = reply.content["metrics"]
    assert "uniform-weight" not in metrics  # the server computes every weight
    assert metrics["num-examples"] == 3  # the site's training frames
