"""The HTTP/1.1 connection edge of `cachectl serve`: a request's head (its request line and headers)
is bounded in size, in header count and in the time it takes to arrive.

uvicorn's httptools protocol bounds none of them, and a head is read before any token is asked
for: one 64 MiB header cost the server 3.8 CPU s and 128 MiB (httptools grows a header's value
one read at a time, roughly quadratic), and stalled every other client's requests meanwhile; a
client sending a header a byte at a time held its connection for as long as it liked. Here a head
past ``MAX_HEAD_BYTES`` or ``MAX_HEADERS`` is answered 431 and the connection closed, after at
most one more read of the socket; one that has not arrived ``header_timeout_s`` after its first
byte (or after the connection opened) is answered 408 and closed. Bodies are bounded after the
head, by ``limits.BodyGuard``. Each GET is offered zero-copy file sends (server/zero_copy.py).

A HEAD, or a GET of a small file, that the app's byte fast lane can answer whole from what it
remembers (server/fast_lane.py ``answer_now``) is written here as soon as its head is parsed, with
no ASGI cycle, task or scope (a larger file's head likewise, then the file by ``sendfile``,
server/zero_copy.py ``ProtocolSend``): most of what such a request cost was uvicorn's per-request
machinery (BENCHMARKS.md "Server against nginx"). Only on a keep-alive HTTP/1.1 connection with
no response in flight and none queued; anything else goes to the app as before.
"""

from __future__ import annotations

import asyncio
from asyncio import TimerHandle
from typing import Any

import httptools
from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

from . import zero_copy
from .config import DEFAULT_HEADER_TIMEOUT_S, ServerSettings, settings_from_env

# A request line and headers together: tokens, cookies and proxies' headers fit in a few KiB
# (nginx's default is 8 KiB a line, 32 KiB in all; Node's 16 KiB).
MAX_HEAD_BYTES = 64 * 1024
MAX_HEADERS = 100


class HeadTooLarge(Exception):
    """Raised from a parser callback: httptools stops parsing and uvicorn answers 400, which
    ``BoundedHttpTools.send_400_response`` turns into this 431."""


