"""Reconcile storage and index: storage is the truth for what exists.

Entries JAX wrote straight into a namespace (services with write access) get
indexed; index rows whose files are gone are dropped; environments are rebuilt
from their env.json. One walk of the root (``Store.dir_stats``, a directory at a
time); file contents are read only for entries that are new or changed size
(through ``Store.dir_reader``), and their rows go to the index a piece at a time
(``index/sync_queries.py``) while a thread plans and reads ahead: with an index
this process opens, the plan of each namespace is made there too, just before its
reads, and on local disk a new file's size and age come from its read's fstat
instead of a stat in the listing (``_Planner``). The plan a real sync reports is
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
from datetime import UTC, datetime, timedelta
from typing import Any, TypeVar

from cachectl import signing
from cachectl.context import Context
from cachectl.entries import (
    AOT_SUFFIX,
    CACHE_SUFFIX,
    ENV_FILE,
    CorruptEntry,
    Kind,
    classify,
    entry_file_matcher,
    entry_keys,
    sha256,
)
from cachectl.errors import BadInput, NotFound
from cachectl.fingerprint import Environment
from cachectl.index import CacheInfo, Index
from cachectl.index.sync_queries import ObservedRow, insert_observed_rows, observed_entry
from cachectl.lifecycle.checks import check_entry_bytes
from cachectl.namespace import QUARANTINE_DIR, read_env_json
from cachectl.permissions import check_writer
from cachectl.store import Store, ordered_map, read_workers


@dataclass(slots=True)
class SyncEntry:
    """One file or row in a sync plan. Slots and no frozen ``__setattr__``: a plan builds one per new
    file (100,000 in a large first sync), at a quarter of a frozen dataclass's cost."""

    namespace: str
    key: str
    size: int | None  # None: a new entry whose size (and age) the read settles (``_Planner``)
    sha256: str | None = None


@dataclass
class NamespaceSync:
    namespace: str
    digest: str | None
    environment: Environment | None
    new_environment: bool = False
    add: list[SyncEntry] = field(default_factory=list)
    update: list[SyncEntry] = field(default_factory=list)
    drop: list[SyncEntry] = field(default_factory=list)
    problem: str | None = None
    # Stored executables: to (re)read and record on their entry's row, to clear from it,
    # and -aot files without their -cache (reported, not indexed).
    record_aot: list[SyncEntry] = field(default_factory=list)
    clear_aot: list[SyncEntry] = field(default_factory=list)
    # New or changed files younger than --min-age: maybe still being written; left for a later sync.
    too_young: list[SyncEntry] = field(default_factory=list)
    orphan_aot: list[SyncEntry] = field(default_factory=list)


@dataclass
class SyncPlan:
    cache: str
    root: str
    namespaces: list[NamespaceSync]
    environments_gone: list[str]
    stray_files: list[str]

    @property
    def entries_to_add(self) -> int:
        return sum(len(n.add) for n in self.namespaces)

    @property
    def entries_to_update(self) -> int:
        return sum(len(n.update) for n in self.namespaces)

    @property
    def rows_to_drop(self) -> int:
        return sum(len(n.drop) for n in self.namespaces)

    @property
    def environments_to_add(self) -> int:
        return sum(1 for n in self.namespaces if n.new_environment)

    @property
    def executables_to_record(self) -> int:
        return sum(len(n.record_aot) for n in self.namespaces)

    @property
    def executables_to_clear(self) -> int:
        return sum(len(n.clear_aot) for n in self.namespaces)

    @property
    def orphan_executables(self) -> list[str]:
        """-aot files whose entry is not in storage (paths relative to the root)."""
        return [f"{n.namespace}/{e.key}{AOT_SUFFIX}" for n in self.namespaces for e in n.orphan_aot]

    __json_extra__ = ("orphan_executables",)

    @property
    def empty(self) -> bool:
        return not (
            self.entries_to_add
            or self.entries_to_update
            or self.rows_to_drop
            or self.environments_to_add
            or self.environments_gone
            or self.executables_to_record
            or self.executables_to_clear
        )


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


# (name, size, mtime in POSIX seconds) as the listing gives it; size None: listed without stats
Stat = tuple[str, int | None, float | None]


