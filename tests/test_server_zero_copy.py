"""server/zero_copy.py under a real uvicorn, as `cachectl serve` runs it (server/http_edge.py's
protocol): downloads leave by ``sendfile``, byte for byte, through the fast lane and the routes;
a client that goes away or stops reading, or a file shorter than its Content-Length, costs only its
own connection."""

from __future__ import annotations

import asyncio
import errno
import hashlib
import os
import socket
import threading
import time
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
import uvicorn
from support.infra import free_port
from support.server_kit import MAIN, LiveServer, bearer, entry_key, seed

from cachectl.index import NewEntry, open_index
from cachectl.storage.entries import make_entry, sha256
from cachectl.storage.store import Store
from cachectl_server import fast_lane, zero_copy
from cachectl_server.app import create_app
from cachectl_server.config import ServerSettings
from cachectl_server.entry_routes import SHA_HEADER, WHOLE
from cachectl_server.http_edge import bounded_http

API = "/api/v1"


@pytest.fixture
def world(tmp_path) -> Any:
    """The seed, plus entries of 1 MiB, of more than WHOLE (which used to be streamed), and of more
    than the socket buffers on both sides of a connection hold (the last)."""
    s = seed(f"sqlite:///{tmp_path}/index.db", str(tmp_path / "main"), str(tmp_path / "other"))
    index = open_index(s.db)
    env = index.find_environment(MAIN, s.digest)
    rows = []
    for n, size in enumerate((1 << 20, WHOLE + (1 << 20), 24 << 20)):
        key = entry_key("jit_big", n)
        data = make_entry(os.urandom(size))
        Store(s.root).write_bytes(f"{s.env.namespace}/{key}-cache", data)
        rows.append(
            NewEntry(key=key, module="jit_big", size=len(data), sha256=sha256(data), origin="warm")
        )
        s.keys.append(key)
        s.entry_bytes[key] = data
    index.upsert_entries(env.id, rows)
    index.close()
    return s


@pytest.fixture
def live(world) -> Iterator[LiveServer]:
    app = create_app(ServerSettings(db=world.db))
    try:
        with LiveServer(app) as server:
            yield server
    finally:
        app.state.cachectl.jobs.shutdown()
        app.state.cachectl.index.close()


@pytest.fixture
def sendfile_bytes(monkeypatch) -> list[int]:
    """Every byte os.sendfile sent, in this process (the live server runs in a thread of it)."""
    sent: list[int] = []
    real = os.sendfile

    def counting(*args: Any) -> int:
        n = real(*args)
        sent.append(n)
        return n

    monkeypatch.setattr(os, "sendfile", counting)
    return sent


def _url(world: Any, key: str) -> str:
    return f"{API}/caches/{MAIN}/environments/{world.digest}/entries/{key}"


def _request(world: Any, key: str, method: str = "GET") -> bytes:
    token = world.tokens["reader"]
    return (
        f"{method} {_url(world, key)} HTTP/1.1\r\nhost: 127.0.0.1\r\n"
        f"authorization: Bearer {token}\r\n\r\n"
    ).encode()


def _read_response(sock: socket.socket, pending: bytearray) -> tuple[bytes, bytes]:
    """One response (head, body) read off a keep-alive connection; what follows stays in pending."""
    while b"\r\n\r\n" not in pending:
        chunk = sock.recv(1 << 16)
        assert chunk, "the connection closed before a response head"
        pending += chunk
    head, _, rest = bytes(pending).partition(b"\r\n\r\n")
    length = int(head.lower().split(b"content-length: ", 1)[1].split(b"\r\n", 1)[0])
    pending[:] = rest
    while len(pending) < length:
        chunk = sock.recv(1 << 20)
        assert chunk, "the connection closed inside a body"
        pending += chunk
    body = bytes(pending[:length])
    del pending[:length]
    return head, body


def test_downloads_leave_by_sendfile_byte_for_byte(
    world, live, sendfile_bytes, monkeypatch
) -> None:
    # every size by sendfile (small ones are otherwise written with their headers at once)
    monkeypatch.setattr(fast_lane, "NOW_MAX", 0)
    with httpx.Client(base_url=live.url, timeout=30, headers=bearer(world.tokens["reader"])) as c:
        # the first GET of a token goes through FastAPI's route, the next ones through the lane
        for _ in range(2):
            for key in world.keys:
                got = c.get(_url(world, key))
                data = world.entry_bytes[key]
                assert got.status_code == 200 and got.content == data, key
                assert got.headers[SHA_HEADER] == sha256(data)
                assert got.headers["content-length"] == str(len(data))
        head = c.head(_url(world, world.keys[-1]))
        assert head.status_code == 200 and head.content == b""
        assert head.headers["content-length"] == str(len(world.entry_bytes[world.keys[-1]]))
    assert sum(sendfile_bytes) == 2 * sum(len(world.entry_bytes[k]) for k in world.keys)


def test_a_file_sendfile_refuses_is_read_and_sent_instead(world, live, monkeypatch) -> None:
    """As on a filesystem without sendfile: the call fails before its first byte, with EINVAL."""
    refused: list[int] = []

    def unsendable(*args: Any) -> int:
        refused.append(args[1])
        raise OSError(errno.EINVAL, "Invalid argument")

    monkeypatch.setattr(os, "sendfile", unsendable)
    monkeypatch.setattr(fast_lane, "NOW_MAX", 0)
    with httpx.Client(base_url=live.url, timeout=30, headers=bearer(world.tokens["reader"])) as c:
        for key in [*world.keys, *world.keys]:
            got = c.get(_url(world, key))
            assert got.status_code == 200 and got.content == world.entry_bytes[key], key
    assert len(refused) == 2 * len(world.keys)


