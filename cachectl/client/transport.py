"""The HTTP transport to one cachectl server: pooled connections, one retry, errors mapped back.

A server error comes back as the CachectlError its status and error name stand for
(cachectl.core.errors.ERRORS), with the server's message, so the CLI exits as in direct mode.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import quote

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


def _message(response: Any) -> tuple[str, str | None]:
    try:
        body = response.json()
    except ValueError:
        return (response.text or response.reason_phrase or f"HTTP {response.status_code}").strip()[
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

        if not url.startswith(("http://", "https://")):
            raise BadInput(f"bad CACHECTL_SERVER {url!r}: use http://HOST:PORT or https://HOST")
        self.url = url.rstrip("/")
        headers = {"user-agent": "cachectl-client"}
        if token:
            headers["authorization"] = f"Bearer {token}"
        self._http = httpx.Client(
            base_url=self.url,
            headers=headers,
            timeout=timeout,
            transport=transport,
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
        import httpx

        if params:
            params = {k: v for k, v in params.items() if v is not None}
        for attempt in (1, 2):
            try:
                response = self._http.request(
                    method, path, json=json, params=params, content=content, headers=headers
                )
                break
            except httpx.RemoteProtocolError as exc:
                # A pooled connection the server closed as we sent: safe to resend a read once.
                if attempt == 2 or method not in ("GET", "HEAD"):
                    raise Unreachable(f"server {self.url} dropped the connection: {exc}") from exc
            except httpx.HTTPError as exc:
                raise Unreachable(
                    f"server {self.url} is unreachable: {type(exc).__name__}: {exc}"
                ) from exc
        if response.status_code < 400:
            return response
        message, name = _message(response)
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


def seg(value: str) -> str:
    """One URL path segment: '/' and friends are escaped, so nothing can climb the path."""
    return quote(str(value), safe="")
