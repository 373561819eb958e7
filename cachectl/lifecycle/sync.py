"""Reconcile storage and index: storage is the truth for what exists.

Entries JAX wrote straight into a namespace (services with write access) get
indexed; index rows whose files are gone are dropped; environments are rebuilt
from their env.json. One walk of the root (``Store.dir_stats``, a directory at a
time); file contents are read only for entries that are new or changed size
(through ``Store.dir_reader``), and their rows go to the index a piece at a time
(``index/sync_queries.py``) while a thread plans and reads ahead: with an index
this process opens, the plan of each namespace is made there too, just before its
reads, and on local disk a new file's size and age come from its read's fstat
instead of a stat in the listing (``lifecycle/sync_plan.py``). The plan a real sync reports is
the one its dry run would have made.

A stored executable (``<key>-aot``) is recorded on its entry's row (size and
sha256 of the stored bytes); one whose ``-cache`` is missing is an orphan,
reported and never indexed (`cachectl verify --quarantine` moves it away);
a row whose ``-aot`` is gone has its executable columns cleared.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import queue
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, TypeVar

from cachectl.context import Context
from cachectl.core.bulk_pass import bulk_pass
from cachectl.core.errors import BadInput, NotFound
from cachectl.index import CacheInfo
from cachectl.index.protocol import IndexBackend
from cachectl.index.stdlib import StdlibReads
from cachectl.index.sync_queries import (
    ObservedRow,
    SyncIndex,
    insert_observed_rows,
    observed_entry,
    open_driver,
)
from cachectl.lifecycle.sync_plan import (
    DEFAULT_MIN_AGE,
    NamespaceSync,
    SyncEntry,
    SyncPlan,
    SyncPlanner,
    is_too_young,
    plan_sync,
)
from cachectl.storage.entries import (
    CACHE_SUFFIX,
    EXECUTABLE_SUFFIX,
    CorruptEntry,
    check_entry_bytes,
    sha256,
)
from cachectl.storage.node_tier import via_server
from cachectl.storage.store import Store, ordered_map, read_workers
from cachectl.trust import signing
from cachectl.trust.permissions import check_writer

T = TypeVar("T")


@dataclass(frozen=True)
class SyncResult:
    plan: SyncPlan
    environments_added: int
    entries_added: int
    entries_updated: int
    rows_dropped: int
    environments_marked_deleted: int
    duration_s: float
    dry_run: bool
    executables_recorded: int = 0
    executables_cleared: int = 0
    # Entries that failed the header check: not indexed.
    broken: list[str] = field(default_factory=list)
    # In a cache that trusts keys: files this sync indexed that no trusted key signed
    # (``namespace/file``). They stay out of the signed list; readers refuse them alone.
    unsigned: list[str] = field(default_factory=list)


def _module(key: str) -> str:
    """The module of a key planning matched against the key pattern (``parse_key(key).module`` without
    running it again): what precedes ``-<64 hex>``, which the pattern lets a final newline follow."""
    return key[:-66] if key.endswith("\n") else key[:-65]


def _observe(
    read: Callable[[str], tuple[bytes, float | None]],
    namespace: str,
    cutoff: float | None,
    entry: SyncEntry,
) -> ObservedRow | str | bool | None:
    """The index row for one entry file (``read`` takes a name in ``namespace``); a one-line problem
    if it is not a whole entry; None if it is gone since planning (the next sync settles it); True
    if the plan left its size and age open (``SyncEntry.size`` None: set here) and it is younger
    than ``cutoff``. Runs on reader threads (each entry on one)."""
    key = entry.key
    try:
        data, mtime = read(key + CACHE_SUFFIX)
    except FileNotFoundError:
        return None
    if entry.size is None:
        entry.size = len(data)
        if is_too_young(mtime, cutoff):
            return True
    try:
        check_entry_bytes(data)
    except CorruptEntry as exc:
        return f"{namespace}/{key}{CACHE_SUFFIX}: {exc}"
    return key, _module(key), len(data), hashlib.sha256(data).hexdigest()


# Entries read per piece: the index writes of one piece overlap the reads of the next, so the
# first read and the last write, which overlap nothing, stay short.
PIECE_ENTRIES = 2_000
# Rows per index transaction on an index this process opens (a namespace's last piece is written
# with what is held): each commit writes every page its rows touched, and new keys land all over the
# entries table's b-trees, so 2,000-row commits cost about twice the CPU of 10,000-row ones for
# 100,000 rows (bench/lifecycle.py).
WRITE_ROWS = 10_000
# New files whose sizes a namespace's first piece stats to choose its readers.
_SIZE_SAMPLE = 8


@dataclass(slots=True)
class _Piece:
    """Part of one namespace's reads: index rows of whole entries, files that are not whole entries;
    on the namespace's last piece, its executables to record or clear (None)."""

    item: NamespaceSync
    rows: list[ObservedRow]
    broken: list[str]
    executables: dict[str, tuple[int, str] | None] | None = None


