"""The read commands' stdlib path (cachectl.index.reads) says what the SQL index says, without SQLAlchemy.

Each read query is written once and run by two drivers: the SQL index's engine and the stdlib
``sqlite3`` reader that ``ls``, ``stats``, ``cache list`` and ``prune --dry-run`` take on a plain
SQLite index at the current schema. Here both run on one populated index and must agree, the
commands must print the same JSON either way, and the stdlib path must refuse what it cannot
serve (no file, another schema revision, another URL form) so the SQL index takes over.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import sqlite3
import subprocess
import sys
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from cachectl.core.errors import NotFound, Unreachable
from cachectl.core.fingerprint import current_environment
from cachectl.index import NewEntry, open_index, plan_reads, reads, usage
from cachectl.index.reads import SqliteReader
from cachectl.index.telemetry_queries import record_telemetry
from cachectl.telemetry.batch import FunctionCounts, SignatureCounts, TelemetryBatch

ROOT = Path(__file__).resolve().parent.parent
NOW = datetime.now(UTC)


def _populate(path: Path) -> str:
    """Two caches; two environments (one deleted later); entries old and new, with and without
    stored executables and accesses; a running warm; telemetry on one function."""
    url = f"sqlite:///{path}"
    index = open_index(url)
    index.add_cache("default", str(path.parent / "root"))
    index.add_cache(
        "svc",
        str(path.parent / "svc"),
        max_size=10**9,
        retention_seconds=86400,
        writers=("ci",),
        trusted_keys=("ed25519:AAAA",),
        storage_options={"anon": True},
    )
    env = current_environment()
    other = dataclasses.replace(env, jax_version="0.4.1", xla_flags=("--xla_cpu_x=1",))
    gone = dataclasses.replace(env, jax_version="0.4.0")
    live = index.ensure_environment("svc", env).id
    old = index.ensure_environment("svc", other).id
    dead = index.ensure_environment("svc", gone).id
    entries = [
        NewEntry(
            key=f"jit_f-{i:03d}",
            module="jit_f",
            size=100 + i,
            sha256=f"{i:064x}",
            origin="warm",
            function="f" if i % 2 else None,
            created_at=NOW - timedelta(days=i),
            aot_size=50 if i % 3 == 0 else None,
            aot_sha256=f"{i + 1:064x}" if i % 3 == 0 else None,
            compile_time_ms=1200 + i,
        )
        for i in range(12)
    ]
    index.upsert_entries(live, entries)
    index.upsert_entries(old, entries[:5])
    index.upsert_entries(dead, entries[:2])
    index.mark_environment_deleted(dead)
    index.start_warm_run(old, manifest_digest="0" * 64, manifest_path="m.yaml", buckets=3)
    # Two manifest functions under one jit name (two modules' generate): told apart by key.
    index.upsert_entries(
        live,
        [
            NewEntry(f"jit_g-{n}", "jit_g", 10, f"{n:064x}", "warm", 500, function=f"g{n}")
            for n in (1, 2)
        ],
    )
    leaves = (((4,), "float32", False, None),)
    signatures = {
        ("jit_g", leaves, key, None): SignatureCounts(leaves, key, hits + misses, hits, misses)
        for key, hits, misses in (("jit_g-1", 2, 0), ("jit_g-2", 1, 0), ("jit_g-9", 0, 1))
    }
    batch = TelemetryBatch(
        "host:1",
        "svc",
        env.digest,
        NOW - timedelta(minutes=2),
        NOW - timedelta(minutes=1),
        {
            "jit_f": FunctionCounts(requests=7, hits=4, writes=1, saved_seconds=2.5, uncacheable=1),
            "jit_g": FunctionCounts(requests=6, hits=5, writes=1),
        },
        {"jit_f-001": (3, NOW - timedelta(minutes=1))},
        dropped=1,
        signatures=signatures,
    )
    record_telemetry(index, live, batch)
    index.close()
    return url


@pytest.fixture
def populated(tmp_path: Path) -> str:
    return _populate(tmp_path / "index.db")


def _answers(reader: reads.Reader) -> dict[str, Any]:
    """Every read query's answer on ``reader``, in comparable form."""
    envs = reads.Queries(reader).environment_stats("svc")
    ids = [e.id for e in reads.Queries(reader).environment_stats("svc", include_deleted=True)]
    selectors: dict[str, Any] = {
        "created_before": NOW - timedelta(days=4),
        "unused_before": NOW - timedelta(days=2),
        "function": "f",
    }
    holder = _Holder(reader)
    return {
        "caches": reads.Queries(reader).list_caches(),
        "svc": reads.Queries(reader).get_cache("svc"),
        "environments": envs,
        "with_deleted": reads.Queries(reader).environment_stats("svc", include_deleted=True),
        "found": reads.Queries(reader).find_environment("svc", envs[0].digest[:8]),
        "summaries": plan_reads.environments(holder, "svc"),
        "warming": plan_reads.warms_in_progress(holder, ids, now=NOW),
        "counts": plan_reads.selected_counts(holder, ids, **selectors),
        "counts_created": plan_reads.selected_counts(holder, ids, created_before=NOW),
        "selected": {
            k: [tuple(r) for r in v]
            for k, v in plan_reads.selected_entries(holder, ids, **selectors).items()
        },
        "recent_hits": plan_reads.environments_with_recent_hits(
            holder, ids, NOW - timedelta(hours=1)
        ),
        "usage": dataclasses.replace(
            usage.telemetry_stats(reader, "svc", timedelta(days=1)), since=NOW
        ),
    }


