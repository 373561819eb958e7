"""Sync's bulk index writes: the rows it inserts at driver speed equal the general path's, on
SQLite and PostgreSQL; keys written meanwhile by someone else are updated, never duplicated."""

from __future__ import annotations

from dataclasses import asdict

from cachectl.core.fingerprint import Environment
from cachectl.index import NewEntry, open_index
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
        assert index.upsert_entries(twin.id, rows) == (1200, 0)
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
