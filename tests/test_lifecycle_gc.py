"""`cachectl gc`: size limits, policies, protection; the SQL eviction cut checked against plain Python."""

from __future__ import annotations

import json
import random
from datetime import timedelta

import pytest
from sqlalchemy import insert, update
from support.lifecycle import (
    CACHE,
    assert_consistent,
    cachectl,
    fake_env,
    setup_cache,
    storage_entries,
    total_bytes,
    write_entries,
)

from cachectl.index import NewEntry
from cachectl.index.eviction_queries import plan_evictions
from cachectl.index.models import Entry, WarmRun, utcnow


def test_lru_evicts_least_recently_used(tmp_path, db_url):
    index, store = setup_cache(db_url, str(tmp_path / "cache"))
    p = write_entries(
        index, store, fake_env("0.10.2"), 6, sizes=[200] * 6, age_days=[6, 5, 4, 3, 2, 1]
    )
    # The oldest entry was used an hour ago: it is the most recently used now.
    index.record_hits(p.info.id, {p.keys[0]: (1, utcnow() - timedelta(hours=1))})
    sizes = {k: s for k, (s, _) in index.entry_keys(p.info.id).items()}
    limit = sizes[p.keys[0]] + sizes[p.keys[5]] + sizes[p.keys[4]]
    res = cachectl(db_url, "gc", "--max-size", str(limit), "--json")
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout)
    assert [e["key"] for e in out["plan"]["deletion"]["entries"]] == p.keys[1:4]
    assert storage_entries(store)[p.env.namespace] == {p.keys[0], p.keys[4], p.keys[5]}
    assert total_bytes(index) <= limit
    assert_consistent(index, store)
    assert index.audit_log(CACHE)[0].operation == "gc"


def test_cost_policy_keeps_expensive_per_byte(tmp_path, db_url):
    index, store = setup_cache(db_url, str(tmp_path / "cache"))
    # Same age; compile ms per byte: cheap-big goes first, expensive-small stays.
    p = write_entries(
        index,
        store,
        fake_env("0.10.2"),
        4,
        sizes=[2000, 200, 2000, 200],
        compile_ms=[1000, 60000, 30000, 1000],
        age_days=[1, 1, 1, 1],
    )
    res = cachectl(db_url, "gc", "--policy", "cost", "--max-size", "2500", "--json")
    assert res.exit_code == 0, res.output
    evicted = [e["key"] for e in json.loads(res.stdout)["plan"]["deletion"]["entries"]]
    assert evicted[0] == p.keys[0]  # 1 s for 2 kB: cheapest per byte
    assert p.keys[1] in storage_entries(store)[p.env.namespace]  # 60 s for 200 B: kept
    assert total_bytes(index) <= 2500


def test_env_max_size_trims_each_environment(tmp_path, sqlite_url):
    index, store = setup_cache(sqlite_url, str(tmp_path / "cache"))
    a = write_entries(index, store, fake_env("0.10.2"), 5, sizes=[300] * 5)
    b = write_entries(index, store, fake_env("0.9.1"), 2, sizes=[300] * 2)
    one = index.entry_keys(a.info.id)[a.keys[0]][0]
    index.update_cache(CACHE, env_max_size=one * 2 + 10)
    res = cachectl(sqlite_url, "gc", "--json")
    assert res.exit_code == 0, res.output
    on_disk = storage_entries(store)
    assert on_disk[a.env.namespace] == set(a.keys[:2])  # the two newest of five
    assert on_disk[b.env.namespace] == set(b.keys)
    assert all(
        "env-max-size" in e["reason"] for e in json.loads(res.stdout)["plan"]["deletion"]["entries"]
    )


def _warm_run(index, env_id, status, minutes_ago):
    now = utcnow()
    at = now - timedelta(minutes=minutes_ago)
    with index.session() as s:
        return s.execute(
            insert(WarmRun)
            .values(
                environment_id=env_id,
                manifest_digest="m",
                host="h",
                user="u",
                status=status,
                started_at=at,
                heartbeat_at=at,
                finished_at=None if status == "running" else at,
            )
            .returning(WarmRun.id)
        ).scalar_one()


