"""Issue 15 (hardening), the server's part: each test drives a real server on 127.0.0.1
(uvicorn through tests/server_kit.py) over real HTTP, with real files and a real index."""

from __future__ import annotations

import html
import os
import resource
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import httpx
import pytest
import zstandard
from sqlalchemy import insert, select
from support.server_kit import MAIN, OTHER, bearer, entry_key, fake_env, seed, served

from cachectl.index import NewEntry, open_index
from cachectl.index.models import TelemetryRecord
from cachectl.storage.entries import make_entry, sha256
from cachectl.storage.store import Store
from cachectl.trust import tokens

API = "/api/v1"


@pytest.fixture
def world(tmp_path):
    return seed(f"sqlite:///{tmp_path}/index.db", str(tmp_path / "main"), str(tmp_path / "other"))


def _raw_head(
    port: int, request: bytes, body_part: bytes, timeout: float = 5.0
) -> tuple[int, float]:
    """Send a request's head and the start of its body; the status line and how long it took."""
    started = time.monotonic()
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        sock.sendall(request + body_part)
        data = b""
        while b"\r\n" not in data:
            chunk = sock.recv(4096)
            if not chunk:
                break
            data += chunk
    return int(data.split(b" ", 2)[1]), time.monotonic() - started


def _batch(s, **overrides):
    now = datetime.now(UTC)
    batch = {
        "process": "host:1",
        "cache": MAIN,
        "environment_digest": s.digest,
        "started_at": (now - timedelta(seconds=5)).isoformat(),
        "ended_at": now.isoformat(),
        "functions": [{"function": "jit_train", "requests": 5, "hits": 4, "writes": 1}],
        "hit_keys": [],
    }
    batch.update(overrides)
    return {"batches": [batch]}


# -- 1. bodies are bounded and authenticated before they are read ---------------------------------


def test_bodies_are_refused_before_they_are_read(world) -> None:
    s = world
    with served(s.db) as (live, c):
        # 80 MB announced, no token: 401 at once, without the server waiting for (or holding) the body
        head = (
            b"POST /api/v1/telemetry HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            b"content-length: 80000000\r\n\r\n"
        )
        status, took = _raw_head(live.port, head, b'{"batches": [' + b" " * 1000)
        assert status == 401 and took < 3
        chunked = (
            b"POST /api/v1/caches/main/resolve HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            b"transfer-encoding: chunked\r\n\r\n"
        )
        status, took = _raw_head(live.port, chunked, b"400\r\n" + b" " * 1024 + b"\r\n")
        assert status == 401 and took < 3
        # with a token: a JSON body above the JSON limit is 413 by its Content-Length, unread
        token = s.tokens["reader"].encode()
        status, took = _raw_head(
            live.port,
            head.replace(b"host: x\r\n", b"host: x\r\nauthorization: Bearer " + token + b"\r\n"),
            b"{",
        )
        assert status == 413 and took < 3

        # and without a Content-Length, cut off at the limit while it streams in
        def endless() -> Iterator[bytes]:
            yield b'{"batches": ['
            for _ in range(20_000):  # 20,000 x 1 KiB = 20 MB, far past the 8 MiB JSON limit
                yield b" " * 1024

        res = c.post(
            f"{API}/telemetry",
            content=endless(),
            headers={**bearer(s.tokens["reader"]), "content-type": "application/json"},
        )
        assert res.status_code == 413 and "limit" in res.json()["detail"]
        # a small body still works, and a bad token on a small body is still 401
        assert (
            c.post(
                f"{API}/telemetry", json=_batch(s), headers=bearer(s.tokens["reader"])
            ).status_code
            == 200
        )
        assert (
            c.post(
                f"{API}/telemetry", json=_batch(s), headers=bearer("cct_" + "x" * 43)
            ).status_code
            == 401
        )


# -- 2. telemetry counters are bounded, sums cannot overflow, rows have a retention --------------


