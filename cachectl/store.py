"""One storage abstraction over fsspec for every cache root.

Local paths, ``file://``, ``gs://``, ``s3://`` and ``memory://`` all go through
the same Store. Dispatch happens once, on the URL's protocol; callers never
branch on schemes. Listing is one recursive call with sizes and times (no
per-file stat round trips on object stores); deletes are batched so s3fs sends
DeleteObjects of up to 1000 keys and gcsfs uses batch requests.
"""

from __future__ import annotations

import builtins
import contextlib
import errno
import functools
import io
import os
import posixpath
import shutil
import stat
import tempfile
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import UTC, datetime
from functools import cached_property
from typing import Any, BinaryIO, TypeVar

from cachectl import temps
from cachectl.config import DELETE_BATCH
from cachectl.errors import BadInput, Unreachable

# Protocols cachectl manages, mapped to their canonical fsspec name.
_PROTOCOLS = {
    None: "file",
    "file": "file",
    "local": "file",
    "s3": "s3",
    "s3a": "s3",
    "gs": "gcs",
    "gcs": "gcs",
    "memory": "memory",
}
# The scheme JAX (through etils epath) understands for each protocol.
_URL_SCHEME = {"s3": "s3", "gcs": "gs", "memory": "memory"}


class NotRegularFile(FileNotFoundError):
    """A path in a local store that is a symlink, is not a regular file, or resolves outside the root.

    A FileNotFoundError, so every reader treats it as missing: nothing a link points at is ever read."""


@dataclass(frozen=True)
class FileInfo:
    """One stored file, relative to the store's root."""

    path: str
    size: int
    mtime: datetime | None


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


def _unlink_all(paths: list[str]) -> int:
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


def _atomic_local_write(full: str, mode: int, write: Callable[[BinaryIO], object]) -> None:
    """Write a local file through a temporary sibling and a rename: readers never see half."""
    directory = os.path.dirname(full)
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=temps.prefix(temps.TEMP_PREFIX), dir=directory)
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


# Reading many local files: threads only when the mean file is at least this big. Small ones
# are bound by Python's per-file work under the GIL, where threads measured slower than one
# loop on a loaded 2-core machine (bench/lifecycle.py); big ones overlap reads, hashing and
# decompression, which release the GIL.
LOCAL_THREADED_MEAN_BYTES = 256 << 10
LOCAL_READ_WORKERS = 4
REMOTE_READ_WORKERS = 32  # object store reads wait on the network: overlap them

T = TypeVar("T")
R = TypeVar("R")


def read_workers(store: Store, sizes: Sequence[int] = ()) -> int:
    """How many threads read (and check) files of these sizes from ``store``."""
    if not store.is_local:
        return REMOTE_READ_WORKERS
    if sizes and sum(sizes) >= LOCAL_THREADED_MEAN_BYTES * len(sizes):
        return LOCAL_READ_WORKERS
    return 1