def test_protect_warm_and_running_warm(tmp_path, db_url):
    index, store = setup_cache(db_url, str(tmp_path / "cache"))
    a = write_entries(index, store, fake_env("0.10.2"), 4, sizes=[300] * 4, age_days=[9, 8, 7, 6])
    old_run = _warm_run(index, a.info.id, "succeeded", 600)
    new_run = _warm_run(index, a.info.id, "succeeded", 60)
    _warm_run(
        index, a.info.id, "interrupted", 5
    )  # partial: does not displace the last complete run
    with index.session() as s:
        s.execute(update(Entry).where(Entry.key.in_(a.keys[:2])).values(warm_run_id=new_run))
        s.execute(update(Entry).where(Entry.key.in_(a.keys[2:])).values(warm_run_id=old_run))
    res = cachectl(db_url, "gc", "--max-size", "1", "--protect-warm", "--json")
    assert res.exit_code == 1  # could not get under the limit: the rest is protected
    assert "still" in res.output and "over max_size" in res.output
    assert storage_entries(store)[a.env.namespace] == set(a.keys[:2])
    assert_consistent(index, store)

    b = write_entries(index, store, fake_env("0.9.1"), 2, sizes=[300] * 2)
    _warm_run(index, b.info.id, "running", 1)
    res = cachectl(db_url, "gc", "--max-size", "1", "--dry-run", "--json")
    assert res.exit_code == 0
    plan = json.loads(res.stdout)["plan"]
    assert {e["namespace"] for e in plan["deletion"]["entries"]} == {a.env.namespace}
    assert plan["deletion"]["protected"][0]["namespace"] == b.env.namespace
    assert plan["over_limit_after"] > 0


@pytest.mark.parametrize(
    "args, message",
    [
        ([], "has no size limit"),
        (["--max-size", "lots"], "bad size 'lots'"),
        (["--max-size", "0"], "--max-size must be positive"),
    ],
)
def test_gc_bad_input_exit_2(tmp_path, sqlite_url, args, message):
    index, store = setup_cache(sqlite_url, str(tmp_path / "cache"))
    p = write_entries(index, store, fake_env("0.10.2"), 2)
    res = cachectl(sqlite_url, "gc", *args)
    assert res.exit_code == 2 and message in res.output, res.output
    assert storage_entries(store)[p.env.namespace] == set(p.keys)


def _reference(rows, total, max_bytes, env_totals, env_max):
    """Plain-Python eviction: per-environment limits first, then the cache limit, in score order."""
    order = sorted(rows, key=lambda r: (r["score"], r["id"]))
    evict = set()
    if env_max is not None:
        taken = dict.fromkeys(env_totals, 0)
        for r in order:
            if taken[r["env"]] < env_totals[r["env"]] - env_max:
                evict.add(r["id"])
                taken[r["env"]] += r["size"]
    freed = sum(r["size"] for r in rows if r["id"] in evict)
    if max_bytes is not None:
        for r in order:
            if r["id"] in evict:
                continue
            if total - freed <= max_bytes:
                break
            evict.add(r["id"])
            freed += r["size"]
    return evict


@pytest.mark.parametrize("max_frac, env_frac", [(0.5, None), (None, 0.6), (0.4, 0.5), (0.95, 0.2)])
def test_eviction_sql_matches_reference(db_url, max_frac, env_frac):
    """The windowed SQL cut equals a straightforward Python greedy over the same rows."""
    from cachectl.index import open_index

    index = open_index(db_url, auto_migrate=True)
    index.add_cache(CACHE, "memory://unused")
    rng = random.Random(7)
    now = utcnow()
    rows = []
    for v in range(4):
        info = index.ensure_environment(CACHE, fake_env(f"0.{v}.0"))
        news = []
        for i in range(60):
            size = rng.randint(100, 5000)
            created = now - timedelta(minutes=rng.randint(0, 100000))
            news.append(
                NewEntry(
                    key=f"jit_f-{v:02d}{i:062d}",
                    module="jit_f",
                    size=size,
                    sha256="0" * 64,
                    origin="warm",
                    created_at=created,
                )
            )
        index.upsert_entries(info.id, news)
        hits = {
            n.key: (1, now - timedelta(minutes=rng.randint(0, 1000)))
            for n in news
            if rng.random() < 0.3
        }
        index.record_hits(info.id, hits)
    with index.session() as s:
        for e in s.query(Entry).all():
            last = e.last_access_at or e.created_at
            rows.append(
                {
                    "id": e.id,
                    "env": e.environment_id,
                    "key": e.key,
                    "size": e.size_bytes,
                    "score": last,
                }
            )
    total = sum(r["size"] for r in rows)
    env_totals: dict[int, int] = {}
    for r in rows:
        env_totals[r["env"]] = env_totals.get(r["env"], 0) + r["size"]
    max_bytes = int(total * max_frac) if max_frac else None
    env_max = int(max(env_totals.values()) * env_frac) if env_frac else None
    got, totals = plan_evictions(
        index, CACHE, policy="lru", max_bytes=max_bytes, env_max_bytes=env_max, now=now
    )
    want = _reference(rows, total, max_bytes, env_totals, env_max)
    by_key = {r["key"]: r["id"] for r in rows}
    assert totals["bytes_before"] == total
    assert {by_key[e.key] for e in got} == want
    assert len(got) == len(want) > 0
    index.close()