def test_telemetry_counts_are_bounded_and_sums_never_overflow(world) -> None:
    s = world
    r = bearer(s.tokens["reader"])
    with served(s.db, maintenance_interval_s=3600) as (live, c):
        huge = _batch(s, functions=[{"function": "f", "requests": 2**53, "hits": 2**53}])
        assert c.post(f"{API}/telemetry", json=huge, headers=r).status_code == 422
        huge_key = _batch(
            s, hit_keys=[{"key": s.keys[0], "count": 2**53, "at": datetime.now(UTC).isoformat()}]
        )
        assert c.post(f"{API}/telemetry", json=huge_key, headers=r).status_code == 422
        assert (
            c.post(f"{API}/telemetry", json=_batch(s, dropped=2**53), headers=r).status_code == 422
        )
        # a flush dated in the future is recorded at the server's now (it would outlive every retention)
        future = _batch(s, process="future", ended_at="2999-01-01T00:00:00+00:00")
        assert c.post(f"{API}/telemetry", json=future, headers=r).status_code == 200
        # rows written before the bound (or by another writer): sums past 2**63 still answer
        index = open_index(s.db)
        env = index.find_environment(MAIN, s.digest)
        with index.session() as session:
            session.execute(
                insert(TelemetryRecord),
                [
                    {
                        "environment_id": env.id,
                        "at": datetime.now(UTC),
                        "process": f"p{i}",
                        "function": "f",
                        "requests": 2**62,
                        "hits": 2**62,
                        "misses": 0,
                        "writes": 0,
                        "saved_seconds": 0.0,
                        "dropped": 0,
                    }
                    for i in range(4)
                ],
            )
        page = c.get("/", headers=r)
        assert page.status_code == 200, page.text[:300]
        assert c.get(f"{API}/caches/{MAIN}/telemetry", headers=r).status_code == 200
        assert c.get("/metrics", headers=r).status_code == 200
        # retention: maintenance deletes telemetry older than --telemetry-retention (30d by default)
        with index.session() as session:
            session.execute(
                insert(TelemetryRecord),
                [
                    {
                        "environment_id": env.id,
                        "at": datetime.now(UTC) - timedelta(days=31),
                        "process": "old",
                        "function": "f",
                        "requests": 1,
                        "hits": 1,
                        "misses": 0,
                        "writes": 0,
                        "saved_seconds": 0.0,
                        "dropped": 0,
                    }
                ],
            )
        live.server.config.app.state.cachectl.maintenance.run_once()
        with index.session() as session:
            processes = set(session.scalars(select(TelemetryRecord.process)))
        assert "old" not in processes and {"p0", "p1", "p2", "p3"} <= processes
        with index.session() as session:
            dated = session.scalar(
                select(TelemetryRecord.at).where(TelemetryRecord.process == "future")
            )
        assert dated <= datetime.now(UTC)
        index.close()


# -- 3. hit times cannot steer eviction --------------------------------------------------------------


def test_reported_hit_times_are_clamped_and_never_move_back(world) -> None:
    s = world
    r = bearer(s.tokens["reader"])
    index = open_index(s.db)
    env = index.find_environment(MAIN, s.digest)
    created = {e.key: e.created_at for e in index.list_entries(env.id)}
    with served(s.db) as (_live, c):
        future = _batch(
            s,
            hit_keys=[
                {"key": s.keys[0], "count": 1, "at": "2999-01-01T00:00:00+00:00"},
                {"key": s.keys[1], "count": 1, "at": "1971-01-01T00:00:00+00:00"},
            ],
        )
        assert c.post(f"{API}/telemetry", json=future, headers=r).status_code == 200
        after = datetime.now(UTC)
        rows = {e.key: e for e in index.list_entries(env.id)}
        assert created[s.keys[0]] <= rows[s.keys[0]].last_access_at <= after  # not the year 2999
        assert rows[s.keys[1]].last_access_at >= created[s.keys[1]]  # not before the entry existed
        first = rows[s.keys[0]].last_access_at
        back = _batch(
            s, hit_keys=[{"key": s.keys[0], "count": 1, "at": created[s.keys[0]].isoformat()}]
        )
        assert c.post(f"{API}/telemetry", json=back, headers=r).status_code == 200
        assert index.get_entry(env.id, s.keys[0]).last_access_at == first  # never backwards
    index.close()


