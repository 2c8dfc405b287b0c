"""The server's round policy has one codec and one set of defaults (issue 63): DeployConfig's
fields travel to the deployed ServerApp as its run config and come back unchanged, and
pyproject.toml's ``[tool.flwr.app.config]`` (what ``flwr run .`` uses without ``train_fed.py``)
holds exactly DeployConfig's defaults."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

from fedst.config import ConfigError
from fedst.experiment import DeployConfig, RoundPolicy
from fedst.experiment.runtime import POLICY_RUN_CONFIG

PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"


def flwr_app_config() -> dict:
    return tomllib.loads(PYPROJECT.read_text())["tool"]["flwr"]["app"]["config"]


def test_pyproject_flwr_app_config_holds_deploy_config_defaults():
    app_config = flwr_app_config()
    policy_keys = {key: app_config[key] for key in POLICY_RUN_CONFIG}
    assert policy_keys == DeployConfig().to_run_config()
    # the values by hand, from DeployConfig's declarations (0: null; eval: 3 x round_timeout)
    assert policy_keys == {
        "min-sites": 0,
        "round-timeout": 600.0,
        "eval-timeout": 0.0,
        "join-timeout": 300.0,
        "audit": False,
        "reply-poll": 0.2,
    }


def test_an_empty_or_the_default_run_config_decodes_to_the_deploy_defaults_policy():
    expected = RoundPolicy(
        min_sites=None,
        round_timeout=600.0,
        eval_timeout=1800.0,
        join_timeout=300.0,
        collect_personal=True,
        audit=False,
        reply_poll=0.2,
    )
    assert DeployConfig.from_run_config({}).policy() == expected
    assert DeployConfig.from_run_config(flwr_app_config()).policy() == expected


@pytest.mark.parametrize(
    "dcfg",
    [
        DeployConfig(),
        DeployConfig(min_sites=3, round_timeout=None, eval_timeout=50.0, audit=True),
        DeployConfig(round_timeout=10.0, join_timeout=0.0, reply_poll=0.05),
    ],
)
def test_a_deploy_policy_survives_the_run_config_round_trip(dcfg):
    decoded = DeployConfig.from_run_config({"run-dir": "x", **dcfg.to_run_config()})
    assert decoded.policy() == dcfg.policy()


def test_a_wrong_policy_value_is_refused_naming_the_deploy_key():
    with pytest.raises(ConfigError, match=r"deploy.round_timeout=-1.0: must be > 0 or null"):
        DeployConfig.from_run_config({"round-timeout": -1})