def _sampled_huge(db_url, samples, oldest_minutes, compile_ms_per_byte, score):
    """One environment of ``samples`` * 64 entries of 100 B, created a minute apart from
    ``oldest_minutes`` ago (oldest first), every sampled one (id % 64 == 0) 100 kB; compile time
    ``compile_ms_per_byte`` a byte (None: none). Returns the index, the environment, now, and the
    rows (score: ``score(entry)``)."""
    from cachectl.index import open_index
    from cachectl.index.eviction_walk import SAMPLE_EVERY

    index = open_index(db_url, auto_migrate=True)
    index.add_cache(CACHE, "memory://unused")
    now = utcnow()
    info = index.ensure_environment(CACHE, fake_env("0.10.2"))
    count = samples * SAMPLE_EVERY
    per_byte = compile_ms_per_byte
    index.upsert_entries(
        info.id,
        [
            NewEntry(
                key=f"jit_f-{i:064d}",
                module="jit_f",
                size=100,
                sha256="0" * 64,
                origin="warm",
                compile_time_ms=None if per_byte is None else 100 * per_byte,
                created_at=now - timedelta(minutes=oldest_minutes - i),
            )
            for i in range(count)
        ],
    )
    with index.session() as s:
        huge = (
            {"size_bytes": 100_000}
            if per_byte is None
            else {"size_bytes": 100_000, "compile_time_ms": 100_000 * per_byte}
        )
        s.execute(update(Entry).where(Entry.id % SAMPLE_EVERY == 0).values(**huge))
        rows = [
            {
                "id": e.id,
                "env": e.environment_id,
                "key": e.key,
                "size": e.size_bytes,
                "score": score(e),
            }
            for e in s.query(Entry).all()
        ]
    return index, info, now, rows


@pytest.mark.parametrize("env_frac", [None, 0.8])
def test_eviction_cut_is_exact_when_the_sample_misleads(db_url, env_frac):
    """gc reads as far as a 1-in-64 sample says the cut ends; a sample that overstates the bytes
    there (every sampled entry huge, the rest tiny) must cost a second read, never a short cut."""
    index, info, now, rows = _sampled_huge(db_url, 5, 1000, None, lambda e: e.created_at)
    total = sum(r["size"] for r in rows)
    max_bytes = total - 250_000  # more than the first sampled entry's 100 kB
    env_max = int(total * env_frac) if env_frac else None
    got, _ = plan_evictions(
        index, CACHE, policy="lru", max_bytes=max_bytes, env_max_bytes=env_max, now=now
    )
    want = _reference(rows, total, max_bytes, {info.id: total}, env_max)
    by_key = {r["key"]: r["id"] for r in rows}
    assert [by_key[e.key] for e in got] == sorted(want)  # the whole cut, in score (= id) order
    assert sum(r["size"] for r in rows if r["id"] in want) >= 250_000
    index.close()


