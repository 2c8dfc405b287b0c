"""Every file of a run directory is named in fedst/runs/layout.py and nowhere else: the other
modules use its constants, so a file cannot be renamed on one side only (issue 48)."""

from __future__ import annotations

from pathlib import Path

from conftest import strings_in_code

from fedst.runs import layout

REPO = Path(__file__).resolve().parents[1]
SOURCES = [*sorted((REPO / "fedst").rglob("*.py")), REPO / "eval_outfed.py", REPO / "train_fed.py"]
ALLOWED = {
    REPO / "fedst/runs/layout.py": "the names themselves",
    REPO / "fedst/schema/feature_bank.py": "SERQ_BANK_SCRATCH: torch-free, below fedst.methods "
    "and fedst.runs; layout re-exports it",
}


def run_file_names() -> set[str]:
    """The file names layout.py defines (its string constants with a suffix), and each one's
    last path part (``selection/selection.json`` -> ``selection.json``)."""
    names = {
        value
        for name, value in vars(layout).items()
        if name.isupper() and isinstance(value, str) and "." in value
    }
    return names | {name.rsplit("/", 1)[-1] for name in names}


def spelled_run_files(names: set[str]) -> list[str]:
    """Every string (f-string parts included, docstrings not) that is one of ``names``, outside
    the allowed modules."""
    return [
        f"{path.relative_to(REPO).parent}/{found}"
        for path in SOURCES
        if path not in ALLOWED
        for found in strings_in_code(path, names)
    ]


def test_layout_names_the_files_its_docstring_lists():
    for name in ("config.json", "final.json", "metrics.jsonl", "train.jsonl", "comm.jsonl",
                 "device.jsonl", "benchmark.json", "log.txt", "selection.json", "fingerprint.json",
                 "serq_bank.work"):  # fmt: skip
        assert name in run_file_names(), name


def test_no_module_but_layout_spells_a_run_files_name():
    found = spelled_run_files(run_file_names())
    assert not found, "run-file names spelled outside fedst/runs/layout.py:\n" + "\n".join(found)
