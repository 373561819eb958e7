"""Bounds for the object store clients over aiohttp: the whole request, and a pause at an
endpoint that keeps timing out (S3: ``bounded_session``; Google Cloud Storage: ``bounded_trace``;
Azure's transport, in ``backends/az.py``, counts and pauses through ``failed`` and
``refuse_if_paused``).

botocore bounds the connect and each silence while a response is read (``connect_timeout``,
``read_timeout``), never a whole request: a server that answers a byte now and then keeps one
open for ever. aiobotocore's session builds aiohttp's timeout from those two alone; this session
adds aiohttp's ``total`` (its own bound on connecting, sending and reading the whole response).
It is handed to s3fs as ``config_kwargs["http_session_cls"]`` where aiobotocore takes one.

Each bound is per attempt, and attempts multiply: botocore tries a timed-out request up to 5
times, s3fs repeats it 5 times more, and an operation makes several. So once requests to an
endpoint timed out ``after`` times in a row (no answer in between), the next ones there fail at
once, without the network, for ``pause_s``, with ``StoragePaused`` (an ``Unreachable``: one line,
exit 2, and neither botocore nor s3fs repeats it). JAX's client pauses after one timeout (a
service's compile then runs as plain JAX, with one warning); cachectl's own after two (one slow
answer does not stop a long sync).
"""

from __future__ import annotations

import functools
import inspect
import logging
import threading
import time
from typing import Any
from urllib.parse import urlsplit

from cachectl.core.errors import Unreachable

STORAGE_TIMEOUT_ENVS = "CACHECTL_STORAGE_CONNECT_TIMEOUT, _READ_TIMEOUT, _TIMEOUT"

log = logging.getLogger(__name__)

# endpoint (scheme://host:port) -> monotonic time until which requests to it fail at once
_PAUSED: dict[str, float] = {}
# endpoint -> timeouts in a row there (an answer sets it back to 0)
_TIMEOUTS: dict[str, int] = {}
_PAUSED_LOCK = threading.Lock()


class StoragePaused(Unreachable):
    """A request not sent: its endpoint timed out just before (bounded_http's pause)."""


def _endpoint(url: str) -> str:
    parts = urlsplit(url)
    return f"{parts.scheme}://{parts.netloc}"


def paused_until(endpoint: str) -> float | None:
    """When requests to ``endpoint`` (scheme://host:port) may go out again; None if they may now."""
    with _PAUSED_LOCK:
        until = _PAUSED.get(endpoint)
    return until if until is not None and until > time.monotonic() else None


def refuse_if_paused(endpoint: str, what: str = "timed out") -> None:
    """StoragePaused, without the network, while ``endpoint`` is paused."""
    until = paused_until(endpoint)
    if until is not None:
        # Not a timeout nor a connection error: no client library repeats it.
        raise StoragePaused(
            f"storage endpoint {endpoint} {what} ({STORAGE_TIMEOUT_ENVS}); requests "
            f"there fail at once for {until - time.monotonic():.0f} s more: check the "
            "endpoint, or raise the bounds"
        )


def failed(endpoint: str, pause_s: float, after: int, error: BaseException) -> None:
    """Count a request at ``endpoint`` that timed out or could not connect (Azure's and Google
    Cloud Storage's clients: a refused connection counts, their retries wait seconds each)."""
    _timed_out(endpoint, pause_s, after, after == 1, error)


def answered(endpoint: str) -> None:
    """An answer from ``endpoint``: the failures in a row start again from none."""
    _answered(endpoint)


def _timed_out(endpoint: str, pause_s: float, after: int, warn: bool, error: BaseException) -> None:
    """Count a timeout at ``endpoint``; pause it once ``after`` came in a row."""
    with _PAUSED_LOCK:
        count = _TIMEOUTS.get(endpoint, 0) + 1
        _TIMEOUTS[endpoint] = count
        if count < after:
            return
        first = endpoint not in _PAUSED or _PAUSED[endpoint] <= time.monotonic()
        _PAUSED[endpoint] = time.monotonic() + pause_s
    if first and warn:
        log.warning(
            "cachectl: storage endpoint %s timed out (%s); JAX compiles without the cache's "
            "reads and writes there for %g s",
            endpoint,
            type(error).__name__,
            pause_s,
        )


def _answered(endpoint: str) -> None:
    if _TIMEOUTS.get(endpoint):
        with _PAUSED_LOCK:
            _TIMEOUTS[endpoint] = 0


@functools.lru_cache(maxsize=16)
def bounded_session(total_s: float, pause_s: float, after: int) -> type[Any] | None:
    """An aiobotocore HTTP session class whose every request ends within ``total_s`` and that
    sends nothing to an endpoint for ``pause_s`` after ``after`` timeouts there in a row (one:
    JAX's client, which also warns once); None where the installed aiobotocore takes no session
    class (then only connect and read are bounded). One class per set of arguments, so fsspec
    sees the same options (and instance) each time."""
    try:
        # No inline types or py.typed marker in either (botocore-stubs is not installed).
        import aiohttp
        from aiobotocore.config import AioConfig  # type: ignore[import-untyped]
        from aiobotocore.httpsession import AIOHTTPSession  # type: ignore[import-untyped]
        from botocore.exceptions import (  # type: ignore[import-untyped]
            ConnectTimeoutError,
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
            endpoint = _endpoint(request.url)
            until = paused_until(endpoint)
            if until is not None:
                # Not a timeout nor a connection error: neither botocore nor s3fs repeats it.
                raise StoragePaused(
                    f"storage endpoint {endpoint} timed out ({STORAGE_TIMEOUT_ENVS}); requests "
                    f"there fail at once for {until - time.monotonic():.0f} s more: check the "
                    "endpoint, or raise the bounds"
                )
            try:
                response = await super().send(request)
            except timed_out as exc:
                _timed_out(endpoint, pause_s, after, after == 1, exc)
                raise
            _answered(endpoint)
            return response

    name = f"BoundedSession{total_s:g}sPause{pause_s:g}sAfter{after}"
    BoundedSession.__qualname__ = BoundedSession.__name__ = name
    return BoundedSession


@functools.lru_cache(maxsize=16)
def bounded_trace(pause_s: float, after: int) -> Any:
    """An aiohttp trace (``session_kwargs={"trace_configs": [...]}``, for gcsfs) that counts the
    requests that time out or cannot connect at an endpoint and, once ``after`` came in a row,
    refuses the next ones there for ``pause_s`` (gcsfs retries each six times, seconds apart).
    One per set of arguments, so fsspec sees the same options each time."""
    import aiohttp

    async def start(session: Any, ctx: Any, params: Any) -> None:
        refuse_if_paused(_endpoint(str(params.url)), "failed to connect or answer")

    async def end(session: Any, ctx: Any, params: Any) -> None:
        answered(_endpoint(str(params.url)))

    async def exception(session: Any, ctx: Any, params: Any) -> None:
        error = params.exception
        if isinstance(error, (aiohttp.ClientConnectionError, TimeoutError)) and not isinstance(
            error, StoragePaused
        ):
            failed(_endpoint(str(params.url)), pause_s, after, error)

    trace = aiohttp.TraceConfig()
    trace.on_request_start.append(start)
    trace.on_request_end.append(end)
    trace.on_request_exception.append(exception)
    return trace