# -- 4. a writer cannot get real environments deleted ------------------------------------------------


def test_made_up_fingerprints_never_supersede_real_environments(world) -> None:
    s = world
    w, a, r = bearer(s.tokens["writer"]), bearer(s.tokens["admin"]), bearer(s.tokens["reader"])
    with served(s.db, maintenance_interval_s=3600) as (live, c):
        bad = fake_env("not.a.version!").to_dict()
        assert c.post(f"{API}/caches/{MAIN}/resolve", json=bad, headers=w).status_code == 422
        fake = fake_env("999.0")
        res = c.post(f"{API}/caches/{MAIN}/resolve", json=fake.to_dict(), headers=w)
        assert res.status_code == 200 and res.json()["created"]
        # an environment resolve created, holding nothing, supersedes nothing
        res = c.post(
            f"{API}/caches/{MAIN}/prune",
            json={"superseded": True, "keep": 1, "dry_run": True},
            headers=a,
        )
        job = _wait_job(c, res.json()["id"], a)
        assert job["status"] == "succeeded", job
        assert [n["namespace"] for n in job["result"]["plan"]["namespaces"]] == []
        # once it holds an entry it is an environment like any other, but scheduled maintenance
        # never deletes the only environment of the group that still serves hits
        key = entry_key("jit_fake", 1)
        put = c.put(
            f"{API}/caches/{MAIN}/environments/{fake.digest}/entries/{key}",
            content=make_entry(os.urandom(500)),
            headers=w,
        )
        assert put.status_code == 201, put.text
        hits = _batch(
            s, hit_keys=[{"key": s.keys[0], "count": 3, "at": datetime.now(UTC).isoformat()}]
        )
        assert c.post(f"{API}/telemetry", json=hits, headers=r).status_code == 200
        index = open_index(s.db)
        index.update_cache(MAIN, keep_versions=1)
        runs = live.server.config.app.state.cachectl.maintenance.run_once()
        superseded = [run for run in runs if run.schedule == "superseded"]
        assert superseded and superseded[0].job.status == "succeeded", runs
        plan = superseded[0].job.result["plan"]
        assert plan["namespaces"] == [] and [p["namespace"] for p in plan["protected"]] == [
            s.env.namespace
        ]
        live_envs = {e.digest for e in index.environment_stats(MAIN)}
        assert s.digest in live_envs
        assert Store(s.root).exists(f"{s.env.namespace}/{s.keys[0]}-cache")
        index.close()


def _wait_job(c: httpx.Client, job_id: str, headers: dict, timeout: float = 60) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        job = c.get(f"{API}/jobs/{job_id}", headers=headers).json()
        if job["status"] in ("succeeded", "failed"):
            return job
        time.sleep(0.05)
    raise AssertionError(f"job {job_id} did not finish")


# -- 5. decompression bombs ------------------------------------------------------------------------


