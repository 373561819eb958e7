"""server/fast_lane.py answers GET and HEAD of stored bytes without FastAPI's routing: the same
questions asked of an app with the lane and of one without it get the same answers, byte for byte,
and the lane is what answered the ones that succeed (the route handlers never ran for them)."""

from __future__ import annotations

import asyncio
import os
import socket
import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from fastapi.testclient import TestClient
from support.server_kit import MAIN, OTHER, LiveServer, bearer, entry_key, seed

from cachectl.core.errors import Unreachable
from cachectl.index import server_queries
from cachectl.storage import executables
from cachectl.storage.entries import sha256
from cachectl.storage.store import Store
from cachectl_server import entry_routes, executable_routes
from cachectl_server.app import create_app

API = "/api/v1"


@pytest.fixture
def apps(tmp_path, monkeypatch):
    """The seeded index, an app with the lane and one without, and the route handlers' calls."""
    s = seed(f"sqlite:///{tmp_path}/index.db", str(tmp_path / "main"), str(tmp_path / "other"))
    store = Store(s.root)
    key = s.keys[0]
    aot = executables.pack(
        b"payload " * 300, key=key, entry_sha256=sha256(s.entry_bytes[key]), function="train"
    )
    store.write_bytes(f"{s.env.namespace}/{key}-aot", aot)
    # A file planted in the namespace behind a symlink: served by neither.
    planted = entry_key("jit_planted", 7)
    os.symlink("/etc/hostname", f"{tmp_path}/main/{s.env.namespace}/{planted}-cache")
    calls: list[str] = []

    def counted(module, name):
        real = getattr(module, name)

        async def wrapper(*args, **kwargs):
            calls.append(name)
            return await real(*args, **kwargs)

        monkeypatch.setattr(module, name, wrapper)

    for module in (entry_routes, executable_routes):
        counted(module, "download")
        counted(module, "head")
    lane, plain = create_app(s.db), create_app(s.db, byte_fast_lane=False)
    with TestClient(lane) as lane_client, TestClient(plain) as plain_client:
        yield s, lane_client, plain_client, calls, planted
    for app in (lane, plain):
        app.state.cachectl.jobs.shutdown()
        app.state.cachectl.index.close()


def answer(response: httpx.Response) -> tuple[int, list[tuple[str, str]], bytes]:
    return response.status_code, sorted(response.headers.multi_items()), response.content


def cases(s, planted: str) -> list[tuple[str, str, str, str | None, dict[str, str]]]:
    """(name, method, path, token, extra headers) for GET and HEAD alike."""
    key, missing = s.keys[0], entry_key("jit_absent", 99)

    def at(cache: str = MAIN, digest: str = s.digest, name: str = key) -> str:
        return f"{API}/caches/{cache}/environments/{digest}/entries/{name}"

    out = []
    for method in ("GET", "HEAD"):
        out += [
            ("entry", method, at(), "reader", {}),
            ("another entry", method, at(name=s.keys[1]), "admin", {}),
            ("its executable", method, at(name=f"{key}/aot"), "reader", {}),
            ("by digest prefix", method, at(digest=s.digest[:12]), "reader", {}),
            ("scoped to this cache", method, at(), "scoped_writer", {}),
            ("with a query string", method, at(name=f"{key}?x=1"), "reader", {}),
            ("no executable", method, at(name=f"{s.keys[1]}/aot"), "reader", {}),
            ("missing entry", method, at(name=missing), "reader", {}),
            ("planted symlink", method, at(name=planted), "reader", {}),
            ("bad key", method, at(name="..%2Fetc"), "reader", {}),
            ("key with a dot first", method, at(name=f".x-{'0' * 64}"), "reader", {}),
            ("unknown environment", method, at(digest="f" * 64), "reader", {}),
            ("digest too long", method, at(digest="f" * 65), "reader", {}),
            ("cache name too long", method, at(cache="c" * 129), "reader", {}),
            ("unknown cache", method, at(cache="nope"), "reader", {}),
            ("other cache", method, at(cache=OTHER), "reader", {}),
            ("token scoped elsewhere", method, at(), "wrong_scope_reader", {}),
            ("no token", method, at(), None, {}),
            ("unknown token", method, at(), "not-a-token", {}),
            ("revoked token", method, at(), "revoked", {}),
            ("expired token", method, at(), "expired", {}),
            ("basic, not bearer", method, at(), "reader", {"authorization": "Basic eDp5"}),
            ("with a body", method, at(), "reader", {"content-length": "2"}),
        ]
    return out


def ask(
    client: TestClient, s, method: str, path: str, token: str | None, extra: dict
) -> httpx.Response:
    headers = bearer(s.tokens.get(token, token)) if token else {}
    headers.update(extra)
    content = b"{}" if "content-length" in extra else None
    return client.request(method, path, headers=headers, content=content)