def _namespace_files(
    dirs: Iterable[tuple[str, list[Stat]]], strays: list[str]
) -> Iterator[tuple[str, list[Stat]]]:
    """A root's directories (``Store.dir_stats``) as namespaces (jax-*/hw/digest16) with their files,
    named relative to the namespace; files outside any namespace are appended to ``strays``. The walk
    is depth first, so a namespace is whole when the next one starts: each is yielded then."""
    current: str | None = None
    files: list[Stat] = []
    for rel_dir, listed in dirs:
        parts = rel_dir.split("/", 3)
        if parts[0] == QUARANTINE_DIR:
            continue
        if len(parts) < 3 or not parts[0].startswith("jax-"):
            strays.extend(f"{rel_dir}/{name}" if rel_dir else name for name, _, _ in listed)
            continue
        ns = "/".join(parts[:3])
        if ns != current:
            if current is not None:
                yield current, files
            current, files = ns, []
        if len(parts) == 3:
            files.extend(listed)
        else:
            sub = f"{parts[3]}/"
            files.extend((sub + name, size, mtime) for name, size, mtime in listed)
    if current is not None:
        yield current, files


# A file JAX (or a copy) is still writing must not be indexed half-written.
DEFAULT_MIN_AGE = timedelta(minutes=5)


def _too_young(mtime: float | None, cutoff: float | None) -> bool:
    return cutoff is not None and mtime is not None and mtime > cutoff


class _Planner:
    """A sync plan, built a namespace at a time as the listing reaches it (``namespaces``), then
    completed (``plan``) with what only the whole listing shows: environments gone and stray files.

    On local disk the listing stats no file: the planner stats the entries the index knows (their
    size says whether they changed) and the executables. A new entry's size and age are stat'ed too
    when ``settle`` is set; else they are left open (``SyncEntry.size`` None, in ``add``) for the
    read, whose descriptor's fstat gives them at no extra call (``_settle_read``)."""

    def __init__(
        self, ctx: Context, cache: CacheInfo, min_age: timedelta, *, settle: bool = True
    ) -> None:
        self.index = ctx.index
        self.cache = cache
        self.store = Store(cache.root_url, cache.storage_options)
        self.store.check_reachable()
        self.known = {
            e.namespace: e for e in ctx.index.environment_stats(cache.name, include_deleted=True)
        }
        self.cutoff = (datetime.now(UTC) - min_age).timestamp() if min_age > timedelta(0) else None
        self.settle = settle
        self.strays: list[str] = []
        self.planned: list[NamespaceSync] = []

    def namespaces(self) -> Iterator[NamespaceSync]:
        for ns_path, files in _namespace_files(self.store.dir_stats("", stat=False), self.strays):
            item = self._plan_namespace(ns_path, files)
            self.planned.append(item)
            yield item

    def plan(self) -> SyncPlan:
        seen = {item.namespace for item in self.planned}
        gone = sorted(ns for ns, e in self.known.items() if e.deleted_at is None and ns not in seen)
        return SyncPlan(self.cache.name, self.store.url, self.planned, gone, self.strays)

    def _plan_namespace(self, ns_path: str, files: list[Stat]) -> NamespaceSync:
        is_entry = entry_file_matcher()
        # In name order, so the plan's lists are in key order; an entry's key is its name less the
        # suffix the match ended with (one comprehension: most of a namespace's files are entries).
        cut = -len(CACHE_SUFFIX)
        on_disk: dict[str, tuple[int | None, float | None]]
        if (
            files and files[0][1] is None
        ):  # a local walk without stats: the keys alone, in one regex pass
            on_disk = dict.fromkeys(entry_keys([f[0] for f in files]), (None, None))
        else:
            on_disk = {rel[:cut]: (size, mtime) for rel, size, mtime in files if is_entry(rel)}
        aot_on_disk: dict[str, tuple[int | None, float | None]] = {}
        has_env = False
        if len(on_disk) < len(files):
            for rel, size, mtime in files:
                if rel == ENV_FILE:
                    has_env = True
                elif rel.endswith(AOT_SUFFIX) and classify(rel) is Kind.AOT:
                    aot_on_disk[rel[: -len(AOT_SUFFIX)]] = size, mtime
        if not has_env:
            return NamespaceSync(
                ns_path, None, None, problem="no env.json: not a cachectl namespace"
            )
        try:
            env = read_env_json(self.store, ns_path)
        except (BadInput, FileNotFoundError) as exc:
            return NamespaceSync(ns_path, None, None, problem=str(exc))
        if env.namespace != ns_path:
            return NamespaceSync(
                ns_path, env.digest, env, problem=f"env.json describes namespace {env.namespace}"
            )
        row = self.known.get(ns_path)
        item = NamespaceSync(
            ns_path, env.digest, env, new_environment=row is None or row.deleted_at is not None
        )
        indexed = self.index.entry_keys(row.id) if row is not None else {}
        indexed_aot = self.index.aot_keys(row.id) if row is not None else {}
        self._stat_unlisted(ns_path, on_disk, CACHE_SUFFIX, None if self.settle else indexed)
        self._stat_unlisted(ns_path, aot_on_disk, AOT_SUFFIX, None)
        cutoff = self.cutoff
        add, update, too_young = item.add, item.update, item.too_young
        for key, (
            size,
            mtime,
        ) in on_disk.items():  # once per entry file: the lookups are done once each
            known_row = indexed.get(key)
            if known_row is not None and known_row[0] == size:
                continue
            if cutoff is not None and mtime is not None and mtime > cutoff:
                too_young.append(SyncEntry(ns_path, key, size))
            elif known_row is None:
                add.append(SyncEntry(ns_path, key, size))  # size None: settled when read
            else:
                update.append(SyncEntry(ns_path, key, size))
        for key in sorted(set(indexed) - set(on_disk)):
            item.drop.append(SyncEntry(ns_path, key, indexed[key][0], indexed[key][1]))
        changed = {e.key for e in add} | {e.key for e in update} if aot_on_disk else set()
        for key, (size, mtime) in sorted(aot_on_disk.items()):
            young = _too_young(mtime, cutoff)
            if key not in on_disk:
                item.orphan_aot.append(SyncEntry(ns_path, key, size))
            elif young and (key not in indexed_aot or indexed_aot[key][0] != size):
                too_young.append(SyncEntry(ns_path, f"{key}{AOT_SUFFIX}", size))
            elif key in changed or key not in indexed_aot or indexed_aot[key][0] != size:
                item.record_aot.append(SyncEntry(ns_path, key, size))
        for key in sorted(set(indexed_aot) - set(aot_on_disk)):
            if key in on_disk:  # a dropped row takes its executable columns with it
                item.clear_aot.append(
                    SyncEntry(ns_path, key, indexed_aot[key][0], indexed_aot[key][1])
                )
        return item

    def _stat_unlisted(
        self,
        ns_path: str,
        files: dict[str, tuple[int | None, float | None]],
        suffix: str,
        only: dict[str, tuple[int, str]] | None,
    ) -> None:
        """Sizes and times the listing left out, for the keys in ``only`` (every key if None); a file
        gone since the listing leaves ``files``."""
        if only is None:
            want = [key for key, (size, _) in files.items() if size is None]
        else:  # the index's keys, usually far fewer than the files on a first sync
            want = [key for key in only if key in files and files[key][0] is None]
        if not want:
            return
        found = self.store.stat_in_dir(ns_path, [key + suffix for key in want])
        for key in want:
            got = found.get(key + suffix)
            if got is None:
                del files[key]
            else:
                files[key] = got


