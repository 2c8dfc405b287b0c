"""Reading a config is light (issue 63): composing and checking the demo config the way
train_fed.py does (Hydra, fedst.cli.split_config, the typed fedst.experiment) imports none of the
training stack, so a mistyped key or ``--help`` answers before torch would have loaded."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

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


ENTRY_POINT_IN_A_FRESH_INTERPRETER = """
import json, runpy, sys
sys.argv = [sys.argv[1], *sys.argv[2:]]
try:
    if sys.argv[0].endswith(".py"):
        runpy.run_path(sys.argv[0], run_name="__main__")
    else:
        runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True)
    status = 0
except SystemExit as stopped:
    status = stopped.code
print(json.dumps([status, sorted(name for name in {heavy!r} if name in sys.modules)]))
"""
"""Runs a script (``train_fed.py``) or a module (``fedst.report``) with the given arguments as its
command line; prints its exit status and the heavy packages it imported."""


@pytest.mark.parametrize(
    ("override", "says"),
    [
        ("train.lr=abc", "train.lr='abc' (str): expected a number"),
        ("train.amp_dtype=fp8", "train.amp_dtype='fp8'; choose one of"),
        ("train.device=tpu", "train.device='tpu'; choose auto, cpu, cuda or cuda:N"),
        ("network.encoder=pvt_v9", "network.encoder='pvt_v9'; choose one of"),
        ("method.algorithm=fedxx", "method.algorithm='fedxx'; choose one of"),
        ("method=fedrep method.options.head_iters=-3", "head_iters=-3: must be >= 0"),
    ],
)
def test_a_wrong_value_ends_in_one_line_before_torch_or_flwr_is_imported(override, says, tmp_path):
    """A wrong *value* (not only a wrong key) is refused by the torch-free config floor: the
    failed command's clean-up (fedst/cli.py remove_unfinished_runs, which reads fedst.runs.layout)
    imports no torch either."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("FEDST_DEBUG", None)
    script = ENTRY_POINT_IN_A_FRESH_INTERPRETER.format(heavy=HEAVY)
    done = subprocess.run(
        [sys.executable, "-c", script, str(REPO / "train_fed.py"), *override.split()],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
    )
    status, heavy = json.loads(done.stdout.strip().splitlines()[-1])
    assert status == 2, done.stderr
    (line,) = done.stderr.strip().splitlines()
    assert line.startswith("train_fed.py: error: ") and says in line, line
    assert heavy == []
    assert not any(tmp_path.iterdir())  # the run directory Hydra made is gone


def test_the_floor_s_names_are_those_the_code_above_it_builds():
    """The names the torch-free floor accepts are exactly what the methods and the encoder
    factory build (checked there too, but only after torch has loaded)."""
    from fedst.methods import METHODS
    from fedst.schema.method_options import OPTIONS
    from fedst.schema.network import ENCODERS
    from models.pvt import PVT_V2_VARIANTS

    assert {name: method.Options for name, method in METHODS.items()} == OPTIONS
    assert ENCODERS == PVT_V2_VARIANTS


@pytest.mark.parametrize(
    ("argv", "status", "says"),
    [
        ("fedst.report --help", 0, "usage: python -m fedst.report"),
        ("fedst.report nope", 2, "nope: not a directory"),
        ("fedst.report msf nope", 2, "msf: nope is not a run directory"),
        ("fedst.report matrix nope", 2, "matrix --rule last: nope is not a run directory"),
        ("fedst.paper --help", 0, "usage: python -m fedst.paper"),
        ("fedst.paper table2 rows=fedsst --dry-run", 2, "['fedsst'] not in table2"),
        ("fedst.deploy --help", 0, "usage: python -m fedst.deploy"),
        ("fedst.deploy local --sites A engine=ray", 2, "engine=ray: deploy local runs Flower's"),
        ("eval_outfed.py run=nope", 2, "run=nope: no such folder"),
    ],
)
def test_the_report_runner_deploy_and_eval_outfed_answer_help_and_a_mistake_before_torch(
    argv, status, says, tmp_path
):
    """`--help` and a wrong argument of ``python -m fedst.report`` / ``fedst.paper`` /
    ``fedst.deploy`` and ``eval_outfed.py`` are answered before torch, flwr or albumentations load
    (each costs seconds); the commands import the training stack once their arguments are
    checked."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "COLUMNS": "200"}
    env.pop("FEDST_DEBUG", None)
    script = ENTRY_POINT_IN_A_FRESH_INTERPRETER.format(heavy=HEAVY)
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            script,
            *(str(REPO / a) if a.endswith(".py") else a for a in argv.split()),
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
    )
    answer, heavy = json.loads(done.stdout.strip().splitlines()[-1])
    assert answer == status, done.stderr[-2000:]
    assert says in (done.stdout if status == 0 else done.stderr), (done.stdout + done.stderr)[
        -2000:
    ]
    assert heavy == []
    assert not any(tmp_path.iterdir())
