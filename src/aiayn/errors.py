"""Errors the command line reports as one line, without a traceback (library and CLI)."""

from __future__ import annotations


class CLIError(Exception):
    """A command-line usage problem (bad option combination, missing argument)."""


class UserError(Exception):
    """Bad input from the user's side: a missing or malformed file, an unwritable directory.

    Library code raises it (or a subclass) with a message that names the file and, where it
    applies, the line; the command line prints the message alone and exits with status 2.
    """


class ConfigError(ValueError):
    """A configuration that cannot be built: unknown key, wrong type or inconsistent values."""


class ResumeMismatch(ConfigError):
    """A run directory's checkpoint that the current config or data cannot continue (another
    model section or another tokenizer)."""
