"""The server's client against a hostile server on loopback (a small stdlib HTTP server here):
each request ends within its timeout, body included, and an entry's or executable's body is cut
at the index's recorded size plus one byte (cachectl/client/deadline.py, transport.py
``read_body``, server_client.py ``download_entry``, service/node_source.py ``_server_fetch``)."""

from __future__ import annotations

import hashlib
import json
import resource
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx
import pytest

from cachectl.client import ServerClient
from cachectl.core.errors import CachectlError, Unreachable
from cachectl.core.jsonable import to_jsonable
from cachectl.core.records import EntryInfo
from cachectl.storage.node_tier import Refused

API = "/api/v1"
CACHE, DIGEST = "main", "d" * 64
ENTRIES = f"{API}/caches/{CACHE}/environments/{DIGEST}/entries"
GOOD = bytes(range(256)) * 16  # what the index records: 4 KiB
GOOD_SHA = hashlib.sha256(GOOD).hexdigest()
HUGE = 200 << 20  # what the hostile server sends instead
TIMEOUT_S = 2.0
DRIP_FOR_S = (
    TIMEOUT_S + 10
)  # the slow server gives up after this: a client without a deadline waits
KEYS = ("jit_good-1", "jit_slow-1", "jit_huge-1", "jit_other-1", "jit_short-1")


def _listing() -> dict[str, Any]:
    items = [
        to_jsonable(
            EntryInfo(
                key=k,
                module=k.split("-")[0],
                size=len(GOOD),
                sha256=GOOD_SHA,
                compile_time_ms=10,
                origin="warm",
                function="f",
                bucket=None,
                created_at=None,
                last_access_at=None,
                hit_count=0,
                environment_id=1,
                aot_size=len(GOOD),
                aot_sha256=GOOD_SHA,
            )
        )
        for k in KEYS
    ]
    return {"items": items, "next_offset": None}


class Hostile(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    sent: dict[str, int] = {}  # path -> body bytes the server got out before the client left

    def log_message(self, *_args: Any) -> None:
        pass

    def _drip(self, data: bytes, every_s: float) -> None:
        end = time.monotonic() + DRIP_FOR_S
        for i in range(len(data)):
            if time.monotonic() > end:
                return  # gives up: the connection closes with the body unfinished
            self.wfile.write(data[i : i + 1])
            self.wfile.flush()
            time.sleep(every_s)

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        path = self.path.split("?", 1)[0]
        name = path.rsplit("/", 1)[-1] if not path.endswith("/aot") else path.split("/")[-2]
        try:
            if path == ENTRIES:
                body = json.dumps(_listing()).encode()
                self._head(len(body), "application/json")
                self.wfile.write(body)
            elif path == f"{API}/caches":  # the headers themselves, a byte at a time
                self._drip(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\nx-pad: " + b"a" * 400, 0.05)
            elif name == "jit_good-1":
                self._head(len(GOOD))
                self.wfile.write(GOOD)
            elif name == "jit_slow-1":
                self._head(len(GOOD))
                self._drip(GOOD, 0.05)
            elif name == "jit_huge-1":
                self._head(HUGE)
                block = b"\0" * (1 << 20)
                for _ in range(HUGE >> 20):
                    self.wfile.write(block)
                    Hostile.sent[self.path] = Hostile.sent.get(self.path, 0) + len(block)
            elif name == "jit_other-1":
                self._head(len(GOOD))
                self.wfile.write(GOOD[::-1])
            elif name == "jit_short-1":
                self._head(len(GOOD) // 2)
                self.wfile.write(GOOD[: len(GOOD) // 2])
            else:
                self.send_error(404)
        except (BrokenPipeError, ConnectionResetError):
            pass

    def _head(self, length: int, kind: str = "application/octet-stream") -> None:
        self.send_response(200)
        self.send_header("content-type", kind)
        self.send_header("content-length", str(length))
        self.end_headers()


@pytest.fixture
def hostile() -> Iterator[str]:
    Hostile.sent = {}
    server = ThreadingHTTPServer(("127.0.0.1", 0), Hostile)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def _timed(fn: Any) -> tuple[float, BaseException | None]:
    start = time.monotonic()
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - the test reads what was raised
        return time.monotonic() - start, exc
    return time.monotonic() - start, None


def _client(url: str) -> ServerClient:
    return ServerClient(url, "t", timeout=httpx.Timeout(TIMEOUT_S, connect=1.0))


def test_each_request_ends_within_its_timeout_body_included(hostile) -> None:
    client = _client(hostile)
    try:
        # the honest answer still comes through
        assert client.download_entry(CACHE, DIGEST, "jit_good-1") == GOOD

        # a body that drips: ends at the deadline (the timeout bounds each silence only)
        took, err = _timed(lambda: client.download_entry(CACHE, DIGEST, "jit_slow-1"))
        print(f"slow body: {took:.1f} s, {type(err).__name__}: {err}")
        assert took < TIMEOUT_S + 5, (took, err)
        assert isinstance(err, Unreachable) and "within 2 s" in str(err), err

        # headers that drip, on an API call
        took, err = _timed(lambda: client.get(f"{API}/caches"))
        print(f"slow headers: {took:.1f} s, {type(err).__name__}: {err}")
        assert took < TIMEOUT_S + 5, (took, err)
        assert isinstance(err, Unreachable), err
    finally:
        client.close()


def test_a_body_is_cut_at_its_recorded_size(hostile) -> None:
    client = _client(hostile)
    try:
        # the honest answer still comes through, entry and executable
        assert client.download_entry(CACHE, DIGEST, "jit_good-1") == GOOD
        assert client.download_executable(CACHE, DIGEST, "jit_good-1") == GOOD

        # a body far over the index's recorded size: cut there, never held whole
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        took, err = _timed(lambda: client.download_entry(CACHE, DIGEST, "jit_huge-1"))
        grown_mib = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
        time.sleep(0.2)  # the server's writer sees the closed connection
        sent_mib = sum(Hostile.sent.values()) / (1 << 20)
        print(f"huge body: {took:.1f} s, sent {sent_mib:.0f} MiB, RSS +{grown_mib:.0f} MiB: {err}")
        assert sent_mib < 64 and grown_mib < 64, (sent_mib, grown_mib)
        assert isinstance(err, CachectlError) and "longer than the index" in str(err), err

        # the same size but other bytes, or fewer: refused, never returned
        for key, says in (("jit_other-1", "other bytes"), ("jit_short-1", "shorter")):
            _, err = _timed(lambda key=key: client.download_entry(CACHE, DIGEST, key))
            assert isinstance(err, CachectlError) and says in str(err), err
        # a key the index does not list: not fetched at all
        _, err = _timed(lambda: client.download_entry(CACHE, DIGEST, "jit_unlisted-1"))
        assert err is not None and "lists no entry" in str(err), err

        # the node tier's fetch: a refusal (never written, never loaded), not a crash
        from cachectl.service.node_source import _server_fetch

        with pytest.raises(Refused):
            _server_fetch(client, CACHE, DIGEST)("jit_huge-1-aot")()
        with pytest.raises(FileNotFoundError):
            _server_fetch(client, CACHE, DIGEST)("jit_unlisted-1-cache")()
    finally:
        client.close()
