"""Request bodies are bounded and authenticated before anything reads them.

FastAPI reads and parses a JSON body before any dependency runs, so a route's
token check alone would let anyone make the server hold a body of any size.
``BodyGuard`` is a pure ASGI middleware in front of the routes: a request that
carries a body to a non-public route must present a valid token first (401,
nothing read), a declared Content-Length above the route's limit is refused at
once (413), and a body without one is counted as it arrives and cut off at the
limit (413). Limits per route: entry uploads the server's upload limit (the
handler streams them to a temporary file and applies the cache's own max entry
size), the sign-in form a few KiB, every other body ``max_json_bytes``.

Every body but the byte uploads is JSON, and it is read whole (within that limit)
and checked here before any route parses it (422): UTF-8, at most
``MAX_JSON_DEPTH`` levels of arrays and objects, no NaN or Infinity, no number
too big for a float (``1e999`` reads back as infinity), no lone surrogate. A deeper
value once stored made every later listing of it, for every reader, fail with
RecursionError; NaN, infinities and lone surrogates cannot be written back as JSON
or UTF-8 (500s, or rows a listing cannot render). 422 is the status of every body
this edge refuses as JSON, as it is FastAPI's for a body its models refuse.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from fastapi import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from cachectl.core.errors import CachectlError, Unreachable
from cachectl.core.units import format_size
from cachectl.trust.tokens import hash_token

from .auth import CHECKED_KEY, UNAUTHORIZED, bearer_token, identify

if TYPE_CHECKING:
    from .config import ServerSettings

_ENTRY_PUT = re.compile(r"^/api/v1/caches/[^/]+/environments/[^/]+/entries/[^/]+$")
# The routes whose body is bytes, not JSON: an entry's and its stored executable's uploads.
_BYTES_PUT = re.compile(r"^/api/v1/caches/[^/]+/environments/[^/]+/entries/[^/]+(?:/aot)?$")
MAX_FORM_BODY = 4096
# Arrays and objects inside one another in a request body; the deepest the API's own bodies go is 8
# (a telemetry signature's shape), a manifest's bucket a few more.
MAX_JSON_DEPTH = 32
# Routes that take a body without a token: the dashboard's sign-in and sign-out forms.
PUBLIC_BODY_PATHS = ("/login", "/logout")


def body_limit(settings: ServerSettings, method: str, path: str) -> int:
    if method == "PUT" and _ENTRY_PUT.match(path):
        return int(settings.max_upload_bytes)
    if path in PUBLIC_BODY_PATHS:
        return MAX_FORM_BODY
    return int(settings.max_json_bytes)


# A JSON string, escapes included, or an unterminated one to the end: possessive, so it never
# backtracks (linear in the body) and every search that starts at a quote matches.
_JSON_STRING = re.compile(rb'"[^"\\]*+(?:\\.[^"\\]*+)*+"?', re.DOTALL)
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")
_EMPTY_PAIR = re.compile(rb"\[\]|\{\}")
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")
# A number that may overflow a float: a three-digit exponent after a digit or point and before
# no letter, digit or quote (so the hex of a sha256, "5e123a", is not one), or 309 digits in a row.
_HUGE_NUMBER = re.compile(rb"[0-9.][eE][+-]?[0-9]{3,}(?![0-9A-Za-z\"])|[0-9]{309}")


def too_deep(body: bytes, limit: int = MAX_JSON_DEPTH) -> bool:
    """Whether a JSON text nests arrays and objects more than ``limit`` deep, without parsing it
    (a parser's recursion is what must not be reached): strings removed, only brackets kept, then
    one pass per level removes the innermost pairs. Not well-formed JSON is left to the parser."""
    if body.count(b"[") + body.count(b"{") <= limit:
        return False
    shape = _JSON_STRING.sub(b"", body).translate(None, _NOT_BRACKETS)
    for _ in range(limit):
        shape, removed = _EMPTY_PAIR.subn(b"", shape)
        if not shape or not removed:
            return False
    return _EMPTY_PAIR.search(shape) is not None


def _constant(name: str) -> Any:
    raise ValueError(name)


def _finite(text: str) -> float:
    value = float(text)
    if value in (float("inf"), float("-inf")):
        raise ValueError(f"{text[:40]} (beyond a float's range)")
    return value


def json_problem(body: bytes) -> str | None:
    """Why a request body may not reach a route's JSON parser, or None. Linear C-speed checks; a
    body that mentions NaN, Infinity, a surrogate escape or a number that may overflow a float
    is parsed once more to be sure."""
    if not body:
        return None
    try:
        body.decode("utf-8")
    except UnicodeDecodeError as exc:
        return f"request body is not UTF-8 JSON (byte {exc.start})"
    if too_deep(body):
        return f"request body nests arrays and objects more than {MAX_JSON_DEPTH} levels deep"
    if (
        b"NaN" in body
        or b"Infinity" in body
        or _SURROGATE_ESCAPE.search(body)
        or _HUGE_NUMBER.search(body)
    ):
        try:
            value = json.loads(body, parse_constant=_constant, parse_float=_finite)
        except ValueError as exc:
            if isinstance(exc, json.JSONDecodeError):
                return None  # not JSON at all: the route's parser says so
            return f"request body holds {exc}: JSON has no NaN or Infinity, numbers must be finite"
        try:
            json.dumps(value, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError:
            return "request body holds a lone UTF-16 surrogate (\\ud800-\\udfff): not text"
    return None


def _too_large(limit: int) -> str:
    return (
        f"request body is above this route's limit of {format_size(limit)}: nothing read or stored"
    )


@dataclass(frozen=True)
class Arriving:
    """What BodyGuard reads from a request's head before any of its body."""

    path: str
    method: str
    declared: int | None  # Content-Length (-1 when not a number: the server's parser refuses it)
    has_body: bool
    limit: int  # this route's body limit (body_limit)

    @classmethod
    def of(cls, scope: Scope, settings: ServerSettings) -> Arriving:
        headers = {
            k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers") or []
        }
        declared = headers.get("content-length")
        length: int | None = None
        if declared is not None:
            try:
                length = int(declared)
            except ValueError:
                length = -1
        path = scope.get("path", "")
        method = scope.get("method", "GET")
        return cls(
            path=path,
            method=method,
            declared=length,
            has_body="transfer-encoding" in headers
            or (declared is not None and declared.strip() not in ("", "0")),
            limit=body_limit(settings, method, path),
        )

    @property
    def needs_token(self) -> bool:
        """A body to a route that is not one of the public forms: a token comes first."""
        return self.has_body and self.path not in PUBLIC_BODY_PATHS

    @property
    def streamed(self) -> bool:
        """The route reads the body itself, within the limit: none, a form, or entry bytes."""
        return (
            not self.has_body
            or self.path in PUBLIC_BODY_PATHS
            or (self.method == "PUT" and _BYTES_PUT.match(self.path) is not None)
        )


def bounded(receive: Receive, limit: int) -> Receive:
    """``receive``, raising 413 (an HTTPException) once the body passes ``limit`` bytes."""
    received = 0

    async def bounded_receive() -> Message:
        nonlocal received
        message = await receive()
        if message["type"] == "http.request":
            received += len(message.get("body", b""))
            if received > limit:
                raise HTTPException(413, _too_large(limit))
        return message

    return bounded_receive


def replaying(body: bytes, receive: Receive) -> Receive:
    """A receive that hands the route the body read already, then the connection's messages."""
    replayed = False

    async def replay() -> Message:
        nonlocal replayed
        if not replayed:
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


class BodyGuard:
    def __init__(self, app: ASGIApp, *, settings: ServerSettings) -> None:
        self.app = app
        self.settings = settings

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        arriving = Arriving.of(scope, self.settings)
        if arriving.needs_token and not await self._authenticated(scope, receive, send):
            return
        if arriving.declared is not None and arriving.declared > arriving.limit:
            await JSONResponse(
                {"detail": _too_large(arriving.limit)},
                status_code=413,
                headers={"connection": "close"},
            )(scope, receive, send)
            return
        within = bounded(receive, arriving.limit)
        if arriving.streamed:
            await self.app(scope, within, send)
            return
        body = await self._read_json(scope, within, receive, send)
        if body is not None:
            await self.app(scope, replaying(body, receive), send)

    async def _authenticated(self, scope: Scope, receive: Receive, send: Send) -> bool:
        """Whether the request's token is valid; answered (401, or the index's error) when not.
        The token found is left in the scope for the route's own check (auth.identify)."""
        try:
            token = await identify(Request(scope))
        except HTTPException:
            token = None
        except CachectlError as exc:  # the index is unreachable: what the route would answer
            await JSONResponse(
                {"detail": exc.message, "error": type(exc).__name__},
                status_code=503 if isinstance(exc, Unreachable) else 500,
            )(scope, receive, send)
            return False
        if token is None:
            await JSONResponse(
                {"detail": UNAUTHORIZED},
                status_code=401,
                headers={"WWW-Authenticate": 'Bearer realm="cachectl"', "connection": "close"},
            )(scope, receive, send)
            return False
        bearer = bearer_token(Request(scope))
        scope.setdefault("state", {})[CHECKED_KEY] = (hash_token(bearer or ""), token)
        return True

    async def _read_json(
        self, scope: Scope, within: Receive, receive: Receive, send: Send
    ) -> bytes | None:
        """A JSON body read whole within the limit and checked (json_problem); None when it was
        answered instead (413, 422) or the client went away."""
        chunks = []
        while True:
            try:
                message = await within()
            except HTTPException as exc:
                await JSONResponse(
                    {"detail": exc.detail}, status_code=413, headers={"connection": "close"}
                )(scope, receive, send)
                return None
            if message["type"] != "http.request":
                return None  # the client went away
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        problem = json_problem(body)
        if problem is not None:
            await JSONResponse({"detail": problem, "error": "BadInput"}, status_code=422)(
                scope, receive, send
            )
            return None
        return body
