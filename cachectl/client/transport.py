"""The HTTP transport to one cachectl server: pooled connections, one retry, errors mapped back.

A server error comes back as the CachectlError its status and error name stand for
(cachectl.core.errors.ERRORS), with the server's message, so the CLI exits as in direct mode.
The server is ``http://HOST:PORT``, ``https://HOST`` or a unix socket, ``unix:///PATH``. Every
request ends within its timeout, its body included (``cachectl.client.deadline``); ``read_body``
takes an entry's or executable's bytes only up to the size the index records.
"""

from __future__ import annotations

import contextlib
import hashlib
import json as jsonlib
from collections.abc import Iterator
from typing import Any
from urllib.parse import quote

from cachectl.client import deadline
from cachectl.core.errors import (
    BadInput,
    OperationFailed,
    PermissionDenied,
    Unreachable,
    error_for_status,
    error_named,
)

API = "/api/v1"
DEFAULT_TIMEOUT_S = 30.0
UNIX = "unix://"
UDS_BASE = "http://cachectl"  # the URL requests over a unix socket name (its Host header)
ERROR_BODY_MAX = 64 << 10  # of a refusal's body, what is read for its message


class BodyRefused(OperationFailed):
    """A body that is not the index's record of it (longer, shorter, or another sha256): its
    bytes are never returned."""


def endpoint(url: str) -> tuple[str, str | None]:
    """(the base URL requests go to, the unix socket they go over or None) of CACHECTL_SERVER."""
    if url.startswith(UNIX):
        path = url[len(UNIX) :]
        if not path.startswith("/") or path.rstrip("/") == "":
            raise BadInput(
                f"bad CACHECTL_SERVER {url!r}: a unix socket is unix:///ABSOLUTE/PATH (three slashes)"
            )
        return UDS_BASE, path
    if not url.startswith(("http://", "https://")):
        raise BadInput(
            f"bad CACHECTL_SERVER {url!r}: use http://HOST:PORT, https://HOST or unix:///PATH"
        )
    return url.rstrip("/"), None


def _message(response: Any, content: bytes | None = None) -> tuple[str, str | None]:
    raw = response.content if content is None else content
    try:
        body = jsonlib.loads(raw)
    except ValueError:
        text = raw.decode("utf-8", "replace")
        return (text or response.reason_phrase or f"HTTP {response.status_code}").strip()[
            :500
        ], None
    detail = body.get("detail") if isinstance(body, dict) else None
    if isinstance(detail, list):  # pydantic validation errors
        parts = []
        for err in detail[:5]:
            where = ".".join(str(p) for p in err.get("loc", ()) if p != "body")
            parts.append(f"{where}: {err.get('msg')}" if where else str(err.get("msg")))
        detail = "; ".join(parts)
    return str(detail or f"HTTP {response.status_code}"), body.get("error") if isinstance(
        body, dict
    ) else None


