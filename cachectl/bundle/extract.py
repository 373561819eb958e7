"""A bundle's members read off its stream into a staging directory, each one verified.

Install's hot loop, kept apart from what install decides (what a bundle must declare, what is
new, the commit: install.py): every member is checked against the bundle's content list
(listed, once, a regular file of its listed size, read only up to that size, its sha256) and
against ingest's rules for new bytes (storage/ingest_rules.py), before anything is visible.
Decompressing runs on the calling thread while worker threads hash, write and check the
members read before it; plain headers are parsed here rather than by tarfile (a third of an
install of small entries went to ``tarfile.next``: BENCHMARKS.md, "OCI").
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import tarfile
from collections import deque
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import IO, cast

from cachectl.bundle.format import (
    CHUNK,
    FILES,
    INLINE_MAX,
    BadBundle,
    ForwardOnly,
    Outcome,
    plain_header,
    ran_here,
    write_all,
)
from cachectl.storage import ingest_rules
from cachectl.storage.entries import CACHE_SUFFIX, parse_aot_filename

FILE_MODE = 0o644  # never world-writable, whatever the umask: readers run what these files hold
_WORKERS = 2  # threads hashing and writing members while the main thread decompresses
_IN_MEMORY_MAX = 16 << 20  # members up to this size are hashed and written in a worker thread
_IN_FLIGHT_MAX = 4 << 20  # bytes read but not yet written: more costs fresh pages (bench/fleet.py)


def _write_hashed(dir_fd: int, name: str, data: bytes) -> str:
    """Write ``data`` to a new file ``name`` in the directory ``dir_fd`` (no path to walk per
    member) and return its sha256 (in a worker: both release the GIL). One write and one hash
    call each: every GIL release in a worker can wait a switch interval for the decompressing
    thread to hand it back, so fewer, longer releases run faster."""
    fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, FILE_MODE, dir_fd=dir_fd)
    try:
        if (n := os.write(fd, data)) != len(data):
            write_all(fd, [memoryview(data)[n:]])
    finally:
        os.close(fd)
    return hashlib.sha256(data).hexdigest()


_TRUNCATED = "a member ends before its size: truncated bundle"


def _read_exactly(src: IO[bytes], size: int) -> bytes:
    """``size`` bytes of a member, never more (its tar header said ``size``, as its list does)."""
    data = src.read(size)
    if len(data) != size:
        raise BadBundle(_TRUNCATED)
    return data


def _stream_hashed(src: IO[bytes], dest: Path, size: int) -> str:
    """A member streamed to ``dest``, stopping at ``size`` bytes; its sha256."""
    digest = hashlib.sha256()
    left = size
    with os.fdopen(os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_EXCL, FILE_MODE), "wb") as dst:
        while left:
            chunk = src.read(min(CHUNK, left))
            if not chunk:
                raise BadBundle(_TRUNCATED)
            digest.update(chunk)
            dst.write(chunk)
            left -= len(chunk)
    return digest.hexdigest()


@contextlib.contextmanager
def _dir_fd(path: Path) -> Iterator[int]:
    """A directory open by fd, for creating its files without walking its path each time."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        yield fd
    finally:
        os.close(fd)


def _check_member(
    name: str,
    staged: bytes | Path,
    expected: dict[str, tuple[int, str]],
    modules: dict[str, str],
) -> int | None:
    """ingest's rules for one verified member, as for every new entry: an entry that decompresses
    into a JAX entry within the expansion bound (its header's compile time in ms; its size, the
    listed one, is within the cache's max entry size by install's ``_check_declared``); an executable intact
    and made for its key and its entry's listed bytes."""
    if name in modules:
        return ingest_rules.check_entry(staged)
    if (aot := parse_aot_filename(name)) is not None:
        data = staged if isinstance(staged, bytes) else staged.read_bytes()
        listed = expected.get(aot.key + CACHE_SUFFIX)
        ingest_rules.check_executable(aot.key, data, listed[1] if listed else None)
    return None