def test_a_decompression_bomb_is_refused_while_streaming(world) -> None:
    s = world
    w = bearer(s.tokens["writer"])
    index = open_index(s.db)
    index.update_cache(MAIN, max_entry_size=1024**2)  # 1 MiB on the wire: at most 16 MiB expanded
    index.close()
    # 400 MiB of zeros in one zstd frame that records no content size: ~13 KB on the wire
    compressor = zstandard.ZstdCompressor().compressobj()
    parts = [compressor.compress(b"\0\0\0\1")]
    block = b"\0" * (1 << 20)
    parts += [compressor.compress(block) for _ in range(400)]
    bomb = b"".join(parts) + compressor.flush()
    del block, parts
    assert len(bomb) < 100_000
    before = files_under(s.root)
    with served(s.db) as (_live, c):
        peak_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB
        res = c.put(
            f"{API}/caches/{MAIN}/environments/{s.digest}/entries/{entry_key('jit_bomb', 1)}",
            content=bomb,
            headers=w,
        )
        grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - peak_before
        assert res.status_code == 413 and "expands" in res.json()["detail"], res.text
        assert grown < 64 * 1024, f"peak RSS grew {grown} KiB while checking the bomb"
        # an honest entry still goes in
        ok = make_entry(os.urandom(50_000))
        res = c.put(
            f"{API}/caches/{MAIN}/environments/{s.digest}/entries/{entry_key('jit_ok', 1)}",
            content=ok,
            headers=w,
        )
        assert res.status_code == 201 and res.json()["sha256"] == sha256(ok)
    assert files_under(s.root) - before == {f"{s.env.namespace}/{entry_key('jit_ok', 1)}-cache"}


def files_under(root: str) -> set[str]:
    return {f.path for f in Store(root).list("")}


# -- 6. quota under concurrency -----------------------------------------------------------------------


