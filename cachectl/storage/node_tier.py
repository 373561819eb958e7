"""The node-local tier: a directory on this machine in front of a remote (the server, s3://, gs://,
az://), the way sccache's multi-level cache puts a local disk in front of its storage.

A read asks the tier first; a miss fetches the file once from the remote (``fetch``), checks its
sha256 against the verified record the caller passes, writes it here atomically and returns it.
Processes on one node take a lock file per file while they fetch, so one fetch serves them all;
the wait for another's fetch is bounded (``WAIT_S``), past it a process fetches on its own. A file
whose sha256 is not the record's (damaged on this disk) is removed and fetched again. The tier
keeps under its size limit by evicting the least recently read files (a read touches the file's
mtime, since many disks are mounted noatime). A full or unwritable disk costs one warning: the
bytes fetched are still returned, so the process reads from the remote rather than fail.

Layout: ``<root>/<source digest16>/<namespace>/<name>`` (one directory per remote, so two caches
never share a file), lock files under ``<root>/.locks``. The file names are the remote's, so in
server mode the namespace directory is also what JAX opens as its cache directory.

Who may have written the tier: every directory of it, from the root down to the files', must be
a real directory (never a symbolic link) owned by this user and writable by nobody else; cachectl
makes the ones missing 0700. A tier that is not so (a co-tenant made the directory first, or it
is group-writable) is said once and never read or written: each read goes to the remote, and the
kept record is not used. Every file of it (an entry, a lock file, the record) is opened without
following a link and without waiting on a FIFO, and used only as a regular file; the record is
bounded in size and checked entry by entry, and a damaged one costs one warning.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import logging
import os
import stat
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import BinaryIO

from cachectl.core.config import Settings, cache_dir
from cachectl.core.temps import TEMP_PREFIX, atomic_write, makedirs
from cachectl.core.urls import url_kind
from cachectl.storage.entries import is_key

log = logging.getLogger(__name__)

DEFAULT_LIMIT = 20 << 30  # 20 GiB unless CACHECTL_NODE_CACHE_SIZE says otherwise
WAIT_S = 120.0  # how long a process waits for another's fetch of the same file
_POLL_S = 0.02
LOCKS = ".locks"
RECORD = ".cachectl-verified.json"  # the index's record of a namespace, kept for restarts
FILE_MODE = 0o644
DIR_MODE = 0o700  # the tier's directories, as cachectl makes them
RECORD_MAX_BYTES = 64 << 20  # far above a record of 100,000 entries (about 45 MB)
# Opens of the tier's files: never through a link, never waiting on a FIFO.
_OPEN_FLAGS = os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
_SHA256 = frozenset("0123456789abcdef")
# Below this fraction of the limit after an eviction pass, so one pass serves many writes.
_EVICT_TO = 0.9


OFF = ("off", "0", "none", "false", "no")
NODE_DIR = "node"  # the default node tier, under the XDG cache home


def node_dir(settings: Settings, root_url: str) -> str | None:
    """The node tier's directory for this root, or None: the setting (``off``: none); in server
    mode without the root here, ``<XDG cache home>/cachectl/node``."""
    value = (settings.node_cache or "").strip()
    if value and value.lower() in OFF:
        return None
    if value:
        return os.path.abspath(os.path.expanduser(value))
    if via_server(settings, root_url):
        return str(cache_dir() / NODE_DIR)
    return None


def root_here(root_url: str) -> bool:
    """Whether this machine reads a local-disk root itself: its directory exists and holds
    something (another machine's root, absent or hidden under an empty mount, does not)."""
    if url_kind(root_url) != "file":
        return False
    try:
        with os.scandir(root_url) as found:
            return any(True for _ in found)
    except OSError:
        return False


def via_server(settings: Settings, root_url: str) -> bool:
    """Whether bytes move over the server's entry routes: server mode, the local-disk root not
    here (an object-store root is read from the bucket, through the tier when one is set), and
    no CACHECTL_ROOT (which says where the root is on this machine)."""
    return (
        bool(settings.server)
        and settings.root is None
        and url_kind(root_url) == "file"
        and not root_here(root_url)
    )


def source_dir(root: str, source: str, cache: str) -> str:
    """Where one remote's cache lives in the tier: its namespaces below, as below the root."""
    return os.path.join(root, hashlib.sha256(f"{source}#{cache}".encode()).hexdigest()[:16])


def server_root(settings: Settings, cache: str, root_url: str) -> str | None:
    """In server mode without the root here: the node directory that stands in for the root
    (what JAX writes there for a command, warm's compiles, is then already on this node)."""
    directory = node_dir(settings, root_url)
    if directory is None or not via_server(settings, root_url):
        return None
    assert settings.server is not None
    return source_dir(directory, settings.server, cache)


class Refused(OSError):
    """Fetched bytes whose sha256 is not the verified record's: never written, never used."""


def dir_problem(info: os.stat_result, path: str, root: bool = False) -> str | None:
    """Why the directory ``path`` (its lstat ``info``; ``root``: the tier's own directory) could
    hold files someone else put there, and what to do; None when it is a real directory of this
    user that nobody else may write."""
    me = os.geteuid()
    elsewhere = ", or set CACHECTL_NODE_CACHE to a directory of your own" if root else ""
    if stat.S_ISLNK(info.st_mode):
        if root:
            return (
                f"{path} is a symbolic link (set CACHECTL_NODE_CACHE to a directory of your "
                "own, or to the one it points to if that is yours alone)"
            )
        return f"{path} is a symbolic link (remove it: cachectl makes the directory again)"
    if not stat.S_ISDIR(info.st_mode):
        return f"{path} is not a directory (remove it{elsewhere})"
    if info.st_uid != me:
        return (
            f"{path} is owned by uid {info.st_uid}, not this user (uid {me}) (remove it, or "
            f"`chown -R {me} {path}`{elsewhere})"
        )
    if info.st_mode & 0o022:
        return (
            f"{path} is writable by group or others (mode {stat.S_IMODE(info.st_mode):04o}) "
            f"(run `chmod go-w {path}`)"
        )
    return None


def _below(root: str, directory: str) -> list[str]:
    """The directories from ``root`` down to ``directory`` (which must lie in it), in order."""
    rel = os.path.relpath(directory, root)
    if rel == os.curdir:
        return [root]
    if rel == os.pardir or rel.startswith(os.pardir + os.sep):
        raise ValueError(f"{directory} is outside the node cache {root}")
    chain = [root]
    for part in rel.split(os.sep):
        chain.append(os.path.join(chain[-1], part))
    return chain


def _record_of(found: object) -> dict[str, list[str | None]]:
    """The kept record, checked entry by entry: key -> [sha256, executable sha256 or None,
    why warm-check found it unusable or None]; ValueError names what is wrong."""

    def sha(value: object) -> bool:
        return isinstance(value, str) and len(value) == 64 and _SHA256.issuperset(value)

    if not isinstance(found, dict):
        raise ValueError("not an object")
    for key, value in found.items():
        if not is_key(key):
            raise ValueError(f"{str(key)[:80]!r} is not a key")
        if not isinstance(value, list) or len(value) not in (2, 3) or not sha(value[0]):
            raise ValueError(f"the record of {key} is not [sha256, sha256 or null, …]")
        if not (value[1] is None or sha(value[1])):
            raise ValueError(f"the executable sha256 of {key} is not one")
        if len(value) == 3 and not (value[2] is None or isinstance(value[2], str)):
            raise ValueError(f"the unusable mark of {key} is not text")
    return found


@dataclass
class Counts:
    """What this process's tier did (for tests and the service's report)."""

    hits: int = 0
    fetched: int = 0
    waited: int = 0
    damaged: int = 0
    unwritable: int = 0
    evicted: int = 0


@dataclass
class NodeTier:
    """One node directory: its size limit, and this process's warnings and counts."""

    root: str
    limit: int = DEFAULT_LIMIT
    warn: Callable[[str], None] = log.warning
    counts: Counts = field(default_factory=Counts)
    _warned: set[str] = field(default_factory=set)
    _size: int | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _checked: dict[str, str | None] = field(default_factory=dict)

    def files(self, source: str, cache: str, namespace: str) -> NodeFiles:
        """The files of ``namespace`` of ``cache`` from the remote named ``source`` (a URL)."""
        return NodeFiles(self, os.path.join(source_dir(self.root, source, cache), namespace))

    def refusal(self, directory: str, fresh: bool = False) -> str | None:
        """Why this process may not use the tier for ``directory`` (one of its directories), or
        None: every directory from the root down to it, and ``.locks``, each made 0700 where
        missing and checked with lstat (dir_problem). Checked once per directory and process
        (a directory only this user can write stays so), and again before each write
        (``fresh``: the tier may have been deleted meanwhile). A refusal is said once."""
        with self._lock:
            if directory in self._checked and not fresh:
                return self._checked[directory]
        root = os.path.abspath(self.root)
        why = None
        try:
            makedirs(os.path.dirname(root), DIR_MODE)  # its parents: as the project makes any
            for path in dict.fromkeys(_below(root, directory) + [os.path.join(root, LOCKS)]):
                with contextlib.suppress(FileExistsError):
                    os.mkdir(path, DIR_MODE)
                why = dir_problem(os.lstat(path), path, root=path == root)
                if why is not None:
                    self.warn_once(
                        "owner",
                        f"cachectl: node cache {root} not used: {why}; reading from the remote",
                    )
                    break
        except ValueError as exc:
            why = str(exc)
            self.warn_once("owner", f"cachectl: node cache not used: {why}")
        except OSError as exc:  # a full or read-only disk: said as any unwritable tier
            why = f"{exc.filename or root}: {exc.strerror or exc}"
            self.counts.unwritable += 1
            full = exc.errno in (errno.ENOSPC, errno.EDQUOT)
            self.warn_once(
                "unwritable",
                f"cachectl: node cache {root} is "
                + ("full" if full else f"not usable ({why})")
                + ": reading from the remote without keeping a copy here",
            )
        with self._lock:
            self._checked[directory] = why
        return why

    def warn_once(self, what: str, message: str) -> None:
        with self._lock:
            if what in self._warned:
                return
            self._warned.add(what)
        self.warn(message)

    # -- size ---------------------------------------------------------------------------------

    def _walk(self) -> list[tuple[float, int, str]]:
        """Every file of the tier: (mtime, size, path); lock files, temporaries and the kept
        records left out."""
        found = []
        for top, dirs, names in os.walk(self.root):
            dirs[:] = [d for d in dirs if d != LOCKS]
            for name in names:
                if name.startswith(TEMP_PREFIX) or name == RECORD:
                    continue  # a write in flight; the record a restart without the remote reads
                path = os.path.join(top, name)
                with contextlib.suppress(OSError):
                    st = os.stat(path)
                    found.append((st.st_mtime, st.st_size, path))
        return found

    def added(self, nbytes: int) -> None:
        """Count a file written; past the limit, evict the least recently read files."""
        with self._lock:
            if self._size is None:
                self._size = sum(size for _, size, _ in self._walk())
            else:
                self._size += nbytes
            if self._size <= self.limit:
                return
            files = sorted(self._walk())
            total = sum(size for _, size, _ in files)
            for _, size, path in files:
                if total <= self.limit * _EVICT_TO:
                    break
                with contextlib.suppress(OSError):
                    os.unlink(path)
                    total -= size
                    self.counts.evicted += 1
            self._size = total


class NodeFiles:
    """One namespace of one remote on this node: :meth:`read` is the tier's one way in."""

    def __init__(self, tier: NodeTier, directory: str) -> None:
        self.tier = tier
        self.directory = directory

    def path(self, name: str) -> str:
        return os.path.join(self.directory, name)

    def usable(self) -> bool:
        """Whether this process may read and write the tier's files here (NodeTier.refusal)."""
        return self.tier.refusal(self.directory) is None

    def keep_record(self, record: dict[str, list[str | None]]) -> None:
        """Keep the verified record the index gave (key -> its sha256s) beside the files, so a
        restart with the remote gone still knows which of them it may read."""
        if self.tier.refusal(self.directory, fresh=True) is not None:
            return
        text = json.dumps(record, sort_keys=True).encode()
        with contextlib.suppress(OSError, ValueError):
            if self._read(RECORD, RECORD_MAX_BYTES, owned=True) == text:
                return
        try:
            atomic_write(self.path(RECORD), FILE_MODE, lambda fh: fh.write(text))
        except OSError as exc:
            self._unwritable(exc)

    def record(self) -> dict[str, list[str | None]] | None:
        """The record :meth:`keep_record` kept; None when there is none, the tier may not be
        used, or the record is damaged (said once: it is written again when the index answers)."""
        if not self.usable():
            return None
        try:
            return _record_of(json.loads(self._read(RECORD, RECORD_MAX_BYTES, owned=True)))
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as exc:
            why = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
            self.tier.warn_once(
                "record",
                f"cachectl: node cache record {self.path(RECORD)} is damaged ({why[:200]}): "
                "ignored (it is written again when the index answers)",
            )
            return None

    def _read(self, name: str, limit: int | None = None, owned: bool = False) -> bytes:
        """``name``'s bytes: opened without following a link or waiting on a FIFO, a regular
        file only (``owned``: of this user, writable by nobody else), at most ``limit`` bytes.
        ValueError where it is none of that; OSError (FileNotFoundError) where it cannot open."""
        try:
            fd = os.open(self.path(name), os.O_RDONLY | _OPEN_FLAGS)
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise ValueError("a symbolic link") from None
            raise
        with os.fdopen(fd, "rb") as fh:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode):
                raise ValueError("not a regular file")
            if owned and (info.st_uid != os.geteuid() or info.st_mode & 0o022):
                raise ValueError("written by another user, or writable by others")
            data = fh.read() if limit is None else fh.read(limit + 1)
        if limit is not None and len(data) > limit:
            raise ValueError(f"over {limit} bytes")
        return data

    def read(self, name: str, sha256: str | None, fetch: Callable[[], bytes]) -> bytes:
        """``name``'s bytes: from this node when they are the record's (``sha256``; None: a
        process that opted in to unverified code takes what is there), else fetched once from
        the remote, checked, kept here (where the tier may not be used: fetched, checked, not
        kept). Raises Refused for fetched bytes that are not the record's, and whatever
        ``fetch`` raises (FileNotFoundError: the remote lacks it)."""
        if not self.usable():
            return self._fetch(name, sha256, fetch, keep=False)
        found = self._local(name, sha256)
        if found is not None:
            return found
        lock = self._lock_file(name)
        try:
            if lock is not None and not self._wait(lock):
                lock.close()
                lock = None  # another process has held it too long: fetch on our own
            if lock is not None:
                found = self._local(name, sha256)  # another process fetched it meanwhile
                if found is not None:
                    self.tier.counts.waited += 1
                    return found
            return self._fetch(name, sha256, fetch)
        finally:
            if lock is not None:
                lock.close()  # closing the descriptor releases the flock

    def _local(self, name: str, sha256: str | None) -> bytes | None:
        """The node's copy when it is the record's; a damaged one is removed (and said once)."""
        path = self.path(name)
        try:
            data = self._read(name)
            why = None
            if sha256 is not None and hashlib.sha256(data).hexdigest() != sha256:
                why = "its sha256 is not the verified record's"
        except OSError:
            return None
        except ValueError as exc:  # a link or a FIFO in an entry's place
            why = str(exc)
        if why is not None:
            self.tier.counts.damaged += 1
            self.tier.warn(
                f"cachectl: node cache file {path} is damaged ({why}): removed, fetching it again"
            )
            with contextlib.suppress(OSError):
                os.unlink(path)
            return None
        with contextlib.suppress(OSError):
            os.utime(path)  # the LRU clock: a read makes it recent
        self.tier.counts.hits += 1
        return data

    def _lock_file(self, name: str) -> BinaryIO | None:
        """The open lock file of ``name`` (not locked yet); None when the disk cannot hold one."""
        where = os.path.join(self.tier.root, LOCKS)
        digest = hashlib.sha256(self.path(name).encode()).hexdigest()[:32]
        try:
            with contextlib.suppress(FileExistsError):
                os.mkdir(where, DIR_MODE)
            # Relative to .locks opened as a directory, never through a link: neither .locks
            # nor the lock file can make this process create or open a file elsewhere.
            at = os.open(where, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
            try:
                fd = os.open(digest, os.O_RDWR | os.O_CREAT | _OPEN_FLAGS, 0o600, dir_fd=at)
            finally:
                os.close(at)
        except OSError as exc:
            self._unwritable(exc)
            return None
        if not stat.S_ISREG(os.fstat(fd).st_mode):  # a FIFO planted at the lock's name
            os.close(fd)
            self._unwritable(OSError(errno.EINVAL, f"{where}/{digest} is not a regular file"))
            return None
        return os.fdopen(fd, "r+b")

    def _wait(self, lock: BinaryIO) -> bool:
        """Hold ``lock``: at once, or once the process fetching the file is done (bounded)."""
        fd = lock.fileno()
        deadline = time.monotonic() + WAIT_S
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return True
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    self.tier.warn_once(
                        "wait",
                        f"cachectl: waited {WAIT_S:.0f} s for another process's fetch into "
                        f"{self.tier.root}: fetching on our own",
                    )
                    return False
                time.sleep(_POLL_S)
            except OSError:
                return False  # a file system without flock: no sharing of fetches

    def _fetch(
        self, name: str, sha256: str | None, fetch: Callable[[], bytes], keep: bool = True
    ) -> bytes:
        data = fetch()
        if sha256 is not None and hashlib.sha256(data).hexdigest() != sha256:
            raise Refused(
                errno.EIO, f"{name} from the remote differs from its verified record (sha256)"
            )
        self.tier.counts.fetched += 1
        if not keep or self.tier.refusal(self.directory, fresh=True) is not None:
            return data
        try:
            atomic_write(self.path(name), FILE_MODE, lambda fh: fh.write(data))
        except OSError as exc:
            self._unwritable(exc)
            return data
        self.tier.added(len(data))
        return data

    def _unwritable(self, exc: OSError) -> None:
        self.tier.counts.unwritable += 1
        full = exc.errno in (errno.ENOSPC, errno.EDQUOT)
        self.tier.warn_once(
            "unwritable",
            f"cachectl: node cache {self.tier.root} is "
            + ("full" if full else f"not writable ({exc.strerror or exc})")
            + ": reading from the remote without keeping a copy here",
        )
