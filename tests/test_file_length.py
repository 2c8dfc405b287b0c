"""Specification: a Python file of the project over 600 lines says why at its top.

A file that long is usually two things; where it is one (an algorithm whose parts share state, a
table read as a whole), its first lines are a comment beginning ``# Over 600 lines:`` that gives the
reason (issue 62)."""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MAX_LINES = 600
REASON = "# Over 600 lines:"
FOLDERS = ("fedst", "models", "bench", "studies", "tests", "tools")


def long_files_without_a_reason(root: Path) -> list[str]:
    files = [*root.glob("*.py"), *(p for f in FOLDERS for p in sorted((root / f).rglob("*.py")))]
    found = []
    for path in files:
        text = path.read_text()
        if text.count("\n") > MAX_LINES and not text.startswith(REASON):
            found.append(f"{path.relative_to(root)}: {text.count(chr(10))} lines")
    return found


def test_the_check_finds_a_long_file_without_its_reason(tmp_path):
    (tmp_path / "fedst").mkdir()
    (tmp_path / "fedst" / "long.py").write_text("x = 1\n" * (MAX_LINES + 1))
    (tmp_path / "fedst" / "said.py").write_text(REASON + " one table\n" + "x = 1\n" * MAX_LINES)
    (tmp_path / "fedst" / "short.py").write_text("x = 1\n" * MAX_LINES)
    assert long_files_without_a_reason(tmp_path) == ["fedst/long.py: 601 lines"]


def test_every_python_file_over_600_lines_states_its_reason_at_its_top():
    assert not long_files_without_a_reason(REPO), long_files_without_a_reason(REPO)
