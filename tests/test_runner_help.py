"""Specification: every option of the table runner (``python -m fedst.paper``) says in its
--help what it does."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def undocumented_options(help_text: str) -> list[str]:
    """The options of an argparse help text's "options:" block listed without a description:
    nothing after the option on its line, and no deeper-indented line under it."""
    lines = help_text.split("options:\n", 1)[1].split("\n\n", 1)[0].splitlines()
    missing = []
    for index, line in enumerate(lines):
        found = re.match(r"  (-\S+(?: \S+)?(?:, -\S+(?: \S+)?)*)(\s{2,}\S.*)?$", line)
        if found is None:
            continue
        follows = lines[index + 1] if index + 1 < len(lines) else ""
        if found.group(2) is None and not re.match(r"\s{4,}[^-\s]", follows):
            missing.append(found.group(1))
    return missing


def test_every_option_of_the_runner_says_what_it_does():
    env = {**os.environ, "FLWR_TELEMETRY_ENABLED": "0", "OMP_NUM_THREADS": "1", "COLUMNS": "100"}
    done = subprocess.run(
        [sys.executable, "-m", "fedst.paper", "--help"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "--fps-frames" in done.stdout
    assert undocumented_options(done.stdout) == []


def test_an_option_without_help_is_found():
    """The reader above, on argparse's layouts: short and long help, and none."""
    text = (
        "usage: x\n\noptions:\n"
        "  -h, --help     show this help message and exit\n"
        "  --fps-frames FPS_FRAMES\n"
        "  --runs RUNS    root of run directories\n"
        "  --out OUT      root of the tables (default: results, or\n"
        "                 <runs>/results with another --runs)\n"
        "  --fps-warmup N\n"
        "                 frames run before the timed ones\n"
        "  --fps-threads N\n"
    )
    assert undocumented_options(text) == ["--fps-frames FPS_FRAMES", "--fps-threads N"]
