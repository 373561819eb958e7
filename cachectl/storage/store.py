"""One storage abstraction over fsspec for every cache root.

Local paths, ``file://``, ``memory://`` and every object store in the registry
(``core/urls.py``: ``gs://``, ``s3://``...) go through the same Store. Dispatch happens once, on the URL's protocol; callers never
branch on schemes. What differs between object stores (options, the bucket to
check) is asked of the store's backend module (``storage/backends/``). Listing is one recursive call with sizes and times (no
per-file stat round trips on object stores); deletes are batched so s3fs sends
DeleteObjects of up to 1000 keys and gcsfs uses batch requests.
"""

from __future__ import annotations

import builtins
import contextlib
import io
import os
import shutil
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FuturesTimeout
from dataclasses import dataclass
from datetime import UTC, datetime
from functools import cached_property
from typing import Any, BinaryIO, TypeVar

from cachectl.core import temps
from cachectl.core.config import DELETE_BATCH, STORAGE_TIMEOUT_ENV, storage_bounds
from cachectl.core.errors import BadInput, CachectlError, Unreachable
from cachectl.core.urls import (  # noqa: F401 - URL dispatch, re-exported
    PROTOCOLS,
    URL_SCHEME,
    normalize_url,
    split_protocol,
    url_kind,
)
from cachectl.storage import store_local as local
from cachectl.storage.backends import backend, require
from cachectl.storage.store_local import Listed
from cachectl.storage.store_local import (
    NotRegularFile as NotRegularFile,  # raised by reads: callers catch it
)


# Protocols cachectl manages, mapped to their canonical fsspec name.
@dataclass(frozen=True)
class FileInfo:
    """One stored file, relative to the store's root."""

    path: str
    size: int
    mtime: datetime | None


# Reading many local files: threads only when the mean file is at least this big. Small ones
# are bound by Python's per-file work under the GIL, where threads were slower than one
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


def _mtime(info: dict[str, Any], own_keys: tuple[str, ...] = ()) -> datetime | None:
    """Modification time across backends (local mtime, S3 LastModified, GCS updated), after the
    keys the store's backend names (``MTIME_KEYS``)."""
    for key in (*own_keys, "mtime", "LastModified", "updated", "created"):
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


def options_for(kind: str, options: dict[str, Any] | None) -> dict[str, Any]:
    """The fsspec options cachectl's client of this kind of store gets: the cache's, the
    environment's endpoint, the bounds (the store's backend module says which)."""
    return backend(kind).client_options(dict(options or {}))


def within_bound(call: Callable[[], T], what: str) -> T:
    """``call()``, or Unreachable once the whole storage bound has passed: a client that retries
    a silent or trickling server still ends on time. The call runs on a daemon thread, left to
    end by itself (its own bounds end it) if it overruns."""
    bound = storage_bounds().total_s
    done: Future[T] = Future()

    def run() -> None:
        try:
            done.set_result(call())
        except BaseException as exc:  # noqa: BLE001 - handed to the caller's thread
            done.set_exception(exc)

    threading.Thread(target=run, name="cachectl-storage-call", daemon=True).start()
    try:
        return done.result(timeout=bound)
    except FuturesTimeout:
        raise Unreachable(
            f"{what} did not answer within {bound:g} s ({STORAGE_TIMEOUT_ENV}); "
            "check the endpoint, or raise the bound"
        ) from None


