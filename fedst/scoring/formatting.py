"""How a summary value is written for humans, torch-free: the report, the paper runner's tables
and ``eval_outfed.py`` print scores with it before (or without) importing the metrics."""

from __future__ import annotations


def format_score(value: float | None, digits: int = 2) -> str:
    """A summary value for humans: "n/a" when it was not scored (``None``), else ``digits``
    decimals."""
    return "n/a" if value is None else f"{value:.{digits}f}"
