"""The server's API against the real app: entries over every storage backend, hostile input,
listings, resolve, jobs, telemetry, metrics and scheduled maintenance."""

from __future__ import annotations

import http.client
import os
import time
import zlib
from datetime import UTC, datetime

import pytest
from fastapi.testclient import TestClient
from support.server_kit import MAIN, LiveServer, bearer, entry_key, fake_env, seed

from cachectl.index import NewEntry, open_index
from cachectl.storage.entries import make_entry, sha256
from cachectl.storage.store import Store
from cachectl_server.app import create_app
from cachectl_server.config import ServerSettings
from cachectl_server.entry_routes import CHUNK, WHOLE, WHOLE_SLOTS

API = "/api/v1"


def files_under(root: str) -> set[str]:
    return {f.path for f in Store(root).list("")}


def lbl(**labels: str) -> frozenset:
    return frozenset(labels.items())


def metric_samples(text: str) -> dict[tuple[str, frozenset], float]:
    """(sample name, labels) -> value, parsed the way Prometheus reads /metrics."""
    from prometheus_client.parser import text_string_to_metric_families

    return {
        (sm.name, frozenset(sm.labels.items())): sm.value
        for family in text_string_to_metric_families(text)
        for sm in family.samples
    }


def wait_job(client: TestClient, job_id: str, headers: dict, timeout: float = 60) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        job = client.get(f"{API}/jobs/{job_id}", headers=headers).json()
        if job["status"] in ("succeeded", "failed"):
            return job
        time.sleep(0.05)
    raise AssertionError(f"job {job_id} did not finish")


@pytest.fixture
def world(tmp_path):
    s = seed(f"sqlite:///{tmp_path}/index.db", str(tmp_path / "main"), str(tmp_path / "other"))
    app = create_app(s.db)
    client = TestClient(app)
    yield s, app, client
    app.state.cachectl.jobs.shutdown()
    app.state.cachectl.index.close()


# -- entries over every storage backend --------------------------------------------------


def test_entry_upload_download_head_on_each_backend(tmp_path, storage_root) -> None:
    s = seed(f"sqlite:///{tmp_path}/index.db", storage_root, str(tmp_path / "other"), entries=1)
    app = create_app(s.db)
    c = TestClient(app)
    w, r = bearer(s.tokens["writer"]), bearer(s.tokens["reader"])
    env = fake_env("0.9.0", "gpu-x")
    res = c.post(f"{API}/caches/{MAIN}/resolve", json=env.to_dict(), headers=r)
    assert (
        res.status_code == 200 and res.json()["exists"] is False and res.json()["created"] is False
    )
    res = c.post(
        f"{API}/caches/{MAIN}/resolve", json={**env.to_dict(), "digest": env.digest}, headers=w
    )
    body = res.json()
    assert (
        res.status_code == 200
        and body["created"]
        and body["url"] == Store(storage_root).url_for(env.namespace)
    )
    assert Store(storage_root).exists(f"{env.namespace}/env.json")
    key = entry_key("jit_decode", 7)
    data = make_entry(os.urandom(3000), compile_seconds=2)
    url = f"{API}/caches/{MAIN}/environments/{env.digest}/entries/{key}"
    put = c.put(url, content=data, headers={**w, "x-cachectl-sha256": sha256(data)})
    assert put.status_code == 201, put.text
    assert put.json()["sha256"] == sha256(data) and put.json()["compile_time_ms"] == 2000
    assert Store(storage_root).read_bytes(f"{env.namespace}/{key}-cache") == data
    got = c.get(url, headers=r)
    assert got.status_code == 200 and got.content == data
    assert got.headers["x-cachectl-sha256"] == sha256(data)
    head = c.head(url, headers=r)
    assert (
        head.status_code == 200
        and head.content == b""
        and int(head.headers["content-length"]) == len(data)
    )
    assert c.put(url, content=data, headers=w).status_code == 200  # replaced, same key
    assert c.get(url.replace(key, entry_key("jit_decode", 8)), headers=r).status_code == 404
    listed = c.get(f"{API}/caches/{MAIN}/environments/{env.digest[:12]}/entries", headers=r).json()
    assert [e["key"] for e in listed["items"]] == [key] and listed["items"][0]["origin"] == "upload"
    # the seeded entry, written straight to storage, is served too
    seeded = c.get(f"{API}/caches/{MAIN}/environments/{s.digest}/entries/{s.keys[0]}", headers=r)
    assert seeded.status_code == 200 and seeded.content == s.entry_bytes[s.keys[0]]
    app.state.cachectl.index.close()


