"""Bulk index writes (index/bulk_rows.py), sync's and every large upsert's: the rows inserted at
driver speed equal the general path's, on SQLite and PostgreSQL; keys written meanwhile by
someone else are updated, never duplicated."""

from __future__ import annotations

from dataclasses import asdict, replace
from datetime import UTC, datetime

from cachectl.core.fingerprint import Environment
from cachectl.index import NewEntry, open_index
from cachectl.index.entry_writes import BULK_MIN
from cachectl.index.sync_queries import insert_observed_entries


def _env() -> Environment:
    return Environment(
        jax_version="0.8.0",
        jaxlib_version="0.8.0",
        backend="cpu",
        platform_version="cpu",
        device_kind="cpu",
        device_count=1,
        process_count=1,
        topology="cpu:1",
        xla_flags=(),
        compression="zstandard",
        enable_xla_caches="none",
        include_metadata_in_key=False,
    )


def _row(i: int, size: int = 100) -> NewEntry:
    return NewEntry(
        key=f"jit_f{i}-{i:064x}",
        module=f"jit_f{i}",
        size=size + i,
        sha256=f"{i:064x}",
        origin="observed",
    )


def _general(index, env_id: int, rows: list[NewEntry]) -> tuple[int, int]:
    """``upsert_entries`` on its general path: batches too small for bulk_rows."""
    inserted = updated = 0
    for start in range(0, len(rows), BULK_MIN - 1):
        i, u = index.upsert_entries(env_id, rows[start : start + BULK_MIN - 1])
        inserted, updated = inserted + i, updated + u
    return inserted, updated


def _comparable(info) -> dict:
    row = asdict(info)
    row.pop("created_at")
    return row


def test_bulk_rows_equal_upserted_ones_and_existing_keys_are_updated(db_url) -> None:
    index = open_index(db_url, auto_migrate=True)
    try:
        index.add_cache("c", "/tmp/unused-root")
        env = index.ensure_environment("c", _env())
        twin = index.ensure_environment(
            "c",
            Environment(
                **{
                    **asdict(_env()),
                    "jax_version": "0.9.0",
                    "jaxlib_version": "0.9.0",
                    "xla_flags": (),
                }
            ),
        )
        rows = [_row(i) for i in range(1200)]  # more than one chunk of keys
        # Someone (a warm, another sync) recorded two of the keys since sync planned, one differently.
        assert index.upsert_entries(env.id, [rows[3], _row(700, size=5)]) == (2, 0)
        assert insert_observed_entries(index, env.id, rows) == (1198, 1)
        assert _general(index, twin.id, rows) == (1200, 0)
        bulk = [_comparable(e) for e in index.list_entries(env.id)]
        general = [_comparable(e) for e in index.list_entries(twin.id)]
        assert [{**r, "environment_id": 0} for r in bulk] == [
            {**r, "environment_id": 0} for r in general
        ]
        assert all(
            e.created_at is not None and e.created_at.tzinfo for e in index.list_entries(env.id)
        )
        assert insert_observed_entries(index, env.id, rows) == (0, 0)  # re-running is harmless
        assert insert_observed_entries(index, env.id, []) == (0, 0)
    finally:
        index.close()


def test_bulk_rows_over_several_statements(db_url) -> None:
    """More rows than one SQLite statement takes (its JSON batch): every row lands once,
    and a key written meanwhile in a later batch is updated."""
    index = open_index(db_url, auto_migrate=True)
    try:
        index.add_cache("c", "/tmp/unused-root")
        env = index.ensure_environment("c", _env())
        rows = [_row(i) for i in range(10_050)]
        assert index.upsert_entries(env.id, [_row(10_020, size=5)]) == (1, 0)
        assert insert_observed_entries(index, env.id, rows) == (10_049, 1)
        stored = index.list_entries(env.id)
        assert sorted((e.key, e.size, e.sha256) for e in stored) == sorted(
            (r.key, r.size, r.sha256) for r in rows
        )
        assert index.entry_keys(env.id)[rows[10_049].key] == (
            rows[10_049].size,
            rows[10_049].sha256,
        )
    finally:
        index.close()


def _full(i: int, run_id: int) -> NewEntry:
    """A row with every column a writer can set (a warm's, a bundle's), some left empty."""
    return NewEntry(
        key=f"jit_g{i % 5}-{i:064x}",
        module=f"jit_g{i % 5}",
        size=1000 + i,
        sha256=f"{i + 7:064x}",
        origin="bundle" if i % 2 else "warm",
        compile_time_ms=None if i % 3 == 0 else 10 * i,
        function=None if i % 4 == 0 else f"model.f{i % 3}",
        bucket=None if i % 4 == 0 else {"batch": 2 ** (i % 6), "name": "é"},
        warm_run_id=run_id if i % 2 == 0 else None,
        created_at=datetime(2026, 1, 1 + i % 28, 12, i % 60, tzinfo=UTC) if i % 5 else None,
        aot_size=None if i % 3 else 500 + i,
        aot_sha256=None if i % 3 else f"{i + 9:064x}",
    )


