"""The one way new entries and stored executables enter a cache (issue 12).

Every writer of new ``-cache``/``-aot`` objects (the server's uploads, ``push``,
``bundle install``) comes through here, so each rule is written once (the checks of 1 to 3
in ingest_rules.py, which writes nothing; the writes here):

1. the sha256 recorded is the one computed here from the bytes, never a client's claim
   (a claim that differs is refused);
2. an entry's size is within the cache's max entry size;
3. an entry decompresses into a JAX entry within a bound (``check_entry``: ``expansion_bound``
   of its size, in one streaming pass of ``scan_entry``, never decompressed whole in memory; a
   zstd frame that declares at most ``ONE_SHOT_BYTES`` within the bound, in one call);
   a stored executable is intact and made for this key and its entry's recorded bytes;
4. quota: a single upload reserves its row first (``server_queries.reserve_entry`` /
   ``reserve_executable``, the cache row locked) and gives it back when the write fails; a
   batch is checked whole before it writes (``server_queries.check_quota``);
5. the bytes are written atomically (``Store.write_file``/``write_bytes``, or a rename of a
   verified staging directory), entries before executables, and only then indexed, all rows
   of a batch in one ``upsert_entries`` call.

A refusal is ``Refused`` (ingest_rules.py) with the rule that refused it, so the server can answer with its
HTTP status and the CLI with one line.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import tempfile
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from cachectl.core import temps
from cachectl.core.errors import EntryConflict
from cachectl.core.fingerprint import Environment
from cachectl.index import CacheInfo, EntryInfo, EnvironmentInfo, Index, NewEntry
from cachectl.index import server_queries as sq
from cachectl.storage.entries import (
    CACHE_SUFFIX,
    ENV_FILE,
    EXECUTABLE_SUFFIX,
    EntryName,
)
from cachectl.storage.ingest_rules import (
    EXECUTABLE,
    MISMATCH,
    TOO_LARGE,
    Refused,
    check_claim,
    check_entry,
    check_executable,
    check_size,
)
from cachectl.storage.namespace import ensure_namespace
from cachectl.storage.store import Store


def is_disk_full(exc: BaseException) -> bool:
    """ENOSPC or EDQUOT: nothing was stored, and trying again elsewhere or later may work."""
    return isinstance(exc, OSError) and exc.errno in (
        errno.ENOSPC,
        getattr(errno, "EDQUOT", errno.ENOSPC),
    )


# -- bytes on their way in --------------------------------------------------------


class Spool:
    """Bytes streamed to a private temporary file, hashed as they arrive (never all in memory)."""

    def __init__(self, directory: str | None = None) -> None:
        fd, self.path = tempfile.mkstemp(prefix=temps.prefix(temps.SPOOL_PREFIX), dir=directory)
        self._fh = os.fdopen(fd, "wb")
        self._digest = hashlib.sha256()
        self.size = 0
        self.sha256 = ""

    def write(self, chunk: bytes) -> None:
        self.size += len(chunk)
        self._digest.update(chunk)
        self._fh.write(chunk)

    def finish(self) -> Spool:
        self._fh.close()
        self.sha256 = self._digest.hexdigest()
        return self

    def discard(self) -> None:
        self._fh.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)


# -- one upload: reserve, write, or give the reservation back -----------------------------


@dataclass(frozen=True)
class Target:
    """Where new objects go: the index, the cache (its rules), one environment, its store."""

    index: Index
    cache: CacheInfo
    env: EnvironmentInfo
    store: Store

    def path(self, key: str, suffix: str) -> str:
        return f"{self.env.namespace}/{key}{suffix}"


@dataclass(frozen=True)
class Ingested:
    """What one ingest did: ``inserted``, ``replaced`` or ``unchanged``; the entry's row after it."""

    outcome: str
    entry: EntryInfo | None
    size: int
    sha256: str


def _stored_size_is(store: Store, path: str, size: int) -> bool:
    try:
        return store.size(path) == size
    except FileNotFoundError:
        return False


