"""Errors that bert-ds reports to the user as one line, without a traceback.

Every check of user-controlled input (files, flags, configs, shards) raises a
subclass of :class:`UserError`; the command-line entry points catch exactly this
class, print ``error: <message>`` and exit with status 2. Anything else is a bug and
keeps its traceback.
"""

import sys

EXIT_USER_ERROR = 2  # the exit status of every entry point for bad input


class UserError(Exception):
    """Bad input the user can fix: the message says what is wrong and where."""


class ShardError(UserError):
    """A token shard or dataset manifest is missing, damaged or inconsistent."""


class ConfigError(UserError):
    """A configuration value is invalid or inconsistent with another."""


def require(cond: bool, field: str, message: str) -> None:
    """The one form of a config check: unless ``cond``, a :class:`ConfigError` ``"<field>: <message>"``."""
    if not cond:
        raise ConfigError(f"{field}: {message}")


def describe(err: BaseException) -> str:
    """An OS or library error as a short clause: ``FILE: reason`` where the file is known."""
    if isinstance(err, OSError) and err.strerror:
        return f"{err.filename}: {err.strerror}" if err.filename else err.strerror
    return " ".join(str(err).split())


def report(err: Exception | str) -> int:
    """Print ``error: <message>`` as one line on stderr; return :data:`EXIT_USER_ERROR`."""
    print(f"error: {' '.join(str(err).split())}", file=sys.stderr, flush=True)
    return EXIT_USER_ERROR
