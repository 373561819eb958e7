"""server/http_edge.py makes fewer timers than uvicorn (a timer made and cancelled cost more than a
stat), with the same bounds. A request head is timed from its first byte, but its timer is made only
when a read ends with a head begun and not whole: a head begun in the same read as the request
before it, after a request the fast lane wrote at once, or on a kept-alive connection, is still cut
off. The keep-alive timer is made once per idle spell: a connection in use past the keep-alive
time stays open, and one idle that long after its last answer is closed."""

from __future__ import annotations

import socket
import threading
import time

import pytest
from support.server_kit import MAIN, bearer, read_until_closed, seed, served

from cachectl_server.app import create_app
from cachectl_server.http_edge import bounded_http

API = "/api/v1"
TIMEOUT_S = 1.0


@pytest.mark.timeout(60)
def test_a_head_left_unfinished_after_a_whole_request_is_cut_off(tmp_path) -> None:
    s = seed(f"sqlite:///{tmp_path}/index.db", str(tmp_path / "main"), str(tmp_path / "other"))
    path = f"{API}/caches/{MAIN}/environments/{s.digest}/entries/{s.keys[0]}"
    auth = bearer(s.tokens["reader"])["authorization"]
    entry = f"GET {path} HTTP/1.1\r\nhost: x\r\nauthorization: {auth}\r\n\r\n".encode()
    partial = b"GET /healthz HTTP/1.1\r\nhost: x\r\n"
    with served(s.db, header_timeout_s=TIMEOUT_S) as (live, client):
        for _ in range(2):  # the app's route, then the lane answers it at once
            assert client.get(path, headers={"authorization": auth}).status_code == 200
        whole = b"GET /healthz HTTP/1.1\r\nhost: x\r\n\r\n"
        for name, first, pause in [
            ("same read, after the app's answer", whole, None),
            ("same read, after the lane's answer", entry, None),
            ("next read, kept alive", entry, 0.3),
        ]:
            with socket.create_connection(("127.0.0.1", live.port), timeout=10) as sock:
                t0 = time.monotonic()
                if pause is None:
                    sock.sendall(first + partial)
                else:
                    sock.sendall(first)
                    time.sleep(pause)
                    sock.sendall(partial)
                got = read_until_closed(sock, 10)
                took = time.monotonic() - t0
            assert got.startswith(b"HTTP/1.1 200 "), (name, got[:200])
            assert b"HTTP/1.1 408 " in got, (name, got[-300:])
            assert TIMEOUT_S * 0.8 < took < TIMEOUT_S + 4, (name, took)


def _response(sock: socket.socket) -> bytes:
    """One whole response with a Content-Length; b"" if the server closed the connection."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            return b""
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = int(head.lower().split(b"content-length: ", 1)[1].split(b"\r\n", 1)[0])
    while len(body) < length:
        chunk = sock.recv(65536)
        assert chunk, "closed mid-answer"
        body += chunk
    return head


@pytest.mark.timeout(60)
def test_keep_alive_closes_idle_connections_only(tmp_path) -> None:
    import uvicorn
    from support.infra import free_port

    s = seed(f"sqlite:///{tmp_path}/index.db", str(tmp_path / "main"), str(tmp_path / "other"))
    app = create_app(s.db)
    port = free_port()
    server = uvicorn.Server(
        uvicorn.Config(
            app,
            host="127.0.0.1",
            port=port,
            log_config=None,
            timeout_keep_alive=1,
            http=bounded_http(app.state.cachectl.settings),
        )
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    path = f"{API}/caches/{MAIN}/environments/{s.digest}/entries/{s.keys[0]}"
    auth = bearer(s.tokens["reader"])["authorization"]
    entry = f"GET {path} HTTP/1.1\r\nhost: x\r\nauthorization: {auth}\r\n\r\n".encode()
    health = b"GET /healthz HTTP/1.1\r\nhost: x\r\n\r\n"
    try:
        deadline = time.monotonic() + 20
        while not server.started:
            assert time.monotonic() < deadline and thread.is_alive()
            time.sleep(0.02)
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
            # in use for 2.1 keep-alive times, the timer due while idle between requests (and
            # due again 0.3 s after the last one): the lane's answers and the app's
            for n in range(4):
                if n:
                    time.sleep(0.7)
                sock.sendall(entry if n % 2 else health)
                assert _response(sock).startswith(b"HTTP/1.1 200 "), n
            last = time.monotonic()
            sock.settimeout(10)
            assert sock.recv(1) == b""  # closed once idle
            idle = time.monotonic() - last
        assert 0.6 < idle < 3, idle
    finally:
        server.should_exit = True
        thread.join(20)
        app.state.cachectl.jobs.shutdown()
        app.state.cachectl.index.close()
