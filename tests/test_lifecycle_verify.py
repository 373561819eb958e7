"""`cachectl verify`: tampered, truncated and unknown files; quarantine; sidecar repair."""

from __future__ import annotations

import json
import os

from support.lifecycle import (
    CACHE,
    assert_consistent,
    cachectl,
    fake_env,
    setup_cache,
    storage_entries,
    write_entries,
)

from cachectl.storage.entries import CACHE_SUFFIX, make_entry


def test_finds_tampered_truncated_unknown_and_quarantines_all_three(storage_root, sqlite_url):
    index, store = setup_cache(sqlite_url, storage_root)
    p = write_entries(index, store, fake_env("0.10.2"), 5)
    ns = p.env.namespace
    tampered, truncated = (f"{ns}/{k}{CACHE_SUFFIX}" for k in p.keys[:2])
    data = bytearray(store.read_bytes(tampered))
    data[len(data) // 2] ^= 0x01  # one flipped bit
    store.write_bytes(tampered, bytes(data))
    store.write_bytes(truncated, store.read_bytes(truncated)[:20])
    unknown = f"{ns}/jit_intruder-{'ab' * 32}{CACHE_SUFFIX}"
    store.write_bytes(unknown, make_entry(b"not from us"))

    res = cachectl(sqlite_url, "verify", "--json")
    assert res.exit_code == 1
    out = json.loads(res.stdout)
    kinds = {f["path"]: f["kind"] for f in out["plan"]["findings"]}
    assert kinds[tampered] in ("mismatch", "corrupt")
    assert kinds[truncated] == "corrupt"
    assert kinds[unknown] == "unknown-writer"
    assert len(kinds) == 3 and out["plan"]["entries_checked"] == 5

    dry = cachectl(sqlite_url, "verify", "--quarantine", "--min-age", "0s", "--dry-run")
    assert dry.exit_code == 1 and store.exists(unknown)

    res = cachectl(sqlite_url, "verify", "--quarantine", "--min-age", "0s", "--json")
    assert res.exit_code == 1, res.output
    out = json.loads(res.stdout)
    assert out["quarantined"] == 3
    qdir = out["plan"]["quarantine_dir"]
    assert qdir.startswith(".quarantine/") and qdir.endswith("Z")
    moved = sorted(f.path for f in store.list(".quarantine"))
    assert moved == sorted(f"{qdir}/{p}" for p in (tampered, truncated, unknown))
    assert storage_entries(store)[ns] == set(p.keys[2:])
    assert_consistent(index, store)  # the two bad rows went with their files
    audit = index.audit_log(CACHE)[0]
    assert audit.operation == "verify" and audit.details["quarantined"] == 3
    assert sorted(audit.details["moved"]) == sorted([tampered, truncated, unknown])
    assert cachectl(sqlite_url, "verify").exit_code == 0


def test_recent_unknown_files_are_not_quarantined(tmp_path, sqlite_url):
    index, store = setup_cache(sqlite_url, str(tmp_path / "cache"))
    p = write_entries(index, store, fake_env("0.10.2"), 1)
    unknown = f"{p.env.namespace}/jit_new-{'cd' * 32}{CACHE_SUFFIX}"
    store.write_bytes(unknown, make_entry(b"a writer about to index this"))
    res = cachectl(sqlite_url, "verify", "--quarantine", "--json")  # default --min-age 10m
    assert res.exit_code == 1
    (finding,) = json.loads(res.stdout)["plan"]["findings"]
    assert finding["action"] == "" and "not quarantined" in finding["detail"]
    assert store.exists(unknown)


def test_sidecars_repaired_and_missing_rows_dropped(tmp_path, sqlite_url):
    index, store = setup_cache(sqlite_url, str(tmp_path / "cache"))
    p = write_entries(index, store, fake_env("0.10.2"), 4, lockfile=True)
    ns = p.env.namespace
    root = tmp_path / "cache" / ns
    os.remove(root / f"{p.keys[0]}-atime")  # -cache without -atime
    os.remove(
        root / f"{p.keys[1]}{CACHE_SUFFIX}"
    )  # -atime without -cache, and a row without a file
    res = cachectl(sqlite_url, "verify", "--json")
    assert res.exit_code == 1
    counts = json.loads(res.stdout)["plan"]["counts"]
    assert counts == {"missing-atime": 1, "orphan-atime": 1, "missing": 1}
    assert not (root / f"{p.keys[0]}-atime").exists()  # plain verify changes nothing

    res = cachectl(sqlite_url, "verify", "--repair", "--json")
    assert res.exit_code == 1  # it found problems, even though it fixed them
    out = json.loads(res.stdout)
    assert (out["atimes_written"], out["atimes_deleted"], out["rows_dropped"]) == (1, 1, 1)
    atime = (root / f"{p.keys[0]}-atime").read_bytes()
    assert len(atime) == 8 and int.from_bytes(atime, "little") > 0
    assert not (root / f"{p.keys[1]}-atime").exists()
    assert_consistent(index, store)
    assert cachectl(sqlite_url, "verify").exit_code == 0


def test_unindexed_namespace_is_reported_not_touched(tmp_path, sqlite_url):
    index, store = setup_cache(sqlite_url, str(tmp_path / "cache"))
    p = write_entries(index, store, fake_env("0.10.2"), 2)
    stray = write_entries(index, store, fake_env("0.9.1"), 2)
    index.mark_environment_deleted(stray.info.id)  # storage has it, the index does not
    res = cachectl(sqlite_url, "verify", "--quarantine", "--min-age", "0s", "--json")
    assert res.exit_code == 1
    (finding,) = json.loads(res.stdout)["plan"]["findings"]
    assert finding["kind"] == "unindexed-namespace" and "cachectl sync" in finding["detail"]
    assert storage_entries(store)[stray.env.namespace] == set(stray.keys)
    assert storage_entries(store)[p.env.namespace] == set(p.keys)


def test_verify_one_environment_and_bad_prefix(tmp_path, sqlite_url):
    index, store = setup_cache(sqlite_url, str(tmp_path / "cache"))
    a = write_entries(index, store, fake_env("0.10.2"), 2)
    b = write_entries(index, store, fake_env("0.9.1"), 3)
    store.write_bytes(f"{b.env.namespace}/{b.keys[0]}{CACHE_SUFFIX}", b"garbage")
    res = cachectl(sqlite_url, "verify", "--env", a.info.digest[:8], "--json")
    assert res.exit_code == 0 and json.loads(res.stdout)["plan"]["entries_checked"] == 2
    assert cachectl(sqlite_url, "verify", "--env", b.info.digest[:8]).exit_code == 1
    res = cachectl(sqlite_url, "verify", "--env", "zz")
    assert res.exit_code == 2 and "bad environment digest prefix" in res.output