def _readers(store: Store, namespace: str, chunk: list[SyncEntry], mean: int | None) -> int:
    """How many threads read ``chunk``: open sizes count as ``mean`` (the mean read so far), before
    any read as the mean of a few stat'ed. A namespace of big entries, whose hashing releases the
    GIL, reads on threads from its first piece."""
    if mean is None:
        some = [e.key + CACHE_SUFFIX for e in chunk[:_SIZE_SAMPLE] if e.size is None]
        sizes = [size for size, _ in store.stat_in_dir(namespace, some).values()] if some else []
        mean = sum(sizes) // len(sizes) if sizes else 0
    return read_workers(store, [mean if e.size is None else e.size for e in chunk])


def read_namespace(
    store: Store, item: NamespaceSync, cutoff: float | None = None, piece: int | None = None
) -> Iterator[_Piece]:
    """One namespace's new and changed entries, ``piece`` at a time, read by name through one
    directory reader (its descriptor is closed before the next namespace's is opened); the last
    piece carries the executables. Entries the plan left open get their size from the read, and
    move to ``too_young`` if the read's mtime is past ``cutoff``."""
    piece = piece or PIECE_ENTRIES
    todo = item.add + item.update
    young: set[str] = set()
    seen_bytes = seen_files = 0
    with store.dir_reader(item.namespace, times=True) as read:
        observe = functools.partial(_observe, read, item.namespace, cutoff)
        for start in range(0, len(todo), piece) or [0]:  # one empty piece where nothing is read
            chunk = todo[start : start + piece]
            rows: list[ObservedRow] = []
            broken: list[str] = []
            workers = _readers(
                store, item.namespace, chunk, seen_bytes // seen_files if seen_files else None
            )
            for entry, seen in zip(chunk, ordered_map(observe, chunk, workers), strict=True):
                if type(seen) is tuple:
                    rows.append(seen)
                    seen_bytes += seen[2]
                    seen_files += 1
                elif isinstance(seen, str):  # half-written or corrupt: never indexed (verify
                    broken.append(seen)  # reports it)
                elif seen:
                    young.add(entry.key)
            if start + piece < len(todo):
                yield _Piece(item, rows, broken)
        if young:  # the plan's lists as a plan that stat'ed every file would have them: entries
            # in name order, then executables
            entries = [e for e in item.too_young if not e.key.endswith(EXECUTABLE_SUFFIX)]
            entries += [e for e in item.add if e.key in young]
            entries.sort(key=lambda e: e.key + CACHE_SUFFIX)
            item.too_young = entries + [
                e for e in item.too_young if e.key.endswith(EXECUTABLE_SUFFIX)
            ]
            item.add = [e for e in item.add if e.key not in young]
        executables: dict[str, tuple[int, str] | None] = {e.key: None for e in item.clear_aot}
        for e in item.record_aot:
            try:
                data, _ = read(f"{e.key}{EXECUTABLE_SUFFIX}")
            except FileNotFoundError:
                executables[e.key] = None  # deleted since planning
                continue
            executables[e.key] = (len(data), sha256(data))
    yield _Piece(item, rows, broken, executables)


def _pieces(
    store: Store, items: Iterable[NamespaceSync], cutoff: float | None = None
) -> Iterator[_Piece]:
    for item in items:
        if not item.problem and item.environment is not None:
            yield from read_namespace(store, item, cutoff)


_DONE = object()


@contextlib.contextmanager
def _ahead(produce: Iterator[T], depth: int = 2) -> Iterator[Iterator[T]]:
    """``produce`` run on a thread, up to ``depth`` items ahead of the consumer; its exceptions are
    raised in the consumer, and leaving the block early stops it."""
    ready: queue.Queue[tuple[bool, Any]] = queue.Queue(maxsize=depth)
    stop = threading.Event()

    def put(item: tuple[bool, Any]) -> bool:
        while not stop.is_set():
            try:
                ready.put(item, timeout=0.05)
                return True
            except queue.Full:
                continue
        return False

    def run() -> None:
        try:
            with contextlib.closing(produce):  # type: ignore[type-var]
                for item in produce:
                    if not put((True, item)):
                        return
            put((True, _DONE))
        except BaseException as exc:  # noqa: BLE001 - handed to the consumer, which raises it
            put((False, exc))

    def consume() -> Iterator[T]:
        while True:
            ok, item = ready.get()
            if not ok:
                raise item
            if item is _DONE:
                return
            yield item

    worker = threading.Thread(target=run, name="cachectl-sync", daemon=True)
    worker.start()
    try:
        yield consume()
    finally:
        stop.set()
        worker.join()


