"""`cachectl prune`: selectors, whole-namespace deletes, protection and bad input (local disk)."""

from __future__ import annotations

import json
import os
from datetime import timedelta

import pytest
from sqlalchemy import insert
from support.lifecycle import (
    CACHE,
    assert_consistent,
    cachectl,
    fake_env,
    index_entries,
    setup_cache,
    storage_entries,
    write_entries,
)

from cachectl.index.models import WarmRun, utcnow


@pytest.fixture
def upgraded(tmp_path, sqlite_url):
    """A cache after two JAX upgrades: 0.8.0, 0.9.1 and 0.10.2 namespaces of 5 entries each."""
    index, store = setup_cache(sqlite_url, str(tmp_path / "cache"))
    envs = {v: write_entries(index, store, fake_env(v), 5) for v in ("0.8.0", "0.9.1", "0.10.2")}
    yield sqlite_url, index, store, envs
    index.close()


def test_superseded_keep_1_deletes_two_keeps_newest(tmp_path, db_url):
    index, store = setup_cache(db_url, str(tmp_path / "cache"))
    envs = {v: write_entries(index, store, fake_env(v), 5) for v in ("0.8.0", "0.9.1", "0.10.2")}
    res = cachectl(db_url, "prune", "--superseded", "--keep", "1", "--json")
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout)
    assert out["execution"]["namespaces_deleted"] == 2
    assert out["execution"]["entries_deleted"] == 10
    assert out["execution"]["storage_calls"] == 2  # one recursive delete per namespace
    assert set(storage_entries(store)) == {envs["0.10.2"].env.namespace}
    assert not os.path.exists(tmp_path / "cache" / "jax-0.8.0")  # empty parents tidied
    live = index.environment_stats(CACHE)
    assert [e.environment.jax_version for e in live] == ["0.10.2"]
    gone = [
        e for e in index.environment_stats(CACHE, include_deleted=True) if e.deleted_at is not None
    ]
    assert sorted(e.environment.jax_version for e in gone) == ["0.8.0", "0.9.1"]
    assert_consistent(index, store)
    audit = index.audit_log(CACHE)[0]
    assert (audit.operation, audit.entries, audit.details["namespaces_deleted"]) == ("prune", 10, 2)
    assert audit.bytes > 0 and audit.duration_ms is not None and "@" in audit.actor
    # Idempotent: nothing left to do.
    again = json.loads(cachectl(db_url, "prune", "--superseded", "--json").stdout)
    assert again["plan"]["entry_count"] == 0


def test_jax_version_specifier(upgraded):
    db, index, store, envs = upgraded
    res = cachectl(db, "prune", "--jax-version", ">=0.9,<0.10", "--dry-run", "--json")
    assert [n["jax_version"] for n in json.loads(res.stdout)["plan"]["namespaces"]] == ["0.9.1"]
    res = cachectl(db, "prune", "--jax-version", "<0.10")
    assert res.exit_code == 0, res.output
    # 0.10.2 > 0.10 in PEP 440 ordering: only 0.8.0 and 0.9.1 go.
    assert set(storage_entries(store)) == {envs["0.10.2"].env.namespace}
    assert_consistent(index, store)


def test_superseded_is_per_hardware_group_and_keep_n(tmp_path, sqlite_url):
    index, store = setup_cache(sqlite_url, str(tmp_path / "cache"))
    cpu = {v: write_entries(index, store, fake_env(v), 2) for v in ("0.8.0", "0.9.1", "0.10.2")}
    gpu = write_entries(index, store, fake_env("0.9.1", backend="gpu", device_kind="H100"), 2)
    flagged = write_entries(index, store, fake_env("0.8.0", xla_flags=("--xla_cpu_foo=1",)), 2)
    res = json.loads(
        cachectl(sqlite_url, "prune", "--superseded", "--keep", "2", "--dry-run", "--json").stdout
    )
    # Only the cpu group without flags has more than two versions; its oldest goes.
    assert [n["namespace"] for n in res["plan"]["namespaces"]] == [cpu["0.8.0"].env.namespace]
    res = json.loads(cachectl(sqlite_url, "prune", "--superseded", "--dry-run", "--json").stdout)
    assert sorted(n["jax_version"] for n in res["plan"]["namespaces"]) == ["0.8.0", "0.9.1"]
    assert gpu.env.namespace not in {n["namespace"] for n in res["plan"]["namespaces"]}
    assert flagged.env.namespace not in {n["namespace"] for n in res["plan"]["namespaces"]}


