"""What server/fast_lane.py keeps between requests, and the file it hands over.

``Bodies`` holds the answers to small GETs, so a repeat costs one ``fstatat``; ``Readers`` holds a
local root's directories opened once. Both are used on the event loop only, and each says what
makes a kept item stale. ``FileAnswer`` and ``OpenFd`` are a large GET's head and descriptor, as
server/zero_copy.py takes them. Apart from the lane's routing and checks, so each stays short.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

from cachectl.storage.entries import sha256
from cachectl.storage.store_local import LocalReader

# Small answers kept whole in memory (``Bodies``): at most this many bytes of bodies in all.
BODIES_MAX_BYTES = 32 * 1024 * 1024
# A file changed less than this long before it was read is not kept: a change within the same
# timestamp tick as the read could leave its ctime as it was ("racy" timestamps, as git has them).
SETTLED_NS = 2_000_000_000


@dataclass(frozen=True)
class FileAnswer:
    """A GET's head, and its file (an open descriptor the taker closes), ``size`` bytes of it."""

    head: bytes
    fd: int
    size: int


class OpenFd:
    """An open descriptor as server/zero_copy.py takes a file: ``fileno``, closed once sent."""

    __slots__ = ("fd",)

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def fileno(self) -> int:
        return self.fd

    def __enter__(self) -> OpenFd:
        return self

    def __exit__(self, *exc: object) -> None:
        os.close(self.fd)


def file_identity(st: os.stat_result) -> tuple[int, int, int, int, int]:
    """What changes whenever a file's bytes do (or another file takes its name): its device,
    inode, size, mtime and ctime (which no user can set back)."""
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


class Bodies:
    """The answers to small GETs (``answer_now``) kept in memory, so that a repeat costs one
    ``fstatat`` of the file (as a HEAD does) instead of an open, a read and a close, and no headers
    built again: what a 4 KiB GET cost over a HEAD (BENCHMARKS.md "Server against nginx").

    Safe by construction: a body is kept only when its bytes hash to the entry's recorded sha256
    and its file was last changed ``SETTLED_NS`` before it was read; it is sent only while the
    file's ``file_identity`` (now, from the ``fstatat``) and the recorded size and sha256 (from the
    index, each at most ``token_cache_s`` old) are the ones it was kept with. An entry replaced
    (a new inode) or written in place (a new ctime) is read again; one deleted is a 404, as
    before. Bounded by ``max_bytes`` (the oldest kept go first). Used on the event loop only."""

    def __init__(self, max_bytes: int = BODIES_MAX_BYTES) -> None:
        self.max_bytes = max_bytes
        self.size = 0
        # (root, rel) -> (file identity, recorded (size, sha256), the answer after its date line)
        self._items: dict[
            tuple[str, str], tuple[tuple[int, int, int, int, int], tuple[int, str], bytes]
        ] = {}

    def __contains__(self, where: tuple[str, str]) -> bool:
        return where in self._items

    def get(
        self, where: tuple[str, str], st: os.stat_result, recorded: tuple[int, str] | None
    ) -> bytes | None:
        item = self._items.get(where)
        if item is None:
            return None
        if item[1] == recorded and item[0] == file_identity(st):
            return item[2]
        self.drop(where)
        return None

    def drop(self, where: tuple[str, str]) -> None:
        item = self._items.pop(where, None)
        if item is not None:
            self.size -= len(item[2])

    def put(
        self,
        where: tuple[str, str],
        st: os.stat_result,
        recorded: tuple[int, str] | None,
        body: bytes,
        tail: bytes,
        read_at_ns: int,
    ) -> None:
        """Keep ``tail`` (the headers after the date, then ``body``) if ``body`` is the recorded
        entry's and its file ``st`` (an ``fstat`` after the read) had settled before the read."""
        if (
            recorded is None
            or len(tail) > self.max_bytes
            or recorded[0] != len(body)
            or st.st_size != len(body)
            or st.st_ctime_ns > read_at_ns - SETTLED_NS
            or st.st_mtime_ns > read_at_ns - SETTLED_NS
            or sha256(body) != recorded[1]
        ):
            return
        self.drop(where)
        while self._items and self.size + len(tail) > self.max_bytes:
            self.drop(next(iter(self._items)))
        self._items[where] = (file_identity(st), recorded, tail)
        self.size += len(tail)


class Readers:
    """A local root's directories opened once (``LocalReader``: no symlink followed, one
    ``fstatat`` or ``openat`` per request instead of an ``lstat`` per directory), for at most
    ``ttl_s``: a namespace deleted and made again is seen that much later (until then its entries
    are 404s, never another file's bytes). Used on the event loop only."""

    def __init__(self, ttl_s: float) -> None:
        self.ttl_s = ttl_s
        self._items: dict[str, tuple[LocalReader, float]] = {}

    def get(self, root: str) -> LocalReader:
        now = time.monotonic()
        item = self._items.get(root)
        if item is not None and item[1] >= now:
            return item[0]
        if item is not None:
            item[0].__exit__(None, None, None)
            del self._items[root]
        reader = LocalReader(root)
        if self.ttl_s > 0:
            self._items[root] = (reader, now + self.ttl_s)
        return reader

    def done(self, reader: LocalReader) -> None:
        """Close a reader that is not kept (``ttl_s`` 0)."""
        if self.ttl_s <= 0:
            reader.__exit__(None, None, None)
