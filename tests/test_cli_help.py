"""Specification: every command-line entry answers --help with its usage and exits 0."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

ENTRIES = {  # command -> text its help must show
    "train_fed.py": "Usage: python train_fed.py",
    "eval_outfed.py": "Usage: python eval_outfed.py run=RUN_DIR",
    "-m fedst.data.check": "usage: python -m fedst.data.check",
    "-m fedst.data.procedural": "--preset",
    "-m fedst.data.preview": "usage:",
    "-m fedst.weights": "--prepare",
    "-m fedst.report": "usage: python -m fedst.report",
    "-m fedst.demo": "--methods",
    "-m fedst.model.indicators": "--sites",
    "-m fedst.experiments": "usage: python -m fedst.experiments",
    "-m fedst.guard": "usage: python -m fedst.guard",
}


@pytest.mark.parametrize("entry", list(ENTRIES))
def test_every_command_line_entry_answers_help_with_its_usage(entry: str):
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, *entry.split(), "--help"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert ENTRIES[entry] in done.stdout