def test_entry_selectors_pick_entries_or_whole_namespaces(tmp_path, db_url):
    index, store = setup_cache(db_url, str(tmp_path / "cache"))
    ages = [0, 1, 10, 20, 40]
    young = write_entries(index, store, fake_env("0.10.2"), 5, age_days=ages)
    old = write_entries(index, store, fake_env("0.9.1"), 3, age_days=[40, 50, 60])
    res = json.loads(cachectl(db_url, "prune", "--older-than", "15d", "--json").stdout)
    plan = res["plan"]
    assert [n["namespace"] for n in plan["namespaces"]] == [
        old.env.namespace
    ]  # every entry old: whole
    assert sorted(e["key"] for e in plan["entries"]) == sorted(young.keys[3:])
    assert storage_entries(store) == {young.env.namespace: set(young.keys[:3])}
    assert_consistent(index, store)


def test_unused_for_uses_last_access_then_created(tmp_path, sqlite_url):
    index, store = setup_cache(sqlite_url, str(tmp_path / "cache"))
    p = write_entries(index, store, fake_env("0.10.2"), 4, age_days=[30, 30, 30, 1])
    index.record_hits(p.info.id, {p.keys[0]: (3, utcnow() - timedelta(days=1))})
    res = cachectl(sqlite_url, "prune", "--unused-for", "7d")
    assert res.exit_code == 0, res.output
    # keys[0] was used yesterday; keys[3] never used but created yesterday.
    assert storage_entries(store)[p.env.namespace] == {p.keys[0], p.keys[3]}
    assert_consistent(index, store)


def test_function_and_env_selectors(upgraded):
    db, index, store, envs = upgraded
    target = envs["0.9.1"]
    res = cachectl(db, "prune", "--env", target.info.digest[:10], "--function", "f0")
    assert res.exit_code == 0, res.output
    f0 = {k for k in target.keys if k.startswith("jit_f0-")}
    assert f0 and storage_entries(store)[target.env.namespace] == set(target.keys) - f0
    for other in ("0.8.0", "0.10.2"):
        assert storage_entries(store)[envs[other].env.namespace] == set(envs[other].keys)
    assert_consistent(index, store)


def test_no_selector_uses_retention_or_refuses(tmp_path, sqlite_url):
    index, store = setup_cache(sqlite_url, str(tmp_path / "cache"))
    p = write_entries(index, store, fake_env("0.10.2"), 3, age_days=[1, 10, 40])
    res = cachectl(sqlite_url, "prune")
    assert res.exit_code == 2
    assert "needs a selector" in res.output and len(res.output.strip().splitlines()) == 1
    index.update_cache(CACHE, retention_seconds=30 * 86400)
    res = cachectl(sqlite_url, "prune", "--json")
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["plan"]["criteria"] == {
        "older_than": "30d",
        "from_retention": True,
    }
    assert storage_entries(store)[p.env.namespace] == set(p.keys[:2])


