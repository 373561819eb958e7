"""Bounds for the S3 client (aiobotocore over aiohttp): the whole request, and a pause after one
that timed out.

botocore bounds the connect and each silence while a response is read (``connect_timeout``,
``read_timeout``), never a whole request: a server that answers a byte now and then keeps one
open for ever. aiobotocore's session builds aiohttp's timeout from those two alone; this session
adds aiohttp's ``total`` (its own bound on connecting, sending and reading the whole response).
It is handed to s3fs as ``config_kwargs["http_session_cls"]`` where aiobotocore takes one.

JAX's own client gets one more rule (``pause_s``): once a request to an endpoint timed out, the
next ones to it fail at once, without the network, for that long. s3fs repeats a timed-out request
(5 times) and JAX makes several per compile (the directory, the lookup, the read): without the
pause a dead endpoint cost a service's first compile each bound many times over; with it, one bound,
then a compile as plain JAX would do it. cachectl's own commands keep every request.
"""

from __future__ import annotations

import functools
import inspect
import logging
import threading
import time
from typing import Any
from urllib.parse import urlsplit

log = logging.getLogger(__name__)

# endpoint (scheme://host:port) -> monotonic time until which JAX's requests to it fail at once
_PAUSED: dict[str, float] = {}
_PAUSED_LOCK = threading.Lock()


def _endpoint(url: str) -> str:
    parts = urlsplit(url)
    return f"{parts.scheme}://{parts.netloc}"


def paused_until(endpoint: str) -> float | None:
    """When requests to ``endpoint`` (scheme://host:port) may go out again; None if they may now."""
    with _PAUSED_LOCK:
        until = _PAUSED.get(endpoint)
    return until if until is not None and until > time.monotonic() else None


def _pause(endpoint: str, pause_s: float, error: BaseException) -> None:
    with _PAUSED_LOCK:
        first = endpoint not in _PAUSED or _PAUSED[endpoint] <= time.monotonic()
        _PAUSED[endpoint] = time.monotonic() + pause_s
    if first:
        log.warning(
            "cachectl: storage endpoint %s timed out (%s); JAX compiles without the cache's "
            "reads and writes there for %g s",
            endpoint,
            type(error).__name__,
            pause_s,
        )


@functools.lru_cache(maxsize=16)
def bounded_session(total_s: float, pause_s: float = 0.0) -> type[Any] | None:
    """An aiobotocore HTTP session class whose every request ends within ``total_s`` (and, with
    ``pause_s``, that fails at once for that long after a request to the same endpoint timed
    out); None where the installed aiobotocore takes no session class (then only connect and
    read are bounded). One class per pair, so fsspec sees the same options (and instance)."""
    try:
        # No inline types or py.typed marker in either (botocore-stubs is not installed).
        import aiohttp
        from aiobotocore.config import AioConfig  # type: ignore[import-untyped]
        from aiobotocore.httpsession import AIOHTTPSession  # type: ignore[import-untyped]
        from botocore.exceptions import (  # type: ignore[import-untyped]
            ConnectTimeoutError,
            EndpointConnectionError,
            ReadTimeoutError,
        )
    except ImportError:
        return None
    if "http_session_cls" not in inspect.signature(AioConfig.__init__).parameters:
        return None
    timed_out = (ConnectTimeoutError, ReadTimeoutError)

    def bounded(timeout: Any) -> Any:
        return aiohttp.ClientTimeout(
            total=total_s, sock_connect=timeout.sock_connect, sock_read=timeout.sock_read
        )

    class BoundedSession(AIOHTTPSession):
        """aiobotocore's session with aiohttp's total bound on each request."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self._timeout: Any = bounded(self._timeout)

        def _get_request_timeout(self, request: Any) -> Any:
            timeout = super()._get_request_timeout(request)
            return None if timeout is None else bounded(timeout)

        async def send(self, request: Any) -> Any:
            if not pause_s:
                return await super().send(request)
            endpoint = _endpoint(request.url)
            until = paused_until(endpoint)
            if until is not None:
                # Not a timeout: s3fs does not repeat it, and neither does botocore.
                raise EndpointConnectionError(
                    endpoint_url=request.url,
                    error=f"paused for {until - time.monotonic():.0f} s after a timeout",
                )
            try:
                return await super().send(request)
            except timed_out as exc:
                _pause(endpoint, pause_s, exc)
                raise

    name = f"BoundedSession{total_s:g}s" + (f"Pause{pause_s:g}s" if pause_s else "")
    BoundedSession.__qualname__ = BoundedSession.__name__ = name
    return BoundedSession
