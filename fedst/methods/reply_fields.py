"""One field of a site's reply as the server accepts it: its kind (whole number, number or text)
and its range. The reply schema the server owns (fedst/app/reply_schema.py) is made of these, and
a method that needs a scalar of its own in the train reply (FedAS's Fisher trace) declares it as
one (:attr:`fedst.methods.base.Method.reply_scalars`), so the server can check it before reading
it. Plain values in, a reason out: no Flower, no torch."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

Kind = Literal["int", "float", "text", "flag"]
"""``int``: a whole number (an int, or a float with a whole value); ``float``: a finite number;
``text``: a string; ``flag``: 0 or 1."""


@dataclass(frozen=True)
class ReplyField:
    """A reply field: ``key``, its ``kind`` and range [``low``, ``high``] (``low_open``: ``low``
    itself excluded); ``median_factor`` (scalars a method weighs by): the server also refuses a
    value beyond ``median_factor`` x or below 1 / ``median_factor`` x the round's median."""

    key: str
    kind: Kind
    low: float | None = None
    high: float | None = None
    low_open: bool = False
    median_factor: float | None = None

    def rule(self) -> str:
        """The rule in words (the reply-schema table of docs/deployment.md)."""
        if self.kind in ("text", "flag"):
            return "a string" if self.kind == "text" else "0 or 1"
        words = "a whole number" if self.kind == "int" else "a finite number"
        if self.low is not None:
            words += f" {'>' if self.low_open else '>='} {self.low:g}"
        if self.high is not None:
            words += f" and <= {self.high:g}"
        if self.median_factor is not None:
            words += f", within {self.median_factor:g} x the round's median either way"
        return words

    def problem(self, value: object) -> str | None:
        """Why ``value`` is not this field (None: it is)."""
        if self.kind == "text":
            return None if isinstance(value, str) else f"{self.key!r} is {_shown(value)}, not text"
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return f"{self.key!r} is {_shown(value)}, not a number"
        if not math.isfinite(value):
            return f"{self.key!r} is {value}, not a finite number"
        if self.kind in ("int", "flag") and value != int(value):
            return f"{self.key!r} is {value!r}, not a whole number"
        if self.kind == "flag" and value not in (0, 1):
            return f"{self.key!r} is {value!r}, not 0 or 1"
        below = self.low is not None and (value <= self.low if self.low_open else value < self.low)
        if below or (self.high is not None and value > self.high):
            return f"{self.key!r} is {value:g}, outside the rule: {self.rule()}"
        return None


def _shown(value: object) -> str:
    """``value`` for an error line: its type and at most 40 characters of it."""
    text = repr(value)
    return f"{type(value).__name__} {text[:40]}{'...' if len(text) > 40 else ''}"