def plan_sync(ctx: Context, cache: CacheInfo, *, min_age: timedelta = DEFAULT_MIN_AGE) -> SyncPlan:
    planner = _Planner(ctx, cache, min_age)
    for _ in planner.namespaces():
        pass
    return planner.plan()


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
        if _too_young(mtime, cutoff):
            return True
    try:
        check_entry_bytes(data)
    except CorruptEntry as exc:
        return f"{namespace}/{key}{CACHE_SUFFIX}: {exc}"
    return key, _module(key), len(data), hashlib.sha256(data).hexdigest()


# Entries read per piece: the index writes of one piece overlap the reads of the next, so the
# first read and the last write, which overlap nothing, stay short.
PIECE_ENTRIES = 2_000
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


def _read_namespace(
    store: Store, item: NamespaceSync, cutoff: float | None = None, piece: int = PIECE_ENTRIES
) -> Iterator[_Piece]:
    """One namespace's new and changed entries, ``piece`` at a time, read by name through one
    directory reader (its descriptor is closed before the next namespace's is opened); the last
    piece carries the executables. Entries the plan left open get their size from the read, and
    move to ``too_young`` if the read's mtime is past ``cutoff``."""
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
                elif isinstance(seen, str):
                    broken.append(
                        seen
                    )  # half-written or corrupt: never indexed (verify reports it)
                elif seen:
                    young.add(entry.key)
            if start + piece < len(todo):
                yield _Piece(item, rows, broken)
        if young:  # the plan's lists as a plan that stat'ed every file would have them: entries
            # in name order, then executables
            entries = [e for e in item.too_young if not e.key.endswith(AOT_SUFFIX)]
            entries += [e for e in item.add if e.key in young]
            entries.sort(key=lambda e: e.key + CACHE_SUFFIX)
            item.too_young = entries + [e for e in item.too_young if e.key.endswith(AOT_SUFFIX)]
            item.add = [e for e in item.add if e.key not in young]
        executables: dict[str, tuple[int, str] | None] = {e.key: None for e in item.clear_aot}
        for e in item.record_aot:
            try:
                data, _ = read(f"{e.key}{AOT_SUFFIX}")
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
            yield from _read_namespace(store, item, cutoff)


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


