"""GET and HEAD of stored bytes (an entry, its stored executable) answered before FastAPI routes them.

These are most of a fleet's requests, and most of what each one cost was FastAPI's machinery around
a handler that does little: matching every route in turn, solving the dependencies, a thread hop
through anyio (BENCHMARKS.md, "Server"). This lane answers only the request that every check passes,
and answers it with what the routes themselves use: the role and scope each byte route declares
(server/auth.py ``refusal``), the token cache the routes fill, ``check_key``, and ``head_answer``
or ``download_answer`` in one thread hop, which build the same response. Anything else goes on to the
app, which answers it as it always did: no token or one not cached yet, a refusal, a path or
parameter the route would reject, a body, a missing entry, an error. So no answer differs from the
app's (tests/test_server_fast_lane.py asks both the same questions), and no rule is written twice.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from fastapi import HTTPException, Request, Response
from fastapi.routing import APIRoute
from starlette.types import ASGIApp, Receive, Scope, Send

from cachectl.core.errors import CachectlError, NotFound

from . import entry_routes, executable_routes
from .api import MAX_CACHE_NAME, MAX_DIGEST
from .auth import PUBLIC, ROLE_KEY, SCOPE_KEY, bearer_value, refusal
from .entry_routes import ENTRY, ByteRoute, check_key, discard, download_answer, head_answer
from .executable_routes import EXECUTABLE
from .state import ServerState
from .zero_copy import offered

LANE_THREADS = 40
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


class ByteFastLane:
    """Pure ASGI, inside BodyGuard and MetricsMiddleware (which count and log what it answers)."""

    def __init__(
        self,
        app: ASGIApp,
        *,
        state: ServerState,
        library_error: Callable[[Request, Exception], Awaitable[Response]],
    ) -> None:
        self.app = app
        self.state = state
        self.lanes = lanes()
        # As many threads as the routes' own hop may use (anyio's default limiter): a HEAD on an
        # object store waits on the network there, and asyncio's default pool has cores + 4.
        self.threads = ThreadPoolExecutor(LANE_THREADS, thread_name_prefix="cachectl-bytes")
        self.library_error = library_error  # the app's handler of a library error (server/app.py)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] not in ("GET", "HEAD"):
            await self.app(scope, receive, send)
            return
        answered = await self._answer(scope, receive, send)
        if not answered:
            await self.app(scope, receive, send)

    def _match(self, scope: Scope) -> tuple[Lane, dict[str, str]] | None:
        if scope.get("root_path"):
            return None
        path, method = scope["path"], scope["method"]
        for lane in self.lanes:
            if lane.method == method and (m := lane.route.path_regex.match(path)):
                return lane, m.groupdict()
        return None

    async def _answer(self, scope: Scope, receive: Receive, send: Send) -> bool:
        """Whether this lane answered; False leaves the request, untouched, to the app."""
        matched = self._match(scope)
        if matched is None:
            return False
        lane, params = matched
        cache, digest, key = params["cache"], params["digest"], params["key"]
        if not (0 < len(cache) <= MAX_CACHE_NAME and 0 < len(digest) <= MAX_DIGEST):
            return False
        authorization, has_body = _head(scope)
        bearer = bearer_value(authorization)
        token = self.state.tokens.get(bearer) if bearer is not None else None
        if has_body or token is None or refusal(token, lane.role, "cache", cache) is not None:
            return False
        try:
            check_key(key)
            args = (self.state, cache, digest, key, lane.reads)
            answer = (
                functools.partial(download_answer, *args, offered(scope))
                if lane.method == "GET"
                else functools.partial(head_answer, *args)
            )
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
