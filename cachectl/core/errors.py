"""Errors that carry the CLI exit code, so every layer can fail the same way.

Exit codes are a contract (README, "Exit codes"): 1 the operation found or hit problems,
2 bad input, 3 hardware or environment mismatch, 4 permission denied.

``ERRORS`` is the one table from an error class to its exit code (the CLI group,
cachectl.cli.CachectlGroup) and its HTTP status (the server's exception handler); the
HTTP client reads it backwards (``error_for``), so an error raised on the server
leaves the CLI with the same message and exit code as in direct mode.
"""

from __future__ import annotations

import os


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


class ProblemsReported(OperationFailed):
    """The command has printed its problems (a report, a findings line): exit 1 with no further line."""

    def __init__(self, message: str = "") -> None:
        super().__init__(message)


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


# error class -> (CLI exit code, HTTP status). The most derived class listed wins.
ERRORS: dict[type[CachectlError], tuple[int, int]] = {
    BadInput: (2, 400),
    NotFound: (2, 404),
    Unreachable: (2, 503),
    QuotaExceeded: (2, 413),
    OperationFailed: (1, 409),
    ProblemsReported: (1, 409),
    EntryConflict: (1, 409),
    EnvironmentMismatch: (3, 409),
    PermissionDenied: (4, 403),
}
for _cls, (_code, _status) in ERRORS.items():
    _cls.exit_code = _code
# Names the server may send in "error" that are not classes here (the lease module's LeaseHeld).
_ALIASES: dict[str, type[CachectlError]] = {"LeaseHeld": OperationFailed}
# What a status means when the body names no error we know (HTTP 422 is FastAPI's validation error).
_STATUS_ERRORS: dict[int, type[CachectlError]] = {
    400: BadInput,
    413: BadInput,
    422: BadInput,
    403: PermissionDenied,
    404: NotFound,
    409: OperationFailed,
    502: Unreachable,
    503: Unreachable,
    504: Unreachable,
}


def path_words(path: str | os.PathLike[str]) -> str:
    """A path as an error names it: absolute, and a relative one with the working directory it
    was read against (a library caller's working directory is not always the user's shell's)."""
    text = os.fspath(path)
    if os.path.isabs(text):
        return text
    try:
        cwd = os.getcwd()
    except OSError:  # the working directory was removed
        return f"{text} (relative to a working directory that no longer exists)"
    return f"{os.path.normpath(os.path.join(cwd, text))} (relative to the working directory {cwd})"


_OS_DENIED = {"EACCES", "EPERM", "EROFS"}
_OS_FULL = {"ENOSPC", "EDQUOT"}


def from_os_error(exc: OSError) -> CachectlError:
    """The library error for a file system error no layer turned into one: a read-only file
    system or no permission is PermissionDenied (4), a full disk or anything else
    OperationFailed (1); one line that names the path."""
    import errno

    name = errno.errorcode.get(exc.errno or 0, "")
    filename = exc.filename
    where = (
        f": {path_words(filename) if isinstance(filename, str) else filename}" if filename else ""
    )
    what = f"{exc.strerror or exc}{where}"
    if name in _OS_DENIED:
        return PermissionDenied(f"{what}: run it as a user who may write there")
    if name in _OS_FULL:
        return OperationFailed(f"{what}: free space (or raise the quota) and run it again")
    return OperationFailed(what.splitlines()[0] if what else type(exc).__name__)


def http_status(exc: CachectlError) -> int:
    """The HTTP status the server answers a library error with (500 for one not in the table)."""
    for cls in type(exc).__mro__:
        entry = ERRORS.get(cls)
        if entry is not None:
            return entry[1]
    return 500


def error_named(name: str | None) -> type[CachectlError] | None:
    """The error class the server named in its answer's "error" field, if it is one of ours."""
    if not name:
        return None
    return _ALIASES.get(name) or next((cls for cls in ERRORS if cls.__name__ == name), None)


def error_for_status(status: int) -> type[CachectlError] | None:
    """The error class an HTTP status stands for when the answer names none."""
    return _STATUS_ERRORS.get(status)