@dataclass
class _Tally:
    environments_added: int = 0
    added: int = 0
    updated: int = 0
    dropped: int = 0
    recorded: int = 0
    cleared: int = 0
    broken: list[str] = field(default_factory=list)


def _write(
    ctx: Context,
    cache: CacheInfo,
    pieces: Iterable[_Piece],
    tally: _Tally,
    writes: SyncIndex | None,
) -> None:
    """The pieces' rows into the index, in order, on this thread: on an index this process opens
    (``writes``), WRITE_ROWS at a time and the rest with a namespace's last piece, with its drops
    and executables; else (the server's) a piece a request."""
    index: SyncIndex | IndexBackend = writes if writes is not None else ctx.index
    env_id, current = 0, None
    held: list[ObservedRow] = []  # rows read, not yet written: one namespace's, under WRITE_ROWS
    for piece in pieces:
        item = piece.item
        if item is not current:
            assert not held  # a namespace's last piece wrote them
            assert item.environment is not None
            if writes is not None:
                env_id = writes.ensure_environment(cache.name, item.environment)
            else:
                env_id = ctx.index.ensure_environment(cache.name, item.environment).id
            current = item
            tally.environments_added += item.new_environment
        tally.broken += piece.broken
        if writes is not None:
            held += piece.rows
            if len(held) < WRITE_ROWS and piece.executables is None:
                continue
            ins, upd = insert_observed_rows(writes, env_id, held)
            held = []
        else:  # the server's index, over HTTP: a piece a request, within its body limit
            ins, upd = ctx.index.upsert_entries(env_id, [observed_entry(r) for r in piece.rows])
        tally.added += ins
        tally.updated += upd
        if piece.executables is None:
            continue
        if item.drop:
            tally.dropped += index.delete_entries(env_id, [e.key for e in item.drop])
        if piece.executables:
            index.set_executables(env_id, piece.executables)
            tally.recorded += sum(v is not None for v in piece.executables.values())
            tally.cleared += sum(v is None for v in piece.executables.values())


def _finish(
    ctx: Context,
    cache: CacheInfo,
    plan: SyncPlan,
    tally: _Tally,
    started: float,
    writes: SyncIndex | None,
) -> SyncResult:
    index: SyncIndex | IndexBackend = writes if writes is not None else ctx.index
    gone = 0
    for ns in plan.environments_gone:
        for env in index.environment_stats(cache.name):
            if env.namespace == ns:
                index.mark_environment_deleted(env.id)
                gone += 1
    duration = time.monotonic() - started
    index.audit(
        "sync",
        cache=cache.name,
        entries=tally.added + tally.updated + tally.dropped,
        duration_ms=int(duration * 1000),
        details={
            "environments_added": tally.environments_added,
            "entries_added": tally.added,
            "entries_updated": tally.updated,
            "rows_dropped": tally.dropped,
            "environments_marked_deleted": gone,
            "executables_recorded": tally.recorded,
            "executables_cleared": tally.cleared,
            "orphan_executables": len(plan.orphan_executables),
        },
    )
    return SyncResult(
        plan,
        environments_added=tally.environments_added,
        entries_added=tally.added,
        entries_updated=tally.updated,
        rows_dropped=tally.dropped,
        environments_marked_deleted=gone,
        duration_s=duration,
        dry_run=False,
        executables_recorded=tally.recorded,
        executables_cleared=tally.cleared,
        broken=tally.broken,
        unsigned=_unsigned(ctx, cache, plan),
    )


