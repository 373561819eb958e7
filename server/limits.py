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
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

from fastapi import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from cachectl.errors import CachectlError, Unreachable
from cachectl.tokens import hash_token
from cachectl.units import format_size

from .auth import CHECKED_KEY, UNAUTHORIZED, bearer_token, identify

if TYPE_CHECKING:
    from .config import ServerSettings

_ENTRY_PUT = re.compile(r"^/api/v1/caches/[^/]+/environments/[^/]+/entries/[^/]+$")
MAX_FORM_BODY = 4096
# Routes that take a body without a token: the dashboard's sign-in and sign-out forms.
PUBLIC_BODY_PATHS = ("/login", "/logout")


def body_limit(settings: ServerSettings, method: str, path: str) -> int:
    if method == "PUT" and _ENTRY_PUT.match(path):
        return int(settings.max_upload_bytes)
    if path in PUBLIC_BODY_PATHS:
        return MAX_FORM_BODY
    return int(settings.max_json_bytes)


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

        await self.app(scope, bounded_receive, send)