@dataclasses.dataclass
class _Holder:
    reader: reads.Reader


def test_both_drivers_answer_every_read_alike(populated: str) -> None:
    stdlib = SqliteReader.open(populated)
    assert stdlib is not None
    index = open_index(populated)
    try:
        theirs = _answers(index.reader)
        mine = _answers(stdlib)
    finally:
        stdlib.close()
        index.close()
    for name in theirs:
        assert mine[name] == theirs[name], name
    # Not vacuous: the populated index shows in every answer.
    assert [c.name for c in mine["caches"]] == ["default", "svc"]
    assert mine["svc"].trusted_keys == ("ed25519:AAAA",) and mine["svc"].writers == ("ci",)
    assert len(mine["environments"]) == 2 and len(mine["with_deleted"]) == 3
    assert sorted(e.entries for e in mine["environments"]) == [5, 14]
    assert mine["environments"][0].created_at.tzinfo is not None
    assert len(mine["warming"]) == 1
    assert sum(mine["counts"].values()) == sum(len(v) for v in mine["selected"].values()) > 0
    assert len(mine["recent_hits"]) == 1
    (row,) = mine["usage"].environments
    assert (row.requests, row.hits, row.misses, row.uncacheable) == (13, 9, 3, 1)
    # jit_g's 5 hits split 2:1 by the keys its signatures looked up (largest remainder), its
    # miss and write to no manifest function's key: one row each, summing to the jit name's.
    g = {
        r.name: (r.requests, r.hits, r.misses, r.writes)
        for r in mine["usage"].functions
        if r.function == "jit_g"
    }
    assert g == {"g1": (3, 3, 0, 0), "g2": (2, 2, 0, 0), None: (1, 0, 1, 1)}, g


def test_the_stdlib_reader_refuses_what_it_cannot_serve(tmp_path: Path, populated: str) -> None:
    assert SqliteReader.open(f"sqlite:///{tmp_path / 'missing.db'}") is None
    assert SqliteReader.open(populated + "?timeout=30") is None  # the SQLAlchemy forms
    assert SqliteReader.open("postgresql+psycopg://u:p@127.0.0.1:1/db") is None
    garbage = tmp_path / "garbage.db"
    garbage.write_bytes(b"not a database" * 100)
    assert SqliteReader.open(f"sqlite:///{garbage}") is None
    path = populated[len("sqlite:///") :]
    with sqlite3.connect(path) as conn:
        conn.execute("UPDATE alembic_version SET version_num = '0009'")
    conn.close()
    assert SqliteReader.open(populated) is None


def test_a_failing_stdlib_read_is_unreachable_not_a_traceback(populated: str) -> None:
    reader = SqliteReader.open(populated)
    assert reader is not None
    with pytest.raises(Unreachable, match="readonly"):  # query_only: the reader never writes
        reader.rows("DELETE FROM caches")
    assert len(reads.Queries(reader).list_caches()) == 2
    path = populated[len("sqlite:///") :]
    with sqlite3.connect(path) as conn:
        conn.execute("DROP TABLE telemetry")
    conn.close()
    try:
        with pytest.raises(Unreachable, match="no such table: telemetry"):
            usage.telemetry_stats(reader, "svc", timedelta(days=1))
        with pytest.raises(NotFound, match="no cache named 'nope' \\(known: default, svc\\)"):
            reads.Queries(reader).get_cache("nope")
    finally:
        reader.close()


