"""The shared base every layer imports, and which imports nothing of bert-ds.

- :mod:`.errors`: :class:`~.errors.UserError` and its kinds, the one-line report, and the
  process exit statuses of every entry point.
- :mod:`.environment`: an installed package that fails to import, as one line.
- :mod:`.atomic`: crash-safe file writes (temporary name, fsync, rename).
- :mod:`.locking`: one writer per output folder (``flock``, released by the OS on any exit).
- :mod:`.interrupts`: Ctrl-C held back while the start-up's modules initialise.
"""
