"""Reconcile storage and index: storage is the truth for what exists.

Entries JAX wrote straight into a namespace (services with write access) get
indexed; index rows whose files are gone are dropped; environments are rebuilt
from their env.json. One recursive listing of the root; file contents are
read only for entries that are new or changed size (through ``Store.reader``),
and their rows go to the index one namespace at a time (``index/sync_queries.py``)
while the next namespace's files are read on a thread.

A stored executable (``<key>-aot``) is recorded on its entry's row (size and
sha256 of the stored bytes); one whose ``-cache`` is missing is an orphan,
reported and never indexed (`cachectl verify --quarantine` moves it away);
a row whose ``-aot`` is gone has its executable columns cleared.
"""

from __future__ import annotations

import functools
import hashlib
import io
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import TypeVar

import zstandard

from cachectl.context import Context
from cachectl.entries import (
    _ZSTD_MAGIC,
    AOT_SUFFIX,
    CACHE_SUFFIX,
    ENV_FILE,
    CorruptEntry,
    Kind,
    classify,
    decompress_zstd,
    entry_file_matcher,
    header_seconds,
    scan_entry,
    sha256,
)
from cachectl.errors import BadInput
from cachectl.fingerprint import Environment
from cachectl.index import CacheInfo, Index
from cachectl.index.sync_queries import ObservedRow, insert_observed_rows, observed_entry
from cachectl.namespace import QUARANTINE_DIR, read_env_json
from cachectl.permissions import check_writer
from cachectl.store import Store, ordered_map, read_workers


@dataclass(slots=True)
class SyncEntry:
    """One file or row in a sync plan. Slots and no frozen ``__setattr__``: a plan builds one per new
    file (100,000 in a large first sync), at a quarter of a frozen dataclass's cost."""

    namespace: str
    key: str
    size: int
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
        return not (self.entries_to_add or self.entries_to_update or self.rows_to_drop
                    or self.environments_to_add or self.environments_gone
                    or self.executables_to_record or self.executables_to_clear)


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


T = TypeVar("T")


def _group_by_namespace(paths: Sequence[str], items: Sequence[T]) -> tuple[dict[str, list[tuple[str, T]]], list[str]]:
    """Split a root listing (its paths, and the item for each) into namespaces (jax-*/hw/digest16/...):
    (path in the namespace, item); and stray files."""
    groups: dict[str, list[tuple[str, T]]] = defaultdict(list)
    strays: list[str] = []
    # The listing is sorted: a namespace's files come together, so a path that starts with the
    # current namespace's prefix (one C call) is sliced once; only the first path of each namespace,
    # and strays, are split at their first three slashes.
    prefix, cut = None, 0
    members: list[tuple[str, T]] = []
    for path, item in zip(paths, items, strict=True):
        if prefix is not None and path.startswith(prefix):
            members.append((path[cut:], item))
            continue
        parts = path.split("/", 3)
        if parts[0] == QUARANTINE_DIR:
            continue
        if len(parts) == 4 and parts[0].startswith("jax-"):
            ns = f"{parts[0]}/{parts[1]}/{parts[2]}"
            prefix, cut, members = f"{ns}/", len(ns) + 1, groups[ns]
            members.append((parts[3], item))
        else:
            strays.append(path)
    return groups, strays


# A file JAX (or a copy) is still writing must not be indexed half-written.
DEFAULT_MIN_AGE = timedelta(minutes=5)