def test_each_environment_cut_is_exact_when_some_samples_mislead(db_url):
    """The per-environment cuts share one sample and one read where the database sorts; an
    environment whose sample overstates its bytes reads on alone, the others must not move."""
    from cachectl.index import open_index
    from cachectl.index.eviction_walk import SAMPLE_EVERY

    index = open_index(db_url, auto_migrate=True)
    index.add_cache(CACHE, "memory://unused")
    now = utcnow()
    rng = random.Random(7)
    for v in range(3):
        info = index.ensure_environment(CACHE, fake_env(f"0.{v}.0"))
        index.upsert_entries(
            info.id,
            [
                NewEntry(
                    key=f"jit_f-{v}{i:063d}",
                    module="jit_f",
                    size=rng.randint(100, 300),
                    sha256="0" * 64,
                    origin="warm",
                    created_at=now - timedelta(minutes=rng.randint(0, 100000)),
                )
                for i in range(6 * SAMPLE_EVERY)
            ],
        )
    with index.session() as s:
        # The middle environment's sampled entries are huge: its sample says its cut ends early.
        middle = sorted({e.environment_id for e in s.query(Entry).all()})[1]
        s.execute(
            update(Entry)
            .where(Entry.environment_id == middle, Entry.id % SAMPLE_EVERY == 0)
            .values(size_bytes=50_000)
        )
        rows = [
            {
                "id": e.id,
                "env": e.environment_id,
                "key": e.key,
                "size": e.size_bytes,
                "score": e.created_at,
            }
            for e in s.query(Entry).all()
        ]
    env_totals: dict[int, int] = {}
    for r in rows:
        env_totals[r["env"]] = env_totals.get(r["env"], 0) + r["size"]
    env_max = min(env_totals.values()) - 40_000
    total = sum(env_totals.values())
    got, _ = plan_evictions(
        index, CACHE, policy="lru", max_bytes=None, env_max_bytes=env_max, now=now
    )
    want = _reference(rows, total, None, env_totals, env_max)
    by_key = {r["key"]: r for r in rows}
    assert {by_key[e.key]["id"] for e in got} == want
    assert [(by_key[e.key]["score"], by_key[e.key]["id"]) for e in got] == sorted(
        (r["score"], r["id"]) for r in rows if r["id"] in want
    )  # one score order across environments
    assert {by_key[e.key]["env"] for e in got} == set(env_totals)
    index.close()


def _case_cost_score(dialect, now):
    """gc's cost score as it was written before the age was clamped with max()/greatest(): the
    reference the current expression must equal bit for bit."""
    from sqlalchemy import Float, case, cast, func

    from cachectl.index import unit_size
    from cachectl.index.lifecycle_queries import COST_HALF_LIFE_DAYS, DEFAULT_COMPILE_MS, as_bound
    from cachectl.index.models import last_used

    last = last_used()
    if dialect == "sqlite":
        age_days = func.julianday(as_bound(now)) - func.julianday(last)
    else:
        age_days = func.extract("epoch", as_bound(now) - last) / 86400.0
    age_days = case((age_days < 0, 0.0), else_=age_days)
    unit = unit_size()
    size_kib = case((unit < 1, 1.0), else_=cast(unit, Float) / 1024.0)
    cost = cast(func.coalesce(Entry.compile_time_ms, DEFAULT_COMPILE_MS), Float)
    return cost / size_kib / (1.0 + age_days / COST_HALF_LIFE_DAYS)


