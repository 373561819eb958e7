"""server/http_edge.py times a request head from its first byte, but makes the timer only when a
read ends with a head begun and not whole (most heads come in one read, and a timer made and
cancelled for each cost more than a stat). A head begun in the same read as the request before it,
after a request the fast lane wrote at once, or on a kept-alive connection, is still cut off."""

from __future__ import annotations

import contextlib
import socket
import time

import pytest
from support.server_kit import MAIN, bearer, seed, served

API = "/api/v1"
TIMEOUT_S = 1.0


def _until_closed(sock: socket.socket, timeout: float) -> bytes:
    sock.settimeout(timeout)
    data = b""
    with contextlib.suppress(OSError):
        while chunk := sock.recv(65536):
            data += chunk
    return data


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
                got = _until_closed(sock, 10)
                took = time.monotonic() - t0
            assert got.startswith(b"HTTP/1.1 200 "), (name, got[:200])
            assert b"HTTP/1.1 408 " in got, (name, got[-300:])
            assert TIMEOUT_S * 0.8 < took < TIMEOUT_S + 4, (name, took)
