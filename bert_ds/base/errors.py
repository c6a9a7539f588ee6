"""Errors that bert-ds reports to the user as one line, without a traceback, and the exit
status of every entry point.

Every check of user-controlled input (files, flags, configs, shards) raises a
subclass of :class:`UserError`. The ends of a run that the user acts on without a traceback
are failures (:class:`Failure`), each with its exit status: bad input (:class:`UserError`), a bad
streak of training steps (:class:`BadStepsError`), a rank that hung or died
(:class:`RankFailure`). The entry points run their body through :func:`guarded`, which prints
``error: <message>`` and returns that status; an installed package that fails to import is one
such line too (:class:`BrokenEnvironment`). Anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import signal
import sys
from collections.abc import Callable

from bert_ds.base.environment import import_failure

# Exit statuses of the entry points (README, "exit status"), defined here and nowhere else.
EXIT_OK = 0  # finished, or stopped by a signal after a checkpoint
EXIT_USER_ERROR = 2  # bad input, a damaged checkpoint, an output folder in use
EXIT_BAD_STEPS = 3  # --max-bad-steps non-finite steps in a row, or non-finite weights at a save
EXIT_RANK_FAILURE = 4  # a rank gave up on its peers (hung or dead)
EXIT_INTERRUPTED = 128 + signal.SIGINT  # a second Ctrl-C: the shell's status for a process ended by SIGINT
# A stop signal N before the first training step (nothing saved) exits with 128 + N, as a shell reports it.


class Failure(Exception):
    """An end of a run the user acts on: one line ``error: <message>`` and :attr:`exit_status`."""

    exit_status = EXIT_USER_ERROR


class UserError(Failure):
    """Bad input the user can fix: the message says what is wrong and where."""


class ShardError(UserError):
    """A token shard or dataset manifest is missing, damaged or inconsistent."""


class ConfigError(UserError):
    """A configuration value is invalid or inconsistent with another."""


class BadStepsError(Failure):
    """Non-finite training steps the run cannot go past: it stops without checkpointing them."""

    exit_status = EXIT_BAD_STEPS


class BrokenEnvironment(UserError):
    """An installed package bert-ds needs does not import (:mod:`bert_ds.base.environment`)."""


class RankFailure(Failure):
    """A collective failed because a rank hung or died."""

    exit_status = EXIT_RANK_FAILURE


def require(cond: bool, field: str, message: str) -> None:
    """The one form of a config check: unless ``cond``, a :class:`ConfigError` ``"<field>: <message>"``."""
    if not cond:
        raise ConfigError(f"{field}: {message}")


def describe(err: BaseException) -> str:
    """An OS or library error as a short clause: ``FILE: reason`` where the file is known."""
    if isinstance(err, OSError) and err.strerror:
        return f"{err.filename}: {err.strerror}" if err.filename else err.strerror
    return " ".join(str(err).split())


def _one_line(text: object) -> str:
    """``text`` with its line breaks and runs of spaces as single spaces."""
    return " ".join(str(text).split())


def report(err: Exception | str) -> int:
    """Print ``error: <message>`` as one line on stderr; return the error's exit status
    (:data:`EXIT_USER_ERROR` for a message or an exception that is not a :class:`Failure`)."""
    # One write of the whole line: stderr writes through, so print() would send the text and its
    # newline in two writes, and the ranks of one run, sharing the launcher's pipe, would splice
    # their lines together ("error: A error: A" then an empty line).
    sys.stderr.write(f"error: {_one_line(err)}\n")
    sys.stderr.flush()
    return err.exit_status if isinstance(err, Failure) else EXIT_USER_ERROR


def guarded(body: Callable[[], int | None], cleanup: Callable[[], None] | None = None,
            interrupted: str | Callable[[], str] | None = None) -> int:
    """Run an entry point's ``body``: its exit status when it returns one (:data:`EXIT_OK` for
    ``None``), a :class:`Failure`'s one line and exit status when it raises one. ``cleanup``
    runs on every path, before the line is printed; any other exception passes through with
    its traceback, but for an installed package that fails to import, which is one line too
    (:class:`BrokenEnvironment`).

    ``interrupted``: what a Ctrl-C leaves behind (a text, or a function that finds it out). Given,
    a ``KeyboardInterrupt`` from ``body`` ends with ``interrupted: <it>`` on one line and
    :data:`EXIT_INTERRUPTED`, as the training ends before its first step; not given, it passes
    through (the entry points whose stop handlers say more)."""
    failure: Failure | KeyboardInterrupt
    try:
        status = body()
        return EXIT_OK if status is None else status
    except Failure as e:
        failure = e
    except KeyboardInterrupt as e:
        if interrupted is None:
            raise
        failure = e
    except Exception as e:
        if (said := import_failure(e)) is None:
            raise
        failure = BrokenEnvironment(said)
    finally:
        if cleanup is not None:
            cleanup()
    if isinstance(failure, KeyboardInterrupt):
        said = interrupted() if callable(interrupted) else interrupted
        # on a line of its own: the key's ^C, or a progress bar, may hold the cursor
        sys.stderr.write(f"\ninterrupted: {_one_line(said)}\n")
        sys.stderr.flush()
        return EXIT_INTERRUPTED
    return report(failure)
