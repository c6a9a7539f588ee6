"""Errors that bert-ds reports to the user as one line, without a traceback.

Every check of user-controlled input (files, flags, configs, shards) raises a
subclass of :class:`UserError`; the command-line entry points catch exactly this
class, print ``error: <message>`` and exit with status 2. Anything else is a bug and
keeps its traceback.
"""


class UserError(Exception):
    """Bad input the user can fix: the message says what is wrong and where."""


class ShardError(UserError):
    """A token shard or dataset manifest is missing, damaged or inconsistent."""
