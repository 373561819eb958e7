"""The local-filesystem side of ``Store``: reads that never follow a link, the walk, atomic writes.

Every function here takes full local paths (or the root and a path relative to it) and is
called by ``Store`` on local disk only; nothing else needs it.
"""

from __future__ import annotations

import errno
import functools
import os
import posixpath
import stat
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from cachectl.core.errors import BadInput

# A listed file: (name, size, mtime in POSIX seconds); size and mtime None where not stat'ed
Listed = tuple[str, int | None, float | None]


class NotRegularFile(FileNotFoundError):
    """A path in a local store that is a symlink, is not a regular file, or resolves outside the root.

    A FileNotFoundError, so every reader treats it as missing: nothing a link points at is ever read."""


def full_path(root: str, rel: str) -> str:
    """``rel`` below ``root``; BadInput if it climbs out (a ``..`` component)."""
    rel = rel.strip("/")
    if ".." in rel.split("/"):
        raise BadInput(f"path {rel!r} escapes the cache root")
    return posixpath.join(root, rel) if rel else root


def absolute(full: str) -> str:
    """A local path spelled as fsspec's local filesystem lists it (absolute, no trailing slash),
    without building that filesystem: importing fsspec and finding its implementations reads
    every installed package's entry points, which a read-only service never needs."""
    return os.path.abspath(full)


_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_DIR_FLAGS = getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_CLOEXEC", 0)
_READ_FLAGS = os.O_RDONLY | _NOFOLLOW | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)


# Local unlinks in parallel: each waits on the filesystem's journal, not on Python.
UNLINK_WORKERS = 4
# Below this many paths a thread pool costs more than it overlaps.
_UNLINK_PARALLEL_MIN = 64


def _unlink(path: str) -> int:
    try:
        os.unlink(path)
        return 1
    except FileNotFoundError:
        return 0


def _unlink_each(paths: list[str]) -> int:
    return sum(map(_unlink, paths))