@pytest.mark.parametrize("env_frac", [None, 0.7])
def test_cost_score_and_selection_equal_the_case_expression(db_url, env_frac):
    """The cost score computes the clamped age once (max/greatest); on a generated index (ages
    future and past, equal ages, no compile time, executables) every row's score equals the old
    CASE expression's exactly, and the plan is the greedy cut over the old scores."""
    from sqlalchemy import select

    from cachectl.index import open_index
    from cachectl.index.eviction_queries import _score

    index = open_index(db_url, auto_migrate=True)
    index.add_cache(CACHE, "memory://unused")
    rng = random.Random(11)
    now = utcnow()
    for v in range(3):
        info = index.ensure_environment(CACHE, fake_env(f"0.{v}.0"))
        # Every 10th entry is the same (size, compile time, age): equal scores, ties by id.
        news = [
            NewEntry(
                key=f"jit_f-{v}{i:063d}",
                module="jit_f",
                size=1000 if i % 10 == 0 else rng.randint(1, 9000),
                sha256="0" * 64,
                origin="warm",
                compile_time_ms=5000
                if i % 10 == 0
                else None
                if i % 7 == 0
                else rng.randint(1, 120_000),
                aot_size=rng.randint(0, 4000) if i % 3 == 0 and i % 10 else None,
                aot_sha256="0" * 64,
                created_at=now
                - timedelta(minutes=60 if i % 10 == 0 else rng.randint(-600, 100_000)),
            )
            for i in range(200)
        ]
        index.upsert_entries(info.id, news)
        index.record_hits(
            info.id,
            {
                n.key: (1, now - timedelta(seconds=rng.randint(-3600, 10**6)))
                for i, n in enumerate(news)
                if i % 10 and rng.random() < 0.3
            },
        )
    dialect = index.dialect
    with index.session() as s:
        got = s.execute(
            select(Entry.id, _score(dialect, "cost", now), _case_cost_score(dialect, now))
        ).all()
        rows = [
            {
                "id": e.id,
                "env": e.environment_id,
                "key": e.key,
                "size": e.size_bytes + (e.aot_size_bytes or 0),
            }
            for e in s.query(Entry).all()
        ]
    assert len(got) == 600 and all(new == old for _, new, old in got)
    assert len({old for _, _, old in got}) < 600  # equal scores exist: ties go by id
    old_score = {i: old for i, _, old in got}
    for r in rows:
        r["score"] = old_score[r["id"]]
    total = sum(r["size"] for r in rows)
    env_totals: dict[int, int] = {}
    for r in rows:
        env_totals[r["env"]] = env_totals.get(r["env"], 0) + r["size"]
    env_max = int(max(env_totals.values()) * env_frac) if env_frac else None
    plan, _ = plan_evictions(
        index, CACHE, policy="cost", max_bytes=int(total * 0.6), env_max_bytes=env_max, now=now
    )
    by_key = {r["key"]: r for r in rows}
    want = _reference(rows, total, int(total * 0.6), env_totals, env_max)
    assert [by_key[e.key]["id"] for e in plan] == [
        r["id"]
        for r in sorted((r for r in rows if r["id"] in want), key=lambda r: (r["score"], r["id"]))
    ]
    index.close()


def test_gc_plan_entries_read_like_a_list(tmp_path, db_url):
    """A gc plan keeps its entries as the cut's rows and builds each PlannedEntry when read: the
    same entries, in order, by index, slice and iteration, the same bytes and the same JSON as a
    list of them."""
    from cachectl.context import Context
    from cachectl.core.config import load_settings
    from cachectl.core.jsonable import to_jsonable
    from cachectl.index.lifecycle_queries import environments
    from cachectl.lifecycle.gc import plan_gc
    from cachectl.lifecycle.plan import PlannedEntries

    index, store = setup_cache(db_url, str(tmp_path / "cache"))
    a = write_entries(
        index, store, fake_env("0.10.2"), 6, sizes=[200] * 6, age_days=[6, 5, 4, 3, 2, 1]
    )
    write_entries(index, store, fake_env("0.9.1"), 3, sizes=[300] * 3, age_days=[9, 8, 7])
    a_bytes = sum(e.bytes for e in environments(index, CACHE) if e.namespace == a.env.namespace)
    index.update_cache(CACHE, env_max_size=a_bytes - 250)  # a gives up its 2 oldest, the cache more
    ctx = Context(load_settings(db=db_url, cache=CACHE))
    plan = plan_gc(ctx, ctx.cache(), max_size=total_bytes(index) - 1000).deletion
    entries = plan.entries
    assert isinstance(entries, PlannedEntries)
    listed = list(entries)
    assert len(entries) == len(listed) >= 3 and entries == listed and listed == entries
    assert entries[0] == listed[0] and entries[-1] == listed[-1] and entries[1:3] == listed[1:3]
    assert entries.total_bytes == sum(e.bytes for e in listed) == plan.bytes_to_free
    assert {e.reason.split(";")[0] for e in listed} == {"env-max-size", "max-size"}
    assert [e.key for e in listed if e.namespace == a.env.namespace][:1] == [a.keys[0]]
    assert to_jsonable(entries) == [to_jsonable(e) for e in listed]
    ctx.close()


