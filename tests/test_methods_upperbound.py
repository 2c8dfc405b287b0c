"""Specification of the upper bound (fedst/methods/upperbound.py): one party trains on the pool of
every federated site's training data, nothing travels, and its one model is scored on every
federated site's test split and out of federation, through the one federation code path."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from fedst.config import ConfigError
from fedst.federation.site import Site
from fedst.methods import method_of
from fedst.methods.upperbound import POOLED, UpperBound
from fedst.scoring.site_data import open_site_data
from fedst.training import run_training
from tests.test_federation import experiment, read_jsonl, tiny_root  # noqa: F401 (module fixture)


def _train_ids(cfg, sites) -> list[str]:
    """The training sample ids of ``sites``, read from each site's own dataset."""
    ids = []
    for site in sites:
        train = open_site_data(cfg, site, ("train",)).train
        ids += [train.sample_id(i) for i in range(len(train))]
    return ids


def test_the_upper_bound_has_one_pooled_party_scored_on_every_federated_site(tiny_root: Path):  # noqa: F811
    method = method_of(experiment(tiny_root, "method=upperbound"))
    assert isinstance(method, UpperBound)
    assert method.training_sites() == (POOLED,)
    assert method.scored_sites(POOLED) == ("A", "B", "C", "D")
    assert [method.party_of(site) for site in "ABCD"] == [POOLED] * 4


def test_the_upper_bound_sees_every_sites_training_samples(tiny_root: Path, tmp_path: Path):  # noqa: F811
    """The pooled party's stream yields, over one pass of the pool, exactly the union of the
    federated sites' training samples (each once)."""
    cfg = experiment(tiny_root, "method=upperbound")
    site = Site(POOLED, cfg, tmp_path / "pooled", torch.device("cpu"))
    expected = _train_ids(cfg, cfg.data.federation)
    assert site.num_examples == len(expected) == len(set(expected))
    seen: list[str] = []
    while len(seen) < len(expected):
        seen += site.stream.next_batch()[2]
    assert sorted(seen[: len(expected)]) == sorted(expected)
    assert {sample_id.split("/")[0] for sample_id in seen} == set(cfg.data.federation)


def test_a_federated_site_sees_only_its_own_training_samples(tiny_root: Path):  # noqa: F811
    """The default party (every other method) trains on its own split: the pool is the method's
    choice, not the site loop's."""
    cfg = experiment(tiny_root, "method=fedavg")
    method = method_of(cfg)
    assert method.training_sites() == ("A", "B", "C", "D")
    assert method.train_sources("B") == ("B",) and method.scored_sites("B") == ("B",)


def test_the_upper_bound_refuses_settings_that_would_federate_or_prompt(tiny_root: Path):  # noqa: F811
    with pytest.raises(ConfigError, match="communicate=false"):
        experiment(tiny_root, "method=upperbound", "method.communicate=true")
    with pytest.raises(ConfigError, match="no site indicator"):
        experiment(tiny_root, "method=upperbound", "method.prompt=true")


def test_a_tiny_upper_bound_run_scores_every_site_and_out_of_federation_uploading_nothing(
    tiny_root: Path,  # noqa: F811
    tmp_path: Path,
):
    cfg = experiment(tiny_root, "method=upperbound", "data.out_of_federation=[E]")
    run_dir = tmp_path / "upperbound"
    run_training(cfg, run_dir, progress=False)
    final = json.loads((run_dir / "final.json").read_text())
    assert final["method"] == "upperbound"
    assert sorted(final["sites"]) == ["A", "B", "C", "D"]  # one metrics row per federated site
    assert all(math.isfinite(row["dice"]) for row in final["sites"].values())
    assert math.isfinite(final["out_of_federation"]["E"]["dice"])
    last = [r for r in read_jsonl(run_dir / "metrics.jsonl") if r["round"] == final["rounds"]]
    assert sorted(r["site"] for r in last) == ["A", "B", "C", "D"]
    train = [r for r in read_jsonl(run_dir / "train.jsonl") if r["site"] != "server"]
    assert {r["site"] for r in train} == {POOLED}
    assert sum(r["iterations"] for r in train) == cfg.train.total_iters  # one site's total
    comm = read_jsonl(run_dir / "comm.jsonl")
    assert comm and all(r["upload_param_bytes"] == 0 for r in comm)
    assert final["upload_mb_per_round"] == 0
    assert "| upperbound |" in (run_dir / "tables" / "tables.md").read_text()
