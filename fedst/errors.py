"""Mistakes a user can fix, and the one error boundary every entry point runs its main in.

An error of this kind carries a one-line message that says what is wrong, where (the file, key
or value) and how to fix it. The entry points (train_fed.py, eval_outfed.py, every
``python -m fedst.*``) run their main in :func:`run_entry_point`, which prints that line and
exits 2 instead of a traceback; anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback
from collections.abc import Callable
from typing import NoReturn


class UserError(Exception):
    """A mistake in a command's input (a config key, a path, a file's content) that the user can
    fix; the message is the one line the entry point prints."""


DEBUG_ENV = "FEDST_DEBUG"
"""``FEDST_DEBUG=1``: a user's mistake shows its traceback before its one line (same exit status)."""


class ArgumentParser(argparse.ArgumentParser):
    """argparse for the entry points: a usage mistake (unknown option, missing argument) is a
    :class:`UserError`, so it ends in the boundary's one line and exit status 2 like every
    other mistake, without argparse's usage lines before it (``--help`` shows them). Its
    sub-parsers are of this class too (argparse's default ``parser_class``)."""

    def error(self, message: str) -> NoReturn:
        raise UserError(f"{message} (usage: {self.prog} --help)")


EXIT_USER_ERROR = 2
EXIT_INTERRUPTED = 130  # 128 + SIGINT, as a shell reports Ctrl-C

FOREIGN_USER_ERRORS = (
    ("models.pvt.weights", "WeightsNotFoundError"),  # no pretrained encoder weights
    ("models.pvt.pvt_v2", "CheckpointMismatchError"),  # weights of another variant
    ("hydra.errors", "ConfigCompositionException"),  # unknown key or group option (and subclasses)
    ("hydra.errors", "OverrideParseException"),  # an override Hydra cannot parse
    ("hydra.errors", "MissingConfigException"),
    ("omegaconf.errors", "MissingMandatoryValue"),  # a required key left at ???
    ("omegaconf.errors", "ConfigKeyError"),
    ("omegaconf.errors", "ValidationError"),
    ("omegaconf.errors", "InterpolationResolutionError"),
)
"""(module, class) of the errors of other packages that are a user's mistake, not a bug. They are
looked up in ``sys.modules`` when an error arrives: an error of a module never imported cannot
have been raised, and neither models/ (which must not import fedst) nor this module (imported by
everything) pays for importing Hydra, OmegaConf or the encoder to name them."""


def user_error_types() -> tuple[type[BaseException], ...]:
    """:class:`UserError` and those of :data:`FOREIGN_USER_ERRORS` whose module is imported."""
    found: list[type[BaseException]] = [UserError]
    for module_name, class_name in FOREIGN_USER_ERRORS:
        module = sys.modules.get(module_name)
        if module is not None and hasattr(module, class_name):
            found.append(getattr(module, class_name))
    return tuple(found)


def is_user_error(err: BaseException) -> bool:
    return isinstance(err, user_error_types())


def one_line(err: BaseException) -> str:
    """The message of a user's mistake as one line.

    An OmegaConf error gives its own sentence and the key (``full_key``), not the node's type
    lines; an error whose cause is a :class:`UserError` (a resolver's ConfigError inside an
    interpolation) gives the cause's message. Otherwise the message up to its first blank line
    (Hydra's "Available options" and "Config search path" sections follow one), its lines joined;
    a Hydra override that does not parse is named with the grammar's page.
    """
    cause = _user_error_cause(err)
    if cause is not None:
        return one_line(cause)
    override = getattr(err, "override", None)  # hydra.errors.OverrideParseException
    if isinstance(override, str):
        return f"{override}: {_fold(str(getattr(err, 'message', err)))}"
    if type(err).__module__.startswith("omegaconf."):  # the sentence, then the node's lines
        sentence, key = str(err).strip().split("\n", 1)[0].strip(), getattr(err, "full_key", None)
        return sentence if not key or key in sentence else f"{key}: {sentence}"
    text = _fold(str(err)) or type(err).__name__
    options = getattr(err, "options", None)  # hydra.errors.MissingConfigException
    if options:
        text += f"; available: {', '.join(options)}"
    return text


def _user_error_cause(err: BaseException) -> UserError | None:
    """The :class:`UserError` that ``err`` (not one itself) was raised from or while handling
    (OmegaConf re-raises a resolver's error as the context of its own), if any."""
    if isinstance(err, UserError):
        return None
    seen: set[int] = set()
    cause = err.__cause__ or err.__context__
    while cause is not None and id(cause) not in seen:
        if isinstance(cause, UserError):
            return cause
        seen.add(id(cause))
        cause = cause.__cause__ or cause.__context__
    return None


def _fold(text: str) -> str:
    """The lines of ``text`` up to its first blank line, stripped and joined by spaces."""
    lines: list[str] = []
    for line in text.strip().splitlines():
        if not line.strip():
            break
        lines.append(line.strip())
    return " ".join(lines)


def debugging() -> bool:
    return os.environ.get(DEBUG_ENV, "") not in ("", "0")


def run_entry_point(
    main: Callable[[], object],
    program: str,
    after_interrupt: Callable[[], str] | None = None,
) -> NoReturn:
    """Run an entry point's ``main`` (no arguments: it reads ``sys.argv``) and exit.

    * returns: exit status ``main``'s int (``None`` or anything else: 0);
    * a user's mistake (:func:`is_user_error`): ``<program>: error: <one line> (FEDST_DEBUG=1
      shows the traceback)`` on stderr, exit 2; with ``FEDST_DEBUG=1`` its traceback comes
      first, then the line, and the exit status stays 2;
    * Ctrl-C: ``<program>: interrupted`` on stderr, followed by what ``after_interrupt`` returns
      (e.g. how to resume; "" for nothing), exit 130 (``FEDST_DEBUG=1``: its traceback first);
    * ``SystemExit`` (argparse's usage errors, ``--help``) passes unchanged, and any other
      exception is a bug: raised with its full traceback.

    Hydra's ``@hydra.main`` prints an error itself and exits 1, unless ``HYDRA_FULL_ERROR=1``,
    where it re-raises (hydra/_internal/utils.py ``run_and_report``): that is set here (unless
    the user set it) so a Hydra entry point's errors arrive here too. ``program``: the name the
    user typed, e.g. ``train_fed.py`` or ``python -m fedst.report``.
    """
    os.environ.setdefault("HYDRA_FULL_ERROR", "1")
    try:
        status = main()
    except KeyboardInterrupt:
        if debugging():
            traceback.print_exc()
        _say(f"{program}: interrupted{after_interrupt() if after_interrupt else ''}")
        sys.exit(EXIT_INTERRUPTED)
    except Exception as err:
        if not is_user_error(err):
            raise
        if debugging():
            traceback.print_exc()
            _say(f"{program}: error: {one_line(err)}")
        else:
            _say(f"{program}: error: {one_line(err)} ({DEBUG_ENV}=1 shows the traceback)")
        sys.exit(EXIT_USER_ERROR)
    sys.exit(status if isinstance(status, int) and not isinstance(status, bool) else 0)


def _say(line: str) -> None:
    sys.stdout.flush()  # what the command printed before comes first
    print(line, file=sys.stderr, flush=True)
