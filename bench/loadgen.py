"""A load generator that costs the server's machine little: raw HTTP/1.1 keep-alive over asyncio.

httpx spends about a millisecond of CPU per request, as much as the server it measures; on a
2-core machine that makes the client the bottleneck. Here every request is a prepared byte
string and a response is read by its Content-Length, so one client core drives thousands of
requests per second. Run it pinned to a core the server does not use (``taskset -c 1``).

    python bench/loadgen.py URL_JSON   (a JSON spec on stdin or as the argument; prints JSON)

Spec: {"host", "port" | "uds" (a unix socket path: host and port then only name the Host header),
"concurrency", "seconds" | "requests", "requests_mix": [[name, weight,
method, path, headers{}, body_b64 or null, want_status, want_length or null], ...]}.
"""

from __future__ import annotations

import asyncio
import base64
import json
import sys
import time
from typing import Any


def _request(
    method: str, path: str, host: str, headers: dict[str, str], body: bytes | None
) -> bytes:
    lines = [f"{method} {path} HTTP/1.1", f"Host: {host}", "Connection: keep-alive"]
    lines += [f"{k}: {v}" for k, v in headers.items()]
    if body is not None:
        lines.append(f"Content-Length: {len(body)}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + (body or b"")


async def _read_response(reader: asyncio.StreamReader, method: str) -> tuple[int, int]:
    head = await reader.readuntil(b"\r\n\r\n")
    status = int(head[9:12])
    length = 0
    for line in head.split(b"\r\n")[1:]:
        if line[:15].lower() == b"content-length:":
            length = int(line[15:])
            break
    if method != "HEAD" and length:
        await reader.readexactly(length)
    return status, length


class Response:
    """What ``KeepAliveClient`` answers: httpx's names for the parts a bench reads."""

    def __init__(self, status_code: int, content: bytes) -> None:
        self.status_code, self.content = status_code, content

    @property
    def text(self) -> str:
        return self.content.decode("utf-8", "replace")

    def json(self) -> Any:
        return json.loads(self.content)


async def _read_body(reader: asyncio.StreamReader) -> tuple[int, bytes, bool]:
    """(status, body, whether the server keeps the connection): Content-Length or chunked."""
    head = await reader.readuntil(b"\r\n\r\n")
    status, length, chunked, keep = int(head[9:12]), 0, False, True
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        name, value = name.strip().lower(), value.strip().lower()
        if name == b"content-length":
            length = int(value)
        elif name == b"transfer-encoding" and b"chunked" in value:
            chunked = True
        elif name == b"connection" and value == b"close":
            keep = False
    if not chunked:
        return status, await reader.readexactly(length) if length else b"", keep
    parts = []
    while True:
        size = int((await reader.readline()).split(b";")[0], 16)
        if size == 0:
            while (await reader.readline()) not in (b"\r\n", b""):
                pass  # trailers
            return status, b"".join(parts), keep
        parts.append(await reader.readexactly(size))
        await reader.readline()


class KeepAliveClient:
    """httpx.AsyncClient's post/get/put for a load generator: raw HTTP/1.1 over kept
    connections, a fraction of httpx's CPU per request, so hundreds of simulated clients on
    this machine leave its cores to the server they measure (bench/lease_scale.py)."""

    def __init__(self, base_url: str, timeout: float = 60.0) -> None:
        rest = base_url.removeprefix("http://").rstrip("/")
        self.host, _, port = rest.partition(":")
        self.port, self.timeout = int(port or 80), timeout
        self._idle: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []

    async def request(
        self, method: str, path: str, headers: dict[str, str] | None = None, body: bytes = b""
    ) -> Response:
        conn = (
            self._idle.pop() if self._idle else await asyncio.open_connection(self.host, self.port)
        )
        reader, writer = conn
        raw = _request(method, path, f"{self.host}:{self.port}", headers or {}, body)
        try:
            writer.write(raw)
            status, content, keep = await asyncio.wait_for(_read_body(reader), self.timeout)
        except BaseException:
            writer.close()
            raise
        if keep:
            self._idle.append(conn)
        else:
            writer.close()
        return Response(status, content)

    async def post(self, path: str, json: Any, headers: dict[str, str]) -> Response:
        body = _json_dumps(json).encode()
        return await self.request(
            "POST", path, {**headers, "content-type": "application/json"}, body
        )

    async def get(self, path: str, headers: dict[str, str]) -> Response:
        return await self.request("GET", path, headers)

    async def put(self, path: str, content: bytes, headers: dict[str, str]) -> Response:
        return await self.request("PUT", path, headers, content)

    async def aclose(self) -> None:
        for _, writer in self._idle:
            writer.close()
        self._idle.clear()


_json_dumps = json.dumps


async def run(spec: dict[str, Any]) -> dict[str, Any]:
    host, port = spec.get("host", "localhost"), int(spec.get("port", 80))
    uds = spec.get("uds")

    async def connect() -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        if uds:
            return await asyncio.open_unix_connection(uds)
        return await asyncio.open_connection(host, port)

    mix = []
    for name, weight, method, path, headers, body, want, want_len in spec["requests_mix"]:
        raw = _request(
            method, path, f"{host}:{port}", headers, base64.b64decode(body) if body else None
        )
        mix += [(name, method, raw, want, want_len)] * int(weight)
    deadline = time.perf_counter() + float(spec.get("seconds", 1e9))
    budget = int(spec.get("requests", 10**12))
    latencies: dict[str, list[float]] = {name: [] for name, *_ in spec["requests_mix"]}
    errors: dict[str, list[str]] = {name: [] for name, *_ in spec["requests_mix"]}
    counter = 0

    async def worker(offset: int) -> None:
        nonlocal counter
        reader, writer = await connect()
        i = offset
        while counter < budget and time.perf_counter() < deadline:
            counter += 1
            name, method, raw, want, want_len = mix[i % len(mix)]
            i += 1
            t = time.perf_counter()
            writer.write(raw)
            try:
                status, length = await _read_response(reader, method)
            except (asyncio.IncompleteReadError, ConnectionError) as exc:
                errors[name].append(f"{type(exc).__name__}")
                writer.close()
                reader, writer = await connect()
                continue
            latencies[name].append(time.perf_counter() - t)
            if status != want or (want_len is not None and length != want_len):
                errors[name].append(f"HTTP {status} length {length}")
        writer.close()

    started = time.perf_counter()
    await asyncio.gather(*(worker(n * 7) for n in range(int(spec["concurrency"]))))
    wall = time.perf_counter() - started

    def pct(values: list[float], q: float) -> float | None:
        if not values:
            return None
        ordered = sorted(values)
        return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))] * 1000

    all_lat = [v for values in latencies.values() for v in values]
    return {
        "wall_s": wall,
        "requests": len(all_lat),
        "req_per_s": len(all_lat) / wall,
        "errors": sum(len(v) for v in errors.values()),
        "error_samples": {k: v[:3] for k, v in errors.items() if v},
        "p50_ms": pct(all_lat, 0.5),
        "p99_ms": pct(all_lat, 0.99),
        "endpoints": {
            name: {
                "requests": len(lat),
                "req_per_s": len(lat) / wall,
                "p50_ms": pct(lat, 0.5),
                "p99_ms": pct(lat, 0.99),
                "errors": len(errors[name]),
            }
            for name, lat in latencies.items()
        },
    }


def main() -> int:
    spec = json.loads(sys.argv[1] if len(sys.argv) > 1 else sys.stdin.read())
    print(json.dumps(asyncio.run(run(spec))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
