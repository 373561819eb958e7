"""Carrying out a deletion plan: storage first, index second, in batches, under the lease.

Apart from cachectl/lifecycle/plan.py (the plan's records), because it needs the SQL index and
SQLAlchemy, which ``prune --dry-run`` never loads.
"""

from __future__ import annotations

import os
import posixpath
import signal
import time
from collections import defaultdict
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

from cachectl.core.config import DELETE_BATCH
from cachectl.index import Index
from cachectl.index.lifecycle_queries import delete_entry_rows
from cachectl.lifecycle.lease import Lease
from cachectl.lifecycle.plan import (
    DeletionPlan,
    ExecutionResult,
    PlannedEntry,
    PlannedNamespace,
)
from cachectl.storage.entries import ATIME_SUFFIX, LOCKFILE
from cachectl.storage.store import Store

# Test hooks, read only by the executor: kill this process (SIGKILL) right
# after the Nth storage batch, before the index learns of it — the worst
# moment to crash; and sleep after each batch, so a test can overlap runs.
CRASH_HOOK = "CACHECTL_TEST_CRASH_AFTER_BATCHES"
DELAY_HOOK = "CACHECTL_TEST_BATCH_DELAY_S"


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
