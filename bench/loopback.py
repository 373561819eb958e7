"""The floor under an HTTP download on loopback: a minimal server that answers every request with a file.

    python bench/loopback.py PATH PORT MODE     (MODE: write | sendfile | empty)

``write``: the event loop uvicorn runs here (uvloop when installed), each request opens and reads
the file and sends the headers and the bytes with a ``transport.write`` each (as uvicorn does), which
is the least any server that reads the file must do. ``sendfile``: asyncio's own loop and ``loop.sendfile`` (zero-copy; uvloop
does not implement it), what an ASGI server with the pathsend extension could reach. ``empty``:
an empty 200 per request on uvloop, the round trip any HTTP answer costs before a byte of a file
moves. No parsing
beyond the blank line that ends a request: bench/server.py compares cachectl's download with these.
"""

from __future__ import annotations

import asyncio
import os
import sys
from typing import Any


def _head(size: int) -> bytes:
    return (
        b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\ncontent-type: application/octet-stream\r\n\r\n"
        % size
    )


class _Responder(asyncio.Protocol):
    def __init__(self, path: str, mode: str) -> None:
        self.path, self.mode = path, mode
        self.buffer = b""
        self.transport: Any = None

    def connection_made(self, transport: Any) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        while b"\r\n\r\n" in self.buffer:
            _request, self.buffer = self.buffer.split(b"\r\n\r\n", 1)
            if self.mode == "sendfile":
                asyncio.ensure_future(self._sendfile())
            elif self.mode == "empty":
                self.transport.write(_head(0))
            else:
                with open(self.path, "rb") as fh:
                    body = fh.read()
                self.transport.write(_head(len(body)))  # two writes, as uvicorn sends a response:
                self.transport.write(body)  # joining them would copy the body once more

    async def _sendfile(self) -> None:
        with open(self.path, "rb") as fh:
            self.transport.write(_head(os.fstat(fh.fileno()).st_size))
            await asyncio.get_running_loop().sendfile(self.transport, fh)


async def _serve(path: str, port: int, mode: str) -> None:
    server = await asyncio.get_running_loop().create_server(
        lambda: _Responder(path, mode), "127.0.0.1", port
    )
    await server.serve_forever()


def main() -> int:
    path, port, mode = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    if mode in ("write", "empty"):
        try:
            import uvloop
        except ImportError:
            pass
        else:
            uvloop.run(_serve(path, port, mode))
            return 0
    asyncio.run(_serve(path, port, mode))
    return 0


if __name__ == "__main__":
    sys.exit(main())