def ingest_entry(
    t: Target,
    key: EntryName,
    body: Spool,
    *,
    origin: str,
    expand_to: int,
    claimed_sha256: str | None = None,
    claim_name: str = "sha256",
    replace_existing: bool = False,
    who: str | None = None,
) -> Ingested:
    """Check, reserve quota for, write and index one entry streamed to ``body``.

    EntryConflict when the key holds other bytes (unless ``replace_existing``: audited),
    QuotaExceeded, Refused; a failed write gives the reservation back.
    """
    check_claim(body.sha256, claimed_sha256, claim_name)
    check_size(t.cache, key.key, body.size)
    compile_ms = check_entry(body.path, expand_to)
    new = NewEntry(
        key=key.key,
        module=key.module,
        size=body.size,
        sha256=body.sha256,
        origin=origin,
        compile_time_ms=compile_ms,
    )
    reservation = sq.reserve_entry(t.index, t.cache.name, t.env.id, new, replace=replace_existing)
    path = t.path(key.key, CACHE_SUFFIX)
    try:
        if not t.store.exists(f"{t.env.namespace}/{ENV_FILE}"):
            # An environment recorded without its namespace (e.g. by a service that may not write):
            # storage must stay self-describing for sync and verify.
            ensure_namespace(t.store, t.env.environment, group=t.cache.group)
        if reservation.outcome != "unchanged" or not _stored_size_is(t.store, path, body.size):
            t.store.write_file(path, body.path)
    except BaseException:
        sq.release_entry(t.index, t.env.id, key.key, reservation)
        raise
    if reservation.outcome == "replaced" and reservation.previous is not None:
        prev = reservation.previous
        t.index.audit(
            "entry-overwrite",
            cache=t.cache.name,
            entries=1,
            nbytes=body.size,
            who=who,
            details={
                "environment": t.env.digest,
                "key": key.key,
                "old_sha256": prev.sha256,
                "new_sha256": body.sha256,
                "old_size": prev.size,
                "old_origin": prev.origin,
            },
        )
    return Ingested(
        reservation.outcome, t.index.get_entry(t.env.id, key.key), body.size, body.sha256
    )


def ingest_executable(
    t: Target,
    key: EntryName,
    body: Spool,
    *,
    claimed_sha256: str | None = None,
    claim_name: str = "sha256",
) -> Ingested:
    """Check, reserve quota for, write and record the stored executable of an indexed entry."""
    check_claim(body.sha256, claimed_sha256, claim_name)
    check_size(t.cache, key.key, body.size)
    with open(body.path, "rb") as fh:
        data = fh.read()  # bounded by the size limit; artifacts are a few KiB
    check_executable(key.key, data, None)
    entry = t.index.get_entry(t.env.id, key.key)
    if entry is None:
        raise Refused(
            f"no entry {key.key} in environment {t.env.digest[:16]}: "
            "upload the entry first, then its executable",
            EXECUTABLE,
        )
    check_executable(key.key, data, entry.sha256)
    previous = sq.reserve_executable(
        t.index, t.cache.name, t.env.id, key.key, body.size, body.sha256
    )
    try:
        t.store.write_file(t.path(key.key, EXECUTABLE_SUFFIX), body.path)
    except BaseException:
        sq.release_executable(t.index, t.env.id, key.key, previous)
        raise
    return Ingested(
        "replaced" if previous is not None else "inserted",
        t.index.get_entry(t.env.id, key.key),
        body.size,
        body.sha256,
    )


# -- a batch: push and bundle install ---------------------------------------------------


# An object's bytes in memory, or the path of a verified private staging file (a str where a
# batch has thousands: bundle install builds no Path per file).
Source = bytes | Path | str


@dataclass(frozen=True)
class NewObject:
    """One entry (and/or its stored executable) of a batch. ``entry``/``executable`` are the bytes
    (in memory) or a path to a verified private staging file; ``entry`` None means the namespace
    holds the entry already (``row`` then carries its size and sha256): it is indexed only with a
    new executable, or when ``in_storage`` says the entry is new to the index (warm: JAX wrote it)."""

    row: NewEntry
    entry: Source | None = None
    executable: Source | None = None
    in_storage: bool = False


def _bytes_of(source: Source) -> bytes:
    return source if isinstance(source, bytes) else Path(source).read_bytes()


def check_new(
    cache: CacheInfo, key: EntryName, data: bytes, *, origin: str, **fields: Any
) -> NewEntry:
    """The index row of entry bytes that pass the rules: size, a JAX entry within the expansion
    bound (one streaming pass, never the whole entry decompressed), the sha256 computed here."""
    check_size(cache, key.key, len(data))
    compile_ms = check_entry(data)
    fields.setdefault("compile_time_ms", compile_ms)
    return NewEntry(
        key=key.key,
        module=key.module,
        size=len(data),
        sha256=hashlib.sha256(data).hexdigest(),
        origin=origin,
        **fields,
    )


def check_fits(index: Any, cache: CacheInfo, env_id: int | None, added: int) -> None:
    """QuotaExceeded when ``added`` more bytes do not fit the cache's or the environment's limit
    (``env_id`` None: an environment not recorded yet), checked before anything is written; in
    server mode the server holds the limits."""
    if has_limits(index, cache):
        sq.check_quota(index.sql, cache.name, env_id if env_id is not None else -1, added)


def has_limits(index: Any, cache: CacheInfo) -> bool:
    """Whether ``check_fits`` has a limit to check here: a size limit on the cache or on its
    environments, held by this index (in server mode the server holds them)."""
    return index.dialect != "remote" and (
        cache.max_size is not None or cache.env_max_size is not None
    )


