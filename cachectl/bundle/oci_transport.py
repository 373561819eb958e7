"""A registry's HTTP: one requests session that holds the two rules every OCI request obeys.

**Credentials stay on the registry.** An ``Authorization`` header (a login, or a token the
registry's token service gave) goes only to the registry's own origin, and to the token service
``allow_realm`` admitted (``realm_refusal``: over https, on the registry's host or one the docker
config names; plain HTTP only to the registry's own host, a loopback one, with ``--insecure``).
Anything else a registry names (an upload ``Location``, a blob redirect, another host) gets the
request without it. The rule is applied in ``send``, the one door every request (oras's token
requests and redirects included) goes through.

**Every request ends within ``CACHECTL_OCI_TIMEOUT``, its body included.** Connect and read
timeouts bound each silence only: a server that sends a byte a second, or a terabyte fast,
holds a request for ever. ``send`` starts a watchdog per request; the connection the request
goes out on reports itself to it (``_Conn``), and when the deadline passes the watchdog shuts
that socket down, so the read in progress ends at once. ``overdue`` tells the caller why.
"""

from __future__ import annotations

import contextlib
import os
import re
import socket
import threading
import urllib.parse
import weakref
from typing import Any

import requests
from requests.adapters import HTTPAdapter
from urllib3.connection import HTTPConnection, HTTPSConnection
from urllib3.connectionpool import HTTPConnectionPool, HTTPSConnectionPool

from cachectl.core.errors import BadInput

TIMEOUT_ENV = "CACHECTL_OCI_TIMEOUT"
CA_ENV = "CACHECTL_OCI_CA_FILE"
DEFAULT_TIMEOUT_S = 30.0
_LOOPBACK = ("127.0.0.1", "localhost", "::1")
_DEFAULT_PORTS = {"http": 80, "https": 443}


def timeout_setting() -> float:
    """``CACHECTL_OCI_TIMEOUT``: seconds each registry request may take, whole."""
    raw = os.environ.get(TIMEOUT_ENV, "").strip()
    if not raw:
        return DEFAULT_TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        raise BadInput(f"{TIMEOUT_ENV}={raw!r} is not a number of seconds") from None
    if not 0 < value <= 3600:
        raise BadInput(f"{TIMEOUT_ENV}={raw!r}: give seconds between 0 and 3600")
    return value


def origin(url: str) -> tuple[str, str, int]:
    """(scheme, host, port) of a URL, the port filled in: what "the same server" means."""
    parts = urllib.parse.urlsplit(url)
    scheme = parts.scheme.lower()
    try:
        port = parts.port
    except ValueError:
        port = None
    return scheme, (parts.hostname or "").lower(), port or _DEFAULT_PORTS.get(scheme, 0)


def host_of(netloc: str) -> str:
    """The host of ``host[:port]`` (brackets dropped from an IPv6 literal), lower case."""
    return (urllib.parse.urlsplit(f"//{netloc}").hostname or "").lower()


def realm_refusal(realm: str, registry: str, insecure: bool, named: set[str]) -> str | None:
    """Why a token service at ``realm`` may not have the registry's login (None: it may).
    Over https, on the registry's host or a host (or host:port) the docker config names; over
    plain HTTP only on the registry's own host, with ``--insecure`` (a loopback registry)."""
    scheme, host, port = origin(realm)
    same = host == host_of(registry)
    if scheme == "https":
        if same or host in named or f"{host}:{port}" in named:
            return None
        return "on another host that the docker config does not name"
    if scheme == "http" and insecure and same:
        return None
    return "over plain HTTP" if scheme == "http" else f"over {scheme or 'no scheme'}"


# --------------------------------------------------------------------------- the deadline

_current = threading.local()  # the Deadline of the request this thread is sending


class Deadline:
    """One request's watchdog: when ``seconds`` pass before ``cancel``, the socket the request
    went out on is shut down (a read in progress there returns at once) and ``fired`` is set."""

    def __init__(self, seconds: float) -> None:
        self.fired = False
        self._conn: Any = None
        self._sock: Any = None
        self._lock = threading.Lock()
        self._timer = threading.Timer(seconds, self._fire)
        self._timer.daemon = True
        self._timer.start()

    def attach(self, conn: Any) -> None:
        """The connection the request goes out on (its socket, once connected: http.client lets
        go of it when the answer closes the connection, while the answer still reads it)."""
        with self._lock:
            self._conn = conn
            conn.cachectl_deadline = self
            self._sock = conn.sock or self._sock
        if self.fired:
            self._fire()

    def cancel(self) -> None:
        self._timer.cancel()
        with self._lock:
            self._conn = None

    def _fire(self) -> None:
        with self._lock:
            self.fired = True
            conn, sock = self._conn, self._sock
            # Only while the connection is still this request's: a pooled one may carry another.
            if sock is None or getattr(conn, "cachectl_deadline", None) is not self:
                return
        with contextlib.suppress(OSError):
            socket.socket.shutdown(sock, socket.SHUT_RDWR)  # the plain socket's, TLS or not


