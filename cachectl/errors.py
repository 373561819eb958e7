"""Errors that carry the CLI exit code, so every layer can fail the same way.

Exit codes are a contract (DESIGN.md §4): 1 the operation found or hit problems,
2 bad input, 3 hardware or environment mismatch, 4 permission denied.
"""

from __future__ import annotations


class CachectlError(Exception):
    """Base class: a one-line message for people, and an exit code for scripts."""

    exit_code: int = 2

    def __init__(self, message: str, *, exit_code: int | None = None) -> None:
        super().__init__(message)
        if exit_code is not None:
            self.exit_code = exit_code

    @property
    def message(self) -> str:
        return str(self.args[0]) if self.args else self.__class__.__name__


class BadInput(CachectlError):
    """Usage, manifest, duration, size or URL that cannot be used as given."""

    exit_code = 2


class NotFound(BadInput):
    """A named cache, environment or entry that does not exist."""


class Unreachable(BadInput):
    """An index or storage backend that cannot be reached."""


class OperationFailed(CachectlError):
    """The command ran but found or hit problems (failed buckets, verify findings)."""

    exit_code = 1


class EnvironmentMismatch(CachectlError):
    """This machine is not the hardware or environment the operation targets."""

    exit_code = 3


class PermissionDenied(CachectlError):
    """The current user may not perform a mutating operation on this cache."""

    exit_code = 4


class QuotaExceeded(BadInput):
    """An entry that does not fit its cache's (or environment's) size limit (HTTP 413)."""


class EntryConflict(OperationFailed):
    """An entry already recorded with other bytes under the same key (HTTP 409)."""