class Transport:
    """HTTP to one server with one token; connections are pooled for the transport's lifetime."""

    def __init__(
        self,
        url: str,
        token: str | None,
        *,
        timeout: Any = DEFAULT_TIMEOUT_S,
        transport: Any = None,
    ) -> None:
        import httpx

        base, uds = endpoint(url)
        self.url = url.rstrip("/")
        self.uds = uds
        # the whole of one request (body included) may take this long: the read timeout
        read = timeout.read if isinstance(timeout, httpx.Timeout) else timeout
        self.timeout_s = float(read) if read is not None else DEFAULT_TIMEOUT_S
        headers = {"user-agent": "cachectl-client"}
        if token:
            headers["authorization"] = f"Bearer {token}"
        self._http = httpx.Client(
            base_url=base,
            headers=headers,
            timeout=timeout,
            transport=transport if transport is not None else deadline.transport(uds),
            trust_env=False,
        )

    def close(self) -> None:
        self._http.close()

    def request(
        self,
        method: str,
        path: str,
        *,
        json: Any = None,
        params: dict[str, Any] | None = None,
        content: bytes | None = None,
        headers: dict[str, str] | None = None,
    ) -> Any:
        """Send; raise the CachectlError the server's status and error name stand for."""
        if params:
            params = {k: v for k, v in params.items() if v is not None}
        seconds = deadline.seconds_for(self.timeout_s, len(content or b""))
        for attempt in (1, 2):
            try:
                with self._unreachable(seconds), deadline.within(seconds):
                    response = self._http.request(
                        method, path, json=json, params=params, content=content, headers=headers
                    )
                break
            except _Resend:
                if attempt == 2 or method not in ("GET", "HEAD"):
                    raise Unreachable(f"server {self.url} dropped the connection") from None
        return self._checked(response)

    @contextlib.contextmanager
    def _unreachable(self, seconds: float) -> Iterator[None]:
        """httpx's errors as Unreachable, a request past its deadline said so."""
        import httpx

        try:
            yield
        except httpx.RemoteProtocolError as exc:
            if deadline.overdue():
                raise self._late(seconds) from exc
            # A pooled connection the server closed as we sent: safe to resend a read once.
            raise _Resend() from exc
        except httpx.HTTPError as exc:
            if deadline.overdue() or isinstance(exc, httpx.TimeoutException):
                raise self._late(seconds) from exc
            raise Unreachable(
                f"server {self.url} is unreachable: {type(exc).__name__}: {exc}"
            ) from exc

    def _late(self, seconds: float) -> Unreachable:
        return Unreachable(
            f"server {self.url} did not answer within {seconds:.0f} s (the whole request, its "
            "body included): is it overloaded or down?"
        )

    def read_body(self, path: str, size: int, sha256: str) -> bytes:
        """GET ``path``'s body, the bytes of an entry or executable the index records at ``size``
        and ``sha256``: at most ``size`` + 1 bytes are read, within the timeout plus ``size`` at
        deadline.MIN_RATE, the sha256 computed as they arrive. BodyRefused when they are not
        the record's."""
        seconds = deadline.seconds_for(self.timeout_s, size)
        for attempt in (1, 2):
            digest, body = hashlib.sha256(), bytearray()
            try:
                with (
                    self._unreachable(seconds),
                    deadline.within(seconds),
                    self._http.stream("GET", path) as response,
                ):
                    if response.status_code >= 400:
                        self._checked(response, _head_of(response, ERROR_BODY_MAX))
                    for chunk in response.iter_raw(64 << 10):
                        piece = chunk[: size + 1 - len(body)]
                        body += piece
                        digest.update(piece)
                        if len(body) > size:
                            break
                break
            except _Resend:
                if attempt == 2:
                    raise Unreachable(f"server {self.url} dropped the connection") from None
        if len(body) != size:
            longer = "longer" if len(body) > size else f"shorter ({len(body)} bytes)"
            raise BodyRefused(
                f"server {self.url} sent a body {longer} than the index's record of it "
                f"({size} bytes) for {path}: refused"
            )
        if digest.hexdigest() != sha256:
            raise BodyRefused(
                f"server {self.url} sent other bytes than the index's record of them (sha256) "
                f"for {path}: refused"
            )
        return bytes(body)

    def _checked(self, response: Any, content: bytes | None = None) -> Any:
        """``response`` when it succeeded; else the CachectlError it stands for, raised."""
        if response.status_code < 400:
            return response
        message, name = _message(response, content)
        status = response.status_code
        if status == 401:
            raise PermissionDenied(
                f"server {self.url} refused the token ({message}): check CACHECTL_TOKEN"
            )
        error = error_named(name)
        if error is not None:
            raise error(message)
        error = error_for_status(status)
        if error is Unreachable:
            raise Unreachable(f"server {self.url}: {message}")
        if error is not None:
            raise error(message)
        raise OperationFailed(f"server {self.url} failed: {message}")

    def get(self, path: str, **params: Any) -> Any:
        return self.request("GET", path, params=params).json()


class _Resend(Exception):
    """A pooled connection the server closed as the request went out."""


def _head_of(response: Any, limit: int) -> bytes:
    """At most ``limit`` bytes of a streamed response's body."""
    out = bytearray()
    for chunk in response.iter_raw(16 << 10):
        out += chunk[: limit - len(out)]
        if len(out) >= limit:
            break
    return bytes(out)


def seg(value: str) -> str:
    """One URL path segment: '/' and friends are escaped, so nothing can climb the path."""
    return quote(str(value), safe="")