def test_downloads_on_both_sides_of_the_whole_read_bound_arrive_intact(db_url, tmp_path) -> None:
    """Up to WHOLE bytes a download is read in the same hop as its open and sent at once; above it, it
    streams in CHUNK reads (memory per request stays within WHOLE). Both arrive whole, with their
    recorded sha256 and a Content-Length that matches; HEAD says the same. On SQLite and PostgreSQL."""
    open_index(db_url, auto_migrate=True).close()
    s = seed(db_url, str(tmp_path / "main"), str(tmp_path / "other"), entries=1)
    app = create_app(s.db)
    c = TestClient(app)
    r = bearer(s.tokens["reader"])
    store, index = Store(s.root), app.state.cachectl.index
    env = index.find_environment(MAIN, s.digest)
    blobs = {
        entry_key("jit_big", n): make_entry(os.urandom(size))
        for n, size in enumerate((WHOLE - 4096, WHOLE + CHUNK + 7))
    }
    for key, data in blobs.items():
        store.write_bytes(f"{env.namespace}/{key}-cache", data)
    index.upsert_entries(
        env.id,
        [
            NewEntry(key=k, module="jit_big", size=len(d), sha256=sha256(d), origin="warm")
            for k, d in blobs.items()
        ],
    )
    assert len(blobs[entry_key("jit_big", 0)]) <= WHOLE < len(blobs[entry_key("jit_big", 1)])
    for key, data in blobs.items():
        url = f"{API}/caches/{MAIN}/environments/{s.digest}/entries/{key}"
        got = c.get(url, headers=r)
        assert got.status_code == 200 and got.content == data
        assert got.headers["x-cachectl-sha256"] == sha256(data) and int(
            got.headers["content-length"]
        ) == len(data)
        head = c.head(url, headers=r)
        assert int(head.headers["content-length"]) == len(data) and head.headers[
            "x-cachectl-sha256"
        ] == sha256(data)
    app.state.cachectl.jobs.shutdown()
    index.close()


def test_whole_reads_are_bounded_and_their_slots_come_back(db_url, tmp_path) -> None:
    """Whole bodies held at once are bounded (WHOLE_SLOTS): with every slot taken a download streams
    instead and still arrives intact; after any number of downloads every slot is free again."""
    open_index(db_url, auto_migrate=True).close()
    s = seed(db_url, str(tmp_path / "main"), str(tmp_path / "other"), entries=1)
    app = create_app(s.db)
    c = TestClient(app)
    url = f"{API}/caches/{MAIN}/environments/{s.digest}/entries/{s.keys[0]}"
    headers = bearer(s.tokens["reader"])
    taken = 0
    while WHOLE_SLOTS.acquire(blocking=False):
        taken += 1
    try:
        got = c.get(url, headers=headers)
        assert got.status_code == 200 and got.content == s.entry_bytes[s.keys[0]]
    finally:
        for _ in range(taken):
            WHOLE_SLOTS.release()
    assert taken == 16
    for _ in range(40):
        assert c.get(url, headers=headers).content == s.entry_bytes[s.keys[0]]
    free = 0
    while WHOLE_SLOTS.acquire(blocking=False):
        free += 1
    for _ in range(free):
        WHOLE_SLOTS.release()
    assert free == 16
    app.state.cachectl.jobs.shutdown()
    app.state.cachectl.index.close()


# -- hostile input ----------------------------------------------------------------------