@pytest.mark.parametrize("env_frac", [None, 0.8])
def test_cost_cut_is_exact_when_the_sample_misleads(db_url, env_frac):
    """The cost policy's cut past a short sample reads on a LIMIT at a time (sorted, then the keys
    looked up): every sampled entry huge, the rest tiny, the score in id order (compile time per
    byte the same for all, older first); more rows past the bound than one LIMIT holds. The cut
    is the whole greedy cut, in order."""
    index, info, now, rows = _sampled_huge(db_url, 40, 5000, 1, lambda e: e.id)
    total = sum(r["size"] for r in rows)
    max_bytes = total - 250_000
    env_max = int(total * env_frac) if env_frac else None
    got, _ = plan_evictions(
        index, CACHE, policy="cost", max_bytes=max_bytes, env_max_bytes=env_max, now=now
    )
    want = _reference(rows, total, max_bytes, {info.id: total}, env_max)
    by_key = {r["key"]: r["id"] for r in rows}
    assert [by_key[e.key] for e in got] == sorted(want)
    assert [e.score for e in got] == sorted(e.score for e in got)
    assert sum(r["size"] for r in rows if r["id"] in want) >= 250_000
    index.close()


@pytest.mark.parametrize("env_frac", [None, 0.7])
def test_cost_cut_is_the_same_whether_the_sample_is_read_by_id_or_by_a_scan(db_url, env_frac):
    """SQLite reads gc's 1-in-64 sample by id while the entries table's ids are dense, by a scan
    once another cache's rows make them sparse: the same plan either way, the greedy cut."""
    from sqlalchemy import func, select

    from cachectl.index import open_index
    from cachectl.index.eviction_queries import _score
    from cachectl.index.eviction_walk import Walk, sample_ids

    index = open_index(db_url, auto_migrate=True)
    index.add_cache(CACHE, "memory://unused")
    rng = random.Random(5)
    now = utcnow()
    for v in range(2):
        info = index.ensure_environment(CACHE, fake_env(f"0.{v}.0"))
        index.upsert_entries(
            info.id,
            [
                NewEntry(
                    key=f"jit_f-{v}{i:063d}",
                    module="jit_f",
                    size=rng.randint(1, 9000),
                    sha256="0" * 64,
                    origin="warm",
                    compile_time_ms=rng.randint(1, 120_000),
                    created_at=now - timedelta(minutes=rng.randint(0, 100_000)),
                )
                for i in range(640)
            ],
        )
    with index.session() as s:
        rows = [
            {"id": i, "env": env, "key": key, "size": size, "score": score}
            for i, env, key, size, score in s.execute(
                select(
                    Entry.id,
                    Entry.environment_id,
                    Entry.key,
                    Entry.size_bytes,
                    _score(index.dialect, "cost", now),
                )
            )
        ]
    total = sum(r["size"] for r in rows)
    env_totals: dict[int, int] = {}
    for r in rows:
        env_totals[r["env"]] = env_totals.get(r["env"], 0) + r["size"]
    env_max = int(max(env_totals.values()) * env_frac) if env_frac else None
    by_key = {r["key"]: r["id"] for r in rows}
    score = {r["id"]: r["score"] for r in rows}
    want = sorted(
        _reference(rows, total, int(total * 0.8), env_totals, env_max), key=lambda i: (score[i], i)
    )

    def planned() -> list[int]:
        got, _ = plan_evictions(
            index, CACHE, policy="cost", max_bytes=int(total * 0.8), env_max_bytes=env_max, now=now
        )
        return [by_key[e.key] for e in got]

    def by_id() -> bool:
        with index.session() as s:
            return (
                sample_ids(index.dialect, s.scalar(select(func.max(Entry.id))), len(rows))
                is not None
            )

    def sampled(top_id: int | None) -> list[int]:
        walk = Walk(index, Entry.id, [], label=None, ordered=False, sample_ids=top_id)
        with index.session() as s:
            return sorted(
                s.scalars(walk._sample([Entry.id], [Entry.environment_id.in_(env_totals)]))
            )

    dense = planned()
    assert by_id() == (index.dialect == "sqlite")
    if index.dialect == "sqlite":
        assert sampled(max(score)) == sampled(None) == sorted(i for i in score if i % 64 == 0) != []
    index.add_cache("other", "memory://other")
    other = index.ensure_environment("other", fake_env("0.9.0"))
    index.upsert_entries(
        other.id,
        [
            NewEntry(
                key=f"jit_g-{i:064d}", module="jit_g", size=100, sha256="0" * 64, origin="warm"
            )
            for i in range(3 * len(rows))
        ],
    )
    assert not by_id()
    assert dense == planned() == want and len(want) > 64
    index.close()
