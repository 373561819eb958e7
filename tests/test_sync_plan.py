"""A sync does what its dry run plans, though the real run plans and reads a namespace at a time and
leaves new files' sizes and ages to the read (local disk): every kind of change at once, on each
store."""

from __future__ import annotations

import dataclasses
import os
import time
from datetime import timedelta

import pytest
from support.lifecycle import CACHE, fake_env, setup_cache, write_entries

from cachectl.context import Context
from cachectl.core.config import load_settings
from cachectl.lifecycle.sync import _ahead, _readers, sync
from cachectl.lifecycle.sync_plan import SyncEntry, plan_sync
from cachectl.storage.entries import CACHE_SUFFIX, EXECUTABLE_SUFFIX, make_entry, sha256
from cachectl.storage.store import LOCAL_READ_WORKERS, Store


def _key(data: bytes) -> str:
    return f"jit_new-{sha256(data)}"


def _old(store: Store, rel: str) -> None:
    """Age a local file past --min-age (object stores keep their upload time)."""
    if store.is_local:
        then = time.time() - 3600
        os.utime(f"{store.root}/{rel}", (then, then))


def _plan_as_data(plan) -> dict:
    out = dataclasses.asdict(plan)
    for ns in out["namespaces"]:
        ns["environment"] = None  # compared by digest
    return out


