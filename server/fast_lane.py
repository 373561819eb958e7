"""GET and HEAD of stored bytes (an entry, its stored executable) answered before FastAPI sees them.

These are most of a fleet's requests, and most of what each one cost was FastAPI's machinery around
a handler that does little: the middleware stack, matching every route in turn, solving the
dependencies, a thread hop through anyio (BENCHMARKS.md, "Server"). The app (server/app.py
``CachectlApp``) asks this lane first, outside its middleware stack; the lane answers only the request
that every check passes, and answers it with what the routes themselves use: the role and scope each
byte route declares (server/auth.py ``refusal``), the token cache the routes fill, ``check_key``'s
rule (``is_key``), and the same headers. It counts and logs what it answers itself (server/metrics.py ``observe``).
Under `cachectl serve`, ``answer_now`` goes further for a HEAD and a GET up to ``NOW_MAX``: the
connection's protocol (server/http_edge.py) writes the whole answer it makes, with no ASGI cycle;
a larger GET's head is written there too, and its file sent from there with ``sendfile``.

Where the token, the (cache, environment) pair and the entry's recorded sha256 are all remembered
(server/state.py ``known``: each at most ``token_cache_s`` old, so a revoked token or a deleted
environment stops being served that much later at the latest) and the bytes are a file on local disk,
the answer is made on the event loop: a ``stat`` for HEAD; for GET the file is opened and handed to
the server's ``sendfile`` (server/zero_copy.py), with no thread hop. Otherwise (an object store, the
first request for a key, a server without zero-copy) ``head_answer`` or ``download_answer`` run in one
thread hop. Anything else goes on to the app, which answers it as it always did: no token or one not
cached yet, a refusal, a path or parameter the route would reject, a body, a missing entry, an error.
So no answer differs from the app's (tests/test_server_fast_lane.py asks both the same questions),
and no rule is written twice.
"""

from __future__ import annotations

import asyncio
import functools
import math
import os
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from fastapi import HTTPException, Request, Response
from fastapi.routing import APIRoute
from starlette.types import Message, Receive, Scope, Send

from cachectl.core.errors import BadInput, CachectlError, NotFound
from cachectl.core.records import TokenInfo
from cachectl.storage.store import Store

from . import entry_routes, executable_routes
from .accel import ACCEL_EXPIRES, ACCEL_HEADER, accel_uri
from .api import MAX_CACHE_NAME, MAX_DIGEST
from .auth import PUBLIC, ROLE_KEY, SCOPE_KEY, bearer_value, refusal
from .entry_routes import (
    ENTRY,
    SHA_HEADER,
    ByteRoute,
    discard,
    download_answer,
    head_answer,
    is_key,
)
from .executable_routes import EXECUTABLE
from .lane_memory import Bodies, FileAnswer, OpenFd, Readers
from .metrics import observe
from .state import ServerState
from .zero_copy import ZERO_COPY, offered

LANE_THREADS = 40
# The stores whose answers are made on the event loop (a stat, an open): local disk. An object
# store's HEAD waits on the network, in a thread.
INLINE_KINDS: tuple[str, ...] = ("file",)
# A GET up to this size is read and written with its headers in one write, with no ASGI cycle
# (server/http_edge.py); a larger one's head is written, then its file sent with sendfile by the
# connection's protocol too (server/zero_copy.py ``ProtocolSend``).
NOW_MAX = 64 * 1024
TAILS = 4096  # header blocks kept by (size, sha256) (``ByteFastLane._tail``)
_OCTETS = (b"content-type", b"application/octet-stream")
_PRIVATE = (b"cache-control", b"private, max-age=0")
# Each byte route's path, as the app serves it, and what it reads.
BYTE_ROUTES: dict[str, ByteRoute] = {
    entry_routes.router.prefix + entry_routes.ENTRY_ROUTE: ENTRY,
    executable_routes.router.prefix + executable_routes.ROUTE: EXECUTABLE,
}