class Store:
    """A cache root on some filesystem, addressed by paths relative to it."""

    def __init__(self, url: str, storage_options: dict[str, Any] | None = None) -> None:
        self.url = normalize_url(url)
        protocol, path = split_protocol(self.url)
        self.kind = PROTOCOLS[protocol]
        self._options = storage_options
        self.root = path if self.kind == "file" else path.strip("/")
        if self.kind == "memory":
            self.root = "/" + self.root

    @cached_property
    def fs(self) -> Any:
        """The fsspec filesystem, built (and fsspec imported) on first use: a read-only service
        only needs the namespace's path."""
        require(self.kind)  # one line where the store's package is missing
        import fsspec

        return fsspec.filesystem(backend(self.kind).FSSPEC, **options_for(self.kind, self._options))

    @property
    def is_local(self) -> bool:
        return self.kind == "file"

    def _full(self, rel: str) -> str:
        return local.full_path(self.root, rel)

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
        return f"{URL_SCHEME[self.kind]}://{full}"

    def check_reachable(self) -> None:
        """Fail with one line if the root cannot be reached (bad bucket, no endpoint), within the
        whole storage bound (``CACHECTL_STORAGE_TIMEOUT``) however often the client retries."""
        bucket = backend(self.kind).bucket(self.root)
        if bucket is None:
            return
        try:
            fs = self.fs  # built (its modules imported) before the clock starts: no network yet
            found = within_bound(lambda: bool(fs.exists(bucket)), f"storage {self.url}")
        except CachectlError:  # Unreachable, or a bad bound setting
            raise
        except Exception as exc:  # noqa: BLE001 - any client error is "unreachable" here
            text = f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
            raise Unreachable(f"storage {self.url} is unreachable: {text}") from exc
        if not found:
            raise Unreachable(
                f"bucket {bucket!r} of {self.url} does not exist or is not accessible"
            )

    def list(self, rel: str = "") -> list[FileInfo]:
        """Every file under ``rel``, recursively, in one listing call."""
        full = self._full(rel)
        if self.kind == "file" and os.path.isdir(full):
            return self._list_local(local.absolute(full))
        try:
            found = self.fs.find(full, detail=True, withdirs=False)
        except FileNotFoundError:
            return []
        own_keys = backend(self.kind).MTIME_KEYS
        return [
            FileInfo(self._rel(name), int(info.get("size") or 0), _mtime(info, own_keys))
            for name, info in sorted(found.items())
            if info.get("type", "file") != "directory"
        ]

    def forget_listings(self, rel: str = "") -> None:
        """Drop the object store client's cached listings under ``rel``: another writer (JAX
        itself, during a warm) adds files there, which a stale listing would hide from reads."""
        if self.kind != "file":
            with contextlib.suppress(Exception):  # a client without a listings cache
                self.fs.invalidate_cache(self._full(rel))

    def list_paths(self, rel: str = "") -> builtins.list[str]:
        """The paths ``list(rel)`` gives, without sizes and times: on local disk the directory reads
        alone (no stat per file), for a caller that needs the times of only a few files (``infos``)."""
        full = self._full(rel)
        if self.kind == "file" and os.path.isdir(full):
            below, found = local.flat(self.root, local.absolute(full), with_stat=False)
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
            listed = local.lstat_listed(self._full(rel))
            if listed is not None:
                size, mtime = listed
                out[rel] = FileInfo(rel, size, datetime.fromtimestamp(mtime, tz=UTC))
        return out

    def _list_local(self, top: str) -> builtins.list[FileInfo]:
        """What ``fs.find(top, detail=True)`` gives on local disk, from os.scandir without fsspec's
        per-file info dicts."""
        below, found = local.flat(self.root, top, with_stat=True)
        stamp = datetime.fromtimestamp
        if not below:
            return [
                FileInfo(self._rel(name), int(size or 0), stamp(mtime or 0, tz=UTC))
                for name, size, mtime in found
            ]
        return [FileInfo(name, size or 0, stamp(mtime or 0, tz=UTC)) for name, size, mtime in found]

    def dir_stats(
        self, rel: str = "", *, stat: bool = True
    ) -> Iterator[tuple[str, builtins.list[Listed]]]:
        """Every file under ``rel`` by directory: (directory relative to the root, its files as
        (name, size, mtime in POSIX seconds)), directories with files only, depth first with names
        sorted (a directory's subdirectories come right after it, before its next sibling). On
        local disk each directory is read as the walk reaches it, so a caller can work on one
        while the rest is unread; with ``stat=False`` there its files' sizes and times are None
        (no lstat per file: ``stat_in_dir`` gives them for the names that need them). Object
        stores list sizes and times anyway."""
        full = self._full(rel)
        found: Sequence[Listed]
        if self.kind == "file" and os.path.isdir(full):
            top = local.absolute(full)
            below, rel_top = local.local_top(self.root, top)
            if below:
                yield from local.walk(top, rel_top, stat)
                return
            _, listed = local.flat(self.root, top, with_stat=True)
            found = [(self._rel(name), size, mtime) for name, size, mtime in listed]
        else:
            found = [
                (f.path, f.size, f.mtime.timestamp() if f.mtime is not None else None)
                for f in self.list(rel)
            ]
        groups: dict[str, builtins.list[Listed]] = {}
        for path, size, mtime in found:
            parent, _, name = path.rpartition("/")
            groups.setdefault(parent, []).append((name, size, mtime))
        for parent in sorted(groups, key=lambda d: d.split("/")):  # by component: depth first
            yield parent, groups[parent]

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
        return local.stat_in_dir(self._full(rel_dir), names)

    def exists(self, rel: str) -> bool:
        return bool(self.fs.exists(self._full(rel)))

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
        with local.LocalReader(self.root) as reader:
            yield reader.read

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
        with local.LocalReader(self.root) as reader:
            yield reader.in_dir(rel_dir, times=times)

    def size(self, rel: str) -> int:
        if self.kind == "file":
            return int(os.stat(local.regular_path(self.root, rel)).st_size)
        return int(self.fs.size(self._full(rel)))

    def read_bytes(self, rel: str) -> bytes:
        if self.kind == "file":
            with local.LocalReader(self.root) as reader:  # the checks of reader(), for one file
                return reader.read(rel)
        return bytes(self.fs.cat_file(self._full(rel)))

    def open(self, rel: str, mode: str = "rb") -> Any:
        """Open a file; reads on local disk only ever open regular files inside the root."""
        if self.kind == "file" and mode in ("rb", "r"):
            fh = local.open_regular(self.root, rel)
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
        temps.atomic_write(full, mode, lambda fh: fh.write(data))

    def write_file(self, rel: str, local_path: str, *, mode: int = 0o644) -> None:
        """Write a local file's bytes to ``rel`` atomically, streamed (never all in memory)."""
        full = self._full(rel)
        if self.kind != "file":
            self.fs.put_file(local_path, full)  # one object PUT (multipart for big files): atomic
            return

        def copy(fh: BinaryIO) -> None:
            with open(local_path, "rb") as src:
                shutil.copyfileobj(src, fh, 1 << 20)

        temps.atomic_write(full, mode, copy)

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
            return local.unlink_all(paths)
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
