"""Each request to the server ends within its deadline, its body included.

httpx's timeouts bound each silence only (connect, one read, one write): a server that sends a
byte a second, or accepts an upload a byte a second, holds a request for ever. As the OCI client
does (cachectl/bundle/oci_transport.py), every request here gets one deadline for the whole of it;
here it is kept by the network layer itself. ``within`` sets the deadline of the requests this
thread sends; the network streams of ``transport`` (httpcore's, wrapped) shorten each connect,
read and write to the time left, and end the request with a timeout once none is left. No
watchdog thread is needed: a read waits at most the time left, and a drip of bytes meets the
check at its next read.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import httpx

# Bytes a second a body of known size may take on top of the request's timeout: a large
# executable gets the time it needs on a slow link, a drip of a small one does not.
MIN_RATE = 4 << 20
WRITE_CHUNK = 64 << 10  # an upload is sent in pieces, each within the time left

_current = threading.local()


def seconds_for(timeout_s: float, nbytes: int = 0) -> float:
    """A request's whole budget: its timeout, plus ``nbytes`` at MIN_RATE."""
    return timeout_s + nbytes / MIN_RATE


@contextlib.contextmanager
def within(seconds: float) -> Iterator[None]:
    """The requests this thread sends inside the block end within ``seconds`` from now."""
    before = getattr(_current, "at", None)
    _current.at = time.monotonic() + seconds
    try:
        yield
    finally:
        _current.at = before


def overdue() -> bool:
    """Whether this thread's deadline has passed."""
    at = getattr(_current, "at", None)
    return at is not None and time.monotonic() >= at


def _left(timeout: float | None, timed_out: str) -> float | None:
    """``timeout`` shortened to the time left; httpcore's ``timed_out`` raised when none is."""
    at = getattr(_current, "at", None)
    if at is None:
        return timeout
    left = at - time.monotonic()
    if left <= 0:
        import httpcore

        raise getattr(httpcore, timed_out)("the request's deadline passed")
    return left if timeout is None else min(timeout, left)


# httpcore's NetworkStream and NetworkBackend, each call kept to the deadline (duck-typed, so
# that importing this module imports no HTTP library: activate() imports it).
class _Stream:
    def __init__(self, inner: Any) -> None:
        self._inner = inner

    def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        data: bytes = self._inner.read(max_bytes, _left(timeout, "ReadTimeout"))
        return data

    def write(self, buffer: bytes, timeout: float | None = None) -> None:
        for start in range(0, len(buffer), WRITE_CHUNK):
            piece = buffer[start : start + WRITE_CHUNK]
            self._inner.write(piece, _left(timeout, "WriteTimeout"))

    def close(self) -> None:
        self._inner.close()

    def start_tls(
        self, ssl_context: Any, server_hostname: str | None = None, timeout: float | None = None
    ) -> _Stream:
        wait = _left(timeout, "ConnectTimeout")
        return _Stream(self._inner.start_tls(ssl_context, server_hostname, wait))

    def get_extra_info(self, info: str) -> Any:
        return self._inner.get_extra_info(info)


class _Backend:
    def __init__(self, inner: Any) -> None:
        self._inner = inner

    def connect_tcp(
        self,
        host: str,
        port: int,
        timeout: float | None = None,
        local_address: str | None = None,
        socket_options: Iterable[Any] | None = None,
    ) -> _Stream:
        wait = _left(timeout, "ConnectTimeout")
        return _Stream(self._inner.connect_tcp(host, port, wait, local_address, socket_options))

    def connect_unix_socket(
        self, path: str, timeout: float | None = None, socket_options: Iterable[Any] | None = None
    ) -> _Stream:
        wait = _left(timeout, "ConnectTimeout")
        return _Stream(self._inner.connect_unix_socket(path, wait, socket_options))

    def sleep(self, seconds: float) -> None:
        self._inner.sleep(seconds)


def transport(uds: str | None = None) -> httpx.HTTPTransport:
    """httpx's transport (over the unix socket ``uds``, else TCP) whose connections keep
    this thread's deadline (``within``)."""
    import httpcore
    import httpx

    made = httpx.HTTPTransport(uds=uds)
    pool = made._pool  # httpx builds httpcore's pool without a way to pass a network backend
    if not isinstance(pool, httpcore.ConnectionPool) or not hasattr(pool, "_network_backend"):
        raise RuntimeError(
            "this httpx/httpcore cannot keep a request's deadline"
        )  # pragma: no cover
    pool._network_backend = _Backend(pool._network_backend)  # type: ignore[assignment]
    return made
