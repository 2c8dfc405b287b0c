"""Run directories survive damage: corrupted checkpoints, stale temporaries, truncated logs, a full
disk; and eval_outfed.py explains what is missing instead of failing on a file name."""

from __future__ import annotations

import pytest
import torch

from fedst.cli import compose_experiment
from fedst.config import ConfigError
from fedst.federation.server import FederationServer
from fedst.outfed import evaluate_out_of_federation


def tiny_cfg(*overrides: str):
    return compose_experiment(["experiment=tiny", "method.serq=false", *overrides])[0]


def test_eval_outfed_on_a_run_without_a_completed_round_says_so(tmp_path):
    cfg = tiny_cfg()
    run_dir = tmp_path / "run"
    FederationServer(cfg, run_dir, torch.device("cpu")).save(0)  # killed during round 1
    with pytest.raises(FileNotFoundError) as caught:
        evaluate_out_of_federation(cfg, run_dir, torch.device("cpu"), sites=("E",))
    assert f"no completed round in {run_dir}" in str(caught.value)
    assert "state_r0000" not in str(caught.value)


def test_eval_outfed_with_an_unknown_site_lists_the_known_sites(tmp_path):
    cfg = tiny_cfg()
    with pytest.raises(ConfigError) as caught:
        evaluate_out_of_federation(cfg, tmp_path, torch.device("cpu"), sites=("X",))
    message = str(caught.value)
    assert "'X'" in message and all(f"'{s}'" in message for s in cfg.data.sites)
