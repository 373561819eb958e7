"""A GET of stored bytes over server/fast_lane.py ``NOW_MAX``, once remembered, is sent by the
connection's protocol (server/http_edge.py, server/zero_copy.py ``ProtocolSend``) with no ASGI cycle:
the same status, headers and bytes as the app's own route, on keep-alive and pipelined connections;
a client gone mid-body leaves nothing open; a revoked token stops within ``token_cache_s``."""

from __future__ import annotations

import os
import socket
import struct
import time

import httpx
import pytest
from support.server_kit import MAIN, LiveServer, bearer, seed

from cachectl.index import NewEntry, open_index
from cachectl.storage.entries import make_entry, sha256
from cachectl.storage.store import Store
from cachectl.trust import tokens
from cachectl_server import fast_lane
from cachectl_server.app import create_app

API = "/api/v1"
BIG = 20 * 1024 * 1024
TOKEN_CACHE_S = 1.0


@pytest.fixture
def served(tmp_path, monkeypatch):
    """A seeded index whose entries are 1 MiB, plus one of 20 MiB; a server with the lane and one
    without it; and a list that records each request the lane's ASGI ``answer`` saw."""
    s = seed(
        f"sqlite:///{tmp_path}/index.db",
        str(tmp_path / "main"),
        str(tmp_path / "other"),
        entries=2,
        entry_size=1 << 20,
    )
    key = "jit_big-" + "b" * 64
    data = make_entry(os.urandom(BIG), compile_seconds=3)
    Store(str(tmp_path / "main")).write_bytes(f"{s.env.namespace}/{key}-cache", data)
    index = open_index(s.db)
    try:
        info = index.ensure_environment(MAIN, s.env)
        index.upsert_entries(
            info.id,
            [
                NewEntry(
                    key=key, module="jit_big", size=len(data), sha256=sha256(data), origin="warm"
                )
            ],
        )
    finally:
        index.close()
    s.keys.append(key)
    s.entry_bytes[key] = data
    asgi: list[str] = []
    real = fast_lane.ByteFastLane.answer

    async def counted(self, scope, receive, send):
        asgi.append(scope["path"])
        return await real(self, scope, receive, send)

    monkeypatch.setattr(fast_lane.ByteFastLane, "answer", counted)
    lane_app = create_app(s.db, token_cache_s=TOKEN_CACHE_S)
    plain_app = create_app(s.db, byte_fast_lane=False, token_cache_s=TOKEN_CACHE_S)
    try:
        with LiveServer(lane_app) as lane, LiveServer(plain_app) as plain:
            yield s, lane, plain, asgi
    finally:
        for app in (lane_app, plain_app):
            app.state.cachectl.jobs.shutdown()
            app.state.cachectl.index.close()


def path_of(s, key: str) -> str:
    return f"{API}/caches/{MAIN}/environments/{s.digest}/entries/{key}"


def answer(r: httpx.Response) -> tuple[int, list[tuple[str, str]], bytes]:
    return r.status_code, sorted(kv for kv in r.headers.multi_items() if kv[0] != "date"), r.content


def read_answer(
    sock: socket.socket, buf: bytearray, head_only: bool = False
) -> tuple[bytes, bytes]:
    """One HTTP/1.1 answer (its head, its body) from ``sock``, ``buf`` holding what came early."""
    while b"\r\n\r\n" not in buf:
        chunk = sock.recv(1 << 20)
        assert chunk, "the connection closed before an answer's head"
        buf += chunk
    end = buf.index(b"\r\n\r\n") + 4
    head = bytes(buf[:end])
    del buf[:end]
    length = 0 if head_only else int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
    while len(buf) < length:
        chunk = sock.recv(1 << 20)
        assert chunk, "the connection closed inside a body"
        buf += chunk
    body = bytes(buf[:length])
    del buf[:length]
    return head, body


def open_files() -> tuple[int, int]:
    """This process's descriptors: (sockets, open entry files)."""
    sockets = files = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue  # listdir's own descriptor, or one closed meanwhile
        sockets += target.startswith("socket:")
        files += target.endswith("-cache")
    return sockets, files


def test_large_gets_are_sent_by_the_protocol_with_the_apps_answer(served) -> None:
    s, lane, plain, asgi = served
    headers = bearer(s.tokens["reader"])
    asks = [
        (method, path_of(s, key), extra)
        for key in s.keys
        for method in ("GET", "HEAD")
        for extra in ({}, {"range": "bytes=0-99"})
    ]
    with (
        httpx.Client(base_url=lane.url, timeout=30) as lane_client,
        httpx.Client(base_url=plain.url, timeout=30) as plain_client,
    ):
        first = [answer(lane_client.request(m, p, headers={**headers, **x})) for m, p, x in asks]
        asgi.clear()
        again = [answer(lane_client.request(m, p, headers={**headers, **x})) for m, p, x in asks]
        assert asgi == []  # every one written by the protocol
        assert (
            again
            == first
            == [answer(plain_client.request(m, p, headers={**headers, **x})) for m, p, x in asks]
        )
    for (method, path, _), (status, got_headers, body) in zip(asks, again, strict=True):
        key = path.rsplit("/", 1)[1]
        assert status == 200
        if method == "GET":
            assert body == s.entry_bytes[key]
            assert (
                dict(got_headers)["x-cachectl-sha256"] == sha256(body) == sha256(s.entry_bytes[key])
            )