def test_the_lane_gives_the_apps_answer_to_every_question(apps) -> None:
    s, lane, plain, calls, planted = apps
    answered_by_lane = 0
    for name, method, path, token, extra in cases(s, planted):
        for attempt in range(2):  # the first fills the token cache the lane reads
            calls.clear()
            got = ask(lane, s, method, path, token, extra)
            lane_calls = list(calls)
            calls.clear()
            want = ask(plain, s, method, path, token, extra)
            assert answer(got) == answer(want), (name, method, attempt)
            if attempt == 1 and got.status_code == 200:
                assert calls, (name, method)  # the app's route answered it
                if name == "with a body":  # the app ignores it; the lane leaves it to the app
                    assert lane_calls, (name, method)
                else:
                    assert not lane_calls, (name, method)  # the lane answered, not the route
                    answered_by_lane += 1
    assert answered_by_lane == 2 * 6  # the six good questions, GET and HEAD
    first = ask(
        lane,
        s,
        "GET",
        f"{API}/caches/{MAIN}/environments/{s.digest}/entries/{s.keys[0]}",
        "reader",
        {},
    )
    assert first.content == s.entry_bytes[s.keys[0]]
    assert first.headers["x-cachectl-sha256"] == sha256(s.entry_bytes[s.keys[0]])


def test_an_index_that_does_not_answer_is_answered_as_the_app_does_once(apps, monkeypatch) -> None:
    s, lane, plain, calls, _planted = apps
    path = f"{API}/caches/{MAIN}/environments/{s.digest}/entries/{s.keys[0]}"
    for client in (lane, plain):
        assert ask(client, s, "HEAD", path, "reader", {}).status_code == 200
    asked = []

    def down(*args, **kwargs):
        asked.append(1)
        raise Unreachable("the index at sqlite:///x does not answer: try again later")

    monkeypatch.setattr(server_queries, "recorded_digest", down)
    # An entry neither app has asked the index about: what was asked is remembered
    # (server/state.py ``recorded``), a failure is not.
    path = f"{API}/caches/{MAIN}/environments/{s.digest}/entries/{s.keys[1]}"
    for method in ("GET", "HEAD"):
        asked.clear()
        got = ask(lane, s, method, path, "reader", {})
        assert len(asked) == 1  # not asked a second time through the app
        assert answer(got) == answer(ask(plain, s, method, path, "reader", {}))
        assert got.status_code == 503


def test_under_uvicorn_the_lane_serves_and_the_metrics_count_it(tmp_path) -> None:
    s = seed(f"sqlite:///{tmp_path}/index.db", str(tmp_path / "main"), str(tmp_path / "other"))
    app = create_app(s.db)
    key = s.keys[0]
    url_path = f"{API}/caches/{MAIN}/environments/{s.digest}/entries/{key}"
    try:
        with LiveServer(app) as server, httpx.Client(base_url=server.url) as client:
            for _ in range(3):
                got = client.get(url_path, headers=bearer(s.tokens["reader"]))
                assert got.status_code == 200 and got.content == s.entry_bytes[key]
                head = client.head(url_path, headers=bearer(s.tokens["reader"]))
                assert head.status_code == 200 and head.content == b""
                assert int(head.headers["content-length"]) == len(s.entry_bytes[key])
            metrics = client.get("/metrics", headers=bearer(s.tokens["reader"])).text
    finally:
        app.state.cachectl.jobs.shutdown()
        app.state.cachectl.index.close()
    template = "/api/v1/caches/{cache}/environments/{digest}/entries/{key}"
    for method in ("GET", "HEAD"):
        line = (
            f'cachectl_http_requests_total{{method="{method}",route="{template}",status="200"}} 3.0'
        )
        assert line in metrics, metrics[:2000]
    assert (
        f'cachectl_entry_download_bytes_total{{cache="{MAIN}"}} {3.0 * len(s.entry_bytes[key])}'
        in metrics
    )