def _unsigned(ctx: Context, cache: CacheInfo, plan: SyncPlan) -> list[str]:
    """The files this sync indexed that a cache with trusted keys has no signature for: sync never
    signs, so they are marked here, and every reader refuses exactly them. Read through
    ``ctx.index`` (the SQL index: only caches that trust keys load it), after every write."""
    if not cache.trusted_keys:
        return []
    out: list[str] = []
    for ns in plan.namespaces:
        touched = {e.key + CACHE_SUFFIX for e in (*ns.add, *ns.update)}
        touched |= {e.key + EXECUTABLE_SUFFIX for e in ns.record_aot}
        if not touched or ns.digest is None or ns.problem:
            continue
        try:
            env_info = ctx.index.get_environment(cache.name, ns.digest)
        except NotFound:
            continue
        names = signing.unsigned_files(ctx.index, cache, env_info) or []
        out += [f"{ns.namespace}/{name}" for name in sorted(set(names) & touched)]
    return out


def execute_sync(
    ctx: Context, cache: CacheInfo, plan: SyncPlan, writes: SyncIndex | None = None
) -> SyncResult:
    """Carry out a plan; safe to re-run (every step is an upsert or a delete). ``writes``: sync's
    own index (``open_sync_index``) where this process opens one, else None (the server's).

    Files are read on a thread a piece ahead of the index writes: the index work (SQLite's
    statements, a server's requests) runs without the GIL, so with a free core the two overlap.
    Every index call stays on this thread, in namespace order."""
    check_writer(cache, "sync")
    started = time.monotonic()
    store = Store(cache.root_url, cache.storage_options)
    tally = _Tally()
    with _ahead(_pieces(store, plan.namespaces)) as pieces:
        _write(ctx, cache, pieces, tally, writes)
    return _finish(ctx, cache, plan, tally, started, writes)


def _plan_and_execute(
    ctx: Context, cache: CacheInfo, min_age: timedelta, writes: SyncIndex
) -> SyncResult:
    """``execute_sync(plan_sync(...))`` with the plan made on the reading thread too, a namespace
    ahead of the writes (each namespace is planned whole before it is read): the listing, the
    diff and the reads run while the index writes the namespace before. Only for an index this
    process opens (its reads and writes serve both threads); the plan is the one ``plan_sync``
    makes."""
    started = time.monotonic()
    planner = SyncPlanner(ctx, cache, min_age, settle=False, index=writes)
    tally = _Tally()
    with _ahead(_pieces(planner.store, planner.namespaces(), planner.cutoff)) as pieces:
        _write(ctx, cache, pieces, tally, writes)
    return _finish(ctx, cache, planner.plan(), tally, started, writes)


def open_sync_index(ctx: Context) -> SyncIndex | None:
    """Sync's row writer for the index ``ctx.index`` opened (the one choice of driver is
    ``open_index``'s): the ``stdlib`` writer on the stdlib driver's SQLite connection, so the
    command never imports SQLAlchemy; the ``sqlalchemy`` writer on the SQL index; None with the
    server's index (server mode), which sync writes through its API. The caller closes it."""
    index = ctx.index
    if index.dialect == "remote":
        return None
    driver = None
    if isinstance(index, StdlibReads):
        driver = open_driver("stdlib", ctx.settings.db, index.reader)
    if driver is None:
        driver = open_driver("sqlalchemy", index.sql)
    return None if driver is None else SyncIndex(driver)


def sync(
    ctx: Context, cache: CacheInfo, *, dry_run: bool = False, min_age: timedelta = DEFAULT_MIN_AGE
) -> SyncResult:
    if via_server(ctx.settings, cache.root_url):
        raise BadInput(
            f"sync compares a root with the index, and the root of cache {cache.name!r} "
            f"({cache.root_url}) is on the server's machine, not here: this machine reads it "
            f"through {ctx.settings.server}. Run `cachectl sync` on that machine"
        )
    if not dry_run:
        check_writer(cache, "sync")
    started = time.monotonic()
    writes = open_sync_index(ctx)  # on a local SQLite index, the stdlib: no SQLAlchemy
    try:
        with bulk_pass():
            if not dry_run and writes is not None:
                return _plan_and_execute(ctx, cache, min_age, writes)
            plan = plan_sync(ctx, cache, min_age=min_age, index=writes)
            if not dry_run:
                return execute_sync(ctx, cache, plan)
    finally:
        if writes is not None:
            writes.close()
    return SyncResult(
        plan,
        environments_added=plan.environments_to_add,
        entries_added=plan.entries_to_add,
        entries_updated=plan.entries_to_update,
        rows_dropped=plan.rows_to_drop,
        environments_marked_deleted=len(plan.environments_gone),
        duration_s=time.monotonic() - started,
        dry_run=True,
        executables_recorded=plan.executables_to_record,
        executables_cleared=plan.executables_to_clear,
    )
