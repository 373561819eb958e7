"""The service's stdlib SQLite path writes what the SQLAlchemy path writes, and spares its import."""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
import textwrap
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from cachectl.core import sqlite_file
from cachectl.core.config import Settings
from cachectl.core.errors import NotFound
from cachectl.core.fingerprint import current_environment
from cachectl.core.records import NewEntry
from cachectl.index import open_index
from cachectl.index.db import migrations_dir
from cachectl.index.stdlib import StdlibReads
from cachectl.index.telemetry_queries import record_telemetry
from cachectl.telemetry import FunctionCounts, TelemetryBatch
from cachectl.telemetry.batch import ServingCounts, SignatureCounts
from cachectl.telemetry.rows import MAX_SIGNATURES_PER_FUNCTION

T0 = datetime(2026, 11, 30, 12, 0, 0, 123456, tzinfo=UTC)


def test_the_stdlib_path_is_written_for_the_schema_head() -> None:
    from alembic.script import ScriptDirectory

    heads = ScriptDirectory(str(migrations_dir())).get_heads()
    assert heads == [sqlite_file.SCHEMA_REVISION], (
        "a migration was added: check the stdlib statements (cachectl.index.stdlib.py, "
        "cachectl/index/reads.py, plan_reads.py, usage.py) against it, then raise SCHEMA_REVISION"
    )


def _stdlib(url: str) -> StdlibReads | None:
    """The stdlib driver (cachectl.index.open) on ``url``, as a service opens it."""
    return StdlibReads.open_for(Settings(db=url, cache="svc", default_root="/unused"), "service")


def _index(path: Path) -> tuple[str, int, list[str]]:
    url = f"sqlite:///{path}"
    index = open_index(url)
    index.add_cache("svc", "/tmp/unused-root")
    env_id = index.ensure_environment("svc", current_environment()).id
    keys = [f"jit_f-{i:04d}" for i in range(3)]
    index.upsert_entries(
        env_id,
        [
            NewEntry(
                key=k,
                module="jit_f",
                size=100,
                sha256="0" * 64,
                origin="warm",
                created_at=T0 - timedelta(days=1),
            )
            for k in keys
        ],
    )
    index.close()
    return url, env_id, keys


def _batch(keys: list[str], at: datetime, signatures: int) -> TelemetryBatch:
    sigs = {
        ("jit_f", (i,), None, None): SignatureCounts(
            leaves=(((i, 4), "float32", False, None),),
            key=f"k{i}",
            requests=2,
            hits=1,
            misses=1,
            first_seen=at.timestamp(),
            last_seen=at.timestamp(),
            source="f at m.py:1",
            statics=((1, "3"),),
        )
        for i in range(signatures)
    }
    return TelemetryBatch(
        "host:1",
        "svc",
        current_environment().digest,
        at - timedelta(minutes=1),
        at,
        {
            "jit_f": FunctionCounts(
                requests=5, hits=3, writes=2, saved_seconds=1.25, uncacheable=1, loads=2
            ),
            "jit_loaded": FunctionCounts(loads=3),
            "jit_g": FunctionCounts(requests=0),
            None: FunctionCounts(requests=1),
        },
        {keys[0]: (2, at), keys[1]: (1, at - timedelta(hours=2)), "not-indexed": (1, at)},
        dropped=3,
        serving={
            "f": ServingCounts(
                calls=4, aot=3, fallback=1, out_of_bucket=0, padded=2, sizes={"n": {7: 3, 9: 1}}
            )
        },
        signatures=sigs,
        signatures_dropped=2,
    )


def _dump(url: str) -> dict[str, Any]:
    conn = sqlite3.connect(url[len("sqlite:///") :])
    out = {}
    for table, cols in {
        "telemetry": "environment_id, at, process, function, requests, hits, misses, writes, saved_seconds, "
        "dropped, uncacheable, loads",
        "serving_telemetry": "environment_id, at, process, function, calls, aot, fallback, out_of_bucket, padded, sizes",
        "signatures": "environment_id, function, digest, key, leaves, source, statics, requests, hits, misses, "
        "uncacheable, repeats, first_seen, last_seen",
        "entries": "key, hit_count, last_access_at",
    }.items():
        rows = conn.execute(f"SELECT {cols} FROM {table} ORDER BY {cols}").fetchall()
        # JSON columns compare as values (separators are the writer's business)
        out[table] = [
            tuple(json.loads(v) if isinstance(v, str) and v[:1] in ("[", "{") else v for v in r)
            for r in rows
        ]
    conn.close()
    return out


def test_both_writers_store_the_same_rows(tmp_path: Path) -> None:
    """Two flushes (the second adds to the first's signatures and overflows the per-function bound)."""
    slow_url, slow_env, keys = _index(tmp_path / "slow.db")
    fast_url, fast_env, _ = _index(tmp_path / "fast.db")
    first, second = (
        _batch(keys, T0, 5),
        _batch(keys, T0 + timedelta(minutes=1), MAX_SIGNATURES_PER_FUNCTION + 4),
    )

    index = open_index(slow_url)
    for b in (first, second):
        record_telemetry(index, slow_env, b)
    index.close()
    fast = _stdlib(fast_url)
    assert fast is not None
    for b in (first, second):
        fast.record_telemetry(fast_env, b, datetime.now(UTC))
    fast.close()

    slow, quick = _dump(slow_url), _dump(fast_url)
    assert (
        len(slow["signatures"]) == MAX_SIGNATURES_PER_FUNCTION + 1 + 1
    )  # jit_f's bound + its '*' + ''/'*'
    assert [r[1] for r in slow["entries"]] == [2 * 2, 2 * 1, 0]
    assert slow == quick


