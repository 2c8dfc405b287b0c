"""Files written so that readers never see half of one, and read back with errors that name
them: atomic torch checkpoints and text, damaged-checkpoint errors, JSON-lines reading.

Layer: the root; imports fedst.errors only.
"""

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

from fedst.errors import UserError

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
    import torch  # here, not at the top: reading a run's text files needs no torch

    with _temporary_beside(path) as tmp:
        try:
            torch.save(obj, tmp)
        except (OSError, RuntimeError) as err:
            raise disk_write_error(err, path) from err
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
            raise disk_write_error(err, previous) from err


def disk_write_error(err: BaseException, path: Path) -> BaseException:
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


class OutputPathError(UserError, ValueError):
    """An output folder the user named that cannot be one (a file stands at it or above it)."""


def require_output_folder(path: Path, option: str) -> Path:
    """``path`` where a command will make (or fill) a folder, checked before anything is
    computed: an existing file at ``path`` or at one of its parents is an
    :class:`OutputPathError` naming ``option`` (e.g. ``--out``), not a traceback when the folder
    is made at the end."""
    for place in (path, *path.parents):
        if place.exists() and not place.is_dir():
            where = "" if place == path else f" ({place} is a file)"
            raise OutputPathError(
                f"{option}={path}: not a folder{where}; name a folder (it is created if missing)"
            )
    return path


def load_checkpoint(path: Path, map_location: Any = "cpu") -> Any:
    """torch.load of a file this run wrote; a damaged file is a CheckpointError naming it."""
    import torch

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
            raise disk_write_error(err, path) from err


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