_PROBE = """
import atexit, json, os, sys
def _report():
    with open(os.environ["MODULES_OUT"], "w") as f:
        json.dump(sorted({m.split(".")[0] for m in sys.modules}), f)
atexit.register(_report)
from cachectl.cli import main
sys.argv = ["cachectl", *sys.argv[1:]]
main()
"""

READ_COMMANDS = [
    ["ls", "--json"],
    ["--cache", "svc", "ls", "--json"],
    ["stats", "--json"],
    ["stats", "--all", "--since", "1d", "--json"],
    ["cache", "list", "--json"],
    ["--cache", "svc", "prune", "--older-than", "3d", "--dry-run", "--json"],
    ["--cache", "svc", "prune", "--older-than", "1d", "--function", "f", "--dry-run", "--json"],
]


def _run(tmp_path: Path, db: str, args: list[str]) -> tuple[Any, set[str]]:
    out = tmp_path / "modules.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CACHECTL_", "JAX_"))}
    env.update(
        CACHECTL_DB=db,
        MODULES_OUT=str(out),
        PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    )
    proc = subprocess.run(
        [sys.executable, "-c", _PROBE, *args],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=120,
    )
    assert proc.returncode == 0, (args, proc.stderr)
    return _steady(json.loads(proc.stdout)), set(json.loads(out.read_text()))


_MINUTE = re.compile(r"\d{4}-\d\d-\d\d \d\d:\d\d")


def _steady(value: Any) -> Any:
    """The JSON less what differs between two runs by nature: window starts, planning times, and
    the cutoff minute a plan's reasons name (two runs may straddle a minute)."""
    if isinstance(value, dict):
        return {k: _steady(v) for k, v in value.items() if k not in ("since", "planning_s")}
    if isinstance(value, list):
        return [_steady(v) for v in value]
    if isinstance(value, str):
        return _MINUTE.sub("<minute>", value)
    return value


@pytest.mark.parametrize("args", READ_COMMANDS, ids=[" ".join(a) for a in READ_COMMANDS])
def test_read_commands_print_the_same_on_either_path(tmp_path: Path, args: list[str]) -> None:
    url = _populate(tmp_path / "index.db")
    before = sorted(p.name for p in tmp_path.glob("index.db*"))
    mine, loaded = _run(tmp_path, url, args)
    # A read leaves the index's files as it found them: no -wal/-shm left behind (a read-only
    # connection cannot checkpoint on close).
    assert sorted(p.name for p in tmp_path.glob("index.db*")) == before
    theirs, sql_loaded = _run(tmp_path, url + "?timeout=30", args)  # the SQLAlchemy form
    assert "sqlalchemy" in sql_loaded  # the comparison is with the SQL index
    assert mine == theirs
    assert loaded.isdisjoint({"sqlalchemy", "alembic", "jax", "ml_dtypes", "numpy", "pydantic"}), (
        sorted(loaded & {"sqlalchemy", "alembic", "jax", "ml_dtypes", "numpy", "pydantic"})
    )


_SERVING = """
import json, sys
sys.path.insert(0, {dir!r})
import cachectl
rt = cachectl.serving({manifest!r})
report = rt.report()
print(json.dumps(dict(
    loaded=sum(f.loaded for f in report.functions.values()),
    buckets=sum(f.buckets for f in report.functions.values()),
    warnings=report.warnings,
    sqlalchemy="sqlalchemy" in sys.modules,
)))
"""


def test_serving_checks_executables_against_the_index_without_sqlalchemy(tmp_path: Path) -> None:
    """cachectl.serving reads the sha256s it checks every executable against through the stdlib
    reader on a plain SQLite index: every bucket loads, SQLAlchemy never imported."""
    from support.infra import run_py
    from support.warming import tiny, warm_json

    manifest = tiny(tmp_path)
    warm_json(str(manifest))
    proc = run_py(_SERVING.format(dir=str(tmp_path), manifest=str(manifest)), check=True)
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out == {"loaded": 5, "buckets": 5, "warnings": [], "sqlalchemy": False}, out