def extract(
    path: Path,
    tar: tarfile.TarFile,
    first: tarfile.TarInfo | None,
    expected: dict[str, tuple[int, str]],
    staging: Path,
    modules: dict[str, str],
) -> dict[str, int]:
    """Every member into ``staging``, each checked against the content list; BadBundle at the first
    that is not listed, repeated, not a file, of another size than listed (before a byte of it is
    read: a member is read only up to its listed size), or whose sha256 differs, and Refused for one
    that ingest's rules refuse. Decompressing runs here while worker threads hash, write and check
    the members read before. Returns each entry's compile time (ms) from its header."""
    seen: set[str] = set()
    pending: deque[tuple[str, int, Outcome[int | None]]] = deque()
    stream = cast(IO[bytes], tar.fileobj)  # open_bundle's ForwardOnly
    in_flight = 0
    header_ms: dict[str, int] = {}
    suffix = len(CACHE_SUFFIX)

    def stage(name: str, staged: bytes | Path, digest: str) -> int | None:
        if digest != expected[name][1]:
            raise BadBundle(
                f"{path}: {FILES}{name} does not match its sha256 in the content list "
                "(tampered or damaged): nothing installed"
            )
        try:
            return _check_member(name, staged, expected, modules)
        except ingest_rules.Refused as exc:
            raise BadBundle(f"{path}: {FILES}{name}: {exc.message}; nothing installed") from None

    def small(name: str, data: bytes) -> int | None:
        return stage(name, data, _write_hashed(into, name, data))  # no Path per member

    def streamed(name: str, src: IO[bytes], size: int) -> int | None:
        dest = staging / name
        return stage(name, dest, _stream_hashed(src, dest, size))

    def settle() -> int:
        name, size, done = pending.popleft()
        ms = done.result()
        if ms is not None:
            header_ms[name[:-suffix]] = ms
        return size

    with (
        _dir_fd(staging) as into,  # closed after the pool's last write
        ThreadPoolExecutor(max_workers=_WORKERS, thread_name_prefix="cachectl-bundle") as pool,
    ):
        for tar_name, is_file, tar_size, at, member in members(tar, first):
            name = _member_name(path, tar_name, is_file, tar_size, expected, seen)
            size = expected[name][0]
            seen.add(name)
            if size <= INLINE_MAX and not pending:
                # Nothing before it is still in a worker: checked here, its error raised now (in
                # member order). A bundle of small entries takes only this path, without an
                # outcome to queue and settle per member (BENCHMARKS.md, "OCI"). The stream stands
                # where a plain member's bytes start (``members`` read its header last).
                if member is not None:
                    stream.seek(at)
                if len(data := stream.read(size)) != size:  # _read_exactly, without a call
                    raise BadBundle(_TRUNCATED)
                if (ms := stage(name, data, _write_hashed(into, name, data))) is not None:
                    header_ms[name[:-suffix]] = ms
                continue
            done: Outcome[int | None]
            if size <= _IN_MEMORY_MAX:
                # Read where the member's bytes stand, as tar.extractfile's reader does (which
                # costs ~4 us a member more over an 8 KiB one): only forward, only its listed size.
                stream.seek(at)
                data = _read_exactly(stream, size)
                done = (
                    ran_here(small, name, data)
                    if size <= INLINE_MAX
                    else pool.submit(small, name, data)
                )
            else:
                src = tar.extractfile(member or _plain_info(tar_name, tar_size, at))
                assert src is not None
                done = ran_here(streamed, name, src, size)
            pending.append((name, size, done))
            in_flight += size
            while in_flight > _IN_FLIGHT_MAX:
                in_flight -= settle()
        while pending:
            settle()
    missing = sorted(set(expected) - seen)
    if missing:
        raise BadBundle(
            f"{path}: {len(missing)} file(s) of the content list are missing ({missing[0]}, ...): "
            "nothing installed"
        )
    return header_ms


def members(
    tar: tarfile.TarFile, first: tarfile.TarInfo | None
) -> Iterator[tuple[str, bool, int, int, tarfile.TarInfo | None]]:
    """(name, is a regular file, size, where its bytes start, TarInfo or None) of each member
    after ``first``'s, in order. A plain header (``plain_header``: what ``member_header`` writes)
    is parsed here off the stream, in one read with the padding before it and no TarInfo:
    tarfile's ``next`` cost a third of an install of 8 KiB entries (BENCHMARKS.md, "OCI"), and
    the stream then stands where its bytes start (no seek to them). Any
    other block is put back for tarfile to read, accept or refuse, as is every header once a
    global PAX header is in force (tarfile applies it to the members after it)."""
    stream = cast(ForwardOnly, tar.fileobj)
    member = first
    while member is not None:
        yield member.name, member.isfile(), member.size, member.offset_data, member
        while not tar.pax_headers:
            skip = tar.offset - stream.tell()  # the previous member's rest and padding
            if skip < 0:
                break  # tarfile's next refuses to go back
            block = stream.read(skip + tarfile.BLOCKSIZE)[skip:]
            plain = plain_header(block)
            if plain is None:
                stream.unread(block)
                break
            name, size = plain
            at = tar.offset + tarfile.BLOCKSIZE
            tar.offset = at + -(-size // tarfile.BLOCKSIZE) * tarfile.BLOCKSIZE
            yield name, True, size, at, None
        member = tar.next()


def _plain_info(name: str, size: int, at: int) -> tarfile.TarInfo:
    """The TarInfo of a member ``members`` parsed itself, for tar.extractfile."""
    info = tarfile.TarInfo(name)
    info.size, info.offset, info.offset_data = size, at - tarfile.BLOCKSIZE, at
    return info


def _member_name(
    path: Path,
    tar_name: str,
    is_file: bool,
    tar_size: int,
    expected: dict[str, tuple[int, str]],
    seen: set[str],
) -> str:
    """The listed file a member holds; BadBundle unless it is one, seen once, a regular file of
    its listed size (checked before a byte of it is read)."""
    if not tar_name.startswith(FILES):
        raise BadBundle(f"{path}: unexpected member {tar_name!r}: nothing installed")
    name = tar_name[len(FILES) :]
    if name not in expected or "/" in name or name in (".", ".."):
        raise BadBundle(
            f"{path}: {tar_name} is not in the bundle's content list: nothing installed"
        )
    if name in seen:
        raise BadBundle(f"{path}: {tar_name} appears twice: nothing installed")
    if not is_file:
        raise BadBundle(f"{path}: {tar_name} is not a regular file: nothing installed")
    size = expected[name][0]
    if tar_size != size:
        raise BadBundle(
            f"{path}: {tar_name} is {tar_size} bytes in the tar stream but {size} in "
            "the content list (tampered or damaged): nothing installed"
        )
    return name
