"""A run directory's files written safely and read back: atomic checkpoints and text, JSON-lines
logs mirrored to TensorBoard, the run's config. What each file holds: fedst/runs/layout.py."""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from fedst.errors import UserError
from fedst.experiment import ExperimentConfig, experiment_from_json

log = logging.getLogger(__name__)

TMP_PATTERN = ".*.tmp"
"""Temporary files of :func:`atomic_torch_save` / :func:`atomic_write_text` (``.<name>.<random>.tmp``)."""


class CheckpointError(UserError, RuntimeError):
    """A checkpoint or state file that cannot be read; the message names the file."""


def atomic_torch_save(obj: Any, path: Path, keep_previous: Path | None = None) -> None:
    """Write ``obj`` with torch.save to a temporary file, then rename: readers never see half a file.

    ``keep_previous``: first make the current ``path`` (if any) available under this name too (a
    hard link, or a copy where links are not supported), so the last two versions stay on disk.
    A full disk is reported as ``no space left on device while writing <path>``.
    """
    with _temporary_beside(path) as tmp:
        try:
            torch.save(obj, tmp)
        except (OSError, RuntimeError) as err:
            raise _write_error(err, path) from err
        if keep_previous is not None and path.exists():
            _keep_copy(path, keep_previous)
        os.replace(tmp, path)


@contextlib.contextmanager
def _temporary_beside(path: Path) -> Iterator[str]:
    """A fresh temporary file name next to ``path`` (same file system, so ``os.replace`` is
    atomic), removed on exit if it still exists."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        yield tmp
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _keep_copy(path: Path, previous: Path) -> None:
    """``previous`` := the current content of ``path``, atomically."""
    with _temporary_beside(previous) as tmp:
        os.unlink(tmp)  # os.link needs a free name
        try:
            try:
                os.link(path, tmp)
            except OSError:
                shutil.copyfile(path, tmp)
            os.replace(tmp, previous)
        except OSError as err:
            raise _write_error(err, previous) from err


def _write_error(err: BaseException, path: Path) -> BaseException:
    """A full disk as an OSError naming ``path``; other errors unchanged."""
    full = isinstance(err, OSError) and err.errno == errno.ENOSPC
    if not full and "unexpected pos" in str(err):  # torch's zip writer hides ENOSPC this way
        try:
            full = shutil.disk_usage(path.parent).free < 1 << 20
        except OSError:
            full = False
    if full:
        return OSError(
            errno.ENOSPC, f"no space left on device while writing {path}; free space and resume"
        )
    return err


def load_checkpoint(path: Path, map_location: Any = "cpu") -> Any:
    """torch.load of a file this run wrote; a damaged file is a CheckpointError naming it."""
    try:
        return torch.load(path, map_location=map_location, weights_only=False)
    except FileNotFoundError:
        raise
    except Exception as err:  # torch/zip/pickle raise many types for a damaged file
        raise CheckpointError(f"{path}: cannot read it ({type(err).__name__}: {err})") from err


def remove_stale_tmp(folder: Path) -> list[Path]:
    """Delete temporaries left in ``folder`` by a process killed while writing; logged."""
    stale = sorted(folder.glob(TMP_PATTERN)) if folder.is_dir() else []
    for path in stale:
        path.unlink(missing_ok=True)
        log.info("removed stale temporary file %s", path)
    return stale


def atomic_write_text(text: str, path: Path) -> None:
    with _temporary_beside(path) as tmp:
        try:
            Path(tmp).write_text(text)
            os.replace(tmp, path)
        except OSError as err:
            raise _write_error(err, path) from err


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """The rows of a JSON-lines log. A last line cut short by a process killed mid-write (no
    final newline) is skipped with a warning; any other bad line is a ValueError naming the file
    and line (``<path>:<line>: not valid JSON``)."""
    if not path.exists():
        return []
    text = path.read_text()
    lines = text.splitlines()
    rows = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError as err:
            if number == len(lines) and not text.endswith("\n"):
                log.warning("%s: last line %d is incomplete (%s); ignored", path, number, err.msg)
                continue
            raise ValueError(f"{path}:{number}: not valid JSON ({err.msg})") from err
    return rows


class RunLog:
    """Appends rows to ``<run>/<stream>.jsonl`` and mirrors numeric fields to TensorBoard.

    On resume, rows of rounds after the last checkpointed round are dropped first
    (:meth:`truncate_after`), so an interrupted round is not logged twice.
    """

    def __init__(self, run_dir: Path, tensorboard: bool = True) -> None:
        self.run_dir = run_dir
        self._writer = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._writer = SummaryWriter(str(run_dir / "tensorboard"))

    def write(self, stream: str, row: dict[str, Any]) -> None:
        path = self.run_dir / f"{stream}.jsonl"
        try:
            with path.open("a") as handle:
                handle.write(json.dumps(row, sort_keys=True) + "\n")
        except OSError as err:
            raise _write_error(err, path) from err
        if self._writer is not None and "round" in row:
            tag = "/".join(str(row[k]) for k in ("site", "model") if k in row)
            if row.get("split", "test") != "test":  # validation scores: their own curves
                tag += f"/{row['split']}"
            for key, value in row.items():
                if (
                    key != "round"
                    and isinstance(value, (int, float))
                    and not isinstance(value, bool)
                ):
                    self._writer.add_scalar(f"{stream}/{key}/{tag}", value, row["round"])

    def truncate_after(self, last_round: int) -> None:
        for path in self.run_dir.glob("*.jsonl"):
            rows = [r for r in read_jsonl(path) if r.get("round", 0) <= last_round]
            atomic_write_text("".join(json.dumps(r, sort_keys=True) + "\n" for r in rows), path)

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()


def load_config(run_dir: Path) -> ExperimentConfig:
    """The experiment of the run in ``run_dir`` (its config.json, written when the run started)."""
    path = run_dir / "config.json"
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing: is {run_dir} a FedST run directory?")
    return experiment_from_json(path.read_text())
