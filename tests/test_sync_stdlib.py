"""`cachectl sync` on a local SQLite index runs on the stdlib driver (cachectl/index/sync_stdlib.py):
a real process never imports SQLAlchemy nor the ORM models, and its rows are the ones the
SQLAlchemy driver writes from the same SQL (cachectl/index/sync_queries.py), column by column;
PostgreSQL takes that driver and does every kind of change."""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

from support.lifecycle import CACHE, fake_env, setup_cache

from cachectl.context import Context
from cachectl.core.config import load_settings
from cachectl.index import open_index
from cachectl.index.sync_engine import EngineDriver
from cachectl.index.sync_stdlib import StdlibDriver
from cachectl.lifecycle.sync import SyncResult, open_sync_index, sync
from cachectl.storage.entries import CACHE_SUFFIX, EXECUTABLE_SUFFIX, make_entry, sha256
from cachectl.storage.namespace import ensure_namespace
from cachectl.storage.store import Store

ROOT = Path(__file__).resolve().parent.parent

_PROBE = """
import atexit, json, os, sys

def _report():
    with open(os.environ["CACHECTL_TEST_MODULES"], "w") as f:
        json.dump(sorted(sys.modules), f)

atexit.register(_report)
from cachectl.cli import main

sys.argv = ["cachectl", *sys.argv[1:]]
main()
"""


def _entry(i: int, size: int = 200) -> tuple[str, bytes]:
    data = make_entry(os.urandom(size + i), compile_seconds=1)
    return f"jit_f{i % 3}-{sha256(data)}", data


class _Storage:
    """Two namespaces of files no index knows, then every kind of change sync makes."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self.env, self.other = fake_env("0.10.2"), fake_env("0.10.2", backend="tpu")
        self.keys: list[str] = []
        self.other_files: list[str] = []

    def first(self) -> None:
        for env, n in ((self.env, 6), (self.other, 2)):
            ensure_namespace(self.store, env)
            for i in range(n):
                key, data = _entry(i)
                self.store.write_bytes(f"{env.namespace}/{key}{CACHE_SUFFIX}", data)
                if env is self.env:
                    self.keys.append(key)
                else:
                    self.other_files.append(f"{env.namespace}/{key}{CACHE_SUFFIX}")
        self.store.write_bytes(f"{self.env.namespace}/{self.keys[0]}{EXECUTABLE_SUFFIX}", b"aot0")

    def second(self) -> None:
        ns, keys = self.env.namespace, self.keys
        self.store.write_bytes(f"{ns}/{keys[1]}{CACHE_SUFFIX}", make_entry(os.urandom(900)))
        self.store.delete([f"{ns}/{keys[2]}{CACHE_SUFFIX}", f"{ns}/{keys[0]}{EXECUTABLE_SUFFIX}"])
        self.store.write_bytes(f"{ns}/{keys[3]}{EXECUTABLE_SUFFIX}", b"aot3")
        self.store.delete([*self.other_files, f"{self.other.namespace}/env.json"])


def _counts(result: SyncResult) -> tuple[int, ...]:
    return (
        result.environments_added,
        result.entries_added,
        result.entries_updated,
        result.rows_dropped,
        result.environments_marked_deleted,
        result.executables_recorded,
        result.executables_cleared,
    )


FIRST = (2, 8, 0, 0, 0, 1, 0)
SECOND = (0, 0, 1, 1, 1, 1, 1)


def _sync(ctx: Context) -> SyncResult:
    return sync(ctx, ctx.cache(), min_age=timedelta(0))


def test_a_sync_process_on_a_local_sqlite_index_never_imports_sqlalchemy(tmp_path: Path) -> None:
    db = f"sqlite:///{tmp_path / 'index.db'}"
    index, store = setup_cache(db, str(tmp_path / "root"))
    index.close()
    files = _Storage(store)
    files.first()
    report = tmp_path / "modules.json"
    env = {
        **os.environ,
        "CACHECTL_TEST_MODULES": str(report),
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    }
    args = ["--db", db, "--cache", CACHE, "sync", "--min-age", "0", "--json"]
    proc = subprocess.run(
        [sys.executable, "-c", _PROBE, *args],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    loaded = set(json.loads(report.read_text()))
    assert "cachectl.index.sync_stdlib" in loaded
    assert not {m for m in loaded if m.split(".")[0] == "sqlalchemy"}
    assert "cachectl.index.models" not in loaded and "cachectl.index.sql" not in loaded
    out = json.loads(proc.stdout)
    assert (out["environments_added"], out["entries_added"], out["executables_recorded"]) == (
        2,
        8,
        1,
    )
    index = open_index(db)
    try:
        (info,) = [e for e in index.environment_stats(CACHE) if e.namespace == files.env.namespace]
        assert set(index.entry_keys(info.id)) == set(files.keys)
        assert set(index.aot_keys(info.id)) == {files.keys[0]}
        assert [a.operation for a in index.audit_log(CACHE)] == ["sync"]
    finally:
        index.close()


_IDS = {"id", "environment_id", "cache_id"}
_TIMES = {"created_at", "last_seen_at", "deleted_at", "at", "last_access_at"}


def _rows(path: Path, table: str, order: str) -> list[dict[str, Any]]:
    """A table's rows as stored: ids left out, times as their stored type and length."""
    conn = sqlite3.connect(path)
    try:
        cur = conn.execute(f"SELECT * FROM {table} ORDER BY {order}")
        names = [d[0] for d in cur.description]
        out = []
        for row in cur.fetchall():
            item: dict[str, Any] = {}
            for name, value in zip(names, row, strict=True):
                if name in _IDS:
                    continue
                if name in _TIMES:
                    value = (type(value).__name__, len(str(value)) if value is not None else 0)
                elif name == "duration_ms":
                    value = type(value).__name__
                item[name] = value
            out.append(item)
        return out
    finally:
        conn.close()