@dataclass(frozen=True)
class Lane:
    """One byte route this lane answers: the app's route (for its path and the metrics' template),
    what it reads, and the role it declares (its scope is the route's ``{cache}``)."""

    route: APIRoute
    reads: ByteRoute
    role: str
    method: str


def lanes() -> list[Lane]:
    """The GET and HEAD byte routes, from the byte routers themselves (the app serves their paths as
    they are), with the role each declares; a route whose scope is not its own ``{cache}`` (or that
    is public) is left to the app."""
    found = []
    for route in [*entry_routes.router.routes, *executable_routes.router.routes]:
        if not isinstance(route, APIRoute) or route.path not in BYTE_ROUTES:
            continue
        extra = route.openapi_extra or {}
        role, scope = extra.get(ROLE_KEY, PUBLIC), extra.get(SCOPE_KEY, PUBLIC)
        if role == PUBLIC or scope != "cache":
            continue
        for method in (route.methods or set()) & {"GET", "HEAD"}:
            found.append(Lane(route, BYTE_ROUTES[route.path], role, method))
    return found


def _head(scope: Scope) -> tuple[str | None, bool]:
    """The request's Authorization value, and whether it carries a body."""
    authorization, body = None, False
    for name, value in scope.get("headers") or ():
        if name == b"authorization":
            if authorization is None:
                authorization = value.decode("latin-1")
        elif name == b"transfer-encoding" or (
            name == b"content-length" and value.strip() not in (b"", b"0")
        ):
            body = True
    return authorization, body


def _discard_unsent(work: asyncio.Future[Response]) -> None:
    if not work.cancelled() and work.exception() is None:
        discard(work.result())


def raw_headers(size: int, sha: str | None) -> list[tuple[bytes, bytes]]:
    """entry_routes.byte_headers as ASGI sends them (the routes' Response adds the content type)."""
    headers = [(b"content-length", str(size).encode("latin-1")), _PRIVATE]
    if sha:
        headers += [(SHA_HEADER.encode(), sha.encode()), (b"etag", f'"{sha}"'.encode())]
    headers.append(_OCTETS)
    return headers


def header_lines(lines: list[tuple[bytes, bytes]]) -> bytes:
    """HTTP/1.1 header lines as written on the wire, each ending in CRLF."""
    return b"".join([b"%s: %s\r\n" % (name, value) for name, value in lines])


def accel_expires(
    state: ServerState, bearer: str, token: TokenInfo, params: dict[str, str], executable: bool
) -> bytes:
    """How long nginx may keep this redirect as its answer to the same token and path
    (server/accel.py): ``@<unix second>``, the last whole second before the first of the token,
    the environment and the recorded entry would be asked of the index again (or the token
    expires); ``0`` (not kept) when that is less than the current second."""
    token_until = state.tokens.expires(bearer)
    known_until = state.known_until(params["cache"], params["digest"], params["key"], executable)
    if token_until is None or known_until is None:
        return b"0"
    now = time.time()
    wall = now + min(token_until, known_until) - time.monotonic()
    if token.expires_at is not None:
        wall = min(wall, token.expires_at.timestamp())
    # nginx keeps an answer while its clock's whole second is at most this one.
    last = math.floor(wall) - 1
    return b"@%d" % last if last >= math.floor(now) else b"0"