@pytest.mark.parametrize("min_age", [timedelta(0), timedelta(minutes=5)])
def test_a_sync_does_what_its_dry_run_planned(
    storage_root: str, tmp_path, min_age: timedelta
) -> None:
    db = f"sqlite:///{tmp_path}/index.db"
    index, store = setup_cache(db, storage_root)
    env, other = fake_env("0.10.2"), fake_env("0.10.2", device_kind="TPU v5e", backend="tpu")
    first = write_entries(index, store, env, 6)
    write_entries(index, store, other, 2)
    ns = env.namespace
    for key in first.keys:
        _old(store, f"{ns}/{key}{CACHE_SUFFIX}")
    new = [make_entry(os.urandom(100 + i), compile_seconds=2) for i in range(5)]
    for data in new:
        store.write_bytes(f"{ns}/{_key(data)}{CACHE_SUFFIX}", data)
        _old(store, f"{ns}/{_key(data)}{CACHE_SUFFIX}")
    young = make_entry(os.urandom(300), compile_seconds=1)
    store.write_bytes(
        f"{ns}/{_key(young)}{CACHE_SUFFIX}", young
    )  # just written: young under a min age
    corrupt = b"\x28\xb5\x2f\xfd" + os.urandom(40)
    store.write_bytes(f"{ns}/{_key(corrupt)}{CACHE_SUFFIX}", corrupt)
    _old(store, f"{ns}/{_key(corrupt)}{CACHE_SUFFIX}")
    changed = make_entry(os.urandom(900), compile_seconds=3)
    store.write_bytes(
        f"{ns}/{first.keys[0]}{CACHE_SUFFIX}", changed
    )  # an indexed entry, another size
    _old(store, f"{ns}/{first.keys[0]}{CACHE_SUFFIX}")
    store.write_bytes(
        f"{ns}/{first.keys[3]}{CACHE_SUFFIX}", make_entry(os.urandom(700))
    )  # changed, young
    store.write_bytes(f"{ns}/{first.keys[4]}{EXECUTABLE_SUFFIX}", b"young executable")
    store.delete([f"{ns}/{first.keys[1]}{CACHE_SUFFIX}"])  # an indexed entry gone
    store.write_bytes(
        f"{ns}/{first.keys[2]}{EXECUTABLE_SUFFIX}", b"executable"
    )  # an executable to record
    _old(store, f"{ns}/{first.keys[2]}{EXECUTABLE_SUFFIX}")
    store.write_bytes(f"{ns}/{'jit_gone-' + 'cd' * 32}{EXECUTABLE_SUFFIX}", b"orphan")
    store.write_bytes(f"{ns}/xla_gpu_per_fusion_autotune/ab/cd", b"sub-cache file")
    store.write_bytes("stray.txt", b"not a namespace")
    store.delete(
        [
            f"{other.namespace}/{k}{CACHE_SUFFIX}"
            for k in index.entry_keys(
                index.environment_stats(CACHE)[0].id
                if index.environment_stats(CACHE)[0].namespace == other.namespace
                else index.environment_stats(CACHE)[1].id
            )
        ]
    )
    store.delete([f"{other.namespace}/env.json"])  # a namespace gone from storage

    ctx = Context(load_settings(db=db, cache=CACHE))
    cache = ctx.cache()
    planned = sync(ctx, cache, dry_run=True, min_age=min_age)
    assert planned.plan == plan_sync(ctx, cache, min_age=min_age)
    done = sync(ctx, cache, min_age=min_age)

    assert _plan_as_data(done.plan) == _plan_as_data(planned.plan)
    (item,) = [n for n in done.plan.namespaces if n.namespace == ns]
    if min_age and not store.is_local:  # objects cannot be aged: every new or changed file is young
        assert not item.add and not item.update and done.entries_added == done.entries_updated == 0
        assert {e.key for e in item.too_young} >= {_key(d) for d in new}
        return
    expect_young = (
        (sorted([_key(young), first.keys[3]]) + [first.keys[4] + EXECUTABLE_SUFFIX])
        if min_age
        else []
    )
    assert [
        e.key for e in item.too_young
    ] == expect_young  # entries in name order, then executables
    assert sorted(e.key for e in item.add) == sorted(
        [_key(d) for d in new] + [_key(corrupt)] + ([] if min_age else [_key(young)])
    )
    assert all(e.size is not None for e in item.add + item.too_young)
    assert [e.key for e in item.update] == sorted(
        [first.keys[0]] + ([] if min_age else [first.keys[3]])
    )
    assert [e.key for e in item.drop] == [first.keys[1]]
    assert [e.key for e in item.record_aot] == sorted(
        [first.keys[2]] + ([] if min_age else [first.keys[4]])
    )
    assert done.plan.orphan_executables == [f"{ns}/{'jit_gone-' + 'cd' * 32}{EXECUTABLE_SUFFIX}"]
    assert done.plan.stray_files == ["stray.txt"] and done.plan.environments_gone == [
        other.namespace
    ]

    assert done.entries_added == len(new) + (0 if min_age else 1)
    assert done.entries_updated == (1 if min_age else 2) and done.executables_recorded == (
        1 if min_age else 2
    )
    assert done.rows_dropped == 1 and done.environments_marked_deleted == 1
    assert len(done.broken) == 1 and _key(corrupt) in done.broken[0]
    rows = index.entry_keys(first.info.id)
    assert rows[first.keys[0]] == (len(changed), sha256(changed))
    for data in new:
        assert rows[_key(data)] == (len(data), sha256(data))
    assert (
        (_key(young) in rows) == (not min_age)
        and _key(corrupt) not in rows
        and first.keys[1] not in rows
    )

    again = sync(ctx, cache, min_age=min_age)  # re-run: only what was left is left
    assert again.entries_added == again.entries_updated == again.rows_dropped == 0
    ctx.close()
    index.close()


def test_dir_stats_is_the_listing_depth_first(storage_root: str) -> None:
    """dir_stats gives list()'s files by directory, a directory's subdirectories right after it;
    without stats (local disk) stat_in_dir gives the same sizes and times."""
    store = Store(storage_root)
    paths = ["a/x", "a/b/y", "a/b-c/z", "a/b/d/w", "top", "a0/v"]
    for i, rel in enumerate(paths):
        store.write_bytes(rel, b"x" * (i + 1))
    dirs = list(store.dir_stats(""))
    assert [d for d, _ in dirs] == ["", "a", "a/b", "a/b/d", "a/b-c", "a0"]
    flat = sorted(
        (f"{d}/{n}" if d else n, size, mtime) for d, files in dirs for n, size, mtime in files
    )
    assert [f[:2] for f in flat] == [(f.path, f.size) for f in store.list("")]
    bare = list(store.dir_stats("", stat=False))
    assert [d for d, _ in bare] == [d for d, _ in dirs]
    for (d, files), (_, listed) in zip(bare, dirs, strict=True):
        assert [f[0] for f in files] == [f[0] for f in listed]
        stats = store.stat_in_dir(d, [f[0] for f in files] + ["not-there"])
        assert {n: s for n, s in stats.items()} == {n: (size, mtime) for n, size, mtime in listed}
        if not store.is_local:
            assert files == listed  # object stores list sizes and times anyway