def _raw(
    port: int, method: str, path: str, token: str, body: bytes = b"", headers: dict | None = None
) -> int:
    """Send the path exactly as given (no client-side normalization of '..' or %2e)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    conn.putrequest(method, path, skip_accept_encoding=True)
    conn.putheader("Authorization", f"Bearer {token}")
    for k, v in (headers or {}).items():
        conn.putheader(k, v)
    conn.putheader("Content-Length", str(len(body)))
    conn.endheaders()
    if body:
        conn.send(body)
    status = conn.getresponse().status
    conn.close()
    return status


def test_path_traversal_never_reaches_outside_the_root(world, tmp_path) -> None:
    s, app, _client = world
    secret = tmp_path / "secret-cache"
    secret.write_bytes(b"do not serve")
    before_all = {p.relative_to(tmp_path) for p in tmp_path.rglob("*")}
    data = make_entry(b"x" * 100)
    base = f"{API}/caches/{MAIN}/environments/{s.digest}/entries"
    h = "a" * 64
    attempts = [
        f"{base}/../../../../secret",
        f"{base}/..%2f..%2f..%2f..%2fsecret-{h}",
        f"{base}/%2e%2e%2f%2e%2e%2fsecret-{h}",
        f"{base}/%2e%2e/%2e%2e/secret-{h}",
        f"{base}/..",
        f"{base}/..-{h}",
        f"{base}/.hidden-{h}",
        f"{base}/%2Fetc%2Fpasswd-{h}",
        f"{base}//etc/passwd-{h}",
        f"{base}/..%5c..%5csecret-{h}",
        f"{base}/%00x-{h}",
        f"{API}/caches/{MAIN}/environments/..%2f..%2f..%2f/entries/jit_x-{h}",
        f"{API}/caches/{MAIN}/environments/../../entries/jit_x-{h}",
        f"{API}/caches/..%2f..%2f/environments/{s.digest}/entries/jit_x-{h}",
        f"{API}/caches/%2e%2e/environments/{s.digest}/entries/jit_x-{h}",
        f"{API}/caches/{MAIN}/environments/{s.digest}/entries/jit_x-{h}/../../../../../secret",
    ]
    with LiveServer(app) as live:
        for path in attempts:
            for method in ("PUT", "GET", "HEAD"):
                status = _raw(
                    live.port, method, path, s.tokens["writer"], data if method == "PUT" else b""
                )
                assert status in (400, 404, 405, 422), (method, path, status)
    after_all = {p.relative_to(tmp_path) for p in tmp_path.rglob("*")}
    new = {p for p in after_all - before_all if not str(p).endswith(("-wal", "-shm", "-journal"))}
    assert not new, new
    assert secret.read_bytes() == b"do not serve"


def test_oversized_uploads_are_refused_and_nothing_is_kept(world) -> None:
    s, app, c = world
    w = bearer(s.tokens["writer"])
    index = open_index(s.db)
    index.update_cache(MAIN, max_entry_size=5000)
    before = files_under(s.root)
    big = make_entry(os.urandom(8000))
    url = f"{API}/caches/{MAIN}/environments/{s.digest}/entries/{entry_key('jit_big', 1)}"
    res = c.put(url, content=big, headers=w)
    assert res.status_code == 413 and "max entry size" in res.json()["detail"]

    def chunks():  # no Content-Length: the limit is enforced while reading
        for i in range(0, len(big), 1000):
            yield big[i : i + 1000]

    res = c.put(url, content=chunks(), headers=w)
    assert res.status_code == 413
    # the quota: a cache already at its max_size takes nothing more
    index.update_cache(
        MAIN, max_entry_size=None, max_size=sum(len(b) for b in s.entry_bytes.values()) + 100
    )
    res = c.put(url, content=make_entry(os.urandom(1000)), headers=w)
    assert res.status_code == 413 and "quota" in res.json()["detail"]
    assert files_under(s.root) == before
    env = index.find_environment(MAIN, s.digest)
    assert sorted(index.entry_keys(env.id)) == sorted(s.keys)
    index.close()


def test_bytes_that_are_not_a_jax_entry_are_refused(world, tmp_path) -> None:
    s, _app, c = world
    w = bearer(s.tokens["writer"])
    before = files_under(s.root)
    url = f"{API}/caches/{MAIN}/environments/{s.digest}/entries/{entry_key('jit_bad', 1)}"
    for body in (
        b"not a jax entry at all",
        b"",
        zlib.compress(b"\x00"),
        b"\x28\xb5\x2f\xfdgarbage",
        zlib.compress(b"\xff\xff\xff\xff" + b"x" * 10),
    ):
        res = c.put(url, content=body, headers=w)
        assert res.status_code == 422, (body[:10], res.text)
    data = make_entry(b"y" * 100)
    res = c.put(url, content=data, headers={**w, "x-cachectl-sha256": "0" * 64})
    assert res.status_code == 422 and "sha256" in res.json()["detail"]
    assert files_under(s.root) == before
    # a decompression bomb: small on the wire, past the server's expansion bound
    app = create_app(ServerSettings(db=s.db, max_decompressed_bytes=100_000))
    bomb = make_entry(b"\0" * 1_000_000)
    assert len(bomb) < 1000
    res = TestClient(app).put(url, content=bomb, headers=w)
    assert res.status_code == 413 and "expands" in res.json()["detail"]
    assert files_under(s.root) == before
    app.state.cachectl.index.close()


def test_malformed_json_and_unknown_fields_are_422(world) -> None:
    s, _app, c = world
    w, a = bearer(s.tokens["writer"]), bearer(s.tokens["admin"])
    json_h = {"content-type": "application/json"}
    for path, headers in (
        (f"{API}/caches/{MAIN}/resolve", w),
        (f"{API}/telemetry", w),
        (f"{API}/caches/{MAIN}/gc", a),
        (f"{API}/tokens", a),
    ):
        res = c.post(path, content=b'{"not": json', headers={**headers, **json_h})
        assert res.status_code == 422, (path, res.text)
    fp = s.env.to_dict()
    assert (
        c.post(f"{API}/caches/{MAIN}/resolve", json={**fp, "extra": 1}, headers=w).status_code
        == 422
    )
    assert (
        c.post(
            f"{API}/caches/{MAIN}/resolve", json={**fp, "digest": "f" * 64}, headers=w
        ).status_code
        == 422
    )
    assert (
        c.post(
            f"{API}/caches/{MAIN}/resolve", json={**fp, "device_count": -1}, headers=w
        ).status_code
        == 422
    )
    assert (
        c.post(
            f"{API}/caches/{MAIN}/gc", json={"policy": "lru", "surprise": True}, headers=a
        ).status_code
        == 422
    )
    assert (
        c.post(f"{API}/caches/{MAIN}/prune", json={"keep": 2}, headers=a).status_code == 400
    )  # --keep needs --superseded
    assert c.patch(f"{API}/caches/{MAIN}", json={"max_size": "lots"}, headers=a).status_code == 400
    assert (
        c.patch(
            f"{API}/caches/{MAIN}", json={"max_size": "1GiB", "owner": "me"}, headers=a
        ).status_code
        == 422
    )
    res = c.get(f"{API}/caches/{MAIN}/environments/not-hex", headers=w)
    assert res.status_code == 400 and "hex digits" in res.json()["detail"]


# -- listings, policy, telemetry, metrics -----------------------------------------------------


def test_listing_filters_and_pagination(tmp_path) -> None:
    s = seed(
        f"sqlite:///{tmp_path}/index.db",
        str(tmp_path / "main"),
        str(tmp_path / "o"),
        entries=7,
        entry_size=10,
    )
    c = TestClient(create_app(s.db))
    r = bearer(s.tokens["reader"])
    url = f"{API}/caches/{MAIN}/environments/{s.digest[:10]}/entries"
    seen, offset = [], 0
    while offset is not None:
        page = c.get(url, params={"limit": 3, "offset": offset}, headers=r).json()
        assert page["total"] == 7 and len(page["items"]) <= 3
        seen += [e["key"] for e in page["items"]]
        offset = page["next_offset"]
    assert seen == sorted(s.keys)
    train = c.get(url, params={"function": "train"}, headers=r).json()
    assert train["total"] == 4 and {e["function"] for e in train["items"]} == {"train"}
    assert c.get(url, params={"module": "jit_step"}, headers=r).json()["total"] == 3
    assert c.get(url, params={"origin": "upload"}, headers=r).json()["total"] == 0
    biggest = c.get(url, params={"order": "-size", "limit": 1}, headers=r).json()["items"][0]
    assert biggest["size"] == max(len(b) for b in s.entry_bytes.values())
    assert c.get(url, params={"limit": 0}, headers=r).status_code == 422
    assert c.get(url, params={"order": "random"}, headers=r).status_code == 422
    envs = c.get(f"{API}/caches/{MAIN}/environments", headers=r).json()
    assert len(envs) == 1 and envs[0]["entries"] == 7
    stats = c.get(f"{API}/caches/{MAIN}/stats", headers=r).json()
    assert stats["entries"] == 7 and stats["bytes"] == sum(len(b) for b in s.entry_bytes.values())
    assert c.get(f"{API}/caches/nope", headers=r).status_code == 404


def test_policy_telemetry_and_metrics(world) -> None:
    s, app, c = world
    a, r = bearer(s.tokens["admin"]), bearer(s.tokens["reader"])
    res = c.patch(
        f"{API}/caches/{MAIN}",
        json={"max_size": "1MiB", "retention": "30d", "keep_versions": 2},
        headers=a,
    )
    assert (
        res.status_code == 200
        and res.json()["max_size"] == 1024**2
        and res.json()["retention_seconds"] == 30 * 86400
    )
    hit_at = datetime.now(UTC)
    batch = {
        "process": "host:1",
        "cache": MAIN,
        "environment_digest": s.digest,
        "started_at": "2026-01-01T00:00:00+00:00",
        "ended_at": "2026-01-01T00:00:05+00:00",
        "functions": [
            {"function": "jit_train", "requests": 5, "hits": 4, "writes": 1, "saved_seconds": 3.5}
        ],
        # A hit after the entry was created: reported times are clamped to [creation, now].
        "hit_keys": [{"key": s.keys[0], "count": 4, "at": hit_at.isoformat()}],
    }
    unknown = {**batch, "environment_digest": "e" * 64}
    res = c.post(f"{API}/telemetry", json={"batches": [batch, unknown]}, headers=r)
    assert res.status_code == 200 and res.json() == {
        "accepted": 1,
        "unknown_environments": 1,
        "rows": 1,
    }
    entry = c.get(
        f"{API}/caches/{MAIN}/environments/{s.digest}/entries",
        params={"key_prefix": s.keys[0]},
        headers=r,
    ).json()["items"][0]
    assert entry["hit_count"] == 4 and entry["last_access_at"].startswith(hit_at.isoformat()[:19])
    assert (
        c.post(
            f"{API}/telemetry",
            json={"batches": [{**batch, "cache": "other"}]},
            headers=bearer(s.tokens["scoped_writer"]),
        ).status_code
        == 403
    )
    usage = c.get(f"{API}/caches/{MAIN}/telemetry", params={"since": "3650d"}, headers=r).json()
    assert usage["environments"][0]["hits"] == 4 and usage["environments"][0]["misses"] == 1
    text = c.get("/metrics", headers=r).text
    m = metric_samples(text)
    total = sum(len(b) for b in s.entry_bytes.values())
    env_labels = {
        "cache": MAIN,
        "environment": s.digest[:16],
        "jax_version": "0.10.2",
        "backend": "cpu",
        "device": "cpu x1",
    }
    assert m[("cachectl_cache_bytes", lbl(cache=MAIN))] == total
    assert m[("cachectl_cache_entries", lbl(cache=MAIN))] == 3
    assert m[("cachectl_cache_max_bytes", lbl(cache=MAIN))] == 1024**2
    assert m[("cachectl_environment_entries", lbl(**env_labels))] == 3
    assert m[("cachectl_environment_bytes", lbl(**env_labels))] == total
    assert m[("cachectl_telemetry_hits_total", lbl(cache=MAIN))] == 4
    assert m[("cachectl_telemetry_misses_total", lbl(cache=MAIN))] == 1
    assert (
        m[
            (
                "cachectl_http_requests_total",
                lbl(method="POST", route="/api/v1/telemetry", status="200"),
            )
        ]
        == 1
    )
    assert (
        m[
            (
                "cachectl_http_request_duration_seconds_count",
                lbl(method="PATCH", route="/api/v1/caches/{cache}"),
            )
        ]
        == 1
    )
    assert s.keys[0] not in text  # paths never become labels
    assert c.get("/metrics").status_code == 401
    public = TestClient(create_app(ServerSettings(db=s.db, metrics_public=True)))
    assert public.get("/metrics").status_code == 200


def test_readyz_reports_unreachable_storage(tmp_path, s3_bucket) -> None:
    db = f"sqlite:///{tmp_path}/index.db"
    index = open_index(db)
    index.add_cache("ok", str(tmp_path / "c"))
    c = TestClient(create_app(db))
    assert c.get("/readyz").json()["status"] == "ready"
    index.add_cache("gone", "s3://cachectl-no-such-bucket-here/x")
    # Without a token only the status; which cache failed is for token holders (issue 15, item 9).
    res = c.get("/readyz")
    assert res.status_code == 503 and res.json() == {"status": "unavailable"}
    from cachectl.trust import tokens

    res = c.get("/readyz", headers=bearer(tokens.create_token(index, "ops", "reader").token))
    assert res.status_code == 503 and "cache gone" in res.json()["problems"][0]
    assert c.get("/healthz").status_code == 200
    index.close()


# -- warm registration ------------------------------------------------------------------------


def test_warm_run_and_entry_registration(world) -> None:
    s, _app, c = world
    w = bearer(s.tokens["writer"])
    run = c.post(
        f"{API}/caches/{MAIN}/environments/{s.digest}/warm-runs",
        json={"manifest_digest": "abc", "buckets": 2},
        headers=w,
    )
    assert run.status_code == 201, run.text
    run_id = run.json()["id"]
    store = Store(s.root)
    key = entry_key("jit_new", 1)
    data = make_entry(b"z" * 500)
    body = {
        "entries": [{"key": key, "size": len(data), "sha256": sha256(data), "function": "new"}],
        "warm_run_id": run_id,
    }
    url = f"{API}/caches/{MAIN}/environments/{s.digest}/entries"
    assert c.post(url, json=body, headers=w).status_code == 422  # not in storage yet
    store.write_bytes(f"{s.env.namespace}/{key}-cache", data)
    assert (
        c.post(
            url, json={**body, "entries": [{**body["entries"][0], "size": 1}]}, headers=w
        ).status_code
        == 422
    )
    res = c.post(url, json=body, headers=w)
    assert res.status_code == 200 and res.json() == {"inserted": 1, "updated": 0}
    beat = c.patch(f"{API}/caches/{MAIN}/warm-runs/{run_id}", json={"compiled": 1}, headers=w)
    assert beat.status_code == 200 and beat.json()["status"] == "running"
    done = c.patch(
        f"{API}/caches/{MAIN}/warm-runs/{run_id}",
        json={"status": "succeeded", "compiled": 1, "cached": 1, "failed": 0},
        headers=w,
    )
    assert done.status_code == 200 and done.json()["status"] == "succeeded"
    assert (
        c.patch(
            f"{API}/caches/other/warm-runs/{run_id}", json={"compiled": 1}, headers=w
        ).status_code
        == 404
    )
    entry = c.get(url, params={"key_prefix": key}, headers=w).json()["items"][0]
    assert entry["function"] == "new" and entry["sha256"] == sha256(data)


# -- jobs and maintenance -----------------------------------------------------------------------


def test_prune_gc_verify_jobs_one_at_a_time(world, monkeypatch) -> None:
    s, app, c = world
    a = bearer(s.tokens["admin"])
    res = c.post(f"{API}/caches/{MAIN}/gc", json={"max_size": 1, "dry_run": True}, headers=a)
    assert res.status_code == 202
    job = wait_job(c, res.json()["id"], a)
    assert job["status"] == "succeeded" and job["result"]["dry_run"] is True
    assert job["result"]["plan"]["deletion"]["entry_count"] == 3
    # a slow real prune holds the cache; a second job is refused until it ends
    monkeypatch.setenv("CACHECTL_TEST_BATCH_DELAY_S", "1.0")
    first = c.post(f"{API}/caches/{MAIN}/prune", json={"function": "train"}, headers=a)
    assert first.status_code == 202
    second = c.post(f"{API}/caches/{MAIN}/verify", json={}, headers=a)
    assert second.status_code == 409 and first.json()["id"] in second.json()["detail"]
    job = wait_job(c, first.json()["id"], a)
    assert job["status"] == "succeeded", job
    assert job["result"]["execution"]["entries_deleted"] == 2
    monkeypatch.delenv("CACHECTL_TEST_BATCH_DELAY_S")
    res = c.post(f"{API}/caches/{MAIN}/verify", json={}, headers=a)
    job = wait_job(c, res.json()["id"], a)
    assert job["status"] == "succeeded" and job["result"]["ok"] is True
    assert job["result"]["plan"]["entries_checked"] == 1
    res = c.post(f"{API}/caches/{MAIN}/gc", json={}, headers=a)  # no size limit anywhere
    job = wait_job(c, res.json()["id"], a)
    assert (
        job["status"] == "failed"
        and "no size limit" in job["error"]
        and job["result"]["exit_code"] == 2
    )
    ops = [e["operation"] for e in c.get(f"{API}/caches/{MAIN}/audit", headers=a).json()]
    assert "prune" in ops and "verify" in ops
    listed = c.get(f"{API}/jobs", params={"cache": MAIN}, headers=a).json()
    assert len(listed) == 4
    assert c.get(f"{API}/jobs", headers=bearer(s.tokens["wrong_scope_admin"])).json() == []


def test_scheduled_maintenance_enforces_policy_once_per_interval(world) -> None:
    s, _app, _c = world
    index = open_index(s.db)
    index.update_cache(MAIN, max_size=sum(len(b) for b in s.entry_bytes.values()) // 2)
    app = create_app(ServerSettings(db=s.db, maintenance_interval_s=3600))
    scheduler = app.state.cachectl.maintenance
    runs = scheduler.run_once()
    assert [(r.schedule, r.job.kind, r.job.status) for r in runs] == [("size", "gc", "succeeded")]
    assert runs[0].job.result["execution"]["bytes_freed"] > 0
    assert scheduler.run_once() == []  # not due again within the interval
    audit = [e for e in index.audit_log(MAIN) if e.operation == "maintenance"]
    assert len(audit) == 1 and audit[0].details["schedule"] == "size" and audit[0].bytes > 0
    assert any(e.operation == "gc" for e in index.audit_log(MAIN))
    m = metric_samples(app.state.cachectl.metrics.render().decode())
    assert (
        m[
            (
                "cachectl_maintenance_runs_total",
                lbl(cache=MAIN, kind="gc", status="succeeded", trigger="schedule"),
            )
        ]
        == 1
    )
    assert (
        m[("cachectl_maintenance_bytes_freed_total", lbl(cache=MAIN, kind="gc"))] == audit[0].bytes
    )
    envs = index.environment_stats(MAIN)
    assert sum(e.bytes for e in envs) <= sum(len(b) for b in s.entry_bytes.values()) // 2
    index.close()
    app.state.cachectl.index.close()


def test_storage_credentials_never_leave_the_server(tmp_path) -> None:
    s = seed(
        f"sqlite:///{tmp_path}/index.db", str(tmp_path / "main"), str(tmp_path / "other"), entries=1
    )
    index = open_index(s.db)
    index.update_cache(
        MAIN,
        storage_options={
            "key": "AKIA-SECRET",
            "secret": "s3cr3t",
            "anon": False,
            "client_kwargs": {"endpoint_url": "http://x", "aws_session_token": "t0k"},
        },
    )
    index.close()
    c = TestClient(create_app(s.db))
    r = bearer(s.tokens["reader"])
    for path in (f"{API}/caches", f"{API}/caches/{MAIN}", f"{API}/caches/{MAIN}/stats"):
        text = c.get(path, headers=r).text
        assert "AKIA-SECRET" not in text and "s3cr3t" not in text and "t0k" not in text, path
        assert "http://x" in text and "<redacted>" in text


def test_serving_telemetry_through_the_server_is_bounded_and_recorded(world) -> None:
    """cachectl.serving's counts and raw sizes, as ServerSink sends them (client.telemetry_wire)."""
    from datetime import timedelta

    from cachectl.client import telemetry_wire
    from cachectl.index.telemetry_queries import serving_usage
    from cachectl.telemetry import ServingCounts, TelemetryBatch

    s, app, c = world
    r = bearer(s.tokens["reader"])
    now = datetime.now(UTC)
    batch = TelemetryBatch(
        process="host:7",
        cache=MAIN,
        environment_digest=s.digest,
        started_at=now,
        ended_at=now,
        functions={},
        hit_keys={},
        dropped=0,
        serving={"prefill": ServingCounts(5, 4, 1, 0, 3, {"seq": {17: 2, 50: 3}})},
    )
    wire = telemetry_wire(batch)
    res = c.post(f"{API}/telemetry", json={"batches": [wire]}, headers=r)
    assert res.status_code == 200 and res.json()["rows"] == 1, res.text
    (usage,) = serving_usage(open_index(s.db), MAIN, timedelta(hours=1))
    assert (usage.function, usage.calls, usage.aot, usage.fallback, usage.padded) == (
        "prefill",
        5,
        4,
        1,
        3,
    )
    assert usage.sizes == {"seq": {17: 2, 50: 3}}
    huge = {**wire, "serving": [{**wire["serving"][0], "calls": 2**53}]}
    assert c.post(f"{API}/telemetry", json={"batches": [huge]}, headers=r).status_code == 422
    many = {
        **wire,
        "serving": [{**wire["serving"][0], "sizes": {"seq": {str(n): 1 for n in range(2000)}}}],
    }
    assert c.post(f"{API}/telemetry", json={"batches": [many]}, headers=r).status_code == 422


