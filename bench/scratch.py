"""Where a bench script puts the runs and data it makes: a directory the user names (kept), or a
temporary one that is removed when the script ends normally and kept, with its path printed, when
it fails (its logs are what the user reads next). A paper-size run leaves 1-2 GB."""

from __future__ import annotations

import shutil
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def scratch_dir(prefix: str, keep: Path | None = None) -> Iterator[Path]:
    """``keep`` (created, never removed), else a new ``/tmp/<prefix>XXXX`` removed on success."""
    if keep is not None:
        keep.mkdir(parents=True, exist_ok=True)
        yield keep
        return
    path = Path(tempfile.mkdtemp(prefix=prefix))
    try:
        yield path
    except BaseException:
        print(f"kept for its logs: {path} (remove it when done)", file=sys.stderr)
        raise
    shutil.rmtree(path, ignore_errors=True)
