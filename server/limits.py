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
``MAX_JSON_DEPTH`` levels of arrays and objects, no NaN or Infinity, no lone
surrogate. A deeper value once stored made every later listing of it, for every
reader, fail with RecursionError; NaN and lone surrogates cannot be written back
as JSON or UTF-8 (500s, or rows a listing cannot render).
"""

from __future__ import annotations

import json
import re
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


def json_problem(body: bytes) -> str | None:
    """Why a request body may not reach a route's JSON parser, or None. Linear C-speed checks; a
    body that mentions NaN, Infinity or a surrogate escape is parsed once more to be sure."""
    if not body:
        return None
    try:
        body.decode("utf-8")
    except UnicodeDecodeError as exc:
        return f"request body is not UTF-8 JSON (byte {exc.start})"
    if too_deep(body):
        return f"request body nests arrays and objects more than {MAX_JSON_DEPTH} levels deep"
    if b"NaN" in body or b"Infinity" in body or _SURROGATE_ESCAPE.search(body):
        try:
            value = json.loads(body, parse_constant=_constant)
        except ValueError as exc:
            if isinstance(exc, json.JSONDecodeError):
                return None  # not JSON at all: the route's parser says so
            return f"request body holds {exc}: JSON has no NaN or Infinity"
        try:
            json.dumps(value, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError:
            return "request body holds a lone UTF-16 surrogate (\\ud800-\\udfff): not text"
    return None


def _too_large(limit: int) -> str:
    return (
        f"request body is above this route's limit of {format_size(limit)}: nothing read or stored"
    )


class BodyGuard:
    def __init__(self, app: ASGIApp, *, settings: ServerSettings) -> None:
        self.app = app
        self.settings = settings

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {
            k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers") or []
        }
        declared = headers.get("content-length")
        has_body = "transfer-encoding" in headers or (
            declared is not None and declared.strip() not in ("", "0")
        )
        path = scope.get("path", "")
        limit = body_limit(self.settings, scope.get("method", "GET"), path)
        if has_body and path not in PUBLIC_BODY_PATHS:
            try:
                token = await identify(Request(scope))
            except HTTPException:
                token = None
            except CachectlError as exc:  # the index is unreachable: what the route would answer
                await JSONResponse(
                    {"detail": exc.message, "error": type(exc).__name__},
                    status_code=503 if isinstance(exc, Unreachable) else 500,
                )(scope, receive, send)
                return
            if token is not None:
                bearer = bearer_token(Request(scope))
                scope.setdefault("state", {})[CHECKED_KEY] = (hash_token(bearer or ""), token)
            if token is None:
                await JSONResponse(
                    {"detail": UNAUTHORIZED},
                    status_code=401,
                    headers={"WWW-Authenticate": 'Bearer realm="cachectl"', "connection": "close"},
                )(scope, receive, send)
                return
        if declared is not None:
            try:
                length = int(declared)
            except ValueError:
                length = -1
            if length > limit:
                await JSONResponse(
                    {"detail": _too_large(limit)}, status_code=413, headers={"connection": "close"}
                )(scope, receive, send)
                return
        received = 0

        async def bounded_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    raise HTTPException(413, _too_large(limit))
            return message

        if not has_body or path in PUBLIC_BODY_PATHS:
            await self.app(scope, bounded_receive, send)
            return
        if scope.get("method") == "PUT" and _BYTES_PUT.match(path):
            await self.app(scope, bounded_receive, send)
            return
        chunks = []
        while True:
            try:
                message = await bounded_receive()
            except HTTPException as exc:
                await JSONResponse(
                    {"detail": exc.detail}, status_code=413, headers={"connection": "close"}
                )(scope, receive, send)
                return
            if message["type"] != "http.request":
                return  # the client went away
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        problem = json_problem(body)
        if problem is not None:
            await JSONResponse({"detail": problem, "error": "BadInput"}, status_code=422)(
                scope, receive, send
            )
            return
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)