def test_warm_in_progress_protects_environment(upgraded):
    db, index, store, envs = upgraded
    now = utcnow()
    with index.session() as s:
        s.execute(
            insert(WarmRun).values(
                environment_id=envs["0.8.0"].info.id,
                manifest_digest="m",
                host="h",
                user="u",
                status="running",
                started_at=now,
                heartbeat_at=now,
            )
        )
        # A warm that stopped beating 20 minutes ago protects nothing.
        s.execute(
            insert(WarmRun).values(
                environment_id=envs["0.9.1"].info.id,
                manifest_digest="m",
                host="h",
                user="u",
                status="running",
                started_at=now - timedelta(hours=1),
                heartbeat_at=now - timedelta(minutes=20),
            )
        )
    res = cachectl(db, "prune", "--superseded", "--json")
    assert res.exit_code == 0, res.output
    plan = json.loads(res.stdout)["plan"]
    assert [n["jax_version"] for n in plan["namespaces"]] == ["0.9.1"]
    assert plan["protected"][0]["namespace"] == envs["0.8.0"].env.namespace
    assert "warm run" in plan["protected"][0]["reason"]
    assert envs["0.8.0"].env.namespace in storage_entries(store)


def test_sidecars_go_with_their_entries(tmp_path, sqlite_url):
    index, store = setup_cache(sqlite_url, str(tmp_path / "cache"))
    p = write_entries(index, store, fake_env("0.10.2"), 3, age_days=[1, 40, 40], lockfile=True)
    assert cachectl(sqlite_url, "prune", "--older-than", "30d").exit_code == 0
    names = sorted(os.listdir(tmp_path / "cache" / p.env.namespace))
    assert names == sorted([".lockfile", "env.json", f"{p.keys[0]}-cache", f"{p.keys[0]}-atime"])


def _state(index, store):
    return storage_entries(store), index_entries(index)


@pytest.mark.parametrize(
    "args, message",
    [
        (["--older-than", "30x"], "bad duration '30x'"),
        (["--unused-for", "-3d"], "bad duration"),
        (["--jax-version", "<<0.10"], "bad --jax-version '<<0.10'"),
        (["--jax-version", "latest"], "bad --jax-version"),
        (["--env", "ffffffffffffffff0"], "no environment"),
        (["--env", "xyz"], "bad environment digest prefix"),
        (["--keep", "2"], "--keep only goes with --superseded"),
        (["--superseded", "--keep", "0"], "--keep must be at least 1"),
    ],
)
def test_bad_input_exits_2_and_deletes_nothing(upgraded, args, message):
    db, index, store, _envs = upgraded
    before = _state(index, store)
    res = cachectl(db, "prune", *args)
    assert res.exit_code == 2, res.output
    assert message in res.output
    assert res.output.startswith("cachectl: error: ") and len(res.output.strip().splitlines()) == 1
    assert _state(index, store) == before
    assert index.audit_log(CACHE) == []


def test_ambiguous_env_prefix_and_unknown_cache_exit_2(tmp_path, sqlite_url):
    index, store = setup_cache(sqlite_url, str(tmp_path / "cache"))
    seen: dict[str, str] = {}
    version = 0
    while True:  # environments until two digests share a first hex digit
        env = fake_env(f"0.4.{version}")
        version += 1
        write_entries(index, store, env, 1)
        if env.digest[0] in seen:
            break
        seen[env.digest[0]] = env.digest
    before = _state(index, store)
    res = cachectl(sqlite_url, "prune", "--env", env.digest[0])
    assert res.exit_code == 2 and "matches 2 environments" in res.output
    res = cachectl(sqlite_url, "prune", "--older-than", "1d", cache="nope")
    assert res.exit_code == 2 and "no cache named 'nope'" in res.output
    assert _state(index, store) == before


def test_not_a_writer_exits_4(upgraded):
    db, index, store, _envs = upgraded
    index.update_cache(CACHE, writers=["someone-else"])
    before = _state(index, store)
    res = cachectl(db, "prune", "--superseded")
    assert res.exit_code == 4 and "may not prune" in res.output
    assert _state(index, store) == before
    # Looking is allowed.
    assert cachectl(db, "prune", "--superseded", "--dry-run").exit_code == 0