def _stored(path: Path) -> dict[str, list[dict[str, Any]]]:
    return {
        "environments": _rows(path, "environments", "namespace"),
        "entries": _rows(path, "entries", "key"),
        "audit_log": _rows(path, "audit_log", "id"),
    }


def test_both_drivers_write_the_same_rows(tmp_path: Path) -> None:
    """The same storage, synced twice into two SQLite indexes: one by the stdlib driver, one by the
    SQLAlchemy driver (an index handed to the context, as the server hands its own)."""
    root = str(tmp_path / "root")
    paths = [tmp_path / "stdlib.db", tmp_path / "engine.db"]
    for path in paths:
        setup_cache(f"sqlite:///{path}", root)[0].close()
    files = _Storage(Store(root))
    given = open_index(f"sqlite:///{paths[1]}")
    contexts = [
        Context(load_settings(db=f"sqlite:///{paths[0]}", cache=CACHE)),
        Context(load_settings(db=f"sqlite:///{paths[1]}", cache=CACHE), index=given),
    ]
    try:
        for ctx, kind in zip(contexts, (StdlibDriver, EngineDriver), strict=True):
            chosen = open_sync_index(ctx)
            assert chosen is not None and isinstance(chosen.driver, kind)
            chosen.close()
        for stage, expected in ((files.first, FIRST), (files.second, SECOND)):
            stage()
            assert [_counts(_sync(ctx)) for ctx in contexts] == [expected, expected]
    finally:
        for ctx in contexts:
            ctx.close()
        given.close()
    stdlib, engine = (_stored(p) for p in paths)
    assert len(stdlib["entries"]) == 5 and len(stdlib["environments"]) == 2
    assert stdlib == engine


def test_sync_does_every_kind_of_change_on_each_database(db_url: str, tmp_path: Path) -> None:
    """SQLite through the stdlib driver, PostgreSQL through the SQLAlchemy one."""
    index, store = setup_cache(db_url, str(tmp_path / "root"))
    files = _Storage(store)
    ctx = Context(load_settings(db=db_url, cache=CACHE))
    try:
        files.first()
        assert _counts(_sync(ctx)) == FIRST
        files.second()
        assert _counts(_sync(ctx)) == SECOND
        assert _counts(_sync(ctx)) == (0,) * 7  # re-running is harmless
        envs = {e.namespace: e for e in index.environment_stats(CACHE, include_deleted=True)}
        info = envs[files.env.namespace]
        assert envs[files.other.namespace].deleted_at is not None
        keys = files.keys
        rows = index.entry_keys(info.id)
        assert set(rows) == set(keys) - {keys[2]}
        data = store.read_bytes(f"{files.env.namespace}/{keys[1]}{CACHE_SUFFIX}")
        assert rows[keys[1]] == (len(data), sha256(data))
        assert index.aot_keys(info.id) == {keys[3]: (4, sha256(b"aot3"))}
        (entry,) = [e for e in index.list_entries(info.id) if e.key == keys[4]]
        assert entry.origin == "observed" and entry.bucket is None and entry.hit_count == 0
        audit = index.audit_log(CACHE)
        assert [a.operation for a in audit] == ["sync"] * 3
        assert audit[1].details["rows_dropped"] == 1
    finally:
        ctx.close()
        index.close()


def test_a_long_list_of_one_action_is_counted_in_one_row(tmp_path: Path, monkeypatch) -> None:
    """Past LISTED files of one action in a namespace, the table says how many (rendering a row
    costs about as much as indexing ten entries); --json still lists each."""
    from click.testing import CliRunner

    from cachectl.cli import cli, sync_cmds

    db = f"sqlite:///{tmp_path / 'index.db'}"
    index, store = setup_cache(db, str(tmp_path / "root"))
    index.close()
    files = _Storage(store)
    files.first()
    monkeypatch.setattr(sync_cmds, "LISTED", 5)
    args = ["--db", db, "--cache", CACHE, "sync", "--dry-run", "--min-age", "0"]
    out = CliRunner().invoke(cli, args, catch_exceptions=False).output
    assert "index entry" in out and "6 files (--json lists each)" in out  # 6 > 5: counted
    assert not any(key in out for key in files.keys[1:])  # keys[0]: its executable is listed
    for name in files.other_files:  # 2 <= 5: each listed
        assert name.rsplit("/", 1)[1].removesuffix(CACHE_SUFFIX) in out
    listed = json.loads(CliRunner().invoke(cli, [*args, "--json"]).output)
    adds = {e["key"] for ns in listed["plan"]["namespaces"] for e in ns["add"]}
    assert set(files.keys) <= adds