def unlink_all(paths: list[str]) -> int:
    """Unlink local files, missing ones being fine; the count removed. In parallel, each thread takes
    one slice (ThreadPoolExecutor.map ignores chunksize: a future per path cost more than the unlink)."""
    if len(paths) < _UNLINK_PARALLEL_MIN:
        return _unlink_each(paths)
    step = -(-len(paths) // UNLINK_WORKERS)
    with ThreadPoolExecutor(
        max_workers=UNLINK_WORKERS, thread_name_prefix="cachectl-unlink"
    ) as pool:
        return sum(
            pool.map(_unlink_each, [paths[i : i + step] for i in range(0, len(paths), step)])
        )


def _target_size(follow: Callable[[], os.stat_result]) -> int:
    """The size a listing gives a symlink: its target's, 0 if dangling (as fsspec lists one)."""
    try:
        return follow().st_size
    except OSError:
        return 0


def _not_regular(exc: OSError, full: str) -> OSError:
    """What a failed open raises: NotRegularFile where the name was a link (O_NOFOLLOW), else itself."""
    if exc.errno in (errno.ELOOP, errno.EMLINK):
        return NotRegularFile(f"{full}: a symlink: not read")
    return exc


class LocalReader:
    """Reads files below one local root: directories opened once each, without following links."""

    def __init__(self, root: str) -> None:
        self._root = root
        self._dirs: dict[str, int] = {}
        self._lock = threading.RLock()

    def __enter__(self) -> LocalReader:
        return self

    def __exit__(self, *exc: object) -> None:
        with self._lock:
            for fd in self._dirs.values():
                os.close(fd)
            self._dirs.clear()

    def _dir_fd(self, rel_dir: str, full: str) -> int:
        """A descriptor of ``rel_dir`` reached from the root through real directories only."""
        fd = self._dirs.get(rel_dir)
        if fd is not None:
            return fd
        with self._lock:  # re-entrant: a directory's parent is opened first, under the same lock
            fd = self._dirs.get(rel_dir)
            if fd is not None:
                return fd
            if not rel_dir:
                fd = os.open(self._root, os.O_RDONLY | _DIR_FLAGS)
            else:
                parent, _, name = rel_dir.rpartition("/")
                try:
                    fd = os.open(
                        name,
                        os.O_RDONLY | _DIR_FLAGS | _NOFOLLOW,
                        dir_fd=self._dir_fd(parent, full),
                    )
                except OSError as exc:
                    if exc.errno in (errno.ELOOP, errno.ENOTDIR, errno.EMLINK):
                        raise NotRegularFile(
                            f"{full}: a directory on its path is a symlink or leaves the cache root"
                        ) from None
                    raise
            self._dirs[rel_dir] = fd
            return fd

    def read(self, rel: str) -> bytes:
        rel = rel.strip("/")
        if ".." in rel:
            full_path(self._root, rel)  # BadInput if it leaves the root
        rel_dir, _, name = rel.rpartition("/")
        fd = self._dirs.get(rel_dir)
        if fd is None:
            try:
                fd = self._dir_fd(rel_dir, f"{self._root}/{rel}")
            except OSError as exc:
                raise _not_regular(exc, f"{self._root}/{rel}") from None
        return self._read_at(fd, rel_dir, name)

    def _dir_of(self, rel_dir: str, full: str) -> int:
        fd = self._dirs.get(rel_dir)
        return self._dir_fd(rel_dir, full) if fd is None else fd

    def open_fd(self, rel: str) -> tuple[int, int]:
        """(descriptor, size) of regular file ``rel``, opened through this reader's directory
        descriptors (no symlink followed, no per-directory ``lstat``); the caller closes it."""
        rel = rel.strip("/")
        if ".." in rel:
            full_path(self._root, rel)  # BadInput if it leaves the root
        rel_dir, _, name = rel.rpartition("/")
        full = f"{self._root}/{rel}"
        try:
            fd = os.open(name, _READ_FLAGS, dir_fd=self._dir_of(rel_dir, full))
        except OSError as exc:
            raise _not_regular(exc, full) from None
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            os.close(fd)
            raise NotRegularFile(f"{full}: not a regular file: not read")
        return fd, st.st_size

    def size(self, rel: str) -> int:
        """The size of regular file ``rel``: one ``fstatat`` through this reader's directories."""
        return self.stat(rel).st_size

    def stat(self, rel: str) -> os.stat_result:
        """The ``lstat`` of regular file ``rel`` (a symlink or special file is refused): one
        ``fstatat`` through this reader's directories."""
        rel = rel.strip("/")
        if ".." in rel:
            full_path(self._root, rel)
        rel_dir, _, name = rel.rpartition("/")
        full = f"{self._root}/{rel}"
        try:
            st = os.stat(name, dir_fd=self._dir_of(rel_dir, full), follow_symlinks=False)
        except OSError as exc:
            raise _not_regular(exc, full) from None
        if not stat.S_ISREG(st.st_mode):
            raise NotRegularFile(f"{full}: not a regular file (symlink or special file): not read")
        return st

    def in_dir(self, rel_dir: str, *, times: bool = False) -> Callable[[str], Any]:
        """``read`` for names directly in ``rel_dir``: its descriptor is found once, not per file. If
        it cannot be opened, each read goes through ``read`` (and raises what it raises). With
        ``times``, each read gives (bytes, the file's mtime from the descriptor it was read through)."""
        rel_dir = rel_dir.strip("/")
        slow: Callable[[str], Any] = (
            (lambda name: (self.read(f"{rel_dir}/{name}"), None))
            if times
            else (lambda name: self.read(f"{rel_dir}/{name}"))
        )
        try:
            if ".." in rel_dir:
                full_path(self._root, rel_dir)
            fd = self._dir_fd(rel_dir, f"{self._root}/{rel_dir}")
        except (OSError, BadInput):
            return slow
        # A name with a '/' would let openat() follow a link in its directories: read() checks each.
        # One call per file below this one (sync and verify read every file through it).
        read_timed = self._read_timed
        if times:
            return lambda name: slow(name) if "/" in name else read_timed(fd, rel_dir, name)
        return lambda name: slow(name) if "/" in name else read_timed(fd, rel_dir, name)[0]

    def _path_of(self, rel_dir: str, name: str) -> str:
        """The full path of ``name`` in ``rel_dir``, for messages."""
        return f"{self._root}/{rel_dir}/{name}" if rel_dir else f"{self._root}/{name}"

    def _read_at(self, dir_fd: int, rel_dir: str, name: str) -> bytes:
        """The whole of regular file ``name`` in the directory open as ``dir_fd`` (``rel_dir``)."""
        return self._read_timed(dir_fd, rel_dir, name)[0]

    def _read_timed(self, dir_fd: int, rel_dir: str, name: str) -> tuple[bytes, float]:
        """``_read_at``, and the mtime of the file read (from the fstat that checks it)."""
        try:
            fd = os.open(name, _READ_FLAGS, dir_fd=dir_fd)
        except OSError as exc:
            raise _not_regular(exc, self._path_of(rel_dir, name)) from None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):  # a directory, a FIFO, a device: never read
                raise NotRegularFile(f"{self._root}/{rel_dir}/{name}: not a regular file: not read")
            data = os.read(fd, st.st_size + 1)
            if len(data) == st.st_size:  # what fstat said, and nothing after it: the whole file
                return data, st.st_mtime
            parts = [data]
            # To the end: it changed since the fstat, or one read returned less than asked (Linux
            # caps a read at 2 GiB).
            while chunk := os.read(fd, 1 << 20):
                parts.append(chunk)
            return b"".join(parts), st.st_mtime
        finally:
            os.close(fd)


