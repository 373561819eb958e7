"""Issue 22, the server's edge: request bodies, keys and headers a client controls are bounded
before any route or file system sees them. A real server on 127.0.0.1 over real HTTP, a real
index and real files; `cachectl ls` in a real process."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import threading
import time
from datetime import UTC, datetime, timedelta

import httpx
import pytest
from support import infra
from support.server_kit import MAIN, bearer, read_until_closed, seed, served

from cachectl.core.jsonable import TOO_DEEP
from cachectl.index import NewEntry, open_index
from cachectl.storage.entries import MAX_KEY_LENGTH, make_entry, sha256
from cachectl.storage.store import Store

API = "/api/v1"


@pytest.fixture
def world(tmp_path):
    return seed(f"sqlite:///{tmp_path}/index.db", str(tmp_path / "main"), str(tmp_path / "other"))


def nested(depth: int) -> dict:
    value: dict = {}
    for _ in range(depth):
        value = {"a": value}
    return value


def _post_json(c: httpx.Client, path: str, text: str, headers: dict) -> httpx.Response:
    return c.post(path, content=text, headers={**headers, "content-type": "application/json"})


def test_deep_json_is_refused_at_the_edge_and_stored_depth_never_breaks_a_listing(
    world, tmp_path
) -> None:
    s = world
    key = s.keys[0]
    blob = s.entry_bytes[key]
    claim = {"key": key, "size": len(blob), "sha256": sha256(blob)}
    w = bearer(s.tokens["writer"])
    entries = f"{API}/caches/{MAIN}/environments/{s.digest}/entries"
    with served(s.db) as (_live, c):
        deep_bucket = json.dumps({"entries": [{**claim, "bucket": nested(900)}]})
        res = _post_json(c, entries, deep_bucket, w)
        assert res.status_code == 422 and "levels deep" in res.json()["detail"], res.text
        # brackets inside strings are text, not nesting; a shallow bucket is recorded
        shallow = {"batch": 8, "note": "[" * 200 + "{" * 200}
        res = _post_json(c, entries, json.dumps({"entries": [{**claim, "bucket": shallow}]}), w)
        assert res.status_code == 200, res.text
        # the audit route too (its free-form details)
        deep_audit = json.dumps({"operation": "warm", "details": {"d": nested(900)}})
        res = _post_json(c, f"{API}/caches/{MAIN}/audit", deep_audit, w)
        assert res.status_code == 422 and "levels deep" in res.json()["detail"], res.text
        # a deep body whose strings try to hide its brackets is still deep
        hiding = '{"entries": [' + '["]", ' * 100 + "1" + "]" * 100 + "]}"
        res = _post_json(c, entries, hiding, w)
        assert res.status_code == 422, res.text

    # What was stored before the edge refused it: every listing still answers, cut at a depth.
    index = open_index(s.db)
    try:
        env = index.ensure_environment(MAIN, s.env)
        limit = sys.getrecursionlimit()
        sys.setrecursionlimit(10_000)  # the test's own writes: SQLAlchemy's encoder recurses
        try:
            index.upsert_entries(
                env.id,
                [
                    NewEntry(
                        key=key,
                        module=key.rsplit("-", 1)[0],
                        size=len(blob),
                        sha256=sha256(blob),
                        origin="warm",
                        bucket=nested(900),
                    )
                ],
            )
            index.audit("warm", cache=MAIN, details={"d": nested(900)})
        finally:
            sys.setrecursionlimit(limit)
    finally:
        index.close()
    r = bearer(s.tokens["reader"])
    with served(s.db) as (_live, c):
        res = c.get(entries, headers=r)
        assert res.status_code == 200, res.text
        (item,) = [i for i in res.json()["items"] if i["key"] == key]
        assert TOO_DEEP in json.dumps(item["bucket"])
        res = c.get(f"{API}/caches/{MAIN}/audit", headers=bearer(s.tokens["admin"]))
        assert res.status_code == 200 and TOO_DEEP in res.text, res.text
    done = subprocess.run(
        [sys.executable, "-m", "cachectl", "--db", s.db, "--cache", MAIN, "ls"]
        + ["--env", s.digest[:12], "--json"],
        capture_output=True,
        text=True,
        env={**os.environ, "HOME": str(tmp_path)},
        timeout=120,
    )
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr
    assert TOO_DEEP in done.stdout


def test_a_key_no_file_system_can_name_is_422_and_the_connection_stays_usable(world) -> None:
    s = world
    w = bearer(s.tokens["writer"])
    base = f"{API}/caches/{MAIN}/environments/{s.digest}/entries"
    longest = "m" * (MAX_KEY_LENGTH - 65) + "-" + "a" * 64
    assert len(longest) == MAX_KEY_LENGTH == 249
    with served(s.db) as (_live, c):
        for module_length in (185, 300, 441):
            key = "m" * module_length + "-" + "a" * 64
            for method, path in (
                ("PUT", f"{base}/{key}"),
                ("GET", f"{base}/{key}"),
                ("HEAD", f"{base}/{key}"),
                ("PUT", f"{base}/{key}/aot"),
                ("GET", f"{base}/{key}/aot"),
            ):
                res = c.request(
                    method, path, headers=w, content=b"x" * 64 if method == "PUT" else None
                )
                assert res.status_code == 422, (module_length, method, path, res.text)
                # the same kept-alive connection answers the next request
                assert c.get("/healthz").status_code == 200
            claim = {"key": key, "size": 1, "sha256": "0" * 64}
            res = c.post(base, json={"entries": [claim]}, headers=w)
            assert res.status_code == 422, res.text
        # the longest key every file of an entry can be named after is stored and served
        data = make_entry(b"\x01" * 500, compile_seconds=1)
        res = c.put(f"{base}/{longest}", content=data, headers=w)
        assert res.status_code == 201, res.text
        assert c.get(f"{base}/{longest}", headers=w).content == data
        assert Store(s.root).exists(f"{s.env.namespace}/{longest}-cache")


def _batch(s, **overrides) -> dict:
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


def test_telemetry_that_is_not_json_text_or_has_naive_times_is_422(world) -> None:
    s = world
    r = bearer(s.tokens["reader"])
    naive = datetime.now().isoformat()
    cases = {
        "NaN": _batch(s, functions=[{"function": "f", "saved_seconds": float("nan")}]),
        "Infinity": _batch(s, functions=[{"function": "f", "retrieval_seconds": float("inf")}]),
        "-Infinity in a signature": _batch(
            s, signatures=[{"function": "f", "first_seen": float("-inf")}]
        ),
        "a lone surrogate": _batch(s, functions=[{"function": "f\ud800"}]),
        "a lone low surrogate in a key": _batch(s, process="p\udc00"),
        "naive times": _batch(s, started_at=naive, ended_at=naive),
        "a naive hit time": _batch(s, hit_keys=[{"key": s.keys[0], "count": 1, "at": naive}]),
    }
    with served(s.db) as (_live, c):
        for name, body in cases.items():
            res = _post_json(c, f"{API}/telemetry", json.dumps(body), r)
            assert res.status_code == 422, (name, res.status_code, res.text)
        # raw (not escaped) surrogate bytes and other bytes that are not UTF-8
        raw = json.dumps(_batch(s, process="PLACEHOLDER")).encode()
        for bad in (b"p\xed\xa0\x80", b"p\xff"):
            res = c.post(
                f"{API}/telemetry",
                content=raw.replace(b"PLACEHOLDER", bad),
                headers={**r, "content-type": "application/json"},
            )
            assert res.status_code == 422, (bad, res.text)
        # a surrogate pair (an emoji as ensure_ascii writes it) and brackets in strings are fine
        good = _batch(s, functions=[{"function": "f\U0001f600[{", "requests": 1}])
        res = _post_json(c, f"{API}/telemetry", json.dumps(good), r)
        assert res.status_code == 200, res.text


# -- request heads: bounded in size, count and time, by `cachectl serve` itself ------------------


def _rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise AssertionError("no VmRSS")


def _send_huge_header(port: int, total: int) -> tuple[bytes, int, float]:
    """Send one header of ``total`` bytes in 64 KiB writes until the server stops reading; its
    answer, how much was sent, and how long until the connection was answered or closed."""
    started = time.monotonic()
    sent = 0
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(b"GET /healthz HTTP/1.1\r\nhost: x\r\nx-big: ")
        chunk = b"a" * 65536
        with contextlib.suppress(OSError):  # reset or broken pipe: the server closed it
            while sent < total:
                sock.sendall(chunk)
                sent += len(chunk)
            sock.sendall(b"\r\n\r\n")
        answer = read_until_closed(sock, 30)
    return answer, sent, time.monotonic() - started


@pytest.mark.timeout(240)
def test_request_heads_are_bounded_in_size_count_and_time(world, tmp_path, monkeypatch) -> None:
    s = world
    # the header timeout is a setting (10 s by default): 2 s here, so the slow sender's cut is quick
    monkeypatch.setenv("CACHECTL_SERVER_HEADER_TIMEOUT", "2s")
    server = infra.start_server(
        "serve",
        lambda port: [sys.executable, "-m", "cachectl", "serve", "--db", s.db, "--port", str(port)],
        tmp_path / "logs",
        check=lambda srv: httpx.get(f"{srv.url}/healthz", timeout=2).raise_for_status(),
    )
    try:
        pid, port = server.process.pid, server.port
        with httpx.Client(base_url=server.url, timeout=30) as c:
            for _ in range(20):  # warm the routes up before the memory baseline
                assert c.get("/healthz").status_code == 200
        baseline = _rss_kib(pid)

        # another client's /healthz, every 50 ms while the attacks run
        latencies: list[float] = []
        stop = threading.Event()

        def well_behaved() -> None:
            with httpx.Client(base_url=server.url, timeout=30) as c:
                while not stop.is_set():
                    t0 = time.monotonic()
                    assert c.get("/healthz").status_code == 200
                    latencies.append(time.monotonic() - t0)
                    time.sleep(0.05)

        watcher = threading.Thread(target=well_behaved, daemon=True)
        watcher.start()
        try:
            # one 64 MiB header: 431 and closed after the first 64 KiB or so, not read to its end
            answer, sent, took = _send_huge_header(port, 64 << 20)
            assert answer.startswith(b"HTTP/1.1 431 "), answer[:200]
            assert sent < 8 << 20 and took < 5, (sent, took)
            # 1,000 small headers: 431
            many = b"".join(b"x-h%d: v\r\n" % n for n in range(1000))
            with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
                with contextlib.suppress(OSError):
                    sock.sendall(b"GET /healthz HTTP/1.1\r\nhost: x\r\n" + many + b"\r\n")
                assert read_until_closed(sock, 10).startswith(b"HTTP/1.1 431 ")
            # a long URL is part of the head too
            with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
                with contextlib.suppress(OSError):
                    sock.sendall(b"GET /healthz?" + b"q" * (200 << 10) + b" HTTP/1.1\r\n\r\n")
                assert read_until_closed(sock, 10).startswith(b"HTTP/1.1 431 ")
            # a head trickled in a byte every 0.2 s is cut off 2 s after it began
            t0 = time.monotonic()
            with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
                sock.sendall(b"GET /healthz HTTP/1.1\r\nhost: x\r\n")
                with contextlib.suppress(OSError):
                    for _ in range(100):
                        sock.sendall(b"x")
                        time.sleep(0.2)
                cut_after = time.monotonic() - t0
                assert read_until_closed(sock, 5).startswith(b"HTTP/1.1 408 ")
            assert 1.5 < cut_after < 6, cut_after
            # a connection that sends nothing is closed after the same bound
            t0 = time.monotonic()
            with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
                assert read_until_closed(sock, 8).startswith(b"HTTP/1.1 408 ")
            assert time.monotonic() - t0 < 6
        finally:
            stop.set()
            watcher.join(30)
        assert latencies and max(latencies) < 2.0, max(latencies)
        grew_mib = (_rss_kib(pid) - baseline) / 1024
        assert grew_mib < 32, grew_mib

        # ordinary heads pass: a 16 KiB header, 50 headers, keep-alive across requests
        with httpx.Client(base_url=server.url, timeout=30) as c:
            extra = {f"x-h{n}": "v" for n in range(50)}
            res = c.get("/healthz", headers={"x-cookie": "c" * (16 << 10), **extra})
            assert res.status_code == 200
            res = c.get(
                f"{API}/caches/{MAIN}/environments/{s.digest}/entries",
                headers=bearer(s.tokens["reader"]),
            )
            assert res.status_code == 200 and len(res.json()["items"]) == 3
        assert "Traceback" not in server.log_tail(400)
    finally:
        server.stop()
