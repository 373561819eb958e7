"""Deletion plans and the one engine that carries them out, for prune and gc.

A plan is built from index queries only, shown (table or JSON), and stops
there on --dry-run. Execution deletes from storage first and from the index
second, batch by batch: a namespace as one recursive delete, entries in
batches of at most 1000 paths, one ``rm`` call per batch (S3 DeleteObjects of
up to 1000 keys; GCS batch requests). A run killed between the two steps
leaves index rows whose files are gone, never files without rows, and the
same selection re-run finishes the job (deleting a missing file is a no-op);
`cachectl sync` reconciles anything else.

An entry and its stored executable (``<key>-aot``) are one unit: deleted in
the same batch, counted together in every size.
"""

from __future__ import annotations

import os
import posixpath
import signal
import time
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, overload

from cachectl.config import DELETE_BATCH
from cachectl.entries import AOT_SUFFIX, ATIME_SUFFIX, CACHE_SUFFIX, LOCKFILE
from cachectl.index import Index
from cachectl.index.lifecycle_queries import delete_entry_rows
from cachectl.lifecycle.lease import Lease
from cachectl.store import Store

# Test hooks, read only by the executor: kill this process (SIGKILL) right
# after the Nth storage batch, before the index learns of it — the worst
# moment to crash; and sleep after each batch, so a test can overlap runs.
CRASH_HOOK = "CACHECTL_TEST_CRASH_AFTER_BATCHES"
DELAY_HOOK = "CACHECTL_TEST_BATCH_DELAY_S"


@dataclass(frozen=True, slots=True)
class PlannedEntry:
    """One entry file to delete, with its stored executable (``-aot``) when it has one, plus
    its -atime sidecar where JAX eviction is on."""

    environment_id: int
    namespace: str
    key: str
    size: int  # the JAX entry's bytes
    reason: str
    aot_size: int | None = None  # the stored executable's bytes, deleted with the entry

    __json_extra__ = ("bytes", "files")

    @property
    def bytes(self) -> int:
        """What deleting this unit frees: the entry and its executable."""
        return self.size + (self.aot_size or 0)

    @property
    def files(self) -> list[str]:
        """The files deleted, relative to the cache root (the -atime sidecar aside)."""
        out = [f"{self.namespace}/{self.key}{CACHE_SUFFIX}"]
        if self.aot_size is not None:
            out.append(f"{self.namespace}/{self.key}{AOT_SUFFIX}")
        return out


class PlannedEntries(Sequence[PlannedEntry]):
    """A plan's entries kept as the rows a query returned, each ``PlannedEntry`` built when it is
    read: a gc plan of 200k entries builds none while planning (the table reads 50; executing and
    --json read each once, as they would read a list). Equal to a list of the same entries."""

    __slots__ = ("_rows", "_make", "_bytes")

    def __init__(
        self,
        rows: Sequence[tuple[Any, ...]],
        make: Callable[[tuple[Any, ...]], PlannedEntry],
        total_bytes: int,
    ) -> None:
        self._rows, self._make, self._bytes = rows, make, total_bytes

    @property
    def total_bytes(self) -> int:
        """What deleting them all frees (the entries and their executables), known without a pass."""
        return self._bytes

    def __len__(self) -> int:
        return len(self._rows)

    @overload
    def __getitem__(self, i: int) -> PlannedEntry: ...
    @overload
    def __getitem__(self, i: slice) -> list[PlannedEntry]: ...
    def __getitem__(self, i: int | slice) -> PlannedEntry | list[PlannedEntry]:
        if isinstance(i, slice):
            return [self._make(row) for row in self._rows[i]]
        return self._make(self._rows[i])

    def __iter__(self) -> Iterator[PlannedEntry]:
        return map(self._make, self._rows)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Sequence) or isinstance(other, (str, bytes)):
            return NotImplemented
        return len(self) == len(other) and all(a == b for a, b in zip(self, other, strict=True))

    __hash__ = None  # type: ignore[assignment]  # mutable-equal like a list

    def __repr__(self) -> str:
        return f"PlannedEntries({len(self)} entries)"


@dataclass(frozen=True)
class PlannedNamespace:
    """A namespace deleted as one unit; its environment row is marked deleted."""

    environment_id: int
    digest: str
    namespace: str
    jax_version: str
    entries: int
    bytes: int
    reason: str


@dataclass(frozen=True)
class Protected:
    """Something the plan leaves alone on purpose, and why."""

    namespace: str
    reason: str
    entries: int = 0
    bytes: int = 0


@dataclass
class DeletionPlan:
    """What prune or gc will delete: namespaces whole, entries one by one."""

    operation: str
    cache: str
    root: str
    criteria: dict[str, Any]
    namespaces: list[PlannedNamespace] = field(default_factory=list)
    entries: Sequence[PlannedEntry] = field(default_factory=list)  # gc: a PlannedEntries
    protected: list[Protected] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    __json_extra__ = ("entry_count", "bytes_to_free")

    @property
    def entry_count(self) -> int:
        return sum(n.entries for n in self.namespaces) + len(self.entries)

    @property
    def bytes_to_free(self) -> int:
        entries = self.entries
        freed = (
            entries.total_bytes
            if isinstance(entries, PlannedEntries)
            else sum(e.bytes for e in entries)
        )
        return sum(n.bytes for n in self.namespaces) + freed

    @property
    def empty(self) -> bool:
        return not (self.namespaces or self.entries)


@dataclass(frozen=True)
class ExecutionResult:
    namespaces_deleted: int
    entries_deleted: int
    bytes_freed: int
    storage_calls: int
    index_rows_removed: int
    duration_s: float


