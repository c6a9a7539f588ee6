"""Errors of the training side; all are :class:`data_tools.errors.UserError`."""

from data_tools.errors import UserError


class ConfigError(UserError):
    """A configuration value is invalid or inconsistent with another."""


__all__ = ["UserError", "ConfigError"]