def plan_sync(ctx: Context, cache: CacheInfo, *, min_age: timedelta = DEFAULT_MIN_AGE) -> SyncPlan:
    store = Store(cache.root_url, cache.storage_options)
    store.check_reachable()
    # (path, size, mtime seconds): sizes and times are compared as numbers; objects are built only
    # for what the plan reports.
    listing = store.list_stats("")
    groups, strays = _group_by_namespace([f[0] for f in listing], listing)
    known = {e.namespace: e for e in ctx.index.environment_stats(cache.name, include_deleted=True)}
    namespaces: list[NamespaceSync] = []
    cutoff = (datetime.now(UTC) - min_age).timestamp() if min_age > timedelta(0) else None
    is_entry = entry_file_matcher()
    for ns_path in sorted(groups):
        files = groups[ns_path]
        on_disk: dict[str, tuple[int, float | None]] = {}
        aot_on_disk: dict[str, tuple[int, float | None]] = {}
        has_env = False
        for rel, (_, size, mtime) in files:
            # an entry's key is its name less the suffix the match ended with
            if is_entry(rel):
                on_disk[rel[: -len(CACHE_SUFFIX)]] = size, mtime
            elif rel == ENV_FILE:
                has_env = True
            elif classify(rel) is Kind.AOT:
                aot_on_disk[rel[: -len(AOT_SUFFIX)]] = size, mtime
        if not has_env:
            namespaces.append(NamespaceSync(ns_path, None, None, problem="no env.json: not a cachectl namespace"))
            continue
        try:
            env = read_env_json(store, ns_path)
        except (BadInput, FileNotFoundError) as exc:
            namespaces.append(NamespaceSync(ns_path, None, None, problem=str(exc)))
            continue
        if env.namespace != ns_path:
            namespaces.append(NamespaceSync(ns_path, env.digest, env,
                                            problem=f"env.json describes namespace {env.namespace}"))
            continue
        row = known.get(ns_path)
        item = NamespaceSync(ns_path, env.digest, env,
                             new_environment=row is None or row.deleted_at is not None)
        indexed = ctx.index.entry_keys(row.id) if row is not None else {}
        indexed_aot = ctx.index.aot_keys(row.id) if row is not None else {}
        changed: set[str] = set()
        add, update, too_young = item.add, item.update, item.too_young
        for key, (size, mtime) in sorted(on_disk.items()):  # once per entry file: the lookups are done once each
            known_row = indexed.get(key)
            if known_row is not None and known_row[0] == size:
                continue
            if cutoff is not None and mtime is not None and mtime > cutoff:
                too_young.append(SyncEntry(ns_path, key, size))
                continue
            (add if known_row is None else update).append(SyncEntry(ns_path, key, size))
            changed.add(key)
        for key in sorted(set(indexed) - set(on_disk)):
            item.drop.append(SyncEntry(ns_path, key, indexed[key][0], indexed[key][1]))
        for key, (size, mtime) in sorted(aot_on_disk.items()):
            young = cutoff is not None and mtime is not None and mtime > cutoff
            if key not in on_disk:
                item.orphan_aot.append(SyncEntry(ns_path, key, size))
            elif young and (key not in indexed_aot or indexed_aot[key][0] != size):
                too_young.append(SyncEntry(ns_path, f"{key}{AOT_SUFFIX}", size))
            elif key in changed or key not in indexed_aot or indexed_aot[key][0] != size:
                item.record_aot.append(SyncEntry(ns_path, key, size))
        for key in sorted(set(indexed_aot) - set(aot_on_disk)):
            if key in on_disk:  # a dropped row takes its executable columns with it
                item.clear_aot.append(SyncEntry(ns_path, key, indexed_aot[key][0], indexed_aot[key][1]))
        namespaces.append(item)
    gone = sorted(
        ns for ns, e in known.items() if e.deleted_at is None and ns not in groups
    )
    return SyncPlan(cache.name, store.url, namespaces, gone, strays)


# What entries.decompress() allows: sync and verify check any stored entry, however it got there.
MAX_EXPANDED_BYTES = 1 << 34
# Decompression output per step: big enough that a real entry (MBs) takes few steps, small
# enough that the buffer is not a fresh mmap for each of 100,000 small entries.
SCAN_CHUNK = 1 << 16


# A zstd frame declaring at most this many bytes is decompressed in one call: zstandard sizes
# its output from the declaration and fails if the frame holds more, so memory stays bounded.
ONE_SHOT_BYTES = 1 << 20


def check_entry_bytes(data: bytes) -> None:
    """An entry's header, checked with a bound (CorruptEntry otherwise): an entry that expands
    enormously (a decompression bomb) costs time here, never memory. Small zstd entries, most of
    a cache, take one decompress call and no Header (sync and verify need only the verdict, once
    per file); the rest one streaming pass."""
    if data[:4] == _ZSTD_MAGIC:
        try:
            declared = zstandard.frame_content_size(data[:18])
        except zstandard.ZstdError:
            declared = -1
        if 0 <= declared <= ONE_SHOT_BYTES:
            header_seconds(decompress_zstd(data))
            return
    scan_entry(io.BytesIO(data), MAX_EXPANDED_BYTES, chunk=SCAN_CHUNK)


def _module(key: str) -> str:
    """The module of a key planning matched against the key pattern (``parse_key(key).module`` without
    running it again): what precedes ``-<64 hex>``, which the pattern lets a final newline follow."""
    return key[:-66] if key.endswith("\n") else key[:-65]


def _observe(read: Callable[[str], bytes], namespace: str, key: str) -> ObservedRow | str | None:
    """The index row for one entry file (``read`` takes a name in ``namespace``); a one-line problem
    if it is not a whole entry; None if it is gone since planning (the next sync settles it). Runs
    on reader threads."""
    try:
        data = read(key + CACHE_SUFFIX)
    except FileNotFoundError:
        return None
    try:
        check_entry_bytes(data)
    except CorruptEntry as exc:
        return f"{namespace}/{key}{CACHE_SUFFIX}: {exc}"
    return key, _module(key), len(data), hashlib.sha256(data).hexdigest()