def test_pipelined_requests_each_get_their_own_answer(world, live, sendfile_bytes) -> None:
    big, small = world.keys[-2], world.keys[0]
    order = [big, small, big, world.keys[-1], small]
    with socket.create_connection(("127.0.0.1", live.port), timeout=30) as sock:
        sock.sendall(b"".join(_request(world, key) for key in order))  # one write, five requests
        pending = bytearray()
        for key in order:
            head, body = _read_response(sock, pending)
            assert head.startswith(b"HTTP/1.1 200"), head
            assert hashlib.sha256(body).hexdigest() == sha256(world.entry_bytes[key]), key
        assert not pending
    assert sum(sendfile_bytes) == sum(len(world.entry_bytes[k]) for k in order)


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_a_client_that_stops_reading_or_goes_costs_only_its_connection(
    world, live, monkeypatch
) -> None:
    monkeypatch.setattr(zero_copy, "STALL_S", 1.0)
    biggest = world.keys[-1]
    full = len(world.entry_bytes[biggest])
    ok = f"{live.url}{_url(world, world.keys[-2])}"
    reader = bearer(world.tokens["reader"])
    httpx.get(ok, headers=reader, timeout=30).raise_for_status()  # the token is cached: the lane
    # ... which then answers on the event loop through the root's directories, opened once
    # (server/fast_lane.py Readers): those stay open, counted in the baseline
    httpx.get(ok, headers=reader, timeout=30).raise_for_status()
    baseline = _open_fds()

    stalled = socket.socket()
    stalled.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    stalled.connect(("127.0.0.1", live.port))
    stalled.sendall(_request(world, biggest))
    # while that client reads nothing, the server answers others at once
    started = time.monotonic()
    for _ in range(3):
        assert httpx.get(ok, headers=reader, timeout=30).status_code == 200
    assert time.monotonic() - started < zero_copy.STALL_S * 3
    # and after STALL_S without progress the stalled connection is closed, its answer unfinished
    time.sleep(zero_copy.STALL_S + 1)
    stalled.settimeout(30)
    received = 0
    while chunk := stalled.recv(1 << 16):
        received += len(chunk)
    stalled.close()
    assert 0 < received < full

    for _ in range(5):  # clients that hang up in the middle of a download
        with socket.create_connection(("127.0.0.1", live.port), timeout=30) as gone:
            gone.sendall(_request(world, biggest))
            assert gone.recv(1000)
    assert httpx.get(ok, headers=reader, timeout=30).status_code == 200
    deadline = time.monotonic() + 10
    while _open_fds() > baseline and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _open_fds() <= baseline, "a descriptor (a file or a socket's duplicate) was left open"


class _Served:
    """A bare ASGI app under uvicorn with `cachectl serve`'s protocol, in a thread."""

    def __init__(self, app: Any) -> None:
        self.port = free_port()
        protocol = bounded_http(SimpleNamespace(header_timeout_s=10))  # type: ignore[arg-type]
        config = uvicorn.Config(
            app, host="127.0.0.1", port=self.port, lifespan="off", log_config=None, http=protocol
        )
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> _Served:
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            assert time.monotonic() < deadline and self.thread.is_alive()
            time.sleep(0.02)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(20)


def test_a_file_shorter_than_its_content_length_closes_the_connection(tmp_path) -> None:
    path = tmp_path / "short"
    path.write_bytes(os.urandom(300_000))
    promised = 300_000 + 4096
    seen: list[dict[str, Any]] = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        seen.append(dict(scope.get("extensions") or {}))
        with open(path, "rb") as fh:
            headers = [(b"content-length", str(promised).encode())]
            await send({"type": "http.response.start", "status": 200, "headers": headers})
            await send({"type": zero_copy.ZERO_COPY, "file": fh, "offset": 0, "count": promised})
            await asyncio.sleep(0)

    with _Served(app) as served:
        with socket.create_connection(("127.0.0.1", served.port), timeout=30) as sock:
            sock.sendall(b"GET /short HTTP/1.1\r\nhost: x\r\n\r\n")
            data = b""
            while chunk := sock.recv(1 << 16):  # the server closes: the answer cannot be whole
                data += chunk
        head, _, body = data.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200") and body == path.read_bytes()
        # the next connection is served as usual
        with socket.create_connection(("127.0.0.1", served.port), timeout=30) as sock:
            sock.sendall(b"GET /short HTTP/1.1\r\nhost: x\r\n\r\n")
            assert sock.recv(100).startswith(b"HTTP/1.1 200")
    assert seen and all(zero_copy.ZERO_COPY in extensions for extensions in seen)


def test_a_uvicorn_without_what_it_needs_is_offered_nothing() -> None:
    cycle = SimpleNamespace(scope={}, send=None, transport=None)  # no counts of body bytes
    zero_copy.offer(cycle)
    assert cycle.scope == {} and cycle.send is None
    assert not zero_copy.offered(cycle.scope)
