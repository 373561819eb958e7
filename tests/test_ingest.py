"""cachectl/storage/ingest.py on a real index (SQLite and PostgreSQL) and local storage: what it refuses
writes nothing, what it accepts is written before it is indexed, with the sha256 it computed."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest
from support.environments import ENV

from cachectl.core.errors import EntryConflict, QuotaExceeded
from cachectl.index import NewEntry, open_index
from cachectl.index import db as index_db
from cachectl.storage import ingest, ingest_rules
from cachectl.storage.entries import make_entry, parse_key
from cachectl.storage.store import Store


@pytest.fixture
def target(db_url: str, tmp_path: Path):
    engine = index_db.make_engine(db_url)
    index_db.upgrade(engine)
    idx = open_index(db_url)
    root = str(tmp_path / "cache")
    cache = idx.ensure_cache("c", root)
    env = idx.ensure_environment("c", ENV)
    yield ingest.Target(idx, cache, env, Store(root))
    idx.close()
    engine.dispose()


def _key(i: int):
    parsed = parse_key(f"jit_f-{i:064x}")
    assert parsed is not None
    return parsed


def _spool(tmp_path: Path, data: bytes) -> ingest.Spool:
    spool = ingest.Spool(str(tmp_path))
    spool.write(data[:7])
    spool.write(data[7:])
    return spool.finish()


def _files(t: ingest.Target) -> list[str]:
    ns = Path(t.store.url_for(t.env.namespace))
    return sorted(p.name for p in ns.iterdir() if p.name != "env.json") if ns.exists() else []


def test_one_upload_refused_claim_bomb_then_stored_once(
    target: ingest.Target, tmp_path: Path
) -> None:
    data = make_entry(os.urandom(2000), 3)
    body = _spool(tmp_path, data)
    assert (body.size, body.sha256) == (len(data), hashlib.sha256(data).hexdigest())
    with pytest.raises(ingest_rules.Refused) as claim:
        ingest.ingest_entry(
            target, _key(1), body, origin="upload", expand_to=1 << 20, claimed_sha256="0" * 64
        )
    with pytest.raises(ingest_rules.Refused) as bomb:
        ingest.ingest_entry(target, _key(1), body, origin="upload", expand_to=100)
    assert (claim.value.rule, bomb.value.rule) == (ingest_rules.SHA256, ingest_rules.EXPANDS)
    assert _files(target) == [] and target.index.get_entry(target.env.id, _key(1).key) is None

    done = ingest.ingest_entry(
        target,
        _key(1),
        body,
        origin="upload",
        expand_to=1 << 20,
        claimed_sha256=body.sha256.upper(),
    )
    assert done.outcome == "inserted" and done.entry is not None
    assert (done.entry.sha256, done.entry.compile_time_ms, done.entry.origin) == (
        body.sha256,
        3000,
        "upload",
    )
    assert target.store.read_bytes(target.path(_key(1).key, "-cache")) == data
    again = ingest.ingest_entry(target, _key(1), body, origin="upload", expand_to=1 << 20)
    assert again.outcome == "unchanged"
    other = _spool(tmp_path, make_entry(os.urandom(2000), 3))
    with pytest.raises(EntryConflict):
        ingest.ingest_entry(target, _key(1), other, origin="upload", expand_to=1 << 20)
    assert target.store.read_bytes(target.path(_key(1).key, "-cache")) == data


def test_check_new_computes_the_sha256_and_refuses_what_is_not_an_entry(
    target: ingest.Target,
) -> None:
    data = make_entry(os.urandom(500), 2)
    row = ingest.check_new(target.cache, _key(2), data, origin="push", function="f")
    assert (row.sha256, row.size, row.compile_time_ms, row.function) == (
        hashlib.sha256(data).hexdigest(),
        len(data),
        2000,
        "f",
    )
    with pytest.raises(ingest_rules.Refused) as exc:
        ingest.check_new(target.cache, _key(2), b"\x28\xb5\x2f\xfd not zstd", origin="push")
    assert exc.value.rule == ingest_rules.CORRUPT


def test_a_batch_over_a_limit_writes_nothing(target: ingest.Target) -> None:
    datas = [make_entry(os.urandom(4000), 1) for _ in range(3)]
    objects = [
        ingest.NewObject(ingest.check_new(target.cache, _key(i), d, origin="push"), d)
        for i, d in enumerate(datas)
    ]
    small = target.index.update_cache("c", max_size=5000)
    with pytest.raises(QuotaExceeded):
        ingest.publish(target.index, small, ENV, target.env.id, target.store, objects)
    strict = target.index.update_cache("c", max_size=None, max_entry_size=1000)
    with pytest.raises(ingest_rules.Refused) as exc:
        ingest.publish(target.index, strict, ENV, target.env.id, target.store, objects)
    assert exc.value.rule == ingest_rules.TOO_LARGE
    assert _files(target) == [] and target.index.entry_keys(target.env.id) == {}

    free = target.index.update_cache("c", max_entry_size=None)
    published = ingest.publish(target.index, free, ENV, target.env.id, target.store, objects)
    assert published.failed == {} and len(published.rows) == 3
    assert _files(target) == sorted(f"{_key(i).key}-cache" for i in range(3))
    assert target.index.entry_keys(target.env.id) == {
        o.row.key: (o.row.size, o.row.sha256) for o in objects
    }


def test_a_batch_never_indexes_what_it_could_not_write(
    target: ingest.Target, tmp_path: Path
) -> None:
    data = make_entry(os.urandom(300), 1)
    ok = ingest.NewObject(ingest.check_new(target.cache, _key(5), data, origin="bundle"), data)
    missing = NewEntry(key=_key(6).key, module="jit_f", size=10, sha256="0" * 64, origin="bundle")
    gone = ingest.NewObject(missing, tmp_path / "not-staged")  # a staging file that is not there
    published = ingest.publish(
        target.index, target.cache, ENV, target.env.id, target.store, [ok, gone]
    )
    assert set(published.failed) == {_key(6).key} and published.failed[_key(6).key][0] == "entry"
    assert set(target.index.entry_keys(target.env.id)) == {_key(5).key}


def test_an_entry_already_in_storage_is_indexed_without_a_write(target: ingest.Target) -> None:
    """What warm records: the entry JAX wrote itself is indexed as it is, never rewritten."""
    data = make_entry(os.urandom(300), 1)
    path = Path(target.store.url_for(target.path(_key(7).key, "-cache")))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    before = path.stat().st_mtime_ns, path.stat().st_ino
    row = ingest.check_new(target.cache, _key(7), data, origin="warm")
    published = ingest.publish(
        target.index,
        target.cache,
        ENV,
        target.env.id,
        target.store,
        [
            ingest.NewObject(row, in_storage=True),
            ingest.NewObject(ingest.check_new(target.cache, _key(8), data, origin="warm")),
        ],
    )
    assert [r.key for r in published.rows] == [_key(7).key]
    assert (path.stat().st_mtime_ns, path.stat().st_ino) == before
    assert target.index.entry_keys(target.env.id) == {_key(7).key: (len(data), row.sha256)}
