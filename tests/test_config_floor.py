"""Reading a config is light (issue 63): composing and checking the demo config the way
train_fed.py does (Hydra, fedst.cli.split_config, the typed fedst.experiment) imports none of the
training stack, so a mistyped key or ``--help`` answers before torch would have loaded."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
HEAVY = ("torch", "timm", "torchvision", "albumentations", "flwr")
"""What reading a config must not import (each costs seconds of CPU at start-up)."""

COMPOSE_DEMO = f"""
import json, sys
from hydra import compose, initialize_config_dir
import fedst.experiment
from fedst.cli import CONFIG_DIR, register_resolvers, split_config

register_resolvers()
with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
    cfg = compose("config", overrides=["experiment=demo"])
experiment, runtime = split_config(cfg)
assert experiment.name == "demo" and runtime.engine == "inprocess", (experiment.name, runtime)
print(json.dumps(sorted(name for name in {HEAVY!r} if name in sys.modules)))
"""


def test_composing_the_demo_config_imports_no_torch_timm_albumentations_or_flwr():
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run(
        [sys.executable, "-c", COMPOSE_DEMO], cwd=REPO, env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.strip().splitlines()[-1]) == []