def _write(ctx: Context, cache: CacheInfo, pieces: Iterable[_Piece], tally: _Tally) -> None:
    """Each piece's rows into the index, in order, on this thread (a namespace's drops and
    executables with its last piece)."""
    env_id, current = 0, None
    for piece in pieces:
        item = piece.item
        if item is not current:
            assert item.environment is not None
            env_id, current = ctx.index.ensure_environment(cache.name, item.environment).id, item
            tally.environments_added += item.new_environment
        tally.broken += piece.broken
        if isinstance(ctx.index, Index):
            ins, upd = insert_observed_rows(ctx.index, env_id, piece.rows)
        else:  # the server's index, over HTTP
            ins, upd = ctx.index.upsert_entries(env_id, [observed_entry(r) for r in piece.rows])
        tally.added += ins
        tally.updated += upd
        if piece.executables is None:
            continue
        if item.drop:
            tally.dropped += ctx.index.delete_entries(env_id, [e.key for e in item.drop])
        if piece.executables:
            ctx.index.set_executables(env_id, piece.executables)
            tally.recorded += sum(v is not None for v in piece.executables.values())
            tally.cleared += sum(v is None for v in piece.executables.values())


def _finish(
    ctx: Context, cache: CacheInfo, plan: SyncPlan, tally: _Tally, started: float
) -> SyncResult:
    gone = 0
    for ns in plan.environments_gone:
        for env in ctx.index.environment_stats(cache.name):
            if env.namespace == ns:
                ctx.index.mark_environment_deleted(env.id)
                gone += 1
    duration = time.monotonic() - started
    ctx.index.audit(
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
        tally.environments_added,
        tally.added,
        tally.updated,
        tally.dropped,
        gone,
        duration,
        False,
        tally.recorded,
        tally.cleared,
        tally.broken,
        _unsigned(ctx, cache, plan),
    )


def _unsigned(ctx: Context, cache: CacheInfo, plan: SyncPlan) -> list[str]:
    """The files this sync indexed that a cache with trusted keys has no signature for: sync never
    signs, so they are marked here, and every reader refuses exactly them."""
    if not cache.trusted_keys:
        return []
    out: list[str] = []
    for ns in plan.namespaces:
        touched = {e.key + CACHE_SUFFIX for e in (*ns.add, *ns.update)}
        touched |= {e.key + AOT_SUFFIX for e in ns.record_aot}
        if not touched or ns.digest is None or ns.problem:
            continue
        try:
            env_info = ctx.index.get_environment(cache.name, ns.digest)
        except NotFound:
            continue
        names = signing.unsigned_files(ctx.index, cache, env_info) or []
        out += [f"{ns.namespace}/{name}" for name in sorted(set(names) & touched)]
    return out


def execute_sync(ctx: Context, cache: CacheInfo, plan: SyncPlan) -> SyncResult:
    """Carry out a plan; safe to re-run (every step is an upsert or a delete).

    Files are read on a thread a piece ahead of the index writes: the index work (SQLite's
    statements, a server's requests) runs without the GIL, so with a free core the two overlap.
    Every index call stays on this thread, in namespace order."""
    check_writer(cache, "sync")
    started = time.monotonic()
    store = Store(cache.root_url, cache.storage_options)
    tally = _Tally()
    with _ahead(_pieces(store, plan.namespaces)) as pieces:
        _write(ctx, cache, pieces, tally)
    return _finish(ctx, cache, plan, tally, started)


def _plan_and_execute(ctx: Context, cache: CacheInfo, min_age: timedelta) -> SyncResult:
    """``execute_sync(plan_sync(...))`` with the plan made on the reading thread too, a namespace
    ahead of the writes (each namespace is planned whole before it is read): the listing, the
    diff and the reads run while the index writes the namespace before. Only for an index this
    process opens (its engine serves both threads); the plan is the one ``plan_sync`` makes."""
    started = time.monotonic()
    planner = _Planner(ctx, cache, min_age, settle=False)
    tally = _Tally()
    with _ahead(_pieces(planner.store, planner.namespaces(), planner.cutoff)) as pieces:
        _write(ctx, cache, pieces, tally)
    return _finish(ctx, cache, planner.plan(), tally, started)


def sync(
    ctx: Context, cache: CacheInfo, *, dry_run: bool = False, min_age: timedelta = DEFAULT_MIN_AGE
) -> SyncResult:
    if not dry_run:
        check_writer(cache, "sync")
    started = time.monotonic()
    if not dry_run and isinstance(ctx.index, Index):
        return _plan_and_execute(ctx, cache, min_age)
    plan = plan_sync(ctx, cache, min_age=min_age)
    if dry_run:
        return SyncResult(
            plan,
            plan.environments_to_add,
            plan.entries_to_add,
            plan.entries_to_update,
            plan.rows_to_drop,
            len(plan.environments_gone),
            time.monotonic() - started,
            True,
            plan.executables_to_record,
            plan.executables_to_clear,
        )
    return execute_sync(ctx, cache, plan)
