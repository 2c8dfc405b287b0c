"""Specification of ``data.mix_synthetic`` (paper Sec. IV-C5 green line, IV-C6 / Fig. 7: "all
synthetic samples are fully mixed into the real training data for each site"): every training
party's training split is its own samples plus each sample of the server's synthetic set once,
as clips of the site's length; its test split is its own, untouched; each site reads the set
from its own disk (its node config), so nothing new travels in a message."""

# ruff: noqa: F811 (the imported fixture tiny_root is the tests' argument)
from __future__ import annotations

import json

import pytest
import torch
from flwr.app import Message

from fedst.app.inprocess import InProcessGrid
from fedst.app.nodes import site_node_config
from fedst.config import ConfigError
from fedst.experiment import experiment_from_json
from fedst.methods import method_of
from fedst.methods.upperbound import POOLED
from fedst.scoring.site_data import open_party_data, open_site_data
from fedst.training import run_training
from tests.test_federation import (
    experiment,
    read_jsonl,
    tiny_root,  # noqa: F401 (module fixture)
)


def sample_ids(dataset) -> list[str]:
    return [dataset.sample_id(i) for i in range(len(dataset))]


def test_each_site_trains_on_its_samples_plus_every_synthetic_sample_once_and_tests_on_its_own(
    tiny_root,
):
    plain = experiment(tiny_root)
    mixed = experiment(tiny_root, "data.mix_synthetic=true")
    synthetic = open_site_data(plain, "synthetic", ("train",)).train
    assert len(synthetic) > 0
    for site in "ABCD":
        own = open_party_data(plain, method_of(plain), site)
        both = open_party_data(mixed, method_of(mixed), site)
        assert sample_ids(both.train) == sample_ids(own.train) + sample_ids(synthetic)
        assert list(both.tests) == [site]
        assert sample_ids(both.tests[site]) == sample_ids(own.tests[site])
    # a synthetic image comes as a clip of the site's length: T copies of the image, and (every
    # clip frame supervised, train.clip_frame_loss_weight 0.5) T copies of its label
    clip, mask, sample_id = both.train[len(own.train)]  # the first synthetic sample
    assert sample_id.startswith("synthetic/")
    assert clip.shape[0] == mixed.clip.num_frames == 4 and mask.shape == (4, *clip.shape[-2:])
    assert all(torch.equal(clip[t], clip[-1]) for t in range(4))
    assert all(torch.equal(mask[t], mask[-1]) for t in range(4))


def test_the_upper_bounds_pool_gets_the_synthetic_set_once(tiny_root):
    plain = experiment(tiny_root, "method=upperbound")
    mixed = experiment(tiny_root, "method=upperbound", "data.mix_synthetic=true")
    synthetic = open_site_data(plain, "synthetic", ("train",)).train
    pool = open_party_data(plain, method_of(plain), POOLED).train
    mixed_pool = open_party_data(mixed, method_of(mixed), POOLED).train
    assert sample_ids(mixed_pool) == sample_ids(pool) + sample_ids(synthetic)


def test_mixing_needs_the_servers_synthetic_set_and_names_both_keys(tiny_root):
    with pytest.raises(ConfigError, match=r"data\.mix_synthetic=true.*data\.server is null"):
        experiment(tiny_root, "data.mix_synthetic=true", "data.server=null")


def test_each_site_reads_the_synthetic_set_from_its_own_disk_and_no_path_travels(
    tiny_root, tmp_path
):
    cfg = experiment(
        tiny_root,
        "method=fedavg",
        "data.mix_synthetic=true",
        "train.total_iters=1",
        "train.local_iters=1",
        "pretraining.iters=1",
    )
    method = method_of(cfg)
    node = site_node_config(cfg, "A")
    assert method.data_sites("A") == ("A", "synthetic")
    assert json.loads(node.other_sites)["synthetic"]["root"] == cfg.data.sites["synthetic"].root

    run_dir = tmp_path / "run"
    messages: list[Message] = []
    original = InProcessGrid.__init__

    def recording_init(self, *args, **kwargs):
        original(self, *args, **kwargs, observer=lambda d, m: messages.append(m))

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(InProcessGrid, "__init__", recording_init)
        run_training(cfg, run_dir, progress=False)
    configs = [dict(m.content["config"]) for m in messages if "config" in m.content]
    assert configs
    for config in configs:
        assert str(tiny_root) not in json.dumps(config)
        if "experiment" in config:
            view = experiment_from_json(config["experiment"])
            assert {spec.root for spec in view.data.sites.values()} == {""}
    synthetic = len(open_site_data(cfg, "synthetic", ("train",)).train)
    own = len(open_site_data(cfg, "A", ("train",)).train)
    replies = [
        m.content["metrics"]["num-examples"]
        for m in messages
        if m.has_content() and "metrics" in m.content and m.metadata.message_type == "train"
    ]
    assert own + synthetic in replies  # site A trained on its samples and the synthetic set
    assert {r["site"] for r in read_jsonl(run_dir / "metrics.jsonl")} <= set("ABCD")
