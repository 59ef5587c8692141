"""The kvtier error family and the one mapping from errors to process exit codes.

Every error kvtier raises on purpose is a :class:`KvtierError`: it carries a one-line
``message`` and an optional ``hint`` telling the user what to do next.  The CLI prints
:func:`render_error` and exits with :func:`exit_code_for`.  Stdlib only, so importing it
never pulls in torch, vLLM or the TUI.
"""

from __future__ import annotations

import os

__all__ = [
    "SharedUnavailable",
    "EXIT_OK",
    "EXIT_FAILURE",
    "EXIT_USAGE",
    "EXIT_NO_SERVER",
    "EXIT_NOT_FOUND",
    "KvtierError",
    "UsageError",
    "ConfigError",
    "NoServerError",
    "NotFoundError",
    "StorageError",
    "StorageFullError",
    "CapacityError",
    "CorruptBlockError",
    "SnapshotError",
    "FingerprintMismatchError",
    "exit_code_for",
    "render_error",
]

EXIT_OK = 0
EXIT_FAILURE = 1
EXIT_USAGE = 2
EXIT_NO_SERVER = 3
EXIT_NOT_FOUND = 4


class KvtierError(Exception):
    """Base of every deliberate kvtier error: a message plus an optional hint."""

    exit_code: int = EXIT_FAILURE

    def __init__(self, message: str, hint: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint

    def __str__(self) -> str:
        return self.message


class UsageError(KvtierError):
    """The command line was wrong (bad flag, bad argument combination)."""

    exit_code = EXIT_USAGE


class ConfigError(UsageError):
    """A setting from a flag, the environment or kvtier.toml is invalid."""


class NoServerError(KvtierError):
    """No running kvtier/vLLM server could be reached."""

    exit_code = EXIT_NO_SERVER


class NotFoundError(KvtierError):
    """A named session, snapshot or block does not exist."""

    exit_code = EXIT_NOT_FOUND


class StorageError(KvtierError):
    """Reading or writing a storage tier failed."""


class StorageFullError(StorageError):
    """The storage device is full (ENOSPC)."""


class SharedUnavailable(StorageError):
    """The shared store cannot be used right now (down, paused, full, refusing our credentials)."""


class CapacityError(KvtierError):
    """A configured budget is too small for what was asked of it."""


class CorruptBlockError(StorageError):
    """A stored block failed its checksum or header check."""

    def __init__(
        self, message: str, hint: str | None = None, path: str | os.PathLike[str] | None = None
    ) -> None:
        super().__init__(message, hint)
        self.path = None if path is None else os.fspath(path)


class SnapshotError(KvtierError):
    """A snapshot could not be written, read or restored."""

    def __init__(
        self, message: str, hint: str | None = None, path: str | os.PathLike[str] | None = None
    ) -> None:
        super().__init__(message, hint)
        self.path = None if path is None else os.fspath(path)


class FingerprintMismatchError(SnapshotError):
    """A snapshot was taken with a different model/layout than the one it is restored into."""


def exit_code_for(exc: BaseException) -> int:
    """Return the process exit code for ``exc``; anything not a KvtierError maps to 1."""
    if isinstance(exc, KvtierError):
        return exc.exit_code
    return EXIT_FAILURE


def render_error(exc: KvtierError) -> str:
    """Format ``exc`` for the terminal: ``error: <message>`` and, if present, ``hint: <hint>``."""
    text = f"error: {exc.message}"
    if exc.hint:
        text += f"\nhint: {exc.hint}"
    return text