@dataclass(frozen=True)
class Published:
    rows: list[NewEntry]  # what was indexed
    failed: dict[
        str, tuple[str, Exception]
    ]  # key -> (which object, "entry" or "executable"; the error)


def publish(
    index: Any,
    cache: CacheInfo,
    env: Environment,
    env_id: int,
    store: Store,
    objects: Iterable[NewObject],
    *,
    staging: Path | None = None,
    parallel: Callable[[Callable[[str], int], list[str]], list[tuple[str, Any]]] | None = None,
    quota: bool = True,
    namespace_ready: bool = False,
) -> Published:
    """Write a batch's checked objects, entries before executables, then index them in one call.

    Every object's sha256 and size are its row's (the caller computed them with check_new or
    verified them against a signed list). Refused (an entry above the max entry size) or
    QuotaExceeded, before anything is written, when the batch does not fit the cache's or the environment's limit. With ``staging`` (a private directory of verified files on
    the namespace's file system, for a namespace that does not exist yet) the whole namespace
    appears at once by one rename. ``parallel`` runs the writes in threads (mirror.parallel).
    Warm passes ``quota=False`` (a cache's size limits are gc's to enforce after a warm; JAX wrote
    the entry already) and ``namespace_ready=True`` (it made the namespace before compiling).
    """
    objects = list(objects)
    for o in objects:
        if o.entry is not None:
            check_size(cache, o.row.key, o.row.size)
    added = sum(o.row.size for o in objects if o.entry is not None)
    added += sum(o.row.aot_size or 0 for o in objects if o.executable is not None)
    if quota:
        check_fits(index, cache, env_id, added)
    run = parallel or (lambda fn, keys: [(k, _guarded(fn, k)) for k in keys])
    failed: dict[str, tuple[str, Exception]] = {}
    renamed = (
        staging is not None
        and store.is_local
        and not store.exists(env.namespace)
        and _rename_staging(staging, store, cache, env, objects)
    )
    if not renamed:
        if not namespace_ready:
            ensure_namespace(store, env, group=cache.group)
        failed = _write_objects(store, env.namespace, objects, run)
    rows = _rows(objects, failed)
    if rows:
        index.upsert_entries(env_id, rows)
    return Published(rows, failed)


def _rename_staging(
    staging: Path, store: Store, cache: CacheInfo, env: Environment, objects: list[NewObject]
) -> bool:
    """A new namespace from its staging directory: what the batch does not write is removed
    first, then one rename makes every file appear at once. False when the namespace appeared
    after the caller looked (another install's rename won): the batch is then written into it
    file by file, as into any namespace that exists."""
    keep = {o.row.key + CACHE_SUFFIX for o in objects if o.entry is not None}
    keep |= {o.row.key + EXECUTABLE_SUFFIX for o in objects if o.executable is not None}
    for name in os.listdir(staging):
        if name != ENV_FILE and name not in keep:
            os.unlink(staging / name)
    final = Path(store.url_for(env.namespace))
    final.parent.mkdir(parents=True, exist_ok=True)
    os.chmod(staging, 0o2775 if cache.group else 0o755)
    try:
        os.rename(staging, final)
    except OSError as exc:
        if exc.errno not in (errno.ENOTEMPTY, errno.EEXIST):
            raise
        return False
    ensure_namespace(store, env, group=cache.group)
    return True


def _write_objects(
    store: Store,
    ns: str,
    objects: list[NewObject],
    run: Callable[[Callable[[str], int], list[str]], list[tuple[str, Any]]],
) -> dict[str, tuple[str, Exception]]:
    """Write the entries, then the executables beside them (through ``run``); what failed, by key."""
    by_key = {o.row.key: o for o in objects}
    failed: dict[str, tuple[str, Exception]] = {}

    def writer(suffix: str, attr: str) -> Callable[[str], int]:
        def write(key: str) -> int:
            source = getattr(by_key[key], attr)
            if not isinstance(source, bytes) and store.is_local:
                os.replace(source, store.url_for(f"{ns}/{key}{suffix}"))
                return 0
            data = _bytes_of(source)
            store.write_bytes(f"{ns}/{key}{suffix}", data)
            return len(data)

        return write

    for key, outcome in run(
        writer(CACHE_SUFFIX, "entry"), [o.row.key for o in objects if o.entry is not None]
    ):
        if isinstance(outcome, Exception):
            failed[key] = ("entry", outcome)
    # An executable only beside its entry: never one whose entry failed to be written.
    aot_keys = [o.row.key for o in objects if o.executable is not None and o.row.key not in failed]
    for key, outcome in run(writer(EXECUTABLE_SUFFIX, "executable"), aot_keys):
        if isinstance(outcome, Exception):
            failed[key] = ("executable", outcome)
    return failed