def _attach(conn: Any) -> None:
    deadline = getattr(_current, "deadline", None)
    if deadline is not None:
        deadline.attach(conn)


class _Deadlined:
    """A connection that attaches the current request's deadline when it connects and sends,
    plain or TLS alike (mixed in before urllib3's connection class)."""

    def connect(self) -> None:
        super().connect()  # type: ignore[misc]
        _attach(self)

    def request(self, *args: Any, **kwargs: Any) -> None:
        _attach(self)
        super().request(*args, **kwargs)  # type: ignore[misc]


class _Conn(_Deadlined, HTTPConnection):
    pass


class _TLSConn(_Deadlined, HTTPSConnection):
    pass


class _Pool(HTTPConnectionPool):
    ConnectionCls = _Conn


class _TLSPool(HTTPSConnectionPool):
    ConnectionCls = _TLSConn


class _Adapter(HTTPAdapter):
    def init_poolmanager(self, *args: Any, **kwargs: Any) -> None:
        super().init_poolmanager(*args, **kwargs)
        self.poolmanager.pool_classes_by_scheme = {"http": _Pool, "https": _TLSPool}


def overdue(r: Any) -> bool:
    """Whether ``r``'s deadline passed (its body, or what is left of it, was cut off there)."""
    deadline = getattr(r, "cachectl_deadline", None)
    return bool(deadline is not None and deadline.fired)


def _closing(r: Any, deadline: Deadline) -> None:
    close = r.close

    def close_and_cancel() -> None:
        deadline.cancel()
        close()

    r.close = close_and_cancel


# --------------------------------------------------------------------------- the session


class RegistrySession(requests.Session):
    """The session of one registry (``base``: its scheme://host:port): credentials only to it
    and to the realms ``allow_realm`` admitted, each request whole within ``timeout``."""

    def __init__(self, base: str, timeout: float) -> None:
        super().__init__()
        self.timeout = timeout
        self.trust_env = False  # no proxy from the environment for a registry named here
        self.max_redirects = 5
        self._origin = origin(base)
        self._realms: set[str] = set()
        self._streaming: weakref.WeakSet[Any] = weakref.WeakSet()  # bodies not read yet
        for prefix in ("http://", "https://"):
            self.mount(prefix, _Adapter())

    def allow_realm(self, realm: str) -> None:
        """A token service the login may go to (``realm_refusal`` said so)."""
        self._realms.add(realm.split("?", 1)[0])

    def may_carry_credentials(self, method: str, url: str) -> bool:
        if origin(url) == self._origin:
            return True
        return method.upper() == "GET" and url.split("?", 1)[0] in self._realms

    def close(self) -> None:
        """Every response still open (one an error left unread) closed, then the pool."""
        for r in list(self._streaming):
            r.close()
        super().close()

    def request(self, *args: Any, **kwargs: Any) -> Any:
        kwargs.setdefault("timeout", (min(self.timeout, 10.0), self.timeout))
        return super().request(*args, **kwargs)

    def send(self, request: requests.PreparedRequest, **kwargs: Any) -> Any:
        if "Authorization" in request.headers and not self.may_carry_credentials(
            str(request.method), str(request.url)
        ):
            del request.headers["Authorization"]
        deadline = Deadline(self.timeout)
        _current.deadline = deadline
        try:
            r = super().send(request, **kwargs)
        except requests.RequestException as exc:
            deadline.cancel()
            if deadline.fired:
                raise requests.exceptions.ReadTimeout(str(exc)) from exc
            raise
        except BaseException:
            deadline.cancel()
            raise
        finally:
            _current.deadline = None
        r.cachectl_deadline = deadline  # type: ignore[attr-defined]
        if kwargs.get("stream"):
            _closing(r, deadline)  # the body is still to be read: the watchdog stays
            self._streaming.add(r)
        else:
            deadline.cancel()
        return r


def read_limited(r: Any, limit: int) -> bytes:
    """A response's body, at most ``limit`` + 1 bytes of it taken (one more than allowed tells
    the caller it is too long); the deadline's cut is an exception here, not a short body."""
    body = bytearray()
    raw = r.raw
    try:
        while len(body) <= limit:
            chunk = raw.read(min(64 << 10, limit + 1 - len(body)), decode_content=True)
            if not chunk:
                break
            body += chunk
    except Exception as exc:
        if overdue(r):
            raise requests.exceptions.ReadTimeout(str(exc)) from None
        raise requests.exceptions.ConnectionError(str(exc)) from None
    finally:
        r.close()
    if overdue(r):
        raise requests.exceptions.ReadTimeout("the deadline passed")
    return bytes(body)


def short(exc: BaseException) -> str:
    """An exception's first line, with urllib3's wrapping taken off."""
    text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    m = re.search(r"\[Errno -?\d+\] ([^'\")]+)|Caused by \w+\('?([^'\")]+)", text)
    text = next((g for g in (m.groups() if m else ()) if g), text)
    return text[:160]