def test_the_lane_runs_as_many_requests_at_once_as_the_routes_did(tmp_path, monkeypatch) -> None:
    """A HEAD on an object store waits on the network in its thread: the lane must not cap how many
    wait at once below the routes' own hop (asyncio's default pool has cores + 4 threads)."""
    from cachectl_server import fast_lane

    s = seed(f"sqlite:///{tmp_path}/index.db", str(tmp_path / "main"), str(tmp_path / "other"))
    at_once = 16
    together = threading.Barrier(at_once, timeout=30)
    answered: list[int] = []
    real = fast_lane.head_answer

    def waits_for_the_others(*args, **kwargs):
        together.wait()  # breaks (and the lane leaves the request to the app) if fewer get here
        answered.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(fast_lane, "head_answer", waits_for_the_others)
    monkeypatch.setattr(fast_lane, "INLINE_KINDS", ())  # every answer in a thread, as for S3
    app = create_app(s.db)
    path = f"{API}/caches/{MAIN}/environments/{s.digest}/entries/{s.keys[0]}"
    try:
        with LiveServer(app) as server:
            url = server.url + path
            assert httpx.head(url, headers=bearer(s.tokens["reader"])).status_code == 200
            together.reset()
            answered.clear()
            with ThreadPoolExecutor(at_once) as pool:
                codes = list(
                    pool.map(
                        lambda _: (
                            httpx.head(
                                url, headers=bearer(s.tokens["reader"]), timeout=60
                            ).status_code
                        ),
                        range(at_once),
                    )
                )
    finally:
        app.state.cachectl.jobs.shutdown()
        app.state.cachectl.index.close()
    assert codes == [200] * at_once
    assert len(answered) == at_once and not together.broken


def free_slots() -> int:
    """How many whole-read slots are free now (taken and given back at once)."""
    taken = 0
    while entry_routes.WHOLE_SLOTS.acquire(blocking=False):
        taken += 1
    for _ in range(taken):
        entry_routes.WHOLE_SLOTS.release()
    return taken


def test_a_get_cancelled_while_its_thread_reads_gives_its_slot_back(tmp_path, monkeypatch) -> None:
    """The thread goes on after the request is cancelled; the whole read it took a slot for is
    never sent, and the slot comes back when the thread is done (none is lost)."""
    from cachectl_server import fast_lane

    s = seed(f"sqlite:///{tmp_path}/index.db", str(tmp_path / "main"), str(tmp_path / "other"))
    app = create_app(s.db)
    path = f"{API}/caches/{MAIN}/environments/{s.digest}/entries/{s.keys[0]}"
    headers = bearer(s.tokens["reader"])
    with TestClient(app) as client:  # fills the token cache the lane reads
        assert client.get(path, headers=headers).status_code == 200
    started, go_on, finished = threading.Event(), threading.Event(), threading.Event()
    real = fast_lane.download_answer

    def slow(*args, **kwargs):
        started.set()
        go_on.wait(30)
        try:
            return real(*args, **kwargs)  # takes a slot for the whole body
        finally:
            finished.set()

    monkeypatch.setattr(fast_lane, "download_answer", slow)
    before = free_slots()
    scope = {
        "type": "http",
        "http_version": "1.1",
        "method": "GET",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "root_path": "",
        "query_string": b"",
        "headers": [(k.lower().encode(), v.encode()) for k, v in headers.items()],
        "client": ("127.0.0.1", 1),
        "server": ("127.0.0.1", 80),
    }
    sent: list[dict] = []

    async def receive():
        await asyncio.sleep(60)
        return {"type": "http.disconnect"}

    async def send(message):
        sent.append(message)

    async def cancelled_midway() -> None:
        task = asyncio.ensure_future(app(scope, receive, send))
        while not started.is_set():
            await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        go_on.set()
        finished.wait(30)
        for _ in range(200):  # the done callback runs on this loop
            await asyncio.sleep(0.01)
            if free_slots() == before:
                break

    try:
        asyncio.run(cancelled_midway())
    finally:
        go_on.set()
        app.state.cachectl.jobs.shutdown()
        app.state.cachectl.index.close()
    assert finished.is_set() and not sent
    assert free_slots() == before


