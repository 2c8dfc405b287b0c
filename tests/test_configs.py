"""Specifications of the configs: the paper's settings, every ablation row, strictness."""

from __future__ import annotations

from pathlib import Path

import pytest
from hydra.errors import ConfigCompositionException

from fedst.cli import compose_experiment
from fedst.config import ConfigError, build
from fedst.experiment import ExperimentConfig, MethodConfig
from fedst.model.partition import PRESETS

ABLATIONS = sorted(
    p.stem for p in (Path(__file__).resolve().parents[1] / "configs" / "ablation").glob("*.yaml")
)


def test_the_paper_experiment_carries_the_papers_settings():
    cfg, _ = compose_experiment(["experiment=paper"])
    assert (cfg.train.rounds, cfg.train.local_iters, cfg.train.batch_size) == (300, 100, 2)
    assert cfg.train.lr == 6e-5 and cfg.train.lambda_dice == 0.3
    assert (cfg.serq.batches_per_round, cfg.serq.lr, cfg.serq.lambda_eq, cfg.serq.lambda_sc) == (
        100,
        1e-4,
        0.3,
        0.3,
    )
    assert cfg.serq.ema_mu == 0.5
    assert cfg.network.receptive_fields == (49, 20, 6, 7) and cfg.network.pool_sizes == (7, 4, 2, 1)
    assert cfg.network.window_size == 7
    assert (cfg.clip.num_frames, cfg.clip.interval_s) == (4, 0.2)
    assert cfg.network.pretrained is True and cfg.method.indicator == "clip"
    assert cfg.data.federation == ("A", "B", "C", "D") and "E" in cfg.data.out_of_federation


@pytest.mark.parametrize("name", ABLATIONS)
def test_every_ablation_config_builds_a_valid_experiment(name):
    experiment = "paper" if name.startswith("fig6") else "demo"  # E = 500 > the demo's total
    cfg, _ = compose_experiment([f"experiment={experiment}", f"+ablation={name}"])
    assert cfg.method.personalization in PRESETS
    assert cfg.train.rounds * cfg.train.local_iters <= cfg.train.total_iters


@pytest.mark.parametrize(
    ("name", "switches"),
    [  # Table IV: (TS, Prompt, CS, SERQ)
        ("table4_row1_baseline", (False, False, False, False)),
        ("table4_row2_ts", (True, False, False, False)),
        ("table4_row3_ts_prompt", (True, True, False, False)),
        ("table4_row4_ts_prompt_cs", (True, True, True, False)),
        ("table4_row5_serq", (False, False, False, True)),
        ("table4_row6_ts_serq", (True, False, False, True)),
        ("table4_row7_full", (True, True, True, True)),
    ],
)
def test_table4_rows_switch_the_components_the_paper_lists(name, switches):
    cfg, _ = compose_experiment(["experiment=demo", f"+ablation={name}"])
    method = cfg.method
    assert (method.temporal, method.prompt, method.channel_selection, method.serq) == switches
    assert method.personalization == "encoder_query"


def test_fig6_keeps_the_total_number_of_local_iterations():
    totals = set()
    for every in (10, 50, 100, 200, 500):
        cfg, _ = compose_experiment(["experiment=paper", f"+ablation=fig6_every_{every}"])
        assert cfg.train.local_iters == every
        totals.add(cfg.train.rounds * every)
    assert totals == {30000}


def test_methods_differ_only_in_their_choices():
    fedst, _ = compose_experiment(["method=fedst"])
    fedavg, _ = compose_experiment(["method=fedavg"])
    local, _ = compose_experiment(["method=local"])
    assert fedst.train == fedavg.train == local.train
    assert (
        fedavg.method.personalization == "none"
        and not fedavg.method.temporal
        and not fedavg.method.serq
    )
    assert local.method.communicate is False and local.method.personalization == "all"


def test_any_field_can_be_overridden_and_a_typo_is_an_error():
    cfg, _ = compose_experiment(["method.aggregation=fedmedian", "train.weight_decay=0.5"])
    assert cfg.method.aggregation == "fedmedian" and cfg.train.weight_decay == 0.5
    with pytest.raises(ConfigCompositionException):
        compose_experiment(["train.learning_rate=0.1"])


def test_unknown_keys_and_bad_values_are_config_errors():
    with pytest.raises(ConfigError, match="unknown key"):
        build(MethodConfig, {"nme": "x"})
    with pytest.raises(ConfigError, match="aggregation"):
        build(MethodConfig, {"aggregation": "mean"})
    with pytest.raises(ConfigError, match="total_iters"):
        compose_experiment(["train.total_iters=10", "train.local_iters=20"])


def test_the_demo_is_explicit_about_what_it_cannot_have_here():
    cfg, _ = compose_experiment([])
    assert isinstance(cfg, ExperimentConfig)
    assert (
        cfg.network.pretrained is False
    )  # no ImageNet weights on this machine: asked for explicitly
    assert (
        cfg.method.indicator == "onehot"
    )  # no CLIP weights here: Table VII's one-hot row, explicitly


def test_personalization_is_a_preset_plus_optional_patterns_from_the_config():
    from fedst.federation.components import build_model, partition_of

    base, _ = compose_experiment(["experiment=tiny"])
    extended, _ = compose_experiment(
        ["experiment=tiny", "method.personal_patterns=['^decoder.head.']"]
    )
    model = build_model(base)
    added = set(partition_of(model, extended).personal) - set(partition_of(model, base).personal)
    assert added == {"decoder.head.weight", "decoder.head.bias"}
    with pytest.raises(ConfigError, match="personalization"):
        compose_experiment(["method.personalization=queries"])
