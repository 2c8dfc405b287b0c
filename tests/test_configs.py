"""Specifications of the configs: the paper's settings, every ablation row, strictness."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
from hydra.errors import ConfigCompositionException

from fedst.cli import compose_experiment
from fedst.config import ConfigError, build, to_dict
from fedst.experiment import ExperimentConfig, MethodConfig

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


def flat(cfg: ExperimentConfig) -> dict[str, object]:
    """{"method.serq": True, "train.rounds": 20, ...}: every leaf of the composed experiment."""

    def walk(prefix: str, value: object) -> dict[str, object]:
        if isinstance(value, dict):
            return {
                k: v
                for key, item in value.items()
                for k, v in walk(f"{prefix}{key}.", item).items()
            }
        return {prefix[:-1]: value}

    return walk("", to_dict(cfg))


@functools.lru_cache
def composed(overrides: tuple[str, ...]) -> dict[str, object]:
    return flat(compose_experiment(list(overrides))[0])


def changes(base: list[str], extra: list[str]) -> dict[str, object]:
    """Leaves whose value differs when ``extra`` overrides are added (the method's name aside)."""
    before_values, after_values = composed(tuple(base)), composed((*base, *extra))
    assert before_values.keys() == after_values.keys()
    return {k: v for k, v in after_values.items() if v != before_values[k] and k != "method.name"}


NO_TS, NO_PROMPT, NO_CS, NO_SERQ = (
    {"method.temporal": False},
    {"method.prompt": False},
    {"method.channel_selection": False},
    {"method.serq": False},
)
# Every ablation, relative to FedST, as the paper's tables define it (Sec. IV-C; Tables IV-VII,
# Fig. 6). FedST itself: TS, prompt, CS, SERQ on; encoder queries (and CS) personalized.
PAPER_ABLATIONS: dict[str, dict[str, object]] = {
    "table4_row1_baseline": {**NO_TS, **NO_PROMPT, **NO_CS, **NO_SERQ},  # FedDP
    "table4_row2_ts": {**NO_PROMPT, **NO_CS, **NO_SERQ},
    "table4_row3_ts_prompt": {**NO_CS, **NO_SERQ},
    "table4_row4_ts_prompt_cs": NO_SERQ,
    "table4_row5_serq": {**NO_TS, **NO_PROMPT, **NO_CS},
    "table4_row6_ts_serq": {**NO_PROMPT, **NO_CS},
    "table4_row7_full": {},
    "table5_row1_none": {
        "method.personalization": "none",
        "method.personalize_channel_selection": False,
    },
    "table5_row2_all": {"method.personalization": "all"},
    "table5_row3_decoder_query": {"method.personalization": "decoder_query"},
    "table5_row4_encoder_decoder_query": {"method.personalization": "encoder_decoder_query"},
    "table5_row5_encoder_query": {},
    "table6_norm": {"method.personalization": "encoder_norm"},
    "table6_key": {"method.personalization": "encoder_key"},
    "table6_value": {"method.personalization": "encoder_value"},
    "table6_key_value": {"method.personalization": "encoder_key_value"},
    "table6_query": {},
    # Table VII on the demo base, whose indicator is one-hot (no CLIP weights here).
    "table7_onehot": {},
    "table7_gaussian": {"method.indicator": "gaussian"},
    "table7_random": {"method.indicator": "random"},
    "table7_clip": {"method.indicator": "clip"},
    # Fig. 6 on the paper base (30000 local iterations, E = 100): E and T = 30000 / E change.
    "fig6_every_10": {"train.local_iters": 10, "train.rounds": 3000},
    "fig6_every_50": {"train.local_iters": 50, "train.rounds": 600},
    "fig6_every_100": {},
    "fig6_every_200": {"train.local_iters": 200, "train.rounds": 150},
    "fig6_every_500": {"train.local_iters": 500, "train.rounds": 60},
    # Fig. 5 on the demo base (20 rounds: a curve point every 2 rounds; the demo evaluates every
    # 4): the ways synthetic data enters FedST without SERQ, and FedST itself.
    "fig5_server_finetune": {"serq.mode": "finetune", "train.eval_every": 2},
    "fig5_local_synthetic": {**NO_SERQ, "data.mix_synthetic": True, "train.eval_every": 2},
    "fig5_serq": {"train.eval_every": 2},
    # Fig. 7: the synthetic set mixed in (the runner doubles train.total_iters: test_experiments)
    "fig7_synthetic": {"data.mix_synthetic": True},
}


def test_every_ablation_config_is_a_row_of_the_paper():
    assert set(ABLATIONS) == set(PAPER_ABLATIONS)


@pytest.mark.parametrize("name", ABLATIONS)
def test_each_ablation_changes_exactly_what_its_paper_row_names(name):
    base = ["experiment=paper" if name.startswith("fig6") else "experiment=demo"]
    assert changes(base, [f"+ablation={name}"]) == PAPER_ABLATIONS[name]


@pytest.mark.parametrize(
    ("base", "every"),
    [("experiment=demo", 2), ("experiment=paper", 30), ("experiment=tiny", 1)],
)
def test_fig5_curves_get_about_ten_points_whatever_the_experiments_rounds(base, every):
    for name in ("fig5_server_finetune", "fig5_local_synthetic", "fig5_serq"):
        cfg, _ = compose_experiment([base, f"+ablation={name}"])
        assert cfg.train.eval_every == every == max(1, cfg.train.rounds // 10)


def test_methods_differ_only_in_their_method_choices():
    def method_of(name: str) -> dict[str, object]:
        return {**changes([], [f"method={name}"]), "method.name": name}

    assert all(key.startswith("method.") for name in ("fedavg", "local") for key in method_of(name))
    assert method_of("fedavg") == {
        "method.name": "fedavg",
        **NO_TS,
        **NO_PROMPT,
        **NO_CS,
        **NO_SERQ,
        "method.personalization": "none",
        "method.personalize_channel_selection": False,
        "method.aggregation_weights": "samples",  # McMahan et al.: n_k / n; FedST: 1/K
        "method.returned_model": "global",  # one global model; FedST: each site's own gamma_k
    }
    assert method_of("local") == {
        "method.name": "local",
        **NO_TS,
        **NO_PROMPT,
        **NO_CS,
        **NO_SERQ,
        "method.personalization": "all",
        "method.communicate": False,
    }


def test_any_field_can_be_overridden_and_a_typo_is_an_error():
    cfg, _ = compose_experiment(["method.aggregation=fedmedian", "train.weight_decay=0.5"])
    assert cfg.method.aggregation == "fedmedian" and cfg.train.weight_decay == 0.5
    with pytest.raises(ConfigError, match=r"unknown key 'train\.learning_rate'") as caught:
        compose_experiment(["train.learning_rate=0.1"])
    assert isinstance(caught.value.__cause__, ConfigCompositionException)  # Hydra's, reworded


def test_unknown_keys_and_bad_values_are_config_errors():
    with pytest.raises(ConfigError, match="unknown key"):
        build(MethodConfig, {"nme": "x"})
    with pytest.raises(ConfigError, match="unknown key"):
        compose_experiment(["+method.temporl=false"])  # a key Hydra lets through, ours does not
    with pytest.raises(ConfigError, match="aggregation"):
        build(MethodConfig, {"aggregation": "mean"})
    with pytest.raises(ConfigError, match="total_iters"):
        compose_experiment(["train.total_iters=10", "train.local_iters=20"])


def test_the_demo_is_explicit_about_what_it_cannot_have_here():
    cfg, _ = compose_experiment([])
    assert (
        cfg.network.pretrained is False
    )  # no ImageNet weights on this machine: asked for explicitly
    assert (
        cfg.method.indicator == "onehot"
    )  # no CLIP weights here: Table VII's one-hot row, explicitly


def test_make_demo_is_the_protocols_configuration_cut_to_its_first_8_rounds():
    from fedst.demo import demo_config

    protocol, _ = compose_experiment(["experiment=demo", "method=fedst", "seed=1"])
    demo, _ = demo_config("fedst", 1, 8, [])
    assert (protocol.train.rounds, demo.train.rounds) == (20, 8)
    assert demo.train.total_iters == 8 * protocol.train.local_iters
    cut = to_dict(demo)
    cut["train"].update(rounds=20, total_iters=protocol.train.total_iters)
    assert cut == to_dict(protocol)  # nothing else differs
    # the user's overrides come last
    assert demo_config("fedavg", 0, 8, ["train.local_iters=10"])[0].train.rounds == 8
    assert demo_config("fedavg", 0, 8, ["train.total_iters=40"])[0].train.rounds == 2


def test_personalization_is_a_preset_plus_optional_patterns_from_the_config():
    from fedst.methods import method_of

    base, _ = compose_experiment(["experiment=tiny"])
    extended, _ = compose_experiment(
        ["experiment=tiny", "method.personal_patterns=['^decoder.head.']"]
    )
    model = method_of(base).build_model()
    added = set(method_of(extended).partition(model).personal) - set(
        method_of(base).partition(model).personal
    )
    assert added == {"decoder.head.weight", "decoder.head.bias"}
    with pytest.raises(ConfigError, match="personalization"):
        compose_experiment(["method.personalization=queries"])
