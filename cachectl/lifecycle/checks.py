"""The checks of stored bytes that sync and verify share: an entry's header within a bound, and
verify's verdict on an indexed file (header, size and sha256 against its row).

Each file is read by a reader the caller holds (``Store.reader``, ``Store.dir_reader``), on
``store.read_workers`` threads: these functions run once per file and build no more than
their verdict.
"""

from __future__ import annotations

import hashlib
import itertools
import operator
from collections.abc import Callable, Iterator
from typing import NamedTuple

from cachectl.lifecycle.verify_records import CORRUPT, MISMATCH, MISSING
from cachectl.storage import executables
from cachectl.storage.entries import (
    CACHE_SUFFIX,
    EXECUTABLE_SUFFIX,
    CorruptEntry,
    check_entry_bytes,
    sha256,
)
from cachectl.storage.store import NotRegularFile, Store, ordered_map


class Check(NamedTuple):
    """The verdict on one file's bytes."""

    kind: str | None  # None: good
    detail: str
    nread: int  # bytes read


class EntryCheck(NamedTuple):
    """An indexed entry file to read and check against its row."""

    namespace: str
    key: str
    size: int
    sha256: str
    environment_id: int
    path: str  # relative to the root


class ExecutableCheck(NamedTuple):
    """An indexed stored executable to read and check against its entry's row."""

    namespace: str
    key: str
    size: int
    sha256: str
    environment_id: int
    entry_sha256: str  # the indexed sha256 of its entry, which its header must name


def _verdict(
    data: bytes, size: int, digest: str, corrupt: str | None, problems: list[str]
) -> Check:
    """The finding for one file's bytes: header problems first, then size and sha256 against the index."""
    if len(data) != size:
        problems.append(f"{len(data)} bytes, index says {size}")
    if sha256(data) != digest:
        problems.append("sha256 differs from the index")
    if corrupt:
        return Check(CORRUPT, "; ".join([corrupt, *problems]), len(data))
    if problems:
        return Check(MISMATCH, "; ".join(problems), len(data))
    return Check(None, "", len(data))


def check_entry(read: Callable[[str], bytes], path: str, size: int, digest: str) -> Check:
    """The finding for one indexed entry file (``read``: a reader of ``path``)."""
    try:
        data = read(path)
    except NotRegularFile:
        return Check(
            CORRUPT, "not a regular file (a symlink, or reached through one): never read", 0
        )
    except FileNotFoundError:
        return Check(MISSING, "file is gone", 0)
    try:
        check_entry_bytes(data)
    except CorruptEntry as exc:
        return _verdict(data, size, digest, str(exc), [])
    if len(data) == size and hashlib.sha256(data).hexdigest() == digest:
        return Check(None, "", size)  # most files: no lists, no second hash
    return _verdict(data, size, digest, None, [])


def entry_checks(store: Store, checks: list[EntryCheck], workers: int) -> Iterator[Check]:
    """``check_entry`` of each check, in order: a namespace's entries read by name through one
    directory reader (``Store.dir_reader``: its descriptor found once, not a path parsed per file)."""
    for ns, run in itertools.groupby(checks, key=operator.attrgetter("namespace")):
        with store.dir_reader(ns) as read:

            def check(c: EntryCheck, read: Callable[[str], bytes] = read) -> Check:
                return check_entry(read, f"{c.key}{CACHE_SUFFIX}", c.size, c.sha256)

            yield from ordered_map(check, list(run), workers)


def check_executable(read: Callable[[str], bytes], c: ExecutableCheck) -> Check:
    """The finding for one indexed stored executable."""
    try:
        data = read(f"{c.namespace}/{c.key}{EXECUTABLE_SUFFIX}")
    except FileNotFoundError:
        return Check(MISSING, "stored executable indexed, but no file in storage", 0)
    problems = []
    corrupt = None
    try:
        header = executables.read_header(data)
        if header.key != c.key:
            corrupt = f"stored executable header names key {header.key[:40]}…, not its file's"
        elif header.entry_sha256 != c.entry_sha256:
            problems.append(
                "made for other entry bytes (its entry_sha256 is not the indexed entry's)"
            )
    except CorruptEntry as exc:
        corrupt = str(exc)
    return _verdict(data, c.size, c.sha256, corrupt, problems)