def test_signatures_through_the_server_reach_misses(world) -> None:
    """A service in server mode (ServerSink) sends its program signatures; the server records them."""
    import time as _time
    from datetime import timedelta

    from cachectl.client import telemetry_wire
    from cachectl.index.telemetry_queries import signature_usage
    from cachectl.telemetry import SignatureCounts, TelemetryBatch

    s, app, c = world
    r = bearer(s.tokens["reader"])
    now = datetime.now(UTC)
    sig = SignatureCounts(
        (((3, 8), "float32", False, None), ((8, 8), "float32", False, None)),
        "jit_affine-" + "a" * 64,
        requests=2,
        hits=0,
        misses=2,
        first_seen=_time.time(),
        last_seen=_time.time() + 10**6,
        source="affine at model.py:3",
    )
    batch = TelemetryBatch(
        process="host:8",
        cache=MAIN,
        environment_digest=s.digest,
        started_at=now,
        ended_at=now,
        functions={},
        hit_keys={},
        dropped=0,
        signatures={("jit_affine", 0): sig},
    )
    res = c.post(f"{API}/telemetry", json={"batches": [telemetry_wire(batch)]}, headers=r)
    assert res.status_code == 200, res.text
    rows = signature_usage(open_index(s.db), MAIN, timedelta(hours=1))
    (row,) = [x for x in rows if x.function == "jit_affine"]
    assert row.misses == 2 and row.leaves[0][0] == [3, 8] and row.source == "affine at model.py:3"
    assert row.last_seen <= datetime.now(UTC)  # a claimed future time is clamped
    bad = telemetry_wire(batch)
    bad["signatures"][0]["requests"] = 2**53
    assert c.post(f"{API}/telemetry", json={"batches": [bad]}, headers=r).status_code == 422