class BoundedHttpTools(HttpToolsProtocol):
    """uvicorn's httptools protocol with a bounded request head (see the module docstring)."""

    max_head_bytes = MAX_HEAD_BYTES
    max_headers = MAX_HEADERS
    header_timeout_s = DEFAULT_HEADER_TIMEOUT_S

    _head_bytes = 0  # bytes received since the last head was complete, outside any body
    _head_size = 0  # the current head's request line and headers, as parsed
    _header_count = 0
    _in_body = False
    _refusal: str | None = None
    _head_timer: TimerHandle | None = None
    _head_begun = False  # a request's head is being parsed (its first byte came)
    _idle_since: float | None = None  # loop time the last response completed; None: busy
    _lane: Any = None  # server/fast_lane.py ByteFastLane of the app, if it has one
    _answered = False  # this request was answered by _answer_now

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._lane = _lane_of(self.app)
        self._arm_head_timer()  # a connection that never sends a head is closed too

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_head_timer()
        self._idle_since = None
        if self.timeout_keep_alive_task is not None:
            self.timeout_keep_alive_task.cancel()
            self.timeout_keep_alive_task = None
        super().connection_lost(exc)

    # -- the keep-alive timer, made once per idle spell rather than once per request -----------

    def _unset_keepalive_if_required(self) -> None:
        """uvicorn cancels its keep-alive timer on every read and makes a new one after every
        response (a ``call_later`` and a ``cancel``, about 2.5 us each): here a read only marks
        the connection busy, and the timer, when due, closes it only if it has been idle for
        ``timeout_keep_alive`` since its last response (``_keep_alive_due``)."""
        self._idle_since = None

    def on_response_complete(self) -> None:
        if self.pipeline or self.transport.is_closing():
            super().on_response_complete()  # a pipelined request starts; or nothing to keep
            return
        # uvicorn's, with the timer kept where one is armed
        self.server_state.total_requests += 1
        self.flow.resume_reading()
        self._idle_since = self.loop.time()
        if self.timeout_keep_alive_task is None:
            self.timeout_keep_alive_task = self.loop.call_later(
                self.timeout_keep_alive, self._keep_alive_due
            )

    def _keep_alive_due(self) -> None:
        self.timeout_keep_alive_task = None
        if self._idle_since is None:
            return  # busy: armed again when its response is complete
        left = self._idle_since + self.timeout_keep_alive - self.loop.time()
        if left > 0:
            self.timeout_keep_alive_task = self.loop.call_later(left, self._keep_alive_due)
        else:
            self.timeout_keep_alive_handler()

    def data_received(self, data: bytes) -> None:
        if not self._in_body:
            if self._head_bytes > self.max_head_bytes:
                return  # refused already; the connection is closing
            self._head_bytes += len(data)
        super().data_received(data)
        if self._head_begun and self._head_timer is None and not self.transport.is_closing():
            self._arm_head_timer()  # a head begun in this read and not yet whole
        if (
            not self._in_body
            and self._head_timer is not None
            and self._head_bytes > self.max_head_bytes
            and not self.transport.is_closing()
        ):
            self._refuse(f"request head above {self.max_head_bytes} bytes")

    # -- parser callbacks --------------------------------------------------------------------

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._head_size = self._header_count = 0
        # Timed from here: ``data_received`` arms the timer once this read is parsed, if the head
        # is not whole by then (most heads arrive in one read: no timer made and cancelled each).
        self._head_begun = True

    def on_url(self, url: bytes) -> None:
        self._grow(len(url))
        super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._header_count += 1
        if self._header_count > self.max_headers:
            self._refusal = f"more than {self.max_headers} request headers"
            raise HeadTooLarge(self._refusal)
        self._grow(len(name) + len(value) + 4)
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        self._head_begun = False
        self._disarm_head_timer()
        self._in_body = True
        self._head_bytes = 0
        if self._answer_now():
            return
        super().on_headers_complete()
        cycle = self.cycle
        # a new cycle (not an upgrade's) for a GET: only a GET's body is a file to send
        if cycle is not None and cycle.scope is self.scope and self.scope["method"] == "GET":
            zero_copy.offer(cycle)

    def on_message_complete(self) -> None:
        self._in_body = False
        if self._answered:
            self._answered = False
            if self.cycle is None or self.cycle.response_complete:
                self.on_response_complete()  # keep-alive timer, reads resumed, a pipelined request
            return  # else a file is still being sent: ``_finish`` goes on when it is done
        super().on_message_complete()

    # -- answers written at once -------------------------------------------------------------

    def _answer_now(self) -> bool:
        """A GET or HEAD of stored bytes that server/fast_lane.py answers whole (``answer_now``),
        written with no ASGI cycle, task or scope: only on a keep-alive HTTP/1.1 connection with no
        response in flight, nothing queued, and a transport taking writes."""
        lane = self._lane
        if lane is None:
            return False
        method = self.parser.get_method()
        if method not in (b"GET", b"HEAD"):
            return False
        cycle = self.cycle
        if (
            (cycle is not None and not cycle.response_complete)
            or self.pipeline
            or self.flow.write_paused
            or self.transport.is_closing()
            or self.parser.get_http_version() != "1.1"
            or not self.parser.should_keep_alive()
            or self.parser.should_upgrade()
            or self.scope.get("root_path")
        ):
            return False
        url = httptools.parse_url(self.url)
        if url.query or b"%" in url.path:
            return False
        answer = lane.answer_now(
            method.decode(),
            url.path.decode("ascii"),
            self.headers,
            self.server_state.default_headers,
        )
        if answer is None:
            return False
        self._answered = True
        if isinstance(answer, bytes):
            self.transport.write(answer)
            return True
        self.transport.write(answer.head)
        sending = zero_copy.ProtocolSend(self.transport, self.flow, answer.fd, answer.size)
        if not sending.start():
            # the rest from a task; a pipelined request waits behind it (see ProtocolSend)
            self.cycle = sending  # type: ignore[assignment]
            self.flow.pause_reading()
            task = self.loop.create_task(self._finish(sending))
            self.tasks.add(task)
            task.add_done_callback(self.tasks.discard)
        return True

    async def _finish(self, sending: zero_copy.ProtocolSend) -> None:
        """The rest of a large answer; then the connection's next request (its head was parsed
        in the same read as this one's, so ``on_message_complete`` has run)."""
        if await sending.finish():
            self.on_response_complete()

    # -- refusals ----------------------------------------------------------------------------

    def _grow(self, n: int) -> None:
        self._head_size += n
        if self._head_size > self.max_head_bytes:
            self._refusal = f"request head above {self.max_head_bytes} bytes"
            raise HeadTooLarge(self._refusal)

    def send_400_response(self, msg: str) -> None:
        if self._refusal is not None:
            self._refuse(self._refusal)
        else:
            super().send_400_response(msg)

    def _refuse(self, message: str, status: int = 431) -> None:
        """Answer ``status`` with ``message`` and close, unless a response is being written on
        this connection (a pipelined request): then only close."""
        self._disarm_head_timer()
        self._head_bytes = self.max_head_bytes + 1  # nothing more is parsed
        if self.cycle is None or self.cycle.response_complete:
            body = message.encode("ascii")
            self.transport.write(
                b"".join(
                    [
                        STATUS_LINE[status],
                        b"content-type: text/plain; charset=utf-8\r\n",
                        b"content-length: " + str(len(body)).encode("ascii") + b"\r\n",
                        b"connection: close\r\n\r\n",
                        body,
                    ]
                )
            )
        self.transport.close()

    def _arm_head_timer(self) -> None:
        self._head_timer = self.loop.call_later(self.header_timeout_s, self._head_timed_out)

    def _disarm_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if not self.transport.is_closing():
            self._refuse(
                f"request head not received within {self.header_timeout_s:g} s", status=408
            )


def _lane_of(app: Any) -> Any:
    """The app's byte fast lane, under the ASGI wrappers uvicorn puts around it (each an ``app``)."""
    for _ in range(8):
        lane = getattr(app, "fast_lane", None)
        if lane is not None:
            return lane
        app = getattr(app, "app", None)
        if app is None:
            return None
    return None


def bounded_http(settings: ServerSettings) -> type[BoundedHttpTools]:
    """The protocol class for uvicorn's ``http=``, with this server's header timeout."""

    class Configured(BoundedHttpTools):
        header_timeout_s = float(settings.header_timeout_s)

    return Configured


class WorkerHttpTools(BoundedHttpTools):
    """The protocol of `cachectl serve --workers N`: uvicorn imports it by name in each worker, so
    its header timeout comes from the settings the command left in the environment."""

    header_timeout_s = float((settings_from_env() or ServerSettings(db="")).header_timeout_s)
