"""The errors that end a command with exit code 2 and a one-line reason.

Every layer raises these (never imports the CLI to get them); `clusterdns.cli`
catches InputError and prints the message.
"""
from __future__ import annotations


class InputError(Exception):
    """Input clusterdns cannot use; the message is one line."""


class UsageError(InputError):
    """A command was given something it cannot use (an unknown pod, an unreachable API server...)."""


class ConfigError(InputError, ValueError):
    """A bad flag or configuration value."""


class ManifestError(InputError):
    """A manifest file that cannot be read or parsed at all."""

    def __init__(self, path: str, line: int | None, reason: str, transient: bool = False) -> None:
        self.path, self.line, self.reason = path, line, reason
        self.transient = transient   # the read failed (retry it), not the content
        where = f"{path}:{line}" if line else path
        super().__init__(f"{where}: {reason}")