def test_what_a_replica_remembers_reaches_it_within_the_bound(tmp_path) -> None:
    """Reads remember (cache, environment) for token_cache_s: a change made elsewhere (here: straight
    in the index, as another replica would) shows after that bound; one made through this replica
    at once; an unknown environment is never remembered."""
    s = seed(
        f"sqlite:///{tmp_path}/index.db", str(tmp_path / "main"), str(tmp_path / "other"), entries=1
    )
    app = create_app(ServerSettings(db=s.db, token_cache_s=0.5))
    c = TestClient(app)
    r, a = (
        bearer(s.tokens["writer"]),
        bearer(s.tokens["admin"]),
    )  # a writer sees the policy in "readonly"
    resolve = f"{API}/caches/{MAIN}/resolve"
    assert (
        c.post(resolve, json={**s.env.to_dict(), "create": False}, headers=r).json()["readonly"]
        is False
    )
    index = open_index(s.db)
    index.update_cache(MAIN, service_writes="deny")  # elsewhere: this replica still remembers
    assert (
        c.post(resolve, json={**s.env.to_dict(), "create": False}, headers=r).json()["readonly"]
        is False
    )
    time.sleep(0.6)
    assert (
        c.post(resolve, json={**s.env.to_dict(), "create": False}, headers=r).json()["readonly"]
        is True
    )
    patched = c.patch(f"{API}/caches/{MAIN}", json={"service_writes": "allow"}, headers=a)
    assert patched.status_code == 200, patched.text  # through this replica: applies at once
    assert (
        c.post(resolve, json={**s.env.to_dict(), "create": False}, headers=r).json()["readonly"]
        is False
    )
    new = fake_env("0.9.9", "late")
    assert (
        c.post(resolve, json={**new.to_dict(), "create": False}, headers=r).json()["exists"]
        is False
    )
    index.ensure_environment(MAIN, new)  # created elsewhere: found on the next request
    assert (
        c.post(resolve, json={**new.to_dict(), "create": False}, headers=r).json()["exists"] is True
    )
    index.close()
    app.state.cachectl.jobs.shutdown()
    app.state.cachectl.index.close()