def test_keep_alive_and_pipelined_large_gets_come_in_order(served) -> None:
    s, lane, _plain, asgi = served
    auth = bearer(s.tokens["reader"])["authorization"]
    small, big = s.keys[0], s.keys[-1]

    def request(method: str, key: str) -> bytes:
        return f"{method} {path_of(s, key)} HTTP/1.1\r\nHost: x\r\nAuthorization: {auth}\r\n\r\n".encode()

    with httpx.Client(base_url=lane.url, timeout=30) as client:
        for key in s.keys:  # remembered from here on
            assert (
                client.get(path_of(s, key), headers=bearer(s.tokens["reader"])).status_code == 200
            )
    asgi.clear()
    with socket.create_connection(("127.0.0.1", lane.port), timeout=30) as sock:
        # a small receive buffer: the 20 MiB file cannot go in one sendfile call
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 * 1024)
        buf = bytearray()
        for key in (small, big, small):  # one after another on one connection
            sock.sendall(request("GET", key))
            _head, body = read_answer(sock, buf)
            assert body == s.entry_bytes[key]
        # pipelined: the answers after the large one wait for its last byte
        sock.sendall(request("GET", big) + request("GET", small) + request("HEAD", big))
        head, body = read_answer(sock, buf)
        assert head.startswith(b"HTTP/1.1 200") and body == s.entry_bytes[big]
        head, body = read_answer(sock, buf)
        assert head.startswith(b"HTTP/1.1 200") and body == s.entry_bytes[small]
        head, _ = read_answer(sock, buf, head_only=True)
        assert head.startswith(b"HTTP/1.1 200") and f"{len(s.entry_bytes[big])}".encode() in head
        assert not buf
    # only the two queued behind the large send went through the app (uvicorn starts them)
    assert asgi == [path_of(s, small), path_of(s, big)]


def test_a_client_gone_mid_body_leaves_the_server_healthy(served) -> None:
    s, lane, _plain, asgi = served
    headers = bearer(s.tokens["reader"])
    big = s.keys[-1]
    with httpx.Client(base_url=lane.url, timeout=30) as client:
        assert client.get(path_of(s, big), headers=headers).content == s.entry_bytes[big]
        before = open_files()
        through_app: list[str] = []
        for _ in range(3):
            # What the lane answers from is remembered for TOKEN_CACHE_S (1 s): a loaded machine
            # can take longer than that between two requests, so remember it again right before.
            assert client.head(path_of(s, big), headers=headers).status_code == 200
            asgi.clear()
            sock = socket.create_connection(("127.0.0.1", lane.port), timeout=30)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 * 1024)
            sock.sendall(
                f"GET {path_of(s, big)} HTTP/1.1\r\nHost: x\r\n"
                f"Authorization: {headers['authorization']}\r\n\r\n".encode()
            )
            assert sock.recv(1 << 16)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            sock.close()  # a reset, with most of the body unsent
            through_app += asgi
        deadline = time.monotonic() + 10
        while open_files() != before and time.monotonic() < deadline:
            time.sleep(0.05)
        assert open_files() == before  # the files and sockets of the dropped answers are closed
        assert through_app == []  # those were the protocol's sends
        got = client.get(path_of(s, big), headers=headers)
        assert got.status_code == 200 and got.content == s.entry_bytes[big]


def test_a_revoked_token_stops_within_the_bound(served) -> None:
    s, lane, _plain, asgi = served
    headers = bearer(s.tokens["reader"])
    big = s.keys[-1]
    with httpx.Client(base_url=lane.url, timeout=30) as client:
        assert client.get(path_of(s, big), headers=headers).status_code == 200
        asgi.clear()
        assert client.get(path_of(s, big), headers=headers).status_code == 200
        assert asgi == []  # sent by the protocol from what the lane remembers
        index = open_index(s.db)
        try:
            tokens.revoke_token(index, "reader")
        finally:
            index.close()
        revoked = time.monotonic()
        while client.get(path_of(s, big), headers=headers).status_code == 200:
            assert time.monotonic() - revoked <= TOKEN_CACHE_S + 0.5
            time.sleep(0.05)
        assert client.get(path_of(s, big), headers=headers).status_code == 401