def test_large_upserts_write_what_the_general_path_writes(db_url) -> None:
    """A batch of BULK_MIN rows or more (a bundle's, a warm's) inserts its new rows through
    bulk_rows and upserts the rest: every column equals what the general path writes, counts too."""
    index = open_index(db_url, auto_migrate=True)
    try:
        index.add_cache("c", "/tmp/unused-root")
        env = index.ensure_environment("c", _env())
        twin = index.ensure_environment("c", replace(_env(), jax_version="0.9.0"))
        run = index.start_warm_run(
            env.id, manifest_digest="a" * 64, manifest_path="m.yaml", buckets=1
        ).id
        rows = [_full(i, run) for i in range(3 * BULK_MIN)]
        # Held already: one the batch changes, one it leaves as it is.
        held = [replace(rows[5], size=1, sha256="0" * 64), rows[9]]
        for target in (env.id, twin.id):
            assert index.upsert_entries(target, held) == (2, 0)
        assert index.upsert_entries(env.id, rows) == (len(rows) - 2, 1)
        assert _general(index, twin.id, rows) == (len(rows) - 2, 1)
        bulk = [asdict(e) for e in index.list_entries(env.id)]
        general = [asdict(e) for e in index.list_entries(twin.id)]
        assert len(bulk) == len(rows)
        given = {r.key: r.created_at for r in rows if r.created_at is not None}
        for b, g in zip(bulk, general, strict=True):
            assert b["key"] == g["key"]
            if b["key"] in given:
                assert b["created_at"] == g["created_at"] == given[b["key"]]
            assert {**b, "created_at": 0, "environment_id": 0} == {
                **g,
                "created_at": 0,
                "environment_id": 0,
            }
        assert {e.key: e.bucket for e in index.list_entries(env.id)}[rows[1].key] == rows[1].bucket
        # As stored, every column (the warm run's, JSON's text for a missing bucket) but the ids
        # and the times of rows that gave none.
        with index.engine.connect() as conn:
            stored = {
                target: conn.exec_driver_sql(
                    "SELECT key, module, size_bytes, sha256, origin, compile_time_ms, function, "
                    "bucket, warm_run_id, aot_size_bytes, aot_sha256, hit_count, last_access_at "
                    f"FROM entries WHERE environment_id = {target} ORDER BY key"
                ).all()
                for target in (env.id, twin.id)
            }
        assert stored[env.id] == stored[twin.id]
        assert {r[0]: r[8] for r in stored[env.id]}[rows[2].key] == run
        assert index.upsert_entries(env.id, rows) == (0, 0)  # re-running is harmless
    finally:
        index.close()


def test_a_column_every_row_shares_is_bound_once_and_stored_as_read_from_json() -> None:
    """bulk_json binds a varying column that holds one value of one type in every row of a batch
    (a bundle's origin, creation time, empty columns) instead of reading it from each row's JSON;
    what SQLite stores is the same either way, types included (1 and 1.0 are not one value)."""
    import json
    import sqlite3

    from cachectl.index import bulk_json

    columns = ['"key"', '"same"', '"mixed"', '"empty"', '"env"']
    rows = [(f"k{i}", "bundle", 1 if i % 2 else 1.0, None) for i in range(4)]
    sql, params = bulk_json._statement("t", columns, 4, (7,), rows)
    assert sql.count("json_extract") == 2  # the key and the mixed column
    assert params[:3] == ("bundle", None, 7)
    assert json.loads(params[-1]) == [[f"k{i}", 1 if i % 2 else 1.0] for i in range(4)]

    conn = sqlite3.connect(":memory:")
    conn.execute('CREATE TABLE t ("key", "same", "mixed", "empty", "env")')
    conn.execute(sql, params)
    per_row = conn.execute(
        "SELECT key, same, typeof(mixed), mixed, empty, env FROM t ORDER BY key"
    ).fetchall()
    conn.execute("DELETE FROM t")
    # What the driver stores for the same rows bound one by one.
    conn.executemany("INSERT INTO t VALUES (?, ?, ?, ?, 7)", rows)
    assert (
        per_row
        == conn.execute(
            "SELECT key, same, typeof(mixed), mixed, empty, env FROM t ORDER BY key"
        ).fetchall()
    )
    assert [r[2] for r in per_row] == ["real", "integer", "real", "integer"]
    # A batch of one row binds all but its key; an unhashable value is read from the JSON.
    assert bulk_json._statement("t", columns, 4, (7,), rows[:1])[0].count("json_extract") == 1
    assert bulk_json._one_value(([1], [1])) is False


def test_the_bulk_json_text_of_a_bucket_is_json_dumps_text() -> None:
    """bulk_rows.json_processor writes a dict or list bucket through one reused C encoder: the
    text is SQLAlchemy's own processor's (``json.dumps``) for every kind of JSON value, and a
    value JSON cannot hold is refused the same way."""
    import pytest
    from sqlalchemy.dialects import sqlite

    from cachectl.index import bulk_rows

    dialect = sqlite.dialect()
    fast = bulk_rows.json_processor("bucket", dialect)
    general = bulk_rows.bind_processor("bucket", dialect)
    assert fast is not general
    values = [
        {"batch": 8, "seq": 128},
        {"name": "é", "x": [1, 2.5, None, True, False, {"a": "\u2028", "b": 'q"\\'}]},
        [1, "two", [], {}],
        {"big": 1e300, "nan": float("nan"), "inf": float("-inf"), "zero": -0.0, "n": 10**30},
        {1: "int key", False: "bool key", None: "none key", 2.5: "float key"},
        {},
        [],
        None,
        3,
        "text",
    ]
    for value in values:
        assert fast(value) == general(value)
    with pytest.raises(TypeError, match="not JSON serializable"):
        fast({"x": object()})
