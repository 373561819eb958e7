"""A file's bytes from the page cache to the socket (``os.sendfile``), under uvicorn, which offers no
zero-copy send.

A download was read into memory in a worker thread and written with one ``transport.write``: two
copies through user space, and up to 4 MiB held per request. Side by side under the same uvicorn
(BENCHMARKS.md, "ASGI servers") ``sendfile`` took about half the time at 1 MiB and at 64 MiB.
This module gives `cachectl serve`'s protocol (server/http_edge.py) the ASGI
``http.response.zerocopysend`` extension; the byte routes use it (server/entry_routes.py
``SentFile``) when the server offers it and the object is a file on local disk.

How a file is sent, and why that is safe:

- only once the response's headers are on the wire (the transport's buffer is empty; otherwise the
  bytes are read and sent through uvicorn, as before), and never more than the Content-Length owed;
- straight from the event loop, as nginx does without ``aio``: ``sendfile`` on the non-blocking
  socket until it is full (a cached entry is a copy in the kernel; a file not in the page cache is
  read from disk in that call, which stalls the loop for that read: a thread hop per request cost
  more than that, BENCHMARKS.md "Server against nginx"); the loop then waits for the socket to
  drain with ``add_writer`` on a duplicate of the connection's descriptor, at most ``STALL_S``
  without progress, and sends the rest on the duplicate, so a connection closed meanwhile (a
  pipelined request's header timeout, a shutdown) cannot hand its number to another connection,
  which would then receive this file. A client that stops reading holds no thread and no memory,
  and is dropped after that;
- a client gone, a stall, or a file shorter than its Content-Length closes the connection: the
  response cannot be completed, and nothing else may be read as its rest;
- a file ``sendfile`` refuses before its first byte (a filesystem without it) is read and sent
  through uvicorn instead.

It reaches into uvicorn's ``RequestResponseCycle`` (its ``send`` wrapped, its count of body bytes
still owed lowered by what was sent, as its own body send does). ``offer`` checks the cycle has what
it uses, and offers nothing otherwise: a uvicorn that changed them answers as before.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from starlette.types import Message, Scope

ZERO_COPY = "http.response.zerocopysend"
STALL_S = 60.0  # the longest a socket may stay full before its client is dropped
COPY_CHUNK = 1 << 20  # when the headers are still buffered: read and sent through uvicorn
COPY_THREADS = 16  # the copied sends' reads
# What sendfile answers for a file it cannot send (some FUSE or network filesystems): read instead.
_UNSENDABLE = {errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP}

log = logging.getLogger("cachectl.server")
_threads = ThreadPoolExecutor(COPY_THREADS, thread_name_prefix="cachectl-copy")
# What this module reads or sets on uvicorn's cycle.
_CYCLE_NEEDS = (
    "transport",
    "send",
    "scope",
    "expected_content_length",
    "response_started",
    "response_complete",
    "chunked_encoding",
    "disconnected",
)


def offer(cycle: Any) -> None:
    """Let a new uvicorn request cycle take ZERO_COPY messages, and say so in its scope (before its
    app runs: uvicorn starts the app in a task that looks ``send`` up when it first runs)."""
    if not all(hasattr(cycle, name) for name in _CYCLE_NEEDS):
        return
    socket = cycle.transport.get_extra_info("socket")
    if socket is None or socket.fileno() < 0:
        return
    plain = cycle.send

    async def send(message: Message) -> None:
        if message["type"] == ZERO_COPY:
            await _send_file(cycle, plain, message)
        else:
            await plain(message)

    cycle.send = send
    cycle.scope.setdefault("extensions", {})[ZERO_COPY] = {}


def offered(scope: Scope) -> bool:
    return ZERO_COPY in (scope.get("extensions") or {})


class _Short(Exception):
    """The file ended before the count of bytes promised."""


def _until_full(sock: int, fd: int, offset: int, count: int) -> int:
    """Bytes sent by ``sendfile`` calls until ``count`` or until the socket is full."""
    sent = 0
    while sent < count:
        try:
            n = os.sendfile(sock, fd, offset + sent, count - sent)
        except BlockingIOError:
            break
        except OSError:
            if sent:
                break  # what was sent counts; the next call meets the error again
            raise
        if n == 0:
            raise _Short
        sent += n
    return sent


def _wake(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


async def _writable(loop: asyncio.AbstractEventLoop, sock: int) -> bool:
    ready: asyncio.Future[None] = loop.create_future()
    loop.add_writer(sock, _wake, ready)
    try:
        await asyncio.wait_for(ready, STALL_S)
        return True
    except TimeoutError:
        return False
    finally:
        loop.remove_writer(sock)


def _drop(cycle: Any, why: str) -> None:
    """End a response that cannot be completed: its connection is closed."""
    log.info("download of %s ended early: %s", cycle.scope.get("path"), why)
    cycle.transport.close()
    cycle.disconnected = (
        True  # the app's ``send`` calls after this are ignored, as for a client gone
    )


async def _send_file(cycle: Any, plain: Any, message: Message) -> None:
    if cycle.disconnected:
        return
    fh, more_body = message["file"], bool(message.get("more_body", False))
    fd = fh.fileno()
    offset = message.get("offset")
    offset = os.lseek(fd, 0, os.SEEK_CUR) if offset is None else int(offset)
    count = message.get("count")
    count = os.fstat(fd).st_size - offset if count is None else int(count)
    if (
        not cycle.response_started
        or cycle.response_complete
        or cycle.chunked_encoding is not False
        or cycle.scope["method"] == "HEAD"
        or not 0 <= count <= cycle.expected_content_length
    ):
        raise RuntimeError(
            f"{ZERO_COPY} needs a started response with a Content-Length that covers the file"
        )
    if cycle.transport.get_write_buffer_size():
        await _send_copied(cycle, plain, fd, offset, count, more_body)
        return
    loop = asyncio.get_running_loop()
    sock = cycle.transport.get_extra_info("socket").fileno()
    waiter: int | None = None  # a duplicate of the socket, made once it is full (see above)
    sent = 0
    try:
        while True:
            sent += _until_full(sock if waiter is None else waiter, fd, offset + sent, count - sent)
            if sent >= count:
                break
            if waiter is None:
                waiter = os.dup(sock)
            if not await _writable(loop, waiter):
                _drop(cycle, f"the client read nothing for {STALL_S:g} s")
                return
            if cycle.disconnected:
                return
    except _Short:
        _drop(cycle, "the file is shorter than its Content-Length (replaced while sent?)")
        return
    except OSError as exc:
        if sent or exc.errno not in _UNSENDABLE:
            _drop(cycle, str(exc))  # the client is gone (EPIPE, ECONNRESET)
            return
        copy = True
    else:
        copy = False
    finally:
        if waiter is not None:
            os.close(waiter)
    if copy:
        await _send_copied(cycle, plain, fd, offset, count, more_body)
        return
    cycle.expected_content_length -= count
    await plain({"type": "http.response.body", "body": b"", "more_body": more_body})


async def _send_copied(
    cycle: Any, plain: Any, fd: int, offset: int, count: int, more_body: bool
) -> None:
    """The file read in chunks and sent through uvicorn: the headers are still in its buffer."""
    loop = asyncio.get_running_loop()
    end = offset + count
    while offset < end:
        chunk = await loop.run_in_executor(
            _threads, os.pread, fd, min(COPY_CHUNK, end - offset), offset
        )
        if not chunk:
            _drop(cycle, "the file is shorter than its Content-Length (replaced while sent?)")
            return
        offset += len(chunk)
        await plain({"type": "http.response.body", "body": chunk, "more_body": True})
    await plain({"type": "http.response.body", "body": b"", "more_body": more_body})


class ProtocolSend:
    """A file sent by the connection's protocol itself after the headers it wrote
    (server/http_edge.py, for server/fast_lane.py ``answer_now``), with no ASGI cycle.

    ``sendfile`` first runs at once, on the socket, while the protocol's callback runs: a file the
    socket takes whole (most of them on a fast link) costs no task and no wait. The rest is sent by
    a task as ``_send_file`` sends it (a duplicate of the socket waited on, at most ``STALL_S``
    without progress; a client gone, a stall or a short file closes the connection), with the
    connection's reads paused. Meanwhile this object stands in the protocol's ``cycle`` as a
    response not complete, which is what makes uvicorn queue a pipelined request behind it, and
    what its ``shutdown`` and ``connection_lost`` set (``keep_alive``, ``disconnected``)."""

    def __init__(self, transport: asyncio.Transport, flow: Any, fd: int, size: int) -> None:
        self.transport, self.flow, self.fd, self.size = transport, flow, fd, size
        self.sent = 0
        self.copy = False  # sendfile refused this file: read and written through the transport
        self.response_complete = False
        self.keep_alive = True
        self.disconnected = False
        self.message_event = asyncio.Event()
        self.task: asyncio.Task[None] | None = None

    def start(self) -> bool:
        """Send what the socket takes now; True when the whole answer is sent (or the connection
        was dropped), False when ``finish`` must send the rest."""
        try:
            sock = self.transport.get_extra_info("socket")
            if self.transport.get_write_buffer_size() or sock is None:
                self.copy = True  # the headers still wait in the transport: write behind them
                return False
            self.sent = _until_full(sock.fileno(), self.fd, 0, self.size)
        except _Short:
            return self._drop("the file is shorter than its Content-Length (replaced while sent?)")
        except OSError as exc:
            if exc.errno not in _UNSENDABLE:
                return self._drop(str(exc))
            self.copy = True
            return False
        if self.sent < self.size:
            return False
        os.close(self.fd)
        self.response_complete = True
        return True

    def _drop(self, why: str) -> bool:
        log.info("download ended early: %s", why)
        self.transport.close()
        os.close(self.fd)
        self.response_complete = True
        return True

    async def finish(self) -> bool:
        """The rest of the file; whether the connection may go on to its next request."""
        try:
            if self.copy:
                await self._copied()
            else:
                await self._rest()
        except _Short:
            self._drop("the file is shorter than its Content-Length (replaced while sent?)")
            return False
        except OSError as exc:
            self._drop(str(exc))  # the client is gone (EPIPE, ECONNRESET)
            return False
        except asyncio.CancelledError:
            self._drop("the server is shutting down")
            raise
        os.close(self.fd)
        self.response_complete = True
        if not self.keep_alive:  # shut down meanwhile: the answer ends the connection
            self.transport.close()
        return not self.transport.is_closing()

    async def _rest(self) -> None:
        loop = asyncio.get_running_loop()
        waiter = os.dup(self.transport.get_extra_info("socket").fileno())
        try:
            while self.sent < self.size:
                if not await _writable(loop, waiter):
                    raise OSError(errno.ETIMEDOUT, f"the client read nothing for {STALL_S:g} s")
                if self.transport.is_closing():
                    raise OSError(errno.ECONNABORTED, "the connection was closed")
                self.sent += _until_full(waiter, self.fd, self.sent, self.size - self.sent)
        finally:
            os.close(waiter)

    async def _copied(self) -> None:
        loop = asyncio.get_running_loop()
        while self.sent < self.size:
            chunk = await loop.run_in_executor(
                _threads, os.pread, self.fd, min(COPY_CHUNK, self.size - self.sent), self.sent
            )
            if not chunk:
                raise _Short
            if self.transport.is_closing():
                raise OSError(errno.ECONNABORTED, "the connection was closed")
            self.sent += len(chunk)
            self.transport.write(chunk)
            if self.flow.write_paused:
                await self.flow.drain()
