"""Run directories survive damage: corrupted checkpoints, stale temporaries, truncated logs, a full
disk; and eval_outfed.py explains what is missing instead of failing on a file name."""

from __future__ import annotations

import errno
import logging
import re
import shutil
from pathlib import Path

import pytest
import torch

from fedst.cli import compose_experiment
from fedst.config import ConfigError
from fedst.data.procedural import generate
from fedst.federation.server import FederationServer
from fedst.runs import Run
from fedst.runs.layout import SERVER_CHECKPOINT, SERVER_PREVIOUS
from fedst.runs.outfed import evaluate_out_of_federation
from fedst.storage import CheckpointError, atomic_torch_save, load_checkpoint, read_jsonl
from fedst.training import run_training


def tiny_cfg(*overrides: str):
    return compose_experiment(["experiment=tiny", "method.serq=false", *overrides])[0]


def test_eval_outfed_on_a_run_without_a_completed_round_says_so(tmp_path):
    cfg = tiny_cfg()
    run_dir = tmp_path / "run"
    FederationServer(cfg, run_dir, torch.device("cpu")).save(0)  # killed during round 1
    with pytest.raises(FileNotFoundError) as caught:
        evaluate_out_of_federation(Run(run_dir, cfg), torch.device("cpu"), sites=("E",))
    assert f"no completed round in {run_dir}" in str(caught.value)
    assert "state_r0000" not in str(caught.value)


def test_eval_outfed_with_an_unknown_site_lists_the_known_sites(tmp_path):
    cfg = tiny_cfg()
    with pytest.raises(ConfigError) as caught:
        evaluate_out_of_federation(Run(tmp_path, cfg), torch.device("cpu"), sites=("X",))
    message = str(caught.value)
    assert "'X'" in message and all(f"'{s}'" in message for s in cfg.data.sites)


# -- item 7: damaged checkpoints, stale temporaries, truncated logs, a full disk -------------------


@pytest.fixture(autouse=True)
def _private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("FEDST_CACHE_DIR", str(tmp_path / "cache"))


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory: pytest.TempPathFactory):
    """A finished 2-round run on the tiny benchmark (no SERQ: fast) and its final.json, with
    what resuming it would read (train.keep_resume_state: the damage below is resumed from)."""
    root = tmp_path_factory.mktemp("bench") / "tiny"
    generate(root, seed=0, preset="tiny", workers=1, progress=False)
    cfg = tiny_cfg(f"data.root={root}", "train.keep_resume_state=true")
    run_dir = tmp_path_factory.mktemp("runs") / "whole"
    final = run_training(cfg, run_dir, progress=False)
    return cfg, run_dir, final


@pytest.fixture()
def run_copy(finished_run, tmp_path):
    cfg, run_dir, final = finished_run
    copy = tmp_path / "run"
    shutil.copytree(run_dir, copy)
    return cfg, copy, final


def truncate(path: Path, keep: float = 0.5) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])


def test_the_server_keeps_the_previous_checkpoint(run_copy):
    _, run_dir, _ = run_copy
    latest = torch.load(run_dir / SERVER_CHECKPOINT, weights_only=False)
    previous = torch.load(run_dir / SERVER_PREVIOUS, weights_only=False)
    assert (latest["round"], previous["round"]) == (2, 1)


def test_a_damaged_server_checkpoint_is_named_and_the_run_resumes_from_the_previous_round(
    run_copy, caplog
):
    """Device: train.device=auto (CUDA where present) with the tiny experiment's
    train.deterministic=true, so the equality holds bit for bit on the CPU and on one GPU."""
    cfg, run_dir, final = run_copy
    truncate(run_dir / SERVER_CHECKPOINT)
    with caplog.at_level(logging.WARNING):
        resumed = run_training(cfg, run_dir, progress=False)
    assert str(run_dir / SERVER_CHECKPOINT) in caplog.text
    assert f"falling back to {run_dir / SERVER_PREVIOUS} (round 1)" in caplog.text
    assert resumed["rounds"] == 2 and resumed["sites"] == final["sites"]  # round 2 redone


def test_a_damaged_latest_site_state_falls_back_to_the_round_before(run_copy, caplog):
    cfg, run_dir, final = run_copy
    damaged = run_dir / "sites" / "B" / "state_r0002.pt"
    truncate(damaged)
    with caplog.at_level(logging.WARNING):
        resumed = run_training(cfg, run_dir, progress=False)
    assert str(damaged) in caplog.text and "(round 1)" in caplog.text
    assert resumed["sites"] == final["sites"]
    assert torch.load(damaged, weights_only=False)["round"] == 2  # rewritten by the redone round


def test_a_damaged_state_file_is_an_error_naming_it(tmp_path):
    path = tmp_path / "state_r0003.pt"
    torch.save({"round": 3, "personal": {"w": torch.zeros(1000)}}, path)
    truncate(path)
    with pytest.raises(CheckpointError, match=re.escape(str(path))):
        load_checkpoint(path)


def test_stale_temporary_files_are_removed_at_start(run_copy):
    cfg, run_dir, _ = run_copy
    stale = [
        run_dir / "checkpoints" / ".server.pt.k1l2m3.tmp",
        run_dir / ".final.json.x9.tmp",
        run_dir / "sites" / "A" / ".state_r0003.pt.q7.tmp",
    ]
    for path in stale:
        path.write_bytes(b"half a file")
    truncate(run_dir / SERVER_CHECKPOINT)  # round 2 is redone: the server and every site start
    run_training(cfg, run_dir, progress=False)
    assert not any(path.exists() for path in stale)


def test_a_truncated_last_log_line_is_skipped_with_a_warning(tmp_path, caplog):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"round": 1, "dice": 50.0}\n{"round": 2, "dice": 5')
    with caplog.at_level(logging.WARNING):
        assert read_jsonl(path) == [{"round": 1, "dice": 50.0}]
    assert f"{path}: last line 2 is incomplete" in caplog.text
    path.write_text('{"round": 1, "di\n{"round": 2, "dice": 50.0}\n')
    with pytest.raises(ValueError, match=re.escape(f"{path}:1: not valid JSON")):
        read_jsonl(path)
    path.write_text('{"round": 1, "dice": 50.0}\n{"round": 2, "di\n')  # complete, but corrupt
    with pytest.raises(ValueError, match=re.escape(f"{path}:2: not valid JSON")):
        read_jsonl(path)


def test_a_full_disk_is_reported_with_the_path_and_leaves_no_temporary(tmp_path, monkeypatch):
    def disk_full(obj, target):
        Path(target).write_bytes(b"partial")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(torch, "save", disk_full)
    target = tmp_path / "checkpoints" / "server.pt"
    with pytest.raises(OSError) as caught:
        atomic_torch_save({"round": 1}, target)
    assert caught.value.errno == errno.ENOSPC
    assert f"no space left on device while writing {target}" in str(caught.value)
    assert list(target.parent.iterdir()) == []


def test_torchs_unexpected_pos_on_a_full_disk_names_the_path(tmp_path, monkeypatch):
    def zip_writer_failure(obj, target):
        raise RuntimeError("[enforce fail at inline_container.cc:664] . unexpected pos 64 vs 0")

    monkeypatch.setattr(torch, "save", zip_writer_failure)
    monkeypatch.setattr(shutil, "disk_usage", lambda p: shutil._ntuple_diskusage(10, 10, 0))
    target = tmp_path / "state_r0001.pt"
    with pytest.raises(OSError, match=re.escape(f"no space left on device while writing {target}")):
        atomic_torch_save({"round": 1}, target)