_Read = tuple[list[ObservedRow], list[str], dict[str, "tuple[int, str] | None"]]


def _read_namespace(store: Store, item: NamespaceSync) -> _Read:
    """One namespace's new and changed entries as index rows, the files that are not whole entries,
    and its executables to record or clear (None). A reader per namespace, by name in its directory:
    its descriptor is closed before the next namespace's is opened."""
    todo = item.add + item.update
    new_rows: list[ObservedRow] = []
    broken: list[str] = []
    with store.dir_reader(item.namespace) as read:
        observe = functools.partial(_observe, read, item.namespace)
        for seen in ordered_map(observe, [e.key for e in todo], read_workers(store, [e.size for e in todo])):
            if isinstance(seen, str):
                broken.append(seen)  # half-written or corrupt: never indexed (verify reports it)
            elif seen is not None:
                new_rows.append(seen)
        executables: dict[str, tuple[int, str] | None] = {e.key: None for e in item.clear_aot}
        for e in item.record_aot:
            try:
                data = read(f"{e.key}{AOT_SUFFIX}")
            except FileNotFoundError:
                executables[e.key] = None  # deleted since planning
                continue
            executables[e.key] = (len(data), sha256(data))
    return new_rows, broken, executables


def execute_sync(ctx: Context, cache: CacheInfo, plan: SyncPlan) -> SyncResult:
    """Carry out a plan; safe to re-run (every step is an upsert or a delete).

    The next namespace's files are read on a thread while this one's rows are written: the index
    work (SQLite's statements, a server's requests) runs without the GIL, so with a free core the
    two overlap. Every index call stays on this thread, in namespace order."""
    check_writer(cache, "sync")
    started = time.monotonic()
    store = Store(cache.root_url, cache.storage_options)
    envs_added = added = updated = dropped = gone = aot_recorded = aot_cleared = 0
    broken: list[str] = []
    todo = [item for item in plan.namespaces if not item.problem and item.environment is not None]
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="cachectl-sync") as ahead:
        pending = [ahead.submit(_read_namespace, store, todo[0])] if todo else []
        for n, item in enumerate(todo):
            assert item.environment is not None
            info = ctx.index.ensure_environment(cache.name, item.environment)
            envs_added += item.new_environment
            new_rows, bad, executables = pending.pop().result()
            if n + 1 < len(todo):
                pending.append(ahead.submit(_read_namespace, store, todo[n + 1]))
            broken += bad
            if isinstance(ctx.index, Index):
                ins, upd = insert_observed_rows(ctx.index, info.id, new_rows)
            else:  # the server's index, over HTTP
                ins, upd = ctx.index.upsert_entries(info.id, [observed_entry(r) for r in new_rows])
            added += ins
            updated += upd
            if item.drop:
                dropped += ctx.index.delete_entries(info.id, [e.key for e in item.drop])
            if executables:
                ctx.index.set_executables(info.id, executables)
                aot_recorded += sum(v is not None for v in executables.values())
                aot_cleared += sum(v is None for v in executables.values())
    for ns in plan.environments_gone:
        for env in ctx.index.environment_stats(cache.name):
            if env.namespace == ns:
                ctx.index.mark_environment_deleted(env.id)
                gone += 1
    duration = time.monotonic() - started
    ctx.index.audit(
        "sync", cache=cache.name, entries=added + updated + dropped,
        duration_ms=int(duration * 1000),
        details={"environments_added": envs_added, "entries_added": added, "entries_updated": updated,
                 "rows_dropped": dropped, "environments_marked_deleted": gone,
                 "executables_recorded": aot_recorded, "executables_cleared": aot_cleared,
                 "orphan_executables": len(plan.orphan_executables)},
    )
    return SyncResult(plan, envs_added, added, updated, dropped, gone, duration, False,
                      aot_recorded, aot_cleared, broken)


def sync(ctx: Context, cache: CacheInfo, *, dry_run: bool = False,
         min_age: timedelta = DEFAULT_MIN_AGE) -> SyncResult:
    if not dry_run:
        check_writer(cache, "sync")
    started = time.monotonic()
    plan = plan_sync(ctx, cache, min_age=min_age)
    if dry_run:
        return SyncResult(plan, plan.environments_to_add, plan.entries_to_add, plan.entries_to_update,
                          plan.rows_to_drop, len(plan.environments_gone), time.monotonic() - started, True,
                          plan.executables_to_record, plan.executables_to_clear)
    return execute_sync(ctx, cache, plan)
