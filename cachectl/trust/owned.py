"""Files that say what to trust are read only when nobody else could have written them.

The pins file (``pins.py``), a ``CACHECTL_TRUST`` or configured ``.pub`` key file: whoever can
write one chooses which keys a service trusts, so its planted pickle would run. One check for
all of them: a regular file, not a symbolic link, owned by this user (or root, for key files
an administrator installs), writable by nobody else.
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

from cachectl.core.errors import BadInput

# A public key file holds one line; anything much larger is not one.
MAX_KEY_FILE_BYTES = 64 * 1024


def owner_problem(info: os.stat_result, path: str | Path, *, root_ok: bool = False) -> str | None:
    """Why a file or directory with ``info`` (an lstat or fstat) could hold another user's
    words; None when only this user (or root, with ``root_ok``) can have written it."""
    if stat.S_ISLNK(info.st_mode):
        return f"{path} is a symbolic link"
    owners = {os.geteuid(), 0} if root_ok else {os.geteuid()}
    if info.st_uid not in owners or info.st_mode & 0o022:
        return f"{path} is not owned by this user alone (others may write it)"
    return None


def read_trusted_file(path: str | Path, limit: int = MAX_KEY_FILE_BYTES) -> bytes:
    """The bytes of a file that says which keys to trust; BadInput (one line) when it is a link,
    not a regular file, or could have been written by someone else. Opened without following a
    link and checked on the open descriptor, so it cannot be swapped between check and read."""
    advice = (
        ": refused, nothing is trusted by it (make it a regular file owned by you or root, "
        "not writable by group or others: chmod go-w)"
    )
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise BadInput(f"trusted key file {path} is a symbolic link{advice}") from None
        raise BadInput(f"cannot read trusted key file {path} ({exc.strerror or exc})") from None
    with os.fdopen(fd, "rb") as fh:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise BadInput(f"trusted key file {path} is not a regular file{advice}")
        problem = owner_problem(info, path, root_ok=True)
        if problem is not None:
            raise BadInput(f"trusted key file {problem}{advice}")
        return fh.read(limit)