def test_the_policy_reads_the_same(tmp_path: Path) -> None:
    url, _, _ = _index(tmp_path / "i.db")
    index = open_index(url)
    index.update_cache(
        "svc",
        max_size=10 << 20,
        writers=["ci"],
        service_writes="deny",
        storage_options={"anon": True},
    )
    want = index.get_cache("svc")
    index.close()
    fast = _stdlib(url)
    assert fast is not None and fast.get_cache("svc") == want
    with pytest.raises(NotFound, match="no cache named 'nope'"):
        fast.get_cache("nope")
    fast.close()


def test_anything_unexpected_goes_the_sqlalchemy_way(tmp_path: Path) -> None:
    assert _stdlib("postgresql+psycopg://u@h/db") is None
    assert _stdlib(f"sqlite:///{tmp_path}/missing.db") is None
    assert _stdlib("sqlite://") is None
    url, _, _ = _index(tmp_path / "old.db")
    conn = sqlite3.connect(tmp_path / "old.db")
    conn.execute("UPDATE alembic_version SET version_num = '0005'")
    conn.commit()
    conn.close()
    assert _stdlib(url) is None
    (tmp_path / "junk.db").write_bytes(b"not a database" * 100)
    assert _stdlib(f"sqlite:///{tmp_path}/junk.db") is None


SERVICE = """
import sys, json, jax, jax.numpy as jnp, cachectl
from cachectl import telemetry
a = cachectl.activate("svc")
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
for i in range(3):
    jax.jit(lambda v, c=float(i): jnp.sin(v) * c)(jnp.ones((8,))).block_until_ready()
telemetry.current().flush()
print(json.dumps({"indexed": a.indexed, "readonly": a.readonly, "warning": a.warning,
                  "sqlalchemy": sorted(m for m in sys.modules if m.split(".")[0] == "sqlalchemy")[:3]}))
"""


def test_a_service_by_cache_name_never_imports_sqlalchemy(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path}/i.db"
    index = open_index(url)
    index.add_cache("svc", str(tmp_path / "root"))
    index.close()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CACHECTL_", "JAX_"))}
    env.update(
        CACHECTL_DB=url,
        HOME=str(tmp_path),
        XDG_CONFIG_HOME=str(tmp_path / "cfg"),
        XDG_DATA_HOME=str(tmp_path / "data"),
    )
    outs = []
    for _run in range(2):
        proc = subprocess.run(
            [sys.executable, "-c", textwrap.dedent(SERVICE)],
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert proc.returncode == 0, proc.stderr
        outs.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    # The first start creates the environment's row (the SQLAlchemy way); from then on a service
    # reads its policy, records itself and flushes telemetry through the stdlib driver alone.
    assert outs[0]["sqlalchemy"] and outs[0]["indexed"] is True
    assert outs[1] == {"indexed": True, "readonly": False, "warning": None, "sqlalchemy": []}
    from cachectl.index.telemetry_queries import telemetry_stats

    index = open_index(url)
    (row,) = telemetry_stats(index, "svc", timedelta(hours=1)).environments
    index.close()
    # the second process hit every program the first wrote (jnp.ones's eager staging programs are
    # not cacheable, counted apart), and both flushes arrived
    assert row.processes == 2 and row.hits == row.misses == 3 and row.writes >= 3
    assert row.requests == row.hits + row.misses + row.uncacheable


QUIET_SERVICE = """
import sys, json, cachectl
a = cachectl.activate("svc", readonly=True)
print(json.dumps({"indexed": a.indexed, "warning": a.warning, "sqlalchemy": "sqlalchemy" in sys.modules}),
      flush=True)
"""


def test_a_known_environment_is_marked_seen_before_exit_though_nothing_compiles(
    tmp_path: Path,
) -> None:
    """activate() marks the environment seen (and revives it) from a thread, off the start path; a
    process that exits at once waits for it, here while another writer holds the index."""
    url, env_id, _ = _index(tmp_path / "i.db")
    conn = sqlite3.connect(tmp_path / "i.db", isolation_level=None)
    conn.execute(
        "UPDATE environments SET last_seen_at = '2020-01-01 00:00:00.000000', "
        "deleted_at = '2020-01-02 00:00:00.000000' WHERE id = ?",
        (env_id,),
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CACHECTL_", "JAX_"))}
    env.update(
        CACHECTL_DB=url,
        HOME=str(tmp_path),
        XDG_CONFIG_HOME=str(tmp_path / "cfg"),
        XDG_DATA_HOME=str(tmp_path / "data"),
    )
    conn.execute("BEGIN IMMEDIATE")  # a writer holds the index: the service's record has to wait
    proc = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(QUIET_SERVICE)],
        env=env,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        line = proc.stdout.readline()  # activate() returned while the index was held
        time.sleep(1.0)
        waiting = proc.poll() is None
    finally:
        conn.execute("COMMIT")
    _out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    assert json.loads(line) == {"indexed": True, "warning": None, "sqlalchemy": False}
    assert waiting, "the process exited before its environment was recorded"
    seen, deleted = conn.execute(
        "SELECT last_seen_at, deleted_at FROM environments WHERE id = ?", (env_id,)
    ).fetchone()
    conn.close()
    assert deleted is None
    assert seen >= (datetime.now(UTC) - timedelta(minutes=10)).strftime("%Y-%m-%d %H:%M:%S")
