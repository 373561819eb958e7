"""Names of files in progress (a temporary beside its target, an upload's spool file, a bundle's
staging directory) that say who writes them, so a sweep can tell debris from a live writer.

A name is ``<prefix><host>.<pid>-<random>``: ``host`` is 8 hex digits of the writer's host name's
sha256, ``pid`` its process. As with the lifecycle lease (``lifecycle/lease.py``), a writer on this
host whose process is gone left debris at once (a kill -9 runs no cleanup); a writer elsewhere, or a
name without a tag (older versions), is debris only past ``STALE_AFTER``, a generous bound no live
write reaches.

``atomic_write`` writes a local file through such a temporary, so every writer of a whole file
(the store, the state files beside it) leaves only names a sweep can read.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import socket
import tempfile
from collections.abc import Callable
from datetime import timedelta
from typing import BinaryIO

TEMP_PREFIX = ".tmp-"  # beside its target, renamed over it when whole (store.py)
SPOOL_PREFIX = "cachectl-upload-"  # an upload's body while it is checked (ingest.Spool)
STAGING_DIR = ".staging"  # in a local cache root: bundle installs stage here (bundle/install.py)
STAGING_PREFIX = "bundle-"  # one install's staging directory in it
# An install into an object store stages in the system temporary directory instead.
LOCAL_STAGING_PREFIX = "cachectl-bundle-"
STALE_AFTER = timedelta(hours=24)

_TAG = re.compile(r"([0-9a-f]{8})\.(\d+)-")


def _host() -> str:
    return hashlib.sha256(socket.gethostname().encode()).hexdigest()[:8]


def prefix(kind: str) -> str:
    """``kind`` followed by this process's tag: what mkstemp/mkdtemp get as their prefix."""
    return f"{kind}{_host()}.{os.getpid()}-"


def no_world_writes() -> int:
    """Add the world-write bit to this process's umask (returns the umask it had): under umask
    000 (some containers and CI runners) every file and directory a command creates, JAX's
    entries and a bundle's files included, would be writable by anyone on the machine."""
    old = os.umask(0o022)
    os.umask(old | 0o002)
    return old


def current_umask() -> int:
    """This process's umask, read without changing it where Linux says it (/proc)."""
    with contextlib.suppress(OSError, ValueError, StopIteration):
        with open("/proc/self/status", encoding="ascii", errors="replace") as fh:
            line = next(x for x in fh if x.startswith("Umask:"))
        return int(line.split()[1], 8)
    old = os.umask(0o022)
    os.umask(old)
    return old


def without_world_write(path: str | os.PathLike[str]) -> None:
    """Drop the world-write bit of a local file or directory this process made, whatever the
    umask (under umask 000 anyone could rewrite it before it is indexed); one this process may
    not change (another owner's) is left as it is."""
    with contextlib.suppress(OSError):
        mode = os.lstat(path).st_mode & 0o7777
        if mode & 0o002:
            os.chmod(path, mode & ~0o002)


def makedirs(path: str | os.PathLike[str], mode: int = 0o777) -> None:
    """``os.makedirs(path, mode, exist_ok=True)``, each directory it creates (parents too, which
    os.makedirs leaves at the umask's mode) without the world-write bit whatever the umask."""
    missing = []
    here = os.path.abspath(path)
    while not os.path.isdir(here) and os.path.dirname(here) != here:
        missing.append(here)
        here = os.path.dirname(here)
    for directory in reversed(missing):
        with contextlib.suppress(FileExistsError):
            os.mkdir(directory, mode)
            without_world_write(directory)


def atomic_write(full: str, mode: int, write: Callable[[BinaryIO], object]) -> None:
    """Write a local file through a temporary sibling and a rename: readers never see half."""
    directory = os.path.dirname(full)
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=prefix(TEMP_PREFIX), dir=directory)
    try:
        with os.fdopen(fd, "wb") as fh:
            write(fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, full)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # alive, another user's
    except OverflowError:
        return False
    return True


def writer_gone(name: str, kind: str, age_s: float) -> str | None:
    """Why ``name`` (a ``kind`` temporary, ``age_s`` seconds since it last changed) is debris, or
    None while its writer may still be writing it."""
    if age_s > STALE_AFTER.total_seconds():
        return f"untouched for more than {int(STALE_AFTER.total_seconds() // 3600)} h"
    match = _TAG.match(name, len(kind)) if name.startswith(kind) else None
    if match is None or match[1] != _host():
        return None
    pid = int(match[2])
    return None if _alive(pid) else f"its writer (pid {pid} on this host) is gone"
