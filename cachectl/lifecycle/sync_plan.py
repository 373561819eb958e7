"""`cachectl sync`'s plan: storage listed a namespace at a time and diffed against the index.

The listing (``Store.dir_stats``) stats no file on local disk: the planner stats only what it must
compare (``SyncPlanner``), and a real sync's reads settle the rest (``lifecycle/sync.py``). Its
plan is the one a dry run (``plan_sync``) makes.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import NamedTuple, Protocol

from cachectl.context import Context
from cachectl.core.errors import BadInput
from cachectl.core.fingerprint import Environment
from cachectl.index import CacheInfo, EnvironmentInfo
from cachectl.storage.entries import (
    CACHE_SUFFIX,
    ENV_FILE,
    EXECUTABLE_SUFFIX,
    Kind,
    classify,
    entry_file_matcher,
    entry_keys,
)
from cachectl.storage.namespace import QUARANTINE_DIR, read_env_json
from cachectl.storage.store import Store


@dataclass(slots=True)
class SyncEntry:
    """One file or row in a sync plan. Slots and no frozen ``__setattr__``: a plan builds one per new
    file (100,000 in a large first sync), at a quarter of a frozen dataclass's cost."""

    namespace: str
    key: str
    size: int | None  # None: a new entry whose size (and age) the read settles (``SyncPlanner``)
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
        return [
            f"{n.namespace}/{e.key}{EXECUTABLE_SUFFIX}"
            for n in self.namespaces
            for e in n.orphan_aot
        ]

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


def is_too_young(mtime: float | None, cutoff: float | None) -> bool:
    return cutoff is not None and mtime is not None and mtime > cutoff


# A file's (size, mtime in POSIX seconds) as the listing gave it; None where it did not stat
Seen = tuple[int | None, float | None]


class _OnDisk(NamedTuple):
    """A namespace's files as its plan needs them: entries and executables by key."""

    entries: dict[str, Seen]
    executables: dict[str, Seen]
    has_env: bool


def _on_disk(files: list[Stat]) -> _OnDisk:
    """Sort a namespace's files (in name order, so the plan's lists are in key order): an entry's
    key is its name less the suffix the match ended with (one comprehension: most files are entries)."""
    cut = -len(CACHE_SUFFIX)
    entries: dict[str, Seen]
    if (
        files and files[0][1] is None
    ):  # a local walk without stats: the keys alone, in one regex pass
        entries = dict.fromkeys(entry_keys([name for name, _, _ in files]), (None, None))
    else:
        is_entry = entry_file_matcher()
        entries = {rel[:cut]: (size, mtime) for rel, size, mtime in files if is_entry(rel)}
    executables: dict[str, Seen] = {}
    has_env = False
    if len(entries) < len(files):
        for rel, size, mtime in files:
            if rel == ENV_FILE:
                has_env = True
            elif rel.endswith(EXECUTABLE_SUFFIX) and classify(rel) is Kind.AOT:
                executables[rel[: -len(EXECUTABLE_SUFFIX)]] = size, mtime
    return _OnDisk(entries, executables, has_env)


class PlanReads(Protocol):
    """What planning reads of an index: sync's own (cachectl.index.sync_queries.SyncIndex) or
    any IndexBackend (the server's)."""

    def environment_stats(
        self, cache: str, *, include_deleted: bool = False
    ) -> list[EnvironmentInfo]: ...

    def entry_keys(self, env_id: int) -> dict[str, tuple[int, str]]: ...

    def aot_keys(self, env_id: int) -> dict[str, tuple[int, str]]: ...


