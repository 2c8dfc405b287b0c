"""What the training path tells a user instead of doing the wrong thing: engine=ray without Ray
and an unknown engine (one ConfigError naming the fix, before any file is written), resuming a
finished run (refused in one line naming what to do instead, the run untouched), and Flower's log
lines without terminal colour codes where the output is not a terminal."""

from __future__ import annotations

import importlib.util
import io
import json
import logging
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from flwr.common.logger import console_handler
from flwr.common.logger import log as flower_log

from fedst import training
from fedst.cli import compose_experiment, setup_logging
from fedst.config import ConfigError
from fedst.errors import UserError

REPO = Path(__file__).resolve().parents[1]


def test_engine_ray_without_ray_is_one_config_error_naming_the_projects_extra_before_any_file(
    tmp_path, monkeypatch
):
    real_find_spec = importlib.util.find_spec

    def find_spec(name, *args, **kwargs):
        return None if name == "ray" else real_find_spec(name, *args, **kwargs)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    cfg, _ = compose_experiment(["experiment=tiny", f"data.root={tmp_path / 'data'}"])
    with pytest.raises(ConfigError) as caught:
        training.run_training(cfg, tmp_path / "run", engine="ray", progress=False)
    # the extra of pyproject.toml that installs Flower's simulation (and so Ray)
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    (extra,) = [
        name
        for name, requirements in extras["optional-dependencies"].items()
        if any(r.startswith("flwr[simulation]") for r in requirements)
    ]
    message = str(caught.value)
    assert isinstance(caught.value, UserError)
    assert f"pip install -e '.[{extra}]'" in message and "\n" not in message
    assert not (tmp_path / "run").exists() and not (tmp_path / "data").exists()


def test_an_unknown_engine_is_one_config_error_naming_the_engines_before_any_file(tmp_path):
    cfg, _ = compose_experiment(["experiment=tiny", f"data.root={tmp_path / 'data'}"])
    with pytest.raises(ConfigError, match=r"engine='raay': choose one of inprocess, ray$"):
        training.run_training(cfg, tmp_path / "run", engine="raay", progress=False)
    assert not (tmp_path / "run").exists()


def finished_run(run_dir: Path, data_root: Path) -> Path:
    """A run directory as a finished tiny run leaves it, as far as resuming reads it: its
    config.json and its final.json."""
    cfg, _ = compose_experiment(["experiment=tiny", f"data.root={data_root}"])
    run_dir.mkdir(parents=True)
    (run_dir / "config.json").write_text(cfg.to_json())
    (run_dir / "final.json").write_text(json.dumps({"rounds": cfg.train.rounds}))
    return run_dir


def test_only_a_finished_run_is_refused_as_nothing_to_resume(tmp_path):
    interrupted = tmp_path / "interrupted"
    interrupted.mkdir()
    training.check_resumable(interrupted)  # no final.json: resumable
    run_dir = finished_run(tmp_path / "finished", tmp_path / "data")
    with pytest.raises(ConfigError) as caught:
        training.check_resumable(run_dir)
    message = str(caught.value)
    assert "\n" not in message and f"resume={run_dir}: the run is finished" in message
    assert f"python eval_outfed.py run={run_dir}" in message


def test_train_fed_resume_of_a_finished_run_exits_2_in_one_line_and_leaves_it_untouched(
    tmp_path,
):
    run_dir = finished_run(tmp_path / "finished", tmp_path / "data")
    before = {p: p.read_bytes() for p in run_dir.rglob("*")}
    hydra_dir = tmp_path / "hydra" / "new"
    env = {**os.environ, "FLWR_TELEMETRY_ENABLED": "0", "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, "train_fed.py", f"resume={run_dir}", f"hydra.run.dir={hydra_dir}"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 2, done.stderr[-2000:]
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "the run is finished" in lines[0], done.stderr[-2000:]
    assert {p: p.read_bytes() for p in run_dir.rglob("*")} == before  # nothing appended
    assert not hydra_dir.exists()  # the directory Hydra made for the command is gone


@pytest.fixture()
def flower_console(monkeypatch):
    """Flower's console handler writing into a file-like buffer (not a terminal), as when a
    run's output is piped or redirected; its stream and colour are restored afterwards."""
    buffer = io.StringIO()
    monkeypatch.setattr(console_handler, "stream", buffer)
    monkeypatch.setattr(console_handler, "colored", True)  # Flower's default
    root, flower = logging.getLogger(), logging.getLogger("flwr")
    handlers, level, propagate = list(root.handlers), root.level, flower.propagate
    yield buffer
    for handler in root.handlers:  # those setup_logging installed
        if handler not in handlers:
            handler.close()
    root.handlers[:] = handlers
    root.setLevel(level)
    flower.propagate = propagate


def test_flower_log_lines_have_no_colour_codes_where_the_output_is_not_a_terminal(
    flower_console, tmp_path
):
    setup_logging(tmp_path / "run")
    flower_log(logging.INFO, "a line from Flower")
    text = flower_console.getvalue()
    assert "a line from Flower" in text
    assert "\x1b[" not in text


def test_flower_log_lines_keep_their_colour_on_a_terminal(flower_console, monkeypatch, tmp_path):
    monkeypatch.setattr(flower_console, "isatty", lambda: True)
    setup_logging(tmp_path / "run")
    flower_log(logging.INFO, "a line from Flower")
    assert "\x1b[" in flower_console.getvalue()
