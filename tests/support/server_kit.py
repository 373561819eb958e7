"""Helpers for the server tests: a seeded index, tokens of every kind, a live uvicorn server.

Everything is real: the FastAPI app from create_app(), SQLite or PostgreSQL,
storage through cachectl.storage.store, uvicorn on 127.0.0.1.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import timedelta

import httpx
from sqlalchemy import update

from cachectl.core.fingerprint import Environment
from cachectl.index import NewEntry, open_index
from cachectl.index.models import Token, utcnow
from cachectl.storage.entries import make_entry, sha256
from cachectl.storage.namespace import ensure_namespace
from cachectl.storage.store import Store
from cachectl.trust import tokens
from support.environments import fake_env

MAIN = "main"
OTHER = "other"


def entry_key(module: str, n: int) -> str:
    return f"{module}-{sha256(f'{module}-{n}'.encode())}"


@dataclass
class Seed:
    db: str
    root: str
    other_root: str
    env: Environment
    digest: str
    keys: list[str]
    entry_bytes: dict[str, bytes]
    tokens: dict[str, str] = field(default_factory=dict)


IDENTITIES = (
    "reader",
    "writer",
    "admin",
    "scoped_writer",
    "wrong_scope_admin",
    "wrong_scope_reader",
    "expired",
    "revoked",
)


def seed(db: str, root: str, other_root: str, *, entries: int = 3, entry_size: int = 2000) -> Seed:
    """Two caches, one environment with ``entries`` real-format entries in ``main``, and tokens:

    reader/writer/admin (unscoped), scoped_writer (main), wrong_scope_admin and
    wrong_scope_reader (other), expired (admin, expiry in the past), revoked (admin).
    """
    index = open_index(db)
    try:
        index.add_cache(MAIN, Store(root).url)
        index.add_cache(OTHER, Store(other_root).url)
        env = fake_env()
        store = Store(root)
        ensure_namespace(store, env)
        info = index.ensure_environment(MAIN, env)
        keys, blobs, new = [], {}, []
        for n in range(entries):
            key = entry_key("jit_step" if n % 2 else "jit_train", n)
            data = make_entry(bytes([n % 251]) * entry_size + key.encode(), compile_seconds=n + 1)
            store.write_bytes(f"{env.namespace}/{key}-cache", data)
            keys.append(key)
            blobs[key] = data
            new.append(
                NewEntry(
                    key=key,
                    module=key.rsplit("-", 1)[0],
                    size=len(data),
                    sha256=sha256(data),
                    origin="warm",
                    compile_time_ms=(n + 1) * 1000,
                    function="train" if n % 2 == 0 else "step",
                )
            )
        index.upsert_entries(info.id, new)
        result = Seed(db, store.url, Store(other_root).url, env, env.digest, keys, blobs)
        made = {
            "reader": tokens.create_token(index, "reader", "reader"),
            "writer": tokens.create_token(index, "writer", "writer"),
            "admin": tokens.create_token(index, "admin", "admin"),
            "scoped_writer": tokens.create_token(index, "scoped-writer", "writer", [MAIN]),
            "wrong_scope_admin": tokens.create_token(index, "other-admin", "admin", [OTHER]),
            "wrong_scope_reader": tokens.create_token(index, "other-reader", "reader", [OTHER]),
            "expired": tokens.create_token(index, "expired", "admin", expires_in=timedelta(days=1)),
            "revoked": tokens.create_token(index, "revoked", "admin"),
        }
        tokens.revoke_token(index, "revoked")
        with index.session() as s:
            s.execute(
                update(Token)
                .where(Token.name == "expired")
                .values(expires_at=utcnow() - timedelta(hours=1))
            )
        result.tokens = {name: created.token for name, created in made.items()}
        return result
    finally:
        index.close()


def bearer(token: str | None) -> dict[str, str]:
    return {"authorization": f"Bearer {token}"} if token else {}


class LiveServer:
    """A real uvicorn server for an app, in a thread of this process, on a free loopback port."""

    def __init__(self, app, *, port: int = 0) -> None:
        import uvicorn

        from cachectl_server.http_edge import bounded_http
        from support.infra import free_port

        self.port = port or free_port()
        config = uvicorn.Config(
            app,
            host="127.0.0.1",
            port=self.port,
            log_level="warning",
            access_log=False,
            lifespan="on",
            log_config=None,
            http=bounded_http(app.state.cachectl.settings),  # as `cachectl serve` runs it
        )
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, name="uvicorn-test", daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> LiveServer:
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=20)


@contextlib.contextmanager
def served(db: str, **settings: object) -> Iterator[tuple[LiveServer, httpx.Client]]:
    """A live server over ``db`` (create_app with these settings) and a client of it."""
    from cachectl_server.app import create_app
    from cachectl_server.config import ServerSettings

    app = create_app(ServerSettings(db=db, **settings))  # type: ignore[arg-type]
    try:
        with LiveServer(app) as live, httpx.Client(base_url=live.url, timeout=30) as client:
            yield live, client
    finally:
        app.state.cachectl.jobs.shutdown()
        app.state.cachectl.index.close()


def read_until_closed(sock: socket.socket, timeout: float) -> bytes:
    """What the server wrote before it closed the connection (or until ``timeout``)."""
    sock.settimeout(timeout)
    data = b""
    with contextlib.suppress(OSError):
        while chunk := sock.recv(65536):
            data += chunk
    return data
