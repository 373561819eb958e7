"""prune, gc and verify on every backend: local disk, memory, S3 (moto), GCS (emulator) × SQLite, PostgreSQL.

One flow per combination keeps the matrix cheap: an upgrade leaves three JAX
versions, prune --superseded removes two, gc trims the rest to a limit,
verify finds a tampered entry and --quarantine moves it.
"""

from __future__ import annotations

import json

from support.lifecycle import (
    assert_consistent,
    cachectl,
    fake_env,
    setup_cache,
    storage_entries,
    total_bytes,
    write_entries,
)

from cachectl.storage.entries import CACHE_SUFFIX


def test_prune_gc_verify_on_every_backend(storage_root, db_url):
    index, store = setup_cache(db_url, storage_root)
    old = write_entries(index, store, fake_env("0.8.0"), 4)
    mid = write_entries(index, store, fake_env("0.9.1"), 4)
    new = write_entries(index, store, fake_env("0.10.2"), 6, age_days=[5, 4, 3, 2, 1, 0])

    # Plan only: nothing moves.
    dry = cachectl(db_url, "prune", "--superseded", "--keep", "1", "--dry-run", "--json")
    assert dry.exit_code == 0, dry.output
    plan = json.loads(dry.stdout)["plan"]
    assert sorted(n["jax_version"] for n in plan["namespaces"]) == ["0.8.0", "0.9.1"]
    assert plan["entry_count"] == 8 and plan["bytes_to_free"] > 0
    assert set(storage_entries(store)) == {old.env.namespace, mid.env.namespace, new.env.namespace}

    res = cachectl(db_url, "prune", "--superseded", "--keep", "1")
    assert res.exit_code == 0, res.output
    assert set(storage_entries(store)) == {new.env.namespace}
    assert [e.environment.jax_version for e in index.environment_stats("lc")] == ["0.10.2"]
    assert_consistent(index, store)

    # gc: keep the newest entries under a limit that fits about half.
    limit = total_bytes(index) // 2
    res = cachectl(db_url, "gc", "--max-size", str(limit), "--json")
    assert res.exit_code == 0, res.output
    assert total_bytes(index) <= limit
    kept = storage_entries(store)[new.env.namespace]
    assert new.keys[-1] in kept and new.keys[0] not in kept  # the oldest went first
    assert_consistent(index, store)

    clean = cachectl(db_url, "verify", "--json")
    assert clean.exit_code == 0, clean.output
    victim = sorted(kept)[0]
    path = f"{new.env.namespace}/{victim}{CACHE_SUFFIX}"
    data = bytearray(store.read_bytes(path))
    data[len(data) // 2] ^= 0xFF
    store.write_bytes(path, bytes(data))
    res = cachectl(db_url, "verify", "--json")
    assert res.exit_code == 1
    findings = json.loads(res.stdout)["plan"]["findings"]
    assert [(f["path"], f["kind"] in ("corrupt", "mismatch")) for f in findings] == [(path, True)]
    res = cachectl(db_url, "verify", "--quarantine")
    assert res.exit_code == 1, res.output
    assert not store.exists(path)
    assert [f.path for f in store.list(".quarantine")][0].endswith(path)
    assert cachectl(db_url, "verify").exit_code == 0
    assert_consistent(index, store)

    ops = [a.operation for a in index.audit_log("lc")]
    assert {"prune", "gc", "verify"} <= set(ops)
    assert all("@" in a.actor for a in index.audit_log("lc"))
