"""Specification: every command-line entry and subcommand answers --help with its usage and a
one line saying what it does, and exits 0: in process (tests/conftest.py run_in_process, the
script or module as ``__main__``), and :data:`IN_A_PROCESS` also in a process of its own."""

from __future__ import annotations

import subprocess

import pytest

from tests.conftest import REPO, run_command

ENTRIES = {  # command -> (text its usage shows, the start of its one-line description)
    "train_fed.py": ("Usage: python train_fed.py", "train_fed.py: train a federation"),
    "eval_outfed.py": (
        "Usage: python eval_outfed.py run=RUN_DIR",
        "eval_outfed.py: out-of-federation evaluation of a finished run",
    ),
    "-m fedst.data.check": ("usage: python -m fedst.data.check", "Dataset checker: what each"),
    "-m fedst.data.procedural": ("--preset", "Procedural multi-site surgical video benchmark"),
    "-m fedst.data.preview": ("usage:", "Contact sheets of sites"),
    "-m fedst.weights": ("--prepare", "Which pretrained weights an experiment needs"),
    "-m fedst.report": ("usage: python -m fedst.report", "Result tables from run directories"),
    "-m fedst.report msf": ("usage: python -m fedst.report msf", "Model selection: rounds"),
    "-m fedst.report matrix": (
        "usage: python -m fedst.report matrix",
        "Cross-site evaluation: every model",
    ),
    "-m fedst.demo": ("--methods", "`make demo`: the whole pipeline"),
    "-m fedst.model.indicators": ("--sites", "Frozen site indicators xi_k"),
    "-m fedst.paper": (
        "usage: python -m fedst.paper",
        "One command per table of the paper",
    ),
    "-m fedst.guard": ("usage: python -m fedst.guard", "GEN-Guard's correction step"),
    "-m fedst.infer": ("python -m fedst.infer run=", "Run a trained site model on a video"),
    "-m fedst.export": ("python -m fedst.export run=", "Export a trained site model"),
    "-m fedst.deploy": ("usage: python -m fedst.deploy", "Run FedST across hospitals"),
    "-m fedst.deploy local": (
        "usage: python -m fedst.deploy local",
        "A whole deployment on this machine",
    ),
    "-m fedst.deploy certs": ("usage: python -m fedst.deploy certs", "TLS for a trial"),
    "-m fedst.deploy key": ("usage: python -m fedst.deploy key", "Node authentication"),
    "-m fedst.app.site_executor": (
        "usage: python -m fedst.app.site_executor",
        "A site's long-lived ClientApp executor",
    ),
}


IN_A_PROCESS = ["train_fed.py", "-m fedst.report"]
"""A Hydra script and an argparse module, also checked end to end (exit status, stdout)."""


def check_help(done: subprocess.CompletedProcess, entry: str) -> None:
    """--help exits 0, shows the usage, and says in one line what the command does: the first
    line of text after the usage block (at a wide terminal, so nothing wraps)."""
    assert done.returncode == 0, done.stderr[-2000:]
    usage, description = ENTRIES[entry]
    assert usage in done.stdout
    assert first_line_of_text(done.stdout).startswith(description), done.stdout[:600]


@pytest.mark.parametrize("entry", list(ENTRIES))
def test_every_command_and_subcommand_answers_help_with_its_usage_and_what_it_does(
    entry: str, in_process
):
    check_help(in_process([*entry.split(), "--help"], REPO, COLUMNS="200"), entry)


@pytest.mark.parametrize("entry", IN_A_PROCESS)
def test_a_hydra_and_an_argparse_command_answer_help_in_a_process_of_their_own(entry: str):
    check_help(run_command([*entry.split(), "--help"], REPO, COLUMNS="200"), entry)


def first_line_of_text(help_text: str) -> str:
    """The first line that is not part of an argparse usage block (which ends at a blank line)."""
    lines = help_text.splitlines()
    if lines and lines[0].lower().startswith("usage:"):
        lines = lines[next((i for i, line in enumerate(lines) if not line.strip()), len(lines)) :]
    return next(line.strip() for line in lines if line.strip())
