"""Reconcile storage and index: storage is the truth for what exists.

Entries JAX wrote straight into a namespace (services with write access) get
indexed; index rows whose files are gone are dropped; environments are rebuilt
from their env.json. One recursive listing of the root; file contents are
read only for entries that are new or changed size.
"""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass, field

from cachectl.context import Context
from cachectl.entries import ENV_FILE, Kind, classify, parse_entry_filename, sha256
from cachectl.errors import BadInput
from cachectl.fingerprint import Environment
from cachectl.index import CacheInfo, NewEntry
from cachectl.namespace import QUARANTINE_DIR, read_env_json
from cachectl.permissions import check_writer
from cachectl.store import FileInfo, Store


@dataclass(frozen=True)
class SyncEntry:
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
    def empty(self) -> bool:
        return not (self.entries_to_add or self.entries_to_update or self.rows_to_drop
                    or self.environments_to_add or self.environments_gone)


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


def _group_by_namespace(files: list[FileInfo]) -> tuple[dict[str, list[tuple[str, FileInfo]]], list[str]]:
    """Split a root listing into namespaces (jax-*/hw/digest16/...) and stray files."""
    groups: dict[str, list[tuple[str, FileInfo]]] = defaultdict(list)
    strays: list[str] = []
    for info in files:
        parts = info.path.split("/")
        if parts[0] == QUARANTINE_DIR:
            continue
        if len(parts) >= 4 and parts[0].startswith("jax-"):
            groups["/".join(parts[:3])].append(("/".join(parts[3:]), info))
        else:
            strays.append(info.path)
    return groups, strays


def plan_sync(ctx: Context, cache: CacheInfo) -> SyncPlan:
    store = Store(cache.root_url, cache.storage_options)
    store.check_reachable()
    groups, strays = _group_by_namespace(store.list(""))
    known = {e.namespace: e for e in ctx.index.environment_stats(cache.name, include_deleted=True)}
    namespaces: list[NamespaceSync] = []
    for ns_path in sorted(groups):
        files = groups[ns_path]
        names = {rel for rel, _ in files}
        if ENV_FILE not in names:
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
        on_disk: dict[str, FileInfo] = {}
        for rel, info in files:
            if classify(rel) is Kind.ENTRY:
                parsed = parse_entry_filename(rel)
                assert parsed is not None
                on_disk[parsed.key] = info
        for key, info in sorted(on_disk.items()):
            if key not in indexed:
                item.add.append(SyncEntry(ns_path, key, info.size))
            elif indexed[key][0] != info.size:
                item.update.append(SyncEntry(ns_path, key, info.size))
        for key in sorted(set(indexed) - set(on_disk)):
            item.drop.append(SyncEntry(ns_path, key, indexed[key][0], indexed[key][1]))
        namespaces.append(item)
    gone = sorted(
        ns for ns, e in known.items() if e.deleted_at is None and ns not in groups
    )
    return SyncPlan(cache.name, store.url, namespaces, gone, strays)


def execute_sync(ctx: Context, cache: CacheInfo, plan: SyncPlan) -> SyncResult:
    """Carry out a plan; safe to re-run (every step is an upsert or a delete)."""
    check_writer(cache, "sync")
    started = time.monotonic()
    store = Store(cache.root_url, cache.storage_options)
    envs_added = added = updated = dropped = gone = 0
    for item in plan.namespaces:
        if item.problem or item.environment is None:
            continue
        info = ctx.index.ensure_environment(cache.name, item.environment)
        envs_added += item.new_environment
        new_rows = []
        for e in item.add + item.update:
            try:
                data = store.read_bytes(f"{item.namespace}/{e.key}-cache")
            except FileNotFoundError:
                continue  # deleted since planning; the next sync settles it
            module = parse_entry_filename(f"{e.key}-cache")
            assert module is not None
            new_rows.append(NewEntry(key=e.key, module=module.module, size=len(data),
                                     sha256=sha256(data), origin="observed"))
        ins, upd = ctx.index.upsert_entries(info.id, new_rows)
        added += ins
        updated += upd
        if item.drop:
            dropped += ctx.index.delete_entries(info.id, [e.key for e in item.drop])
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
                 "rows_dropped": dropped, "environments_marked_deleted": gone},
    )
    return SyncResult(plan, envs_added, added, updated, dropped, gone, duration, False)


def sync(ctx: Context, cache: CacheInfo, *, dry_run: bool = False) -> SyncResult:
    if not dry_run:
        check_writer(cache, "sync")
    started = time.monotonic()
    plan = plan_sync(ctx, cache)
    if dry_run:
        return SyncResult(plan, plan.environments_to_add, plan.entries_to_add, plan.entries_to_update,
                          plan.rows_to_drop, len(plan.environments_gone), time.monotonic() - started, True)
    return execute_sync(ctx, cache, plan)
