"""Loopback servers that never answer, answer a byte at a time, or record who called.

Each runs on daemon threads in the test process, bound to 127.0.0.1 on a free port: a real
peer for the storage bounds (tests/test_storage_network.py), not a mock of the client.
"""

from __future__ import annotations

import socket
import socketserver
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

LOOPBACK = "127.0.0.1"


def _read_head(conn: socket.socket, limit: int = 65536) -> bytes:
    """The request head (up to the blank line), or what came before the peer stopped."""
    data = b""
    while b"\r\n\r\n" not in data and len(data) < limit:
        chunk = conn.recv(4096)
        if not chunk:
            break
        data += chunk
    return data


class _Server(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, behaviour: str) -> None:
        self.behaviour = behaviour
        self.connections = 0
        self.requests: list[str] = []
        self.held: list[socket.socket] = []
        self.closing = threading.Event()
        super().__init__((LOOPBACK, 0), _Handler)


class _Handler(socketserver.BaseRequestHandler):
    server: _Server

    def handle(self) -> None:
        server, conn = self.server, self.request
        server.connections += 1
        if server.behaviour == "silent":  # accepts, reads nothing, answers nothing
            server.held.append(conn)
            server.closing.wait()
            return
        head = _read_head(conn)
        server.requests.append(head.split(b"\r\n", 1)[0].decode("latin-1"))
        if server.behaviour == "trickle":  # a status line and headers, one byte at a time, for ever
            answer = b"HTTP/1.1 200 OK\r\nContent-Length: 1000000\r\n\r\n" + b"x" * 1000000
            for byte in answer:
                if server.closing.wait(0.2):
                    return
                try:
                    conn.sendall(bytes([byte]))
                except OSError:
                    return
            return
        # "record": a refusal any client understands
        conn.sendall(b"HTTP/1.1 403 Forbidden\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")


class Peer:
    """A running server: its URL, how many connections it took, the request lines it read."""

    def __init__(self, server: _Server) -> None:
        self._server = server
        self.port = server.server_address[1]
        self.url = f"http://{LOOPBACK}:{self.port}"

    @property
    def connections(self) -> int:
        return self._server.connections

    @property
    def requests(self) -> list[str]:
        return list(self._server.requests)


@contextmanager
def peer(behaviour: str) -> Iterator[Peer]:
    """A loopback server: ``silent`` (accepts, never answers), ``trickle`` (answers one byte
    every 0.2 s) or ``record`` (records each request, answers 403)."""
    assert behaviour in ("silent", "trickle", "record"), behaviour
    server = _Server(behaviour)
    thread = threading.Thread(target=server.serve_forever, name=f"peer-{behaviour}", daemon=True)
    thread.start()
    try:
        yield Peer(server)
    finally:
        server.closing.set()
        server.shutdown()
        for conn in server.held:
            conn.close()
        server.server_close()
        time.sleep(0)  # let handler threads see the event
