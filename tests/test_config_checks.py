"""Config values are type- and range-checked when the experiment is built, naming key and values."""

from __future__ import annotations

import dataclasses
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from fedst.cli import compose_experiment, resume_experiment
from fedst.config import ConfigError
from fedst.training import save_config

REPO = Path(__file__).resolve().parents[1]

BAD_VALUES = [
    # (override, key the message must name, accepted values it must state)
    ("train.rounds=abc", "train.rounds", "integer"),
    ("train.lr=abc", "train.lr", "number"),
    ("seed=abc", "seed", "integer"),
    ("train.local_iters=0", "train.local_iters", ">= 1"),
    ("train.local_iters=abc", "train.local_iters", "integers"),
    ("train.batch_size=0", "train.batch_size", ">= 1"),
    ("train.eval_every=0", "train.eval_every", ">= 1"),
    ("train.eval_max_frames=0", "train.eval_max_frames", ">= 1"),
    ("train.lr=0", "train.lr", "> 0"),
    ("seed=-1", "seed", ">= 0"),
    ("serq.batch_size=0", "serq.batch_size", ">= 1"),
    ("method.serq=maybe", "method.serq", "true or false"),
    ("clip.image_size=[64]", "clip.image_size", "2 values"),
    ("data.federation=[]", "data.federation", "at least one site"),
    ("data.federation=[A,A]", "data.federation", "more than once"),
]


@pytest.mark.parametrize(("override", "key", "accepted"), BAD_VALUES)
def test_a_bad_value_is_a_config_error_naming_the_key_and_what_is_accepted(override, key, accepted):
    with pytest.raises(ConfigError) as caught:
        compose_experiment(["experiment=tiny", override])
    message = str(caught.value)
    assert key in message and accepted in message, message


def test_good_values_of_every_type_still_build():
    cfg, _ = compose_experiment(
        [
            "experiment=tiny",
            "train.lr=1e-4",
            "train.eval_max_frames=null",
            "train.max_grad_norm=1",
            "clip.image_size=[32,40]",
            "network.pretrained=false",
            "data.federation=[A,B]",
        ]
    )
    assert cfg.train.lr == 1e-4 and cfg.train.eval_max_frames is None
    assert cfg.clip.image_size == (32, 40) and cfg.data.federation == ("A", "B")


# -- resume=<run>: safe overrides are applied and logged, others are refused by name ----------------


def test_resume_applies_the_safe_overrides_and_logs_them(caplog):
    saved, _ = compose_experiment(["experiment=tiny", "seed=3"])
    overrides = ["train.eval_every=5", "train.num_workers=1", "progress=false", "resume=runs/x"]
    overrides += ["site=server", "deploy.port=9100", "deploy.certs=certs"]  # a restarted server
    overrides += ["serq.bank_storage=disk", "network.encoder_grad_checkpointing=true"]
    composed, _ = compose_experiment(overrides)  # today's defaults + the command line
    with caplog.at_level(logging.INFO):
        resumed = resume_experiment(saved, composed, overrides)
    assert resumed.train.eval_every == 5 and resumed.train.num_workers == 1
    assert resumed.serq.bank_storage == "disk" and resumed.network.encoder_grad_checkpointing
    unchanged = dataclasses.replace(
        resumed, train=saved.train, serq=saved.serq, network=saved.network
    )
    assert unchanged == saved  # nothing else changed
    assert "train.eval_every changed from 1 to 5" in caplog.text


def test_resume_refuses_overrides_that_change_what_the_run_learns():
    saved, _ = compose_experiment(["experiment=tiny"])
    overrides = ["train.lr=0.5", "method=fedavg", "train.device=cpu", "resume=runs/x"]
    composed, _ = compose_experiment(["experiment=tiny", *overrides])
    with pytest.raises(ConfigError) as caught:
        resume_experiment(saved, composed, overrides)
    message = str(caught.value)
    assert "train.lr=0.5" in message and "method=fedavg" in message
    assert "train.device=cpu" not in message.split("Accepted")[0]
    assert "train.eval_every" in message  # the accepted keys are listed


def test_train_fed_refuses_an_unsafe_override_on_resume(tmp_path):
    cfg, _ = compose_experiment(["experiment=tiny"])
    save_config(cfg, tmp_path / "run")
    done = subprocess.run(
        [sys.executable, str(REPO / "train_fed.py"), f"resume={tmp_path / 'run'}", "train.lr=0.5"],
        cwd=tmp_path,  # Hydra's own output folder goes under tmp_path/runs, not into the checkout
        env={**os.environ, "FLWR_TELEMETRY_ENABLED": "0", "HYDRA_FULL_ERROR": "1"},
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode != 0 and "train.lr=0.5" in done.stderr
    assert not (tmp_path / "run" / "checkpoints").exists()
