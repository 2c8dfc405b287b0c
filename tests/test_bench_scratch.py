"""Specification of bench/scratch.py: a bench script's temporary runs are removed when it ends
normally, kept (and named) when it fails, and a directory the user names is never removed."""

from __future__ import annotations

import pytest

from bench.scratch import scratch_dir


def test_a_temporary_directory_is_removed_when_the_script_ends_normally():
    with scratch_dir("fedst_test_scratch_") as work:
        (work / "run").mkdir()
        (work / "run" / "log.txt").write_text("round 1")
    assert not work.exists()


def test_a_temporary_directory_is_kept_and_named_when_the_script_fails(capsys):
    with pytest.raises(SystemExit), scratch_dir("fedst_test_scratch_") as work:
        (work / "log.txt").write_text("the error")
        raise SystemExit("train_fed.py failed")
    try:
        assert (work / "log.txt").read_text() == "the error"
        assert str(work) in capsys.readouterr().err
    finally:
        (work / "log.txt").unlink()
        work.rmdir()


def test_a_directory_the_user_names_is_created_and_kept(tmp_path):
    keep = tmp_path / "runs" / "bench"
    with scratch_dir("fedst_test_scratch_", keep) as work:
        (work / "log.txt").write_text("round 1")
    assert work == keep and (keep / "log.txt").exists()