class ByteFastLane:
    """Asked by server/app.py ``CachectlApp`` before its middleware stack: ``answer`` says whether
    it answered; a request it leaves goes, untouched, to the app."""

    def __init__(
        self,
        *,
        state: ServerState,
        library_error: Callable[[Request, Exception], Awaitable[Response]],
    ) -> None:
        self.state = state
        self.lanes = lanes()
        # As many threads as the routes' own hop may use (anyio's default limiter): a HEAD on an
        # object store waits on the network there, and asyncio's default pool has cores + 4.
        self.threads = ThreadPoolExecutor(LANE_THREADS, thread_name_prefix="cachectl-bytes")
        self.library_error = library_error  # the app's handler of a library error (server/app.py)
        self.readers = Readers(state.settings.token_cache_s)
        self.bodies = Bodies()
        self._downloaded: dict[str, Any] = {}  # cache name: its download_bytes series
        self._tails: dict[tuple[int, str | None], bytes] = {}
        self._date: tuple[list[tuple[bytes, bytes]] | None, bytes] = (None, b"")

    def _match(self, scope: Scope) -> tuple[Lane, dict[str, str]] | None:
        if scope.get("root_path"):
            return None
        path, method = scope["path"], scope["method"]
        for lane in self.lanes:
            if lane.method == method and (m := lane.route.path_regex.match(path)):
                return lane, m.groupdict()
        return None

    async def answer(self, scope: Scope, receive: Receive, send: Send) -> bool:
        """Whether this lane answered (counted and logged); False leaves the request to the app."""
        started = time.perf_counter()
        status: list[int] = []

        async def counted(message: Message) -> None:
            if message["type"] == "http.response.start":
                status.append(message["status"])
            await send(message)

        try:
            answered = await self._answer(scope, receive, counted)
        finally:
            if status:
                route = scope.get("route")
                observe(
                    self.state.metrics,
                    scope["method"],
                    getattr(route, "path", "<unmatched>"),
                    status[0],
                    time.perf_counter() - started,
                )
        return answered

    async def _answer(self, scope: Scope, receive: Receive, send: Send) -> bool:
        matched = self._match(scope)
        if matched is None:
            return False
        lane, params = matched
        allowed = self._allowed(lane, params, scope)
        if allowed is None:
            return False
        bearer, token, known = allowed
        if known is not None:
            store = self.state.store(known[0])
            if store.kind in INLINE_KINDS and (
                lane.method == "HEAD" or offered(scope) or self.state.settings.accel_redirect
            ):
                return await self._inline(lane, params, store, known, (bearer, token), scope, send)
        return await self._threaded(lane, params, scope, receive, send)

    def answer_now(
        self, method: str, path: str, headers: list[tuple[bytes, bytes]], date: list[Any]
    ) -> bytes | FileAnswer | None:
        """The whole HTTP/1.1 answer to a HEAD, or to a GET of at most ``NOW_MAX`` bytes (or one
        nginx sends), made at once from what ``_inline`` would send, for server/http_edge.py to write
        with no ASGI cycle; for a larger GET, its head and the open file, which the protocol sends
        (server/zero_copy.py ``ProtocolSend``). None leaves the request to ``answer`` and the app.
        Counted and logged."""
        started = time.perf_counter()
        found = self._ready(method, path, headers)
        if found is None:
            return None
        lane, params, store, (_info, env, recorded), (bearer, token) = found
        rel = lane.reads.path_of(env, params["key"])
        accel = self.state.settings.accel_redirect if method == "GET" else None
        reader = self.readers.get(store.root)
        body = b""
        big: int | None = None
        kept: bytes | None = None
        where = (store.root, rel)
        read_at = 0
        st: os.stat_result | None = None
        try:
            if method == "HEAD" or accel is not None:
                size = reader.size(rel)
            elif where in self.bodies:  # kept whole: one fstatat says whether it still holds
                st = reader.stat(rel)
                size = st.st_size
                kept = self.bodies.get(where, st, recorded)
            if method == "GET" and accel is None and kept is None:
                read_at = time.time_ns()
                fd, size = reader.open_fd(rel)
                if size > NOW_MAX:
                    big = fd  # sent after the headers by the protocol (server/zero_copy.py)
                else:
                    try:
                        body = os.read(fd, size + 1)
                        st = os.fstat(fd)  # what the file was once read (``Bodies.put``)
                    finally:
                        os.close(fd)
                    if len(body) != size:
                        return None  # replaced while read: the ASGI path answers
        except (OSError, BadInput):
            self.bodies.drop(where)
            return None
        finally:
            self.readers.done(reader)
        head = self._date_lines(date)
        if kept is not None:
            self._count_download(params["cache"], size)
            observe(self.state.metrics, method, lane.route.path, 200, time.perf_counter() - started)
            return b"HTTP/1.1 200 OK\r\n" + head + kept
        sha = recorded[1] if recorded and recorded[0] == size else None
        if accel is not None:
            lines = raw_headers(size, sha)
            lines[0] = (b"content-length", b"0")
            lines.append((ACCEL_HEADER.encode(), accel_uri(accel, params["cache"], rel).encode()))
            expires = accel_expires(self.state, bearer, token, params, lane.reads.executable)
            lines.append((ACCEL_EXPIRES, expires))
            tail = header_lines(lines) + b"\r\n"
        else:
            tail = self._tail(size, sha)
            if method == "GET":
                self._count_download(params["cache"], size)
        observe(self.state.metrics, method, lane.route.path, 200, time.perf_counter() - started)
        if big is not None:
            return FileAnswer(b"HTTP/1.1 200 OK\r\n" + head + tail, big, size)
        if method == "GET" and accel is None and st is not None:
            self.bodies.put(where, st, recorded, body, tail + body, read_at)
        return b"HTTP/1.1 200 OK\r\n" + head + tail + body

    def _date_lines(self, date: list[tuple[bytes, bytes]]) -> bytes:
        """The server's default header lines (its Date), joined once per list uvicorn makes (a new
        one each second); the list is held, so its identity is not reused meanwhile."""
        if date is not self._date[0]:
            self._date = (date, header_lines(date))
        return self._date[1]

    def _tail(self, size: int, sha: str | None) -> bytes:
        """``raw_headers`` as written after the Date and before the body: the same for every
        answer of this size and sha256, so made once each (at most ``TAILS`` kept)."""
        tail = self._tails.get((size, sha))
        if tail is None:
            lines = raw_headers(size, sha)
            tail = header_lines(lines) + b"\r\n"
            if len(self._tails) >= TAILS:
                self._tails.clear()
            self._tails[(size, sha)] = tail
        return tail

    def _count_download(self, cache: str, size: int) -> None:
        """``download_bytes`` counted for ``cache``, its series looked up once (``labels`` takes a
        lock and builds a key every call)."""
        series = self._downloaded.get(cache)
        if series is None:
            series = self.state.metrics.download_bytes.labels(cache)
            if len(self._downloaded) < 10_000:
                self._downloaded[cache] = series
        series.inc(size)

    def _allowed(
        self, lane: Lane, params: dict[str, str], scope: Scope
    ) -> tuple[str, TokenInfo, tuple[Any, Any, tuple[int, str] | None] | None] | None:
        """The bearer and its remembered token when the lane may answer this request (sane names,
        no body, a token allowed on the cache, a valid key), with what is remembered of the entry
        (None: not remembered); None where the ASGI path must answer."""
        cache, digest, key = params["cache"], params["digest"], params["key"]
        if not (0 < len(cache) <= MAX_CACHE_NAME and 0 < len(digest) <= MAX_DIGEST):
            return None
        authorization, has_body = _head(scope)
        bearer = bearer_value(authorization)
        token = self.state.tokens.get(bearer) if bearer is not None else None
        if (
            has_body
            or bearer is None
            or token is None
            or refusal(token, lane.role, "cache", cache) is not None
        ):
            return None
        if not is_key(key):
            return None
        known = self.state.known(cache, digest, key, lane.reads.executable)
        if known is not None and self._nginx_would_not_keep(lane, params, bearer, token):
            return None
        return bearer, token, known

    def _nginx_would_not_keep(
        self, lane: Lane, params: dict[str, str], bearer: str, token: TokenInfo
    ) -> bool:
        """Behind nginx (server/accel.py), True when what is remembered ends before nginx could
        keep this answer for a whole second: then it is forgotten and the ASGI path asks the index
        again, so the next answer is kept for most of ``token_cache_s`` instead of nginx asking on
        every request until the memory ends. Never for a ``token_cache_s`` under a second, where a
        fresh memory could not be kept either."""
        if (
            lane.method != "GET"
            or self.state.settings.accel_redirect is None
            or self.state.settings.token_cache_s < 1
        ):
            return False
        executable = lane.reads.executable
        if accel_expires(self.state, bearer, token, params, executable) != b"0":
            return False
        self.state.forget(bearer, params["cache"], params["digest"], params["key"], executable)
        return True

    def _ready(
        self, method: str, path: str, headers: list[tuple[bytes, bytes]]
    ) -> (
        tuple[
            Lane,
            dict[str, str],
            Store,
            tuple[Any, Any, tuple[int, str] | None],
            tuple[str, TokenInfo],
        ]
        | None
    ):
        """What ``answer_now`` needs, when every check passes and all of it is remembered."""
        for lane in self.lanes:
            if lane.method == method and (m := lane.route.path_regex.match(path)):
                break
        else:
            return None
        params = m.groupdict()
        allowed = self._allowed(lane, params, {"headers": headers})
        if allowed is None:
            return None
        bearer, token, known = allowed
        if known is None:
            return None
        store = self.state.store(known[0])
        if store.kind not in INLINE_KINDS:
            return None
        return lane, params, store, known, (bearer, token)

    async def _inline(
        self,
        lane: Lane,
        params: dict[str, str],
        store: Store,
        known: tuple[Any, Any, tuple[int, str] | None],
        who: tuple[str, TokenInfo],
        scope: Scope,
        send: Send,
    ) -> bool:
        """The answer made on the event loop, from what the state remembers; a missing or odd file
        (a symlink, a directory) is left to the app, which answers it as the route does."""
        _info, env, recorded = known
        rel = lane.reads.path_of(env, params["key"])
        accel = self.state.settings.accel_redirect if lane.method == "GET" else None
        reader = self.readers.get(store.root)
        try:
            if lane.method == "HEAD" or accel is not None:
                fh, size = None, reader.size(rel)
            else:
                fd, size = reader.open_fd(rel)
                fh = OpenFd(fd)
        except (OSError, BadInput):
            return False
        finally:
            self.readers.done(reader)
        sha = recorded[1] if recorded and recorded[0] == size else None
        scope["route"], scope["path_params"] = lane.route, params  # the metrics' route template
        headers = raw_headers(size, sha)
        if accel is not None:  # nginx sends the bytes (server/accel.py), and counts its own length
            headers[0] = (b"content-length", b"0")
            headers.append((ACCEL_HEADER.encode(), accel_uri(accel, params["cache"], rel).encode()))
            expires = accel_expires(self.state, *who, params, lane.reads.executable)
            headers.append((ACCEL_EXPIRES, expires))
        start = {"type": "http.response.start", "status": 200, "headers": headers}
        if fh is None:
            await send(start)
            await send({"type": "http.response.body", "body": b""})
            return True
        with fh:
            self.state.metrics.download_bytes.labels(params["cache"]).inc(size)
            await send(start)
            await send({"type": ZERO_COPY, "file": fh, "offset": 0, "count": size})
        return True

    async def _threaded(
        self, lane: Lane, params: dict[str, str], scope: Scope, receive: Receive, send: Send
    ) -> bool:
        """The routes' own work in one thread hop (which fills what ``_inline`` reads)."""
        args = (self.state, params["cache"], params["digest"], params["key"], lane.reads)
        answer = (
            functools.partial(download_answer, *args, offered(scope))
            if lane.method == "GET"
            else functools.partial(head_answer, *args)
        )
        try:
            work = asyncio.get_running_loop().run_in_executor(self.threads, answer)
            try:
                response = await asyncio.shield(work)
            except asyncio.CancelledError:
                # The thread runs on; what its answer holds (a whole read's slot) goes back once
                # it is done, since it will never be sent.
                work.add_done_callback(_discard_unsent)
                raise
        except (HTTPException, NotFound):
            return False  # a bad key, no such cache or entry: the app answers, asking as cheaply
        except CachectlError as exc:
            # The index does not answer: asking again through the app would wait for it twice.
            scope["route"], scope["path_params"] = lane.route, params
            refused = await self.library_error(Request(scope, receive), exc)
            await refused(scope, receive, send)
            return True
        except Exception:
            return False  # the app answers it as it answers the unexpected
        scope["route"], scope["path_params"] = lane.route, params  # the metrics' route template
        await response(scope, receive, send)
        return True