def ordered_map(fn: Callable[[T], R], items: Sequence[T], workers: int) -> Iterator[R]:
    """``fn`` over ``items``, results in order: in this thread with one worker, else on a pool in
    chunks (one task per item costs more than a small file's read)."""
    if workers <= 1 or len(items) < 2:
        yield from map(fn, items)
        return
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="cachectl-read") as pool:
        yield from pool.map(fn, items, chunksize=max(1, min(256, len(items) // (workers * 4))))


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


class _LocalReader:
    """Reads files below one local root: directories opened once each, without following links."""

    def __init__(self, store: Store) -> None:
        self._store = store
        self._dirs: dict[str, int] = {}
        self._lock = threading.RLock()

    def __enter__(self) -> _LocalReader:
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
                fd = os.open(self._store.root, os.O_RDONLY | _DIR_FLAGS)
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
            self._store._full(rel)  # BadInput if it leaves the root
        rel_dir, _, name = rel.rpartition("/")
        fd = self._dirs.get(rel_dir)
        if fd is None:
            try:
                fd = self._dir_fd(rel_dir, f"{self._store.root}/{rel}")
            except OSError as exc:
                raise _not_regular(exc, f"{self._store.root}/{rel}") from None
        return self._read_at(fd, rel_dir, name)

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
                self._store._full(rel_dir)
            fd = self._dir_fd(rel_dir, f"{self._store.root}/{rel_dir}")
        except (OSError, BadInput):
            return slow
        at = functools.partial(self._read_timed if times else self._read_at, fd, rel_dir)
        # A name with a '/' would let openat() follow a link in its directories: read() checks each.
        return lambda name: slow(name) if "/" in name else at(name)

    def _path_of(self, rel_dir: str, name: str) -> str:
        """The full path of ``name`` in ``rel_dir``, for messages."""
        return f"{self._store.root}/{rel_dir}/{name}" if rel_dir else f"{self._store.root}/{name}"

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
                raise NotRegularFile(
                    f"{self._store.root}/{rel_dir}/{name}: not a regular file: not read"
                )
            data = os.read(fd, st.st_size + 1)
            if len(data) == st.st_size:  # what fstat said, and nothing after it: the whole file
                return data, st.st_mtime
            parts = [data]
            while chunk := os.read(
                fd, 1 << 20
            ):  # to the end: it changed since the fstat, or one read
                # returned less than asked (Linux caps a read at 2 GiB)
                parts.append(chunk)
            return b"".join(parts), st.st_mtime
        finally:
            os.close(fd)


def split_protocol(url: str) -> tuple[str | None, str]:
    """fsspec.core.split_protocol without importing fsspec (a service's start needs only paths)."""
    if "://" in url:
        protocol, path = url.split("://", 1)
        if len(protocol) > 1:  # not a Windows drive letter
            return protocol, path
    if url.startswith("data:"):
        return "data", url[5:]
    return None, url


def normalize_url(url: str) -> str:
    """Canonical form of a root URL; raises BadInput for schemes we do not manage."""
    if not url or not url.strip():
        raise BadInput(
            "empty storage URL: give a local path, file://, gs://, s3:// or memory:// URL"
        )
    url = url.strip()
    protocol, path = split_protocol(url)
    if protocol not in _PROTOCOLS:
        raise BadInput(
            f"unsupported storage URL scheme {f'{protocol}://'!r} in {url!r}: "
            "use a local path, file://, gs://, s3:// or memory://"
        )
    kind = _PROTOCOLS[protocol]
    if kind == "file":
        return os.path.abspath(os.path.expanduser(path))
    path = path.strip("/")
    if not path:
        raise BadInput(f"storage URL {url!r} names no bucket: use e.g. {protocol}://bucket/prefix")
    return f"{_URL_SCHEME[kind]}://{path}"


def url_kind(url: str) -> str | None:
    """The storage a URL names ("file", "s3", "gcs", "memory"; None for a scheme not managed):
    what callers ask instead of testing a URL's prefix."""
    return _PROTOCOLS.get(split_protocol(url.strip())[0])


def _mtime(info: dict[str, Any]) -> datetime | None:
    """Modification time across backends (local mtime, S3 LastModified, GCS updated)."""
    for key in ("mtime", "LastModified", "updated", "created"):
        value = info.get(key)
        if value is None:
            continue
        if isinstance(value, datetime):
            return value if value.tzinfo else value.replace(tzinfo=UTC)
        if isinstance(value, (int, float)):
            return datetime.fromtimestamp(float(value), tz=UTC)
        if isinstance(value, str):
            try:
                return datetime.fromisoformat(value.replace("Z", "+00:00"))
            except ValueError:
                continue
    return None


def _storage_options(kind: str, options: dict[str, Any] | None) -> dict[str, Any]:
    opts = dict(options or {})
    if kind == "gcs" and os.environ.get("STORAGE_EMULATOR_HOST") and "token" not in opts:
        opts["token"] = "anon"
    if kind == "s3" and os.environ.get("AWS_ENDPOINT_URL") and "endpoint_url" not in opts:
        opts.setdefault("client_kwargs", {}).setdefault(
            "endpoint_url", os.environ["AWS_ENDPOINT_URL"]
        )
    if kind in ("s3", "gcs"):
        # Endpoints and credentials come from the environment; a cached instance
        # could carry an endpoint from before the environment changed.
        opts["skip_instance_cache"] = True
    return opts


class Store:
    """A cache root on some filesystem, addressed by paths relative to it."""

    def __init__(self, url: str, storage_options: dict[str, Any] | None = None) -> None:
        self.url = normalize_url(url)
        protocol, path = split_protocol(self.url)
        self.kind = _PROTOCOLS[protocol]
        self._options = storage_options
        self.root = path if self.kind == "file" else path.strip("/")
        if self.kind == "memory":
            self.root = "/" + self.root

    @cached_property
    def fs(self) -> Any:
        """The fsspec filesystem, built (and fsspec imported) on first use: a read-only service
        only needs the namespace's path."""
        import fsspec

        return fsspec.filesystem(self.kind, **_storage_options(self.kind, self._options))

    @property
    def is_local(self) -> bool:
        return self.kind == "file"

    def _full(self, rel: str) -> str:
        rel = rel.strip("/")
        if ".." in rel.split("/"):
            raise BadInput(f"path {rel!r} escapes the cache root")
        return posixpath.join(self.root, rel) if rel else self.root

    def _rel(self, full: str) -> str:
        full = full.rstrip("/")
        if self.kind == "memory" and not full.startswith("/"):
            full = "/" + full
        root = self.root.rstrip("/")
        return full[len(root) :].lstrip("/") if full.startswith(root) else full

    def url_for(self, rel: str = "") -> str:
        """The URL a JAX process (or a person) uses for this path."""
        full = self._full(rel)
        if self.kind == "file":
            return full
        if self.kind == "memory":
            return "memory://" + full.lstrip("/")
        return f"{_URL_SCHEME[self.kind]}://{full}"

    def check_reachable(self) -> None:
        """Fail with one line if the root cannot be reached (bad bucket, no endpoint)."""
        try:
            if self.kind == "file":
                return
            bucket = self.root.split("/", 1)[0] if self.kind in ("s3", "gcs") else self.root
            if self.kind in ("s3", "gcs") and not self.fs.exists(bucket):
                raise Unreachable(
                    f"bucket {bucket!r} of {self.url} does not exist or is not accessible"
                )
        except Unreachable:
            raise
        except Exception as exc:  # noqa: BLE001 - any client error is "unreachable" here
            raise Unreachable(
                f"storage {self.url} is unreachable: {type(exc).__name__}: {exc}"
            ) from exc

    def list(self, rel: str = "") -> list[FileInfo]:
        """Every file under ``rel``, recursively, in one listing call."""
        full = self._full(rel)
        if self.kind == "file" and os.path.isdir(full):
            return self._list_local(self.fs._strip_protocol(full))
        try:
            found = self.fs.find(full, detail=True, withdirs=False)
        except FileNotFoundError:
            return []
        return [
            FileInfo(self._rel(name), int(info.get("size") or 0), _mtime(info))
            for name, info in sorted(found.items())
            if info.get("type", "file") != "directory"
        ]

    def list_paths(self, rel: str = "") -> builtins.list[str]:
        """The paths ``list(rel)`` gives, without sizes and times: on local disk the directory reads
        alone (no stat per file), for a caller that needs the times of only a few files (``infos``)."""
        full = self._full(rel)
        if self.kind == "file" and os.path.isdir(full):
            below, found = self._flat_local(self.fs._strip_protocol(full), with_stat=False)
            names = [name for name, _, _ in found]
            return names if below else [self._rel(name) for name in names]
        return [f.path for f in self.list(rel)]

    def infos(self, rels: Sequence[str], within: str = "") -> dict[str, FileInfo]:
        """Size and time of listed files, as ``list`` gives them (files gone since are left out):
        on local disk one lstat each, elsewhere one listing of ``within`` (no call per file)."""
        if not rels:
            return {}
        if self.kind != "file":
            wanted = set(rels)
            return {f.path: f for f in self.list(within) if f.path in wanted}
        out: dict[str, FileInfo] = {}
        for rel in rels:
            full = self._full(rel)
            try:
                st = os.lstat(full)
            except FileNotFoundError:
                continue
            size = st.st_size
            if stat.S_ISLNK(st.st_mode):
                size = _target_size(functools.partial(os.stat, full))
            out[rel] = FileInfo(rel, size, datetime.fromtimestamp(st.st_mtime, tz=UTC))
        return out

    def _local_top(self, top: str) -> tuple[bool, str]:
        """Whether ``top`` is below the root as spelled, and the name its files' names start from:
        relative to the root if so, else the full path."""
        root = self.root.rstrip("/")
        if top == root or top.startswith(root + "/"):
            return True, top[len(root) + 1 :]
        return False, top

    def _flat_local(
        self, top: str, *, with_stat: bool
    ) -> tuple[bool, builtins.list[tuple[str, int | None, float | None]]]:
        """``_dir_stats_local``'s files as one sorted list of (name, size, mtime); whether ``top`` is
        below the root (``_local_top``: names relative to it, else full paths)."""
        below, rel_top = self._local_top(top)
        found = [
            (f"{rel_dir}/{name}" if rel_dir else name, size, mtime)
            for rel_dir, files in self._dir_stats_local(top, rel_top, with_stat)
            for name, size, mtime in files
        ]
        found.sort()
        return below, found

    def _stat_local(self, top: str) -> tuple[bool, builtins.list[tuple[str, int, float]]]:
        """Every file below ``top`` (directories are descended, symlinks to them are not: listed as
        files) with one lstat each, sorted: (name, size, mtime seconds) as plain numbers (a
        symlink's size is its target's, 0 if dangling; mtimes are the link's own)."""
        return self._flat_local(top, with_stat=True)  # type: ignore[return-value]

    def _list_local(self, top: str) -> builtins.list[FileInfo]:
        """What ``fs.find(top, detail=True)`` gives on local disk, from os.scandir without fsspec's
        per-file info dicts."""
        below, found = self._stat_local(top)
        stamp = datetime.fromtimestamp
        if not below:
            return [
                FileInfo(self._rel(name), int(size), stamp(mtime, tz=UTC))
                for name, size, mtime in found
            ]
        return [FileInfo(name, size, stamp(mtime, tz=UTC)) for name, size, mtime in found]

    def list_stats(self, rel: str = "") -> Sequence[tuple[str, int, float | None]]:
        """``list(rel)`` as (path, size, mtime in POSIX seconds or None) tuples: on local disk no
        FileInfo or datetime per file, for a caller (sync's plan) that compares numbers and builds
        objects only for what it reports."""
        full = self._full(rel)
        if self.kind == "file" and os.path.isdir(full):
            below, found = self._stat_local(self.fs._strip_protocol(full))
            if below:
                return found
            return [(self._rel(name), int(size), mtime) for name, size, mtime in found]
        return [
            (f.path, f.size, f.mtime.timestamp() if f.mtime is not None else None)
            for f in self.list(rel)
        ]

    def dir_stats(
        self, rel: str = "", *, stat: bool = True
    ) -> Iterator[tuple[str, builtins.list[tuple[str, int | None, float | None]]]]:
        """``list_stats(rel)`` by directory: (directory relative to the root, its files as (name, size,
        mtime)), directories with files only, depth first with names sorted (a directory's
        subdirectories come right after it, before its next sibling). On local disk each directory
        is read as the walk reaches it, so a caller can work on one while the rest is unread; with
        ``stat=False`` there its files' sizes and times are None (no lstat per file: ``stat_in_dir``
        gives them for the names that need them). Object stores list sizes and times anyway."""
        full = self._full(rel)
        if self.kind == "file" and os.path.isdir(full):
            top = self.fs._strip_protocol(full)
            below, rel_top = self._local_top(top)
            if below:
                yield from self._dir_stats_local(top, rel_top, stat)
                return
        groups: dict[str, list[tuple[str, int | None, float | None]]] = {}
        for path, size, mtime in self.list_stats(rel):
            parent, _, name = path.rpartition("/")
            groups.setdefault(parent, []).append((name, size, mtime))
        for parent in sorted(groups, key=lambda d: d.split("/")):  # by component: depth first
            yield parent, groups[parent]

    @staticmethod
    def _dir_stats_local(
        top: str, rel_top: str, with_stat: bool
    ) -> Iterator[tuple[str, builtins.list[tuple[str, int | None, float | None]]]]:
        """``dir_stats`` on local disk: one scandir per directory (and one lstat per file), as the walk goes."""
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

    def stat_in_dir(
        self, rel_dir: str, names: Sequence[str]
    ) -> dict[str, tuple[int, float | None]]:
        """(size, mtime) of files directly in ``rel_dir``, as ``dir_stats`` gives them (files gone
        since are left out): on local disk one lstat each relative to the directory's descriptor."""
        if not names:
            return {}
        if self.kind != "file":
            prefix = f"{rel_dir.strip('/')}/" if rel_dir.strip("/") else ""
            found = self.infos([prefix + name for name in names], within=rel_dir)
            return {
                path[len(prefix) :]: (f.size, f.mtime.timestamp() if f.mtime is not None else None)
                for path, f in found.items()
            }
        out: dict[str, tuple[int, float | None]] = {}
        try:
            fd = os.open(self._full(rel_dir), os.O_RDONLY | _DIR_FLAGS)
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

    def iter_dirs(self, rel: str = "") -> Iterator[str]:
        """Immediate subdirectories of ``rel`` (relative paths)."""
        try:
            items = self.fs.ls(self._full(rel), detail=True)
        except FileNotFoundError:
            return
        for info in items:
            if info.get("type") == "directory":
                yield self._rel(info["name"])

    def exists(self, rel: str) -> bool:
        return bool(self.fs.exists(self._full(rel)))

    def _regular_local(self, rel: str, *, check_file: bool = True) -> str:
        """The path of ``rel`` on local disk if it is a regular file reached without any symlink.

        Every directory between the root and the file must be a real directory (its real path is
        the root's real path plus ``rel``'s directories), and the file itself no symlink; anything
        else raises NotRegularFile, so a link planted in a namespace never serves what it points at.
        """
        full = self._full(rel)
        # One lstat per directory below the root (a realpath() of both sides cost an lstat per
        # component of the whole path, twice, per file: most of a local verify's time).
        here = self.root
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
        if not check_file:  # the caller opens with O_NOFOLLOW and checks the descriptor's fstat
            return full
        st = os.lstat(full)
        if not stat.S_ISREG(st.st_mode):
            raise NotRegularFile(f"{full}: not a regular file (symlink or special file): not read")
        return full

    def _open_local(self, rel: str) -> Any:
        full = self._regular_local(rel)
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

    def _read_local(self, rel: str) -> bytes:
        """_open_local's checks and a read, on the raw descriptor (no file object per read)."""
        with _LocalReader(self) as reader:
            return reader.read(rel)

    @contextlib.contextmanager
    def reader(self) -> Iterator[Callable[[str], bytes]]:
        """``read_bytes`` for many files, safe to call from threads.

        On local disk each directory is opened once, without following links, and files are
        opened relative to it (``dir_fd``, ``O_NOFOLLOW``): the per-file lstat of every
        directory on the path goes, and a directory swapped for a link after its check cannot
        redirect a read (it is the checked directory that is read from)."""
        if self.kind != "file":
            yield self.read_bytes
            return
        with _LocalReader(self) as local:
            yield local.read

    @contextlib.contextmanager
    def dir_reader(self, rel_dir: str, *, times: bool = False) -> Iterator[Callable[[str], Any]]:
        """``reader`` for the files directly in one directory, by name: on local disk the directory's
        descriptor is looked up once, not per file (sync reads a namespace's files this way). With
        ``times``, each read gives (bytes, mtime in POSIX seconds, or None where the store has none
        without another call)."""
        if self.kind != "file":
            if times:
                yield lambda name: (self.read_bytes(f"{rel_dir}/{name}"), None)
            else:
                yield lambda name: self.read_bytes(f"{rel_dir}/{name}")
            return
        with _LocalReader(self) as local:
            yield local.in_dir(rel_dir, times=times)

    def size(self, rel: str) -> int:
        if self.kind == "file":
            return int(os.stat(self._regular_local(rel)).st_size)
        return int(self.fs.size(self._full(rel)))

    def read_bytes(self, rel: str) -> bytes:
        if self.kind == "file":
            return self._read_local(rel)
        return bytes(self.fs.cat_file(self._full(rel)))

    def open(self, rel: str, mode: str = "rb") -> Any:
        """Open a file; reads on local disk only ever open regular files inside the root."""
        if self.kind == "file" and mode in ("rb", "r"):
            fh = self._open_local(rel)
            return fh if mode == "rb" else io.TextIOWrapper(fh)
        return self.fs.open(self._full(rel), mode)

    def makedirs(self, rel: str, mode: int | None = None) -> None:
        """Create a directory; on local disk with an explicit mode (umask ignored)."""
        full = self._full(rel)
        if self.kind != "file":
            return  # object stores have no directories
        missing = []
        path = full
        while not os.path.isdir(path):
            missing.append(path)
            parent = os.path.dirname(path)
            if parent == path:
                break
            path = parent
        os.makedirs(full, exist_ok=True)
        if mode is not None:
            for created in missing:
                os.chmod(created, mode)

    def write_bytes(self, rel: str, data: bytes, *, mode: int = 0o644) -> None:
        """Write atomically: readers see the old file or the new one, never half."""
        full = self._full(rel)
        if self.kind != "file":
            self.fs.pipe_file(full, data)  # an object PUT is atomic
            return
        _atomic_local_write(full, mode, lambda fh: fh.write(data))

    def write_file(self, rel: str, local_path: str, *, mode: int = 0o644) -> None:
        """Write a local file's bytes to ``rel`` atomically, streamed (never all in memory)."""
        full = self._full(rel)
        if self.kind != "file":
            self.fs.put_file(local_path, full)  # one object PUT (multipart for big files): atomic
            return

        def copy(fh: BinaryIO) -> None:
            with open(local_path, "rb") as src:
                shutil.copyfileobj(src, fh, 1 << 20)

        _atomic_local_write(full, mode, copy)

    def delete(self, rels: Iterable[str], batch_size: int = DELETE_BATCH) -> int:
        """Delete files in batches (one rm call per batch); missing files are fine."""
        deleted = 0
        batch: list[str] = []
        for rel in rels:
            batch.append(self._full(rel))
            if len(batch) >= batch_size:
                deleted += self._delete_batch(batch)
                batch = []
        if batch:
            deleted += self._delete_batch(batch)
        return deleted

    def _delete_batch(self, paths: builtins.list[str]) -> int:
        if self.kind == "file":
            return _unlink_all(paths)
        try:
            self.fs.rm(paths)
        except FileNotFoundError:
            # Some backends refuse the whole batch when one path is gone: retry
            # with what is left, so a re-run after a crash finishes the job.
            remaining = [p for p in paths if self.fs.exists(p)]
            if remaining:
                self.fs.rm(remaining)
        return len(paths)

    def delete_tree(self, rel: str) -> None:
        """Remove a whole directory (a namespace) in one recursive call."""
        full = self._full(rel)
        if not rel.strip("/"):
            raise BadInput("refusing to delete a cache root as a tree")
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm(full, recursive=True)
        if self.kind == "file" and os.path.isdir(full):
            shutil.rmtree(full, ignore_errors=True)

    def move(self, src: str, dst: str) -> None:
        """Move a file (rename on local disk, copy + delete on object stores)."""
        if self.kind == "file":
            os.makedirs(os.path.dirname(self._full(dst)), exist_ok=True)
            os.replace(self._full(src), self._full(dst))
        else:
            # copy + delete rather than fs.mv: gcsfs's mv tries the moveTo API
            # first and, where it is missing (the GCS emulator answers 501),
            # retries with backoff for ~30 s per file before doing this anyway.
            self.fs.copy(self._full(src), self._full(dst))
            self.fs.rm_file(self._full(src))