def _rows(objects: list[NewObject], failed: dict[str, tuple[str, Exception]]) -> list[NewEntry]:
    """The index rows of what is new and was written: an executable's columns only when it was."""
    rows = []
    for o in objects:
        kind = failed.get(o.row.key, ("", None))[0]
        if kind == "entry":
            continue
        row = o.row
        if kind == "executable" or o.executable is None:
            if row.aot_size is not None or row.aot_sha256 is not None:
                row = replace(row, aot_size=None, aot_sha256=None)
            if o.entry is None and not o.in_storage:
                continue  # nothing new for this key
        rows.append(row)
    return rows


def _guarded(fn: Callable[[str], int], key: str) -> int | Exception:
    try:
        return fn(key)
    except Exception as exc:  # noqa: BLE001 - reported per object
        return exc


# -- a registration: entries a writer stored itself -------------------------------------


def _storage_sha256(store: Store, path: str) -> str:
    digest = hashlib.sha256()
    with store.open(path, "rb") as fh:
        while block := fh.read(1 << 20):
            digest.update(block)
    return digest.hexdigest()


def _stored(t: Target, key: str, suffix: str, size: int, sha: str, what: str) -> str:
    """The sha256 of ``what`` of ``key`` as storage holds it; Refused unless it has ``size`` and ``sha``."""
    path = t.path(key, suffix)
    try:
        stored_size = t.store.size(path)
    except FileNotFoundError:
        raise Refused(
            f"{what} is not in storage"
            + (f" at {t.env.namespace}" if suffix == CACHE_SUFFIX else "")
            + ": write it first",
            MISMATCH,
        ) from None
    if stored_size != size:
        raise Refused(f"{what} is {stored_size} bytes in storage, not {size}", MISMATCH)
    if (
        suffix == CACHE_SUFFIX
        and t.cache.max_entry_size is not None
        and size > t.cache.max_entry_size
    ):
        raise Refused(
            f"{what} ({size} bytes) is above cache {t.cache.name!r}'s max entry size "
            f"({t.cache.max_entry_size} bytes)",
            TOO_LARGE,
        )
    stored_sha = _storage_sha256(t.store, path)  # what is recorded: never the claim
    if stored_sha != sha:
        raise Refused(f"{what} has sha256 {stored_sha} in storage, not the {sha} sent", MISMATCH)
    return stored_sha


def register_stored(
    t: Target,
    claims: list[NewEntry],
    *,
    run_environment_id: int | None = None,
    replace_existing: bool = False,
    who: str | None = None,
) -> tuple[int, int]:
    """Index entries (and stored executables) a writer stored itself, each checked against storage:
    size, the max entry size, and the sha256 computed here from storage's bytes. EntryConflict for a
    key recorded with other bytes unless ``replace_existing`` (audited). Returns (inserted, updated)."""
    rows = []
    for e in claims:
        sha = _stored(t, e.key, CACHE_SUFFIX, e.size, e.sha256, f"entry {e.key}")
        if (e.aot_size is None) != (e.aot_sha256 is None):
            raise Refused(f"entry {e.key}: give both aot_size and aot_sha256, or neither", MISMATCH)
        aot_sha = None
        if e.aot_size is not None and e.aot_sha256 is not None:
            aot_sha = _stored(
                t,
                e.key,
                EXECUTABLE_SUFFIX,
                e.aot_size,
                e.aot_sha256,
                f"stored executable of {e.key}",
            )
        rows.append(replace(e, sha256=sha, aot_sha256=aot_sha))
    if run_environment_id is not None and run_environment_id != t.env.id:
        raise Refused(f"warm run {claims[0].warm_run_id} belongs to another environment", MISMATCH)
    # The claimed keys' rows only: a registration of a few entries into a namespace of many
    # thousands read every row of it before (BENCHMARKS.md, "Planning").
    known = {
        k: (h.size, h.sha256)
        for k, h in t.index.held_entries(t.env.id, [n.key for n in rows]).items()
    }
    changed = [n for n in rows if n.key in known and known[n.key] != (n.size, n.sha256)]
    if changed and not replace_existing:
        raise EntryConflict(
            f"entry {changed[0].key} is already recorded with other bytes "
            f"(sha256 {known[changed[0].key][1][:16]}): entries are immutable"
        )
    inserted, updated = t.index.upsert_entries(t.env.id, rows)
    for n in changed:
        t.index.audit(
            "entry-overwrite",
            cache=t.cache.name,
            entries=1,
            nbytes=n.size,
            who=who,
            details={
                "environment": t.env.digest,
                "key": n.key,
                "old_sha256": known[n.key][1],
                "new_sha256": n.sha256,
                "old_size": known[n.key][0],
                "via": "register",
            },
        )
    return inserted, updated