def _hook_int(name: str) -> int:
    try:
        return int(os.environ.get(name, "0") or 0)
    except ValueError:
        return 0


def _hook_float(name: str) -> float:
    try:
        return float(os.environ.get(name, "0") or 0)
    except ValueError:
        return 0.0


class _Hooks:
    def __init__(self) -> None:
        self.crash_after = _hook_int(CRASH_HOOK)
        self.delay = _hook_float(DELAY_HOOK)
        self.batches = 0

    def after_storage_batch(self) -> None:
        self.batches += 1
        if self.crash_after and self.batches >= self.crash_after:
            os.kill(os.getpid(), signal.SIGKILL)

    def after_batch(self) -> None:
        if self.delay:
            time.sleep(self.delay)


def _entry_batches(
    entries: Sequence[PlannedEntry], sidecar_ns: set[str], batch_size: int
) -> Iterator[tuple[list[PlannedEntry], list[str]]]:
    """Entries grouped so each batch holds at most ``batch_size`` paths."""
    batch: list[PlannedEntry] = []
    paths: list[str] = []
    for e in entries:
        mine = e.files
        if e.namespace in sidecar_ns:
            mine.append(f"{e.namespace}/{e.key}{ATIME_SUFFIX}")
        if paths and len(paths) + len(mine) > batch_size:
            yield batch, paths
            batch, paths = [], []
        batch.append(e)
        paths.extend(mine)
    if batch:
        yield batch, paths


def _remove_empty_parents(store: Store, namespace: str) -> None:
    """Local disk: drop the jax-*/hw-* directories a namespace delete left empty."""
    if not store.is_local:
        return
    parent = posixpath.dirname(namespace)
    while parent:
        try:
            os.rmdir(store.url_for(parent))
        except OSError:
            return
        parent = posixpath.dirname(parent)


# Namespaces deleted at once: each recursive delete waits on the filesystem (or the network), and
# separate directories do not serialize on one directory's lock the way one directory's unlinks do.
TREE_WORKERS = 4


def _deleted_trees(
    store: Store, namespaces: Sequence[PlannedNamespace]
) -> Iterator[PlannedNamespace]:
    """Delete the namespaces' trees on a few threads; yield each, in plan order, once its files are
    gone, so the caller updates the index for it only after its storage. A crash meanwhile leaves
    at worst other namespaces partly deleted with their rows still there: the re-run finishes them."""
    if len(namespaces) <= 1:
        for ns in namespaces:
            store.delete_tree(ns.namespace)
            yield ns
        return
    with ThreadPoolExecutor(
        max_workers=min(TREE_WORKERS, len(namespaces)), thread_name_prefix="cachectl-delete"
    ) as pool:
        for ns, _ in zip(
            namespaces, pool.map(lambda n: store.delete_tree(n.namespace), namespaces), strict=True
        ):
            yield ns


def execute_plan(
    index: Index,
    store: Store,
    plan: DeletionPlan,
    *,
    lease: Lease | None = None,
    batch_size: int = DELETE_BATCH,
) -> ExecutionResult:
    """Carry out a plan: storage first, then the index, batch by batch; then audit it."""
    batch_size = max(1, min(batch_size, DELETE_BATCH))
    started = time.monotonic()
    hooks = _Hooks()
    calls = rows = ns_done = entries_done = freed = 0
    for ns in _deleted_trees(store, plan.namespaces):
        calls += 1
        hooks.after_storage_batch()
        _remove_empty_parents(store, ns.namespace)
        index.mark_environment_deleted(ns.environment_id)
        rows += ns.entries
        ns_done += 1
        entries_done += ns.entries
        freed += ns.bytes
        hooks.after_batch()
        if lease:
            lease.check()
    # Sidecars exist only where JAX's own eviction ran (it leaves a .lockfile).
    sidecar_ns = {n for n in {e.namespace for e in plan.entries} if store.exists(f"{n}/{LOCKFILE}")}
    # A batch's rows are deleted on a thread while the next batch leaves storage (its commit waits
    # on the disk, the unlinks or the object store's round trip on theirs): still storage first,
    # then the index, batch by batch, and at most one batch's rows behind its files.
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="cachectl-index") as behind:
        pending: Future[int] | None = None
        for batch, paths in _entry_batches(plan.entries, sidecar_ns, batch_size):
            store.delete(paths, batch_size=len(paths))  # one rm call for the whole batch
            calls += 1
            hooks.after_storage_batch()
            by_env: dict[int, list[str]] = defaultdict(list)
            for e in batch:
                by_env[e.environment_id].append(e.key)
            if pending is not None:
                rows += pending.result()
            pending = behind.submit(delete_entry_rows, index, by_env)
            entries_done += len(batch)
            freed += sum(e.bytes for e in batch)
            hooks.after_batch()
            if lease:
                lease.check()
        if pending is not None:
            rows += pending.result()
    duration = time.monotonic() - started
    result = ExecutionResult(ns_done, entries_done, freed, calls, rows, duration)
    index.audit(
        plan.operation,
        cache=plan.cache,
        entries=entries_done,
        nbytes=freed,
        duration_ms=int(duration * 1000),
        details={
            "criteria": plan.criteria,
            "namespaces_deleted": ns_done,
            "namespaces": [n.namespace for n in plan.namespaces[:100]],
            "entries_deleted": entries_done,
            "storage_calls": calls,
            "index_rows_removed": rows,
            "protected": [f"{p.namespace}: {p.reason}" for p in plan.protected[:100]],
        },
    )
    return result


@dataclass(frozen=True)
class LifecycleResult:
    """A plan and, unless it was a dry run, what executing it did."""

    plan: DeletionPlan
    execution: ExecutionResult | None
    dry_run: bool
    planning_s: float