class SyncPlanner:
    """A sync plan, built a namespace at a time as the listing reaches it (``namespaces``), then
    completed (``plan``) with what only the whole listing shows: environments gone and stray files.

    On local disk the listing stats no file: the planner stats the entries the index knows (their
    size says whether they changed) and the executables. A new entry's size and age are stat'ed too
    when ``settle`` is set; else they are left open (``SyncEntry.size`` None, in ``add``) for the
    read, whose descriptor's fstat gives them at no extra call (``_settle_read``). ``index``: what
    it reads (``ctx.index`` when None)."""

    def __init__(
        self,
        ctx: Context,
        cache: CacheInfo,
        min_age: timedelta,
        *,
        settle: bool = True,
        index: PlanReads | None = None,
    ) -> None:
        self.index: PlanReads = index if index is not None else ctx.index
        self.cache = cache
        self.store = Store(cache.root_url, cache.storage_options)
        self.store.check_reachable()
        self.known = {
            e.namespace: e for e in self.index.environment_stats(cache.name, include_deleted=True)
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
        on_disk = _on_disk(files)
        item = self._environment(ns_path, on_disk.has_env)
        if item.problem:
            return item
        row = self.known.get(ns_path)
        indexed = self.index.entry_keys(row.id) if row is not None else {}
        indexed_aot = self.index.aot_keys(row.id) if row is not None else {}
        self._stat_unlisted(
            ns_path, on_disk.entries, CACHE_SUFFIX, None if self.settle else indexed
        )
        self._stat_unlisted(ns_path, on_disk.executables, EXECUTABLE_SUFFIX, None)
        self._diff_entries(item, on_disk.entries, indexed)
        self._diff_executables(item, on_disk, indexed_aot)
        return item

    def _environment(self, ns_path: str, has_env: bool) -> NamespaceSync:
        """The namespace's plan, empty, from its env.json; one with a ``problem`` where that is
        missing, unreadable or names another namespace."""
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
        return NamespaceSync(
            ns_path, env.digest, env, new_environment=row is None or row.deleted_at is not None
        )

    def _diff_entries(
        self, item: NamespaceSync, on_disk: dict[str, Seen], indexed: dict[str, tuple[int, str]]
    ) -> None:
        """Entry files new, changed or too young, and rows whose file is gone."""
        ns_path, cutoff = item.namespace, self.cutoff
        add, update, too_young = item.add, item.update, item.too_young
        for key, (size, mtime) in on_disk.items():  # once per entry file: each lookup done once
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
            size, digest = indexed[key]
            item.drop.append(SyncEntry(ns_path, key, size, digest))

    def _diff_executables(
        self, item: NamespaceSync, on_disk: _OnDisk, indexed_aot: dict[str, tuple[int, str]]
    ) -> None:
        """Executables to record (new, changed, or their entry is), orphans, and columns to clear."""
        ns_path, entries = item.namespace, on_disk.entries
        changed = (
            {e.key for e in item.add} | {e.key for e in item.update}
            if on_disk.executables
            else set()
        )
        for key, (size, mtime) in sorted(on_disk.executables.items()):
            known = indexed_aot.get(key)
            differs = known is None or known[0] != size
            if key not in entries:
                item.orphan_aot.append(SyncEntry(ns_path, key, size))
            elif is_too_young(mtime, self.cutoff) and differs:
                item.too_young.append(SyncEntry(ns_path, f"{key}{EXECUTABLE_SUFFIX}", size))
            elif key in changed or differs:
                item.record_aot.append(SyncEntry(ns_path, key, size))
        for key in sorted(set(indexed_aot) - set(on_disk.executables)):
            if key in entries:  # a dropped row takes its executable columns with it
                size, digest = indexed_aot[key]
                item.clear_aot.append(SyncEntry(ns_path, key, size, digest))

    def _stat_unlisted(
        self,
        ns_path: str,
        files: dict[str, Seen],
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


def plan_sync(
    ctx: Context,
    cache: CacheInfo,
    *,
    min_age: timedelta = DEFAULT_MIN_AGE,
    index: PlanReads | None = None,
) -> SyncPlan:
    planner = SyncPlanner(ctx, cache, min_age, index=index)
    for _ in planner.namespaces():
        pass
    return planner.plan()