@pytest.mark.parametrize("backend", ["sqlite", "postgresql"])
def test_concurrent_uploads_never_overrun_the_quota(tmp_path, backend, request) -> None:
    db = (
        f"sqlite:///{tmp_path}/index.db"
        if backend == "sqlite"
        else request.getfixturevalue("pg_url")
    )
    open_index(db, auto_migrate=True).close()
    s = seed(db, str(tmp_path / "main"), str(tmp_path / "other"), entries=1)
    index = open_index(s.db)
    used = sum(len(b) for b in s.entry_bytes.values())
    entry_size = 100_000
    limit = used + 5 * entry_size + entry_size // 2  # room for five more
    index.update_cache(MAIN, max_size=limit)
    blobs = [make_entry(os.urandom(entry_size - 60)) for _ in range(24)]
    statuses: list[int] = []
    with served(s.db) as (live, _c):
        barrier = threading.Barrier(len(blobs))

        def upload(n: int) -> None:
            with httpx.Client(base_url=live.url, timeout=60) as client:
                barrier.wait()
                res = client.put(
                    f"{API}/caches/{MAIN}/environments/{s.digest}/entries/{entry_key('jit_q', n)}",
                    content=blobs[n],
                    headers=bearer(s.tokens["writer"]),
                )
                statuses.append(res.status_code)

        threads = [threading.Thread(target=upload, args=(n,)) for n in range(len(blobs))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    env = index.find_environment(MAIN, s.digest)
    indexed = sum(size for size, _sha in index.entry_keys(env.id).values())
    stored = sum(f.size for f in Store(s.root).list(s.env.namespace) if f.path.endswith("-cache"))
    index.close()
    assert sorted(set(statuses)) == [201, 413], statuses
    assert indexed <= limit and stored <= limit, (indexed, stored, limit)
    assert statuses.count(201) == 5


# -- 7. symlinks are never followed -----------------------------------------------------------------


def test_symlinks_in_a_namespace_are_never_served(world, tmp_path) -> None:
    s = world
    secret = tmp_path / "shadow"
    secret.write_bytes(make_entry(b"the server's secrets"))
    store = Store(s.root)
    ns_dir = os.path.join(store.url_for(s.env.namespace))
    link_key = entry_key("jit_link", 1)
    os.symlink(secret, os.path.join(ns_dir, f"{link_key}-cache"))
    # a planted link whose row even carries the target's real size and sha256
    index = open_index(s.db)
    env = index.find_environment(MAIN, s.digest)
    data = secret.read_bytes()
    index.upsert_entries(
        env.id,
        [
            NewEntry(
                key=link_key,
                module="jit_link",
                size=len(data),
                sha256=sha256(data),
                origin="observed",
            )
        ],
    )
    # and a namespace whose directory is a link to somewhere else
    elsewhere = tmp_path / "elsewhere"
    other_env = fake_env("0.10.2", "linked")
    (elsewhere).mkdir()
    other_key = entry_key("jit_other", 1)
    (elsewhere / f"{other_key}-cache").write_bytes(data)
    os.makedirs(os.path.dirname(store.url_for(other_env.namespace)), exist_ok=True)
    os.symlink(elsewhere, store.url_for(other_env.namespace))
    other = index.ensure_environment(MAIN, other_env)
    index.upsert_entries(
        other.id,
        [
            NewEntry(
                key=other_key,
                module="jit_other",
                size=len(data),
                sha256=sha256(data),
                origin="observed",
            )
        ],
    )
    r = bearer(s.tokens["reader"])
    with served(s.db) as (_live, c):
        for digest, key in ((s.digest, link_key), (other_env.digest, other_key)):
            url = f"{API}/caches/{MAIN}/environments/{digest}/entries/{key}"
            got = c.get(url, headers=r)
            assert got.status_code == 404 and b"secrets" not in got.content, (key, got.status_code)
            assert c.head(url, headers=r).status_code == 404
        good = c.get(f"{API}/caches/{MAIN}/environments/{s.digest}/entries/{s.keys[0]}", headers=r)
        assert good.status_code == 200 and good.content == s.entry_bytes[s.keys[0]]
    # the library paths that read entries: mirror pull and verify
    from cachectl.lifecycle.verify import verify
    from cachectl.lifecycle.verify_records import VerifyOptions
    from cachectl.service.mirror import pull_namespace

    dest = tmp_path / "mirror"
    result = pull_namespace(index, index.get_cache(MAIN), s.env, dest)
    assert not (dest / f"{link_key}-cache").exists() and not result.ok
    assert link_key in {p.key for p in result.refused}
    assert (dest / f"{s.keys[0]}-cache").read_bytes() == s.entry_bytes[s.keys[0]]
    from cachectl.context import Context
    from cachectl.core.config import load_settings

    ctx = Context(load_settings(db=s.db))
    report = verify(ctx, index.get_cache(MAIN), VerifyOptions(dry_run=True))
    by_key = {f.key: f for f in report.plan.findings if f.key}
    assert by_key[link_key].kind == "corrupt" and "regular file" in by_key[link_key].detail
    # the linked namespace directory is not descended into: reported, never read
    assert other_env.namespace in {f.namespace for f in report.plan.findings}
    assert other_key not in by_key or by_key[other_key].kind != "mismatch"
    index.close()


# -- 8. existing entries are immutable (unless an admin says so), overwrites are audited ------------


def test_an_existing_entry_is_not_silently_replaced(world) -> None:
    s = world
    w, a = bearer(s.tokens["writer"]), bearer(s.tokens["admin"])
    key = s.keys[0]
    url = f"{API}/caches/{MAIN}/environments/{s.digest}/entries/{key}"
    other = make_entry(os.urandom(700), compile_seconds=3)
    with served(s.db) as (_live, c):
        res = c.put(url, content=other, headers=w)
        assert res.status_code == 409, res.text
        assert c.get(url, headers=w).content == s.entry_bytes[key]
        assert (
            c.put(url, content=s.entry_bytes[key], headers=w).status_code == 200
        )  # same bytes: idempotent
        assert (
            c.put(url, content=other, headers={**w, "x-cachectl-overwrite": "true"}).status_code
            == 403
        )
        res = c.put(url, content=other, headers={**a, "x-cachectl-overwrite": "true"})
        assert res.status_code == 200, res.text
        row = res.json()
        assert (
            row["sha256"] == sha256(other) and row["origin"] == "upload" and row["function"] is None
        )
        assert row["compile_time_ms"] == 3000 and row["hit_count"] == 0
        assert c.get(url, headers=w).content == other
        audit = c.get(f"{API}/caches/{MAIN}/audit", headers=a).json()
        overwrites = [e for e in audit if e["operation"] == "entry-overwrite"]
        assert len(overwrites) == 1 and overwrites[0]["details"]["key"] == key
        assert overwrites[0]["details"]["old_sha256"] == sha256(s.entry_bytes[key])
        # registration: the sha256 recorded is the one computed from storage, never the claim
        store = Store(s.root)
        new_key = entry_key("jit_reg", 1)
        data = make_entry(os.urandom(400))
        store.write_bytes(f"{s.env.namespace}/{new_key}-cache", data)
        reg = f"{API}/caches/{MAIN}/environments/{s.digest}/entries"
        lie = {"entries": [{"key": new_key, "size": len(data), "sha256": "0" * 64}]}
        assert c.post(reg, json=lie, headers=w).status_code == 422
        honest = {"entries": [{"key": new_key, "size": len(data), "sha256": sha256(data)}]}
        assert c.post(reg, json=honest, headers=w).status_code == 200
        # bytes swapped behind the index's back are not re-registered over the recorded row
        swapped = make_entry(os.urandom(400))
        assert len(swapped) == len(data)
        store.write_bytes(f"{s.env.namespace}/{new_key}-cache", swapped)
        again = {"entries": [{"key": new_key, "size": len(swapped), "sha256": sha256(swapped)}]}
        assert c.post(reg, json=again, headers=w).status_code == 409
        index = open_index(s.db)
        env = index.find_environment(MAIN, s.digest)
        assert index.get_entry(env.id, new_key).sha256 == sha256(data)
        index.close()


# -- 9. what leaks to whom ------------------------------------------------------------------------------


def test_nothing_leaks_to_callers_without_the_right(world) -> None:
    s = world
    index = open_index(s.db)
    index.update_cache(
        MAIN,
        storage_options={
            "client_kwargs": {"endpoint_url": "http://ci:hunter2@minio:9000"},
            "endpoint": "https://admin:pa55w0rd@s3.internal",
        },
    )
    index.add_cache("doomed", s.other_root + "-doomed")
    doomed = tokens.create_token(index, "doomed-reader", "reader", ["doomed"]).token
    index.remove_cache("doomed")
    index.close()
    with served(s.db) as (_live, c):
        ready = c.get("/readyz")
        assert ready.status_code == 200 and ready.json() == {"status": "ready"}
        assert MAIN not in ready.text and OTHER not in ready.text
        detailed = c.get("/readyz", headers=bearer(s.tokens["reader"])).json()
        assert detailed["status"] == "ready" and detailed["caches"] == 2
        for path in (f"{API}/caches", f"{API}/caches/{MAIN}"):
            text = c.get(path, headers=bearer(s.tokens["reader"])).text
            assert "hunter2" not in text and "pa55w0rd" not in text, path
            assert "<redacted>" in text
        res = c.get(f"{API}/caches/doomed", headers=bearer(doomed))
        assert res.status_code == 403, res.text
        assert MAIN not in res.text and OTHER not in res.text
        res = c.get(f"{API}/caches/doomed/environments", headers=bearer(doomed))
        assert res.status_code == 403 and MAIN not in res.text


# -- 10. dashboard sign-in ------------------------------------------------------------------------------


def test_dashboard_sign_in_checks_origin_and_issues_a_session(world) -> None:
    s = world
    form = {"content-type": "application/x-www-form-urlencoded"}
    reader = s.tokens["reader"]
    with served(s.db) as (live, c):
        cross = c.post(
            "/login", content=f"token={reader}", headers={**form, "origin": "https://evil.example"}
        )
        assert cross.status_code == 403 and "set-cookie" not in cross.headers
        cross = c.post(
            "/login", content=f"token={reader}", headers={**form, "sec-fetch-site": "cross-site"}
        )
        assert cross.status_code == 403 and "set-cookie" not in cross.headers
        admin = c.post(
            "/login", content=f"token={s.tokens['admin']}", headers={**form, "origin": live.url}
        )
        assert admin.status_code == 400 and "set-cookie" not in admin.headers
        # The form, its refusal and docs/server.md agree: reader or writer signs in, admin never,
        # and each names the command that makes a reader.
        command = "cachectl token create --name dashboard --role reader"
        form_page = html.unescape(c.get("/login").text)
        docs = (Path(__file__).resolve().parents[1] / "docs" / "server.md").read_text()
        assert command in html.unescape(admin.text) and command in form_page and command in docs
        assert "reader or writer token" in form_page and "admin tokens are refused" in form_page
        assert "reader or writer" in docs and "admin tokens are refused" in docs
        ok = c.post("/login", content=f"token={reader}", headers={**form, "origin": live.url})
        assert ok.status_code == 303, ok.text
        cookie = ok.headers["set-cookie"]
        assert reader not in cookie and "HttpOnly" in cookie and "samesite=strict" in cookie.lower()
        assert "secure" not in cookie.lower()  # served on loopback: plain http must keep working
        value = ok.cookies["cachectl_session"]
        page = c.get("/", cookies={"cachectl_session": value})
        assert page.status_code == 200 and 'id="cache-main"' in page.text
        # the session is no API token
        assert c.get(f"{API}/caches", headers=bearer(value)).status_code == 401
        # revoking the token ends its sessions
        index = open_index(s.db)
        tokens.revoke_token(index, "reader")
        index.close()
        assert c.get("/", cookies={"cachectl_session": value}).status_code == 401
    # off loopback, the cookie is Secure
    with served(s.db, host="0.0.0.0", token_cache_s=0) as (live, c):
        ok = c.post(
            "/login",
            content=f"token={s.tokens['scoped_writer']}",
            headers={**form, "origin": live.url},
        )
        assert ok.status_code == 303 and "secure" in ok.headers["set-cookie"].lower()


# -- 11. a full disk ----------------------------------------------------------------------------------


@pytest.fixture
def tiny_disk(tmp_path) -> Iterator[str]:
    mount = tmp_path / "tiny"
    mount.mkdir()
    try:
        done = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mount)],
            capture_output=True,
            timeout=20,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        pytest.skip(f"cannot mount a tmpfs here: {exc}")
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode(errors='replace').strip()}")
    try:
        yield str(mount)
    finally:
        subprocess.run(["umount", "-l", str(mount)], capture_output=True, timeout=20)


def test_a_full_disk_is_507_and_leaves_nothing_behind(tmp_path, tiny_disk) -> None:
    s = seed(
        f"sqlite:///{tmp_path}/index.db",
        os.path.join(tiny_disk, "cache"),
        str(tmp_path / "other"),
        entries=1,
        entry_size=1000,
    )
    w = bearer(s.tokens["writer"])
    before = files_under(s.root)
    key = entry_key("jit_big", 1)
    data = make_entry(os.urandom(200_000))  # incompressible, three times the disk
    with served(s.db) as (_live, c):
        res = c.put(
            f"{API}/caches/{MAIN}/environments/{s.digest}/entries/{key}", content=data, headers=w
        )
        assert res.status_code == 507 and "storage" in res.json()["detail"].lower(), res.text
        assert (
            c.head(
                f"{API}/caches/{MAIN}/environments/{s.digest}/entries/{key}", headers=w
            ).status_code
            == 404
        )
    assert files_under(s.root) == before
    index = open_index(s.db)
    env = index.find_environment(MAIN, s.digest)
    assert index.get_entry(env.id, key) is None
    index.close()
