"""Progress display, decided in one place: tqdm bars on a terminal, nothing in a log.

Bars redraw with carriage returns, which a terminal turns into one updating line and a log file
(CI, ``make demo > log``) into thousands of lines. :func:`progress_bar` therefore draws only when
progress is asked for **and** stderr is a terminal; the round loop logs one line per round either
way (fedst/app/server_app.py), which is the whole record in a non-terminal.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable
from typing import Any, TypeVar

from tqdm import tqdm

T = TypeVar("T")


def bars_enabled(requested: bool) -> bool:
    """Draw bars: progress requested and stderr (where tqdm writes) is a terminal."""
    return bool(requested) and sys.stderr.isatty()


def progress_bar(iterable: Iterable[T] | None = None, *, enabled: bool, **kwargs: Any) -> tqdm:
    """``tqdm(iterable, **kwargs)``, disabled unless :func:`bars_enabled` (``enabled``)."""
    return tqdm(iterable, disable=not bars_enabled(enabled), **kwargs)


SHOW_NOW = {"show_now": True}
"""``extra=`` of a log record that starts a long step (generating data): a console holding the
records of a run's set-up (fedst.cli.console_held_while_setting_up) shows it, and the records
held before it, at once."""