def test_once_remembered_local_bytes_are_answered_on_the_event_loop(tmp_path, monkeypatch) -> None:
    """After the first GET and HEAD of a key (which fill what server/state.py remembers), the lane
    answers from the event loop: no thread hop, no index query, the file sent with sendfile."""
    from cachectl_server import fast_lane

    s = seed(f"sqlite:///{tmp_path}/index.db", str(tmp_path / "main"), str(tmp_path / "other"))
    app = create_app(s.db)
    key = s.keys[0]
    url_path = f"{API}/caches/{MAIN}/environments/{s.digest}/entries/{key}"
    threaded: list[str] = []
    real_head, real_download = fast_lane.head_answer, fast_lane.download_answer

    def counted(real, name):
        def wrapper(*args, **kwargs):
            threaded.append(name)
            return real(*args, **kwargs)

        return wrapper

    monkeypatch.setattr(fast_lane, "head_answer", counted(real_head, "head"))
    monkeypatch.setattr(fast_lane, "download_answer", counted(real_download, "get"))
    try:
        with LiveServer(app) as server, httpx.Client(base_url=server.url) as client:
            for method in ("GET", "HEAD", "GET", "HEAD"):  # the app's routes, then the lane's
                assert client.request(method, url_path, headers=bearer(s.tokens["reader"]))
            threaded.clear()

            def no_index(*args, **kwargs):
                raise AssertionError("the index was asked")

            monkeypatch.setattr(server_queries, "recorded_digest", no_index)
            monkeypatch.setattr(server_queries, "locate", no_index)
            for _ in range(3):
                got = client.get(url_path, headers=bearer(s.tokens["reader"]))
                assert got.status_code == 200 and got.content == s.entry_bytes[key]
                assert got.headers["x-cachectl-sha256"] == sha256(s.entry_bytes[key])
                head = client.head(url_path, headers=bearer(s.tokens["reader"]))
                assert head.status_code == 200 and head.content == b""
                assert int(head.headers["content-length"]) == len(s.entry_bytes[key])
            assert threaded == []
            # an entry deleted from storage is a 404 at once (the app's answer)
            os.unlink(f"{tmp_path}/main/{s.env.namespace}/{key}-cache")
            monkeypatch.undo()
            for method in ("GET", "HEAD"):
                assert (
                    client.request(method, url_path, headers=bearer(s.tokens["reader"])).status_code
                    == 404
                )
    finally:
        app.state.cachectl.jobs.shutdown()
        app.state.cachectl.index.close()


def test_small_gets_and_heads_are_written_whole_with_the_apps_headers(
    tmp_path, monkeypatch
) -> None:
    """Once remembered, a HEAD and a GET up to NOW_MAX are written by the connection's protocol
    (server/http_edge.py ``_answer_now``) with no ASGI cycle: the same status, headers (but the
    date) and bytes as the app's own route gives, pipelined requests in order, and counted."""
    from cachectl_server import fast_lane

    s = seed(f"sqlite:///{tmp_path}/index.db", str(tmp_path / "main"), str(tmp_path / "other"))
    lane_app, plain_app = create_app(s.db), create_app(s.db, byte_fast_lane=False)
    asgi_answers: list[int] = []
    real = fast_lane.ByteFastLane.answer

    async def counted(self, scope, receive, send):
        asgi_answers.append(1)
        return await real(self, scope, receive, send)

    monkeypatch.setattr(fast_lane.ByteFastLane, "answer", counted)
    headers = bearer(s.tokens["reader"])
    paths = [f"{API}/caches/{MAIN}/environments/{s.digest}/entries/{k}" for k in s.keys]

    def answers(client: httpx.Client) -> list[tuple[int, list[tuple[str, str]], bytes]]:
        got = []
        for path in paths:
            for method in ("GET", "HEAD"):
                r = client.request(method, path, headers=headers)
                got.append(
                    (
                        r.status_code,
                        sorted(kv for kv in r.headers.multi_items() if kv[0] != "date"),
                        r.content,
                    )
                )
        return got

    try:
        with (
            LiveServer(lane_app) as lane,
            LiveServer(plain_app) as plain,
            httpx.Client(base_url=lane.url) as lane_client,
            httpx.Client(base_url=plain.url) as plain_client,
        ):
            first = answers(lane_client)  # the app's routes, which fill what the lane remembers
            asgi_answers.clear()
            again = answers(lane_client)
            assert asgi_answers == []  # all written at once
            assert again == first == answers(plain_client)
            assert "date" in lane_client.head(paths[0], headers=headers).headers
            # pipelined on one connection: each answer in its place
            with socket.create_connection(("127.0.0.1", lane.port), timeout=30) as sock:
                auth = headers["authorization"]
                sock.sendall(
                    b"".join(
                        f"{m} {p} HTTP/1.1\r\nHost: x\r\nAuthorization: {auth}\r\n\r\n".encode()
                        for p in paths
                        for m in ("HEAD", "GET")
                    )
                )
                got = b""
                sock.settimeout(10)
                while got.count(b"HTTP/1.1 200") < 2 * len(paths) or not got.endswith(
                    s.entry_bytes[s.keys[-1]]
                ):
                    chunk = sock.recv(1 << 16)
                    assert chunk
                    got += chunk
                positions = [got.index(s.entry_bytes[k]) for k in s.keys]  # GET bodies in order
                assert positions == sorted(positions)
            metrics = lane_client.get("/metrics", headers=headers).text
    finally:
        for app in (lane_app, plain_app):
            app.state.cachectl.jobs.shutdown()
            app.state.cachectl.index.close()
    template = "/api/v1/caches/{cache}/environments/{digest}/entries/{key}"
    count = f'cachectl_http_requests_total{{method="HEAD",route="{template}",status="200"}} '
    assert count in metrics
    assert float(metrics.split(count, 1)[1].split()[0]) == 2 * len(paths) + 1 + len(paths)
