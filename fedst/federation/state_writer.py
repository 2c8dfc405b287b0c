"""Site states written in the background: a site's round ends when its state is on its way to
disk, not when it is there.

One writer thread per process writes the files in the order they were handed over (an atomic
rename each, fedst/storage.py: a crash mid-write leaves the previous round's file as it was, and
the server resumes only from rounds whose site states read, fedst/federation/server.py). A site
waits for its own pending write before its next save and before it reads its state folder
(:func:`wait_for_state_writes`); the in-process engine waits for every write when its run ends
(fedst/training.py), and a process that exits normally finishes them first (the writer thread is
joined at exit). A write that failed raises its error at the next wait.

Not covered: a site whose next message reaches another process (a Ray actor taking the site
over) while the previous process is still writing; that process reads the folder without
waiting (docs/paper-scale.md, "Per-round costs off the critical path")."""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

_WRITER = ThreadPoolExecutor(max_workers=1, thread_name_prefix="fedst-state-writer")
_PENDING: dict[Path, Future[None]] = {}
"""The last write handed over for each state folder (resolved path), until waited for."""
_LOCK = threading.Lock()


def write_in_background(state_dir: Path, write: Callable[[], None]) -> None:
    """Run ``write`` (which writes files of ``state_dir``) on the writer thread, after the
    folder's previous write has finished (its error, if any, is raised here)."""
    wait_for_state_writes(state_dir)
    future = _WRITER.submit(write)
    with _LOCK:
        _PENDING[state_dir.resolve()] = future


def wait_for_state_writes(state_dir: Path | None = None, *, under: Path | None = None) -> None:
    """Block until the pending write of ``state_dir`` (None: of every folder, or of every folder
    inside ``under``: a run's own sites) is on disk; re-raise the error of a write that failed."""
    with _LOCK:
        folders = [
            d
            for d in _PENDING
            if (state_dir is None or d == state_dir.resolve())
            and (under is None or d.is_relative_to(under.resolve()))
        ]
        futures = [_PENDING.pop(d) for d in folders]
    for future in futures:
        future.result()