def test_ahead_raises_the_producers_error_and_stops_it_when_left() -> None:
    def failing():
        yield 1
        raise ValueError("boom")

    with pytest.raises(ValueError, match="boom"), _ahead(failing()) as items:
        assert next(items) == 1
        next(items)

    closed = []

    def endless():
        try:
            n = 0
            while True:
                n += 1
                yield n
        finally:
            closed.append(True)

    with _ahead(endless(), depth=1) as items:
        assert [next(items) for _ in range(3)] == [1, 2, 3]
    assert closed == [True]  # the block was left: the producer's generator was closed on its thread


def test_a_first_sync_of_big_entries_reads_them_on_threads(tmp_path) -> None:
    """New files' sizes are left to their reads, so the readers are chosen from a few stat'ed: big
    entries (hashing releases the GIL) read on threads from the first piece, small ones on one."""
    store = Store(str(tmp_path))
    for name, size in (("big", 300 << 10), ("small", 1 << 10)):
        for i in range(4):
            store.write_bytes(f"ns/{name}/jit_f-{i:064x}{CACHE_SUFFIX}", b"x" * size)
    for name, expect in (("big", LOCAL_READ_WORKERS), ("small", 1)):
        entries = [SyncEntry(f"ns/{name}", f"jit_f-{i:064x}", None) for i in range(4)]
        assert _readers(store, f"ns/{name}", entries, None) == expect
        assert _readers(store, f"ns/{name}", entries, 1 << 10) == 1  # the mean read so far decides


def test_sync_writes_rows_in_transactions_of_write_rows_and_a_namespaces_rest_with_its_end(
    tmp_path, monkeypatch
) -> None:
    """Pieces are read a few files at a time, but written WRITE_ROWS rows to a transaction (each
    commit rewrites every page its rows touched); a namespace's rest goes with its last piece, so
    no row is written under another namespace's environment and none is left behind."""
    from cachectl.lifecycle import sync as sync_module

    db = f"sqlite:///{tmp_path / 'index.db'}"
    index, store = setup_cache(db, str(tmp_path / "root"))
    other, _ = setup_cache(f"sqlite:///{tmp_path / 'other.db'}", str(tmp_path / "root"))
    envs = [fake_env("0.8.0"), fake_env("0.9.0")]
    stored = {
        e.namespace: write_entries(other, store, e, n) for e, n in zip(envs, (13, 4), strict=True)
    }
    other.close()
    index.close()
    monkeypatch.setattr(sync_module, "PIECE_ENTRIES", 2)
    monkeypatch.setattr(sync_module, "WRITE_ROWS", 5)
    writes: list[tuple[int, int]] = []
    real = sync_module.insert_observed_rows

    def counted(index, env_id, rows):
        writes.append((env_id, len(rows)))
        return real(index, env_id, rows)

    monkeypatch.setattr(sync_module, "insert_observed_rows", counted)
    ctx = Context(load_settings(db=db, cache=CACHE))
    try:
        result = sync(ctx, ctx.cache(), min_age=timedelta(0))
        assert result.entries_added == 17
        ids = {ns: ctx.index.ensure_environment(CACHE, p.env).id for ns, p in stored.items()}
        first, second = (ids[e.namespace] for e in envs)
        assert writes == [(first, 6), (first, 6), (first, 1), (second, 4)]
        for ns, populated in stored.items():
            assert set(ctx.index.entry_keys(ids[ns])) == set(populated.keys)
    finally:
        ctx.close()
