"""Mistakes a user can fix: the base class every such error derives from.

An error of this kind carries a one-line message that says what is wrong, where (the file, key
or value) and how to fix it. The entry points (train_fed.py, eval_outfed.py, every
``python -m fedst.*``) print that line and exit non-zero instead of a traceback; anything else
is a bug and keeps its traceback.
"""

from __future__ import annotations


class UserError(Exception):
    """A mistake in a command's input (a config key, a path, a file's content) that the user can
    fix; the message is the one line the entry point prints."""