def walk(
    top: str, rel_top: str, with_stat: bool
) -> Iterator[tuple[str, list[tuple[str, int | None, float | None]]]]:
    """``Store.dir_stats`` on local disk: one scandir per directory (and one lstat per file, with
    ``with_stat``), as the walk goes; names relative to ``rel_top``."""
    pending = [(top, rel_top)]
    while pending:
        path, rel_dir = pending.pop()
        try:
            it = os.scandir(path)
        except OSError:
            continue  # gone or unreadable since listed: fsspec's walk skips it too
        files: list[tuple[str, int | None, float | None]] = []
        subdirs: list[str] = []
        with it:
            for entry in it:
                try:
                    if entry.is_dir(follow_symlinks=False):
                        subdirs.append(entry.name)
                        continue
                    if not with_stat:
                        files.append((entry.name, None, None))
                        continue
                    st = entry.stat(follow_symlinks=False)
                except FileNotFoundError:
                    continue
                size = st.st_size
                if stat.S_ISLNK(st.st_mode):  # listed as a file, never descended
                    size = _target_size(functools.partial(entry.stat, follow_symlinks=True))
                files.append((entry.name, size, st.st_mtime))
        if files:
            files.sort()
            yield rel_dir, files
        subdirs.sort(reverse=True)  # popped smallest first
        pending.extend(
            (f"{path}/{name}", f"{rel_dir}/{name}" if rel_dir else name) for name in subdirs
        )


def local_top(root: str, top: str) -> tuple[bool, str]:
    """Whether ``top`` is below ``root`` as spelled, and the name its files' names start from:
    relative to the root if so, else the full path."""
    root = root.rstrip("/")
    if top == root or top.startswith(root + "/"):
        return True, top[len(root) + 1 :]
    return False, top


def flat(root: str, top: str, *, with_stat: bool) -> tuple[bool, list[Listed]]:
    """``walk``'s files as one sorted list of (name, size, mtime); whether ``top`` is below the
    root (``local_top``: names relative to it, else full paths)."""
    below, rel_top = local_top(root, top)
    found = [
        (f"{rel_dir}/{name}" if rel_dir else name, size, mtime)
        for rel_dir, files in walk(top, rel_top, with_stat)
        for name, size, mtime in files
    ]
    found.sort()
    return below, found


def lstat_listed(full: str) -> tuple[int, float] | None:
    """(size, mtime) of one file as a listing gives it (a symlink's size is its target's); None if gone."""
    try:
        st = os.lstat(full)
    except FileNotFoundError:
        return None
    size = st.st_size
    if stat.S_ISLNK(st.st_mode):
        size = _target_size(functools.partial(os.stat, full))
    return size, st.st_mtime


def stat_in_dir(full_dir: str, names: Sequence[str]) -> dict[str, tuple[int, float | None]]:
    """``Store.stat_in_dir`` on local disk: one lstat each relative to the directory's descriptor."""
    out: dict[str, tuple[int, float | None]] = {}
    try:
        fd = os.open(full_dir, os.O_RDONLY | _DIR_FLAGS)
    except FileNotFoundError:
        return out
    try:
        for name in names:
            try:
                st = os.stat(name, dir_fd=fd, follow_symlinks=False)
            except FileNotFoundError:
                continue
            size = st.st_size
            if stat.S_ISLNK(st.st_mode):
                size = _target_size(functools.partial(os.stat, name, dir_fd=fd))
            out[name] = size, st.st_mtime
    finally:
        os.close(fd)
    return out


def regular_path(root: str, rel: str) -> str:
    """The path of ``rel`` on local disk if it is a regular file reached without any symlink.

    Every directory between the root and the file must be a real directory (its real path is
    the root's real path plus ``rel``'s directories), and the file itself no symlink; anything
    else raises NotRegularFile, so a link planted in a namespace never serves what it points at.
    """
    full = full_path(root, rel)
    # One lstat per directory below the root (a realpath() of both sides cost an lstat per
    # component of the whole path, twice, per file: most of a local verify's time).
    here = root
    for part in posixpath.dirname(rel.strip("/")).split("/"):
        if part in ("", "."):
            continue
        here = f"{here}/{part}"
        try:
            mode = os.lstat(here).st_mode
        except FileNotFoundError:
            break  # the file's own lstat below raises FileNotFoundError, as before
        if not stat.S_ISDIR(mode):
            raise NotRegularFile(
                f"{full}: a directory on its path is a symlink or leaves the cache root"
            )
    st = os.lstat(full)
    if not stat.S_ISREG(st.st_mode):
        raise NotRegularFile(f"{full}: not a regular file (symlink or special file): not read")
    return full


def open_regular(root: str, rel: str) -> Any:
    """``rel`` opened for reading if ``regular_path`` accepts it, re-checked on the descriptor."""
    full = regular_path(root, rel)
    try:
        fd = os.open(
            full, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)
        )
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.EMLINK):
            raise NotRegularFile(f"{full}: a symlink: not read") from None
        raise
    fh = os.fdopen(fd, "rb")
    if not stat.S_ISREG(os.fstat(fd).st_mode):  # swapped between the check and the open
        fh.close()
        raise NotRegularFile(f"{full}: not a regular file: not read")
    return fh
