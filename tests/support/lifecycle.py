"""Helpers for the lifecycle tests: fake environments written through the real layout.

Entries are built with cachectl.storage.entries.make_entry (valid JAX format, no
compile), stored with Store.write_bytes under a namespace made by
ensure_namespace (env.json), and indexed with Index.upsert_entries.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from click.testing import CliRunner

from cachectl.cli import cli
from cachectl.core.fingerprint import Environment
from cachectl.index import EnvironmentInfo, Index, NewEntry, open_index
from cachectl.index.models import utcnow
from cachectl.storage.entries import (
    CACHE_SUFFIX,
    Kind,
    classify,
    make_entry,
    parse_entry_filename,
    sha256,
)
from cachectl.storage.namespace import QUARANTINE_DIR, ensure_namespace
from cachectl.storage.store import Store, normalize_url
from support.environments import fake_env  # noqa: F401 - re-exported for lifecycle tests

CACHE = "lc"


@dataclass
class Populated:
    env: Environment
    info: EnvironmentInfo
    keys: list[str] = field(default_factory=list)


def write_entries(
    index: Index,
    store: Store,
    env: Environment,
    count: int,
    *,
    cache: str = CACHE,
    now: datetime | None = None,
    age_days: Sequence[float] | None = None,
    sizes: Sequence[int] | None = None,
    compile_ms: Sequence[int] | None = None,
    functions: Sequence[str] | None = None,
    warm_run_id: int | None = None,
    lockfile: bool = False,
) -> Populated:
    """``count`` valid entries in ``env``'s namespace, stored and indexed."""
    now = now or utcnow()
    ensure_namespace(store, env)
    info = index.ensure_environment(cache, env)
    rows = []
    keys = []
    for i in range(count):
        payload = os.urandom(sizes[i] if sizes else 64 + i)
        data = make_entry(payload, compile_seconds=1)
        fn = functions[i] if functions else f"f{i % 3}"
        key = f"jit_{fn}-{sha256(data)}"
        store.write_bytes(f"{env.namespace}/{key}{CACHE_SUFFIX}", data)
        if lockfile:
            store.write_bytes(f"{env.namespace}/{key}-atime", (1).to_bytes(8, "little"))
        created = now - timedelta(days=age_days[i] if age_days else i)
        rows.append(
            NewEntry(
                key=key,
                module=f"jit_{fn}",
                size=len(data),
                sha256=sha256(data),
                origin="warm",
                function=fn,
                compile_time_ms=compile_ms[i] if compile_ms else 1000,
                created_at=created,
                warm_run_id=warm_run_id,
            )
        )
        keys.append(key)
    if lockfile:
        store.write_bytes(f"{env.namespace}/.lockfile", b"")
    index.upsert_entries(info.id, rows)
    return Populated(env, info, keys)


def setup_cache(db_url: str, root: str, **policy) -> tuple[Index, Store]:
    index = open_index(db_url, auto_migrate=True)
    root = normalize_url(root)
    index.add_cache(CACHE, root, **policy)
    store = Store(root)
    if store.is_local:
        os.makedirs(root, exist_ok=True)
    return index, store


def cachectl(db_url: str, *args: str, cache: str = CACHE):
    """Run the CLI in-process (click's CliRunner), as scripts would."""
    runner = CliRunner()
    return runner.invoke(cli, ["--db", db_url, "--cache", cache, *args], catch_exceptions=False)


def cachectl_argv(db_url: str, *args: str, cache: str = CACHE) -> list[str]:
    """argv for a fresh `cachectl` process (crash and concurrency tests)."""
    return [sys.executable, "-m", "cachectl", "--db", db_url, "--cache", cache, *args]


def storage_entries(store: Store) -> dict[str, set[str]]:
    """namespace -> entry keys present in storage (quarantine excluded)."""
    out: dict[str, set[str]] = {}
    for f in store.list(""):
        parts = f.path.split("/")
        if parts[0] == QUARANTINE_DIR or len(parts) < 4:
            continue
        ns, rel = "/".join(parts[:3]), "/".join(parts[3:])
        out.setdefault(ns, set())
        if classify(rel) is Kind.ENTRY:
            parsed = parse_entry_filename(rel)
            assert parsed is not None
            out[ns].add(parsed.key)
    return out


def index_entries(index: Index, cache: str = CACHE) -> dict[str, set[str]]:
    """namespace -> entry keys the index holds for live environments."""
    return {e.namespace: set(index.entry_keys(e.id)) for e in index.environment_stats(cache)}


def assert_consistent(index: Index, store: Store, cache: str = CACHE) -> None:
    """No index row points at a missing file; no entry file is left unindexed."""
    on_disk = storage_entries(store)
    indexed = index_entries(index, cache)
    for ns, keys in indexed.items():
        missing = keys - on_disk.get(ns, set())
        assert not missing, f"index rows without files in {ns}: {sorted(missing)[:3]}"
    for ns, keys in on_disk.items():
        if not keys:
            continue
        unindexed = keys - indexed.get(ns, set())
        assert not unindexed, f"files without index rows in {ns}: {sorted(unindexed)[:3]}"


def total_bytes(index: Index, cache: str = CACHE) -> int:
    return sum(e.bytes for e in index.environment_stats(cache))
