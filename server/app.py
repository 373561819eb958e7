"""The FastAPI app factory: ``create_app(settings | db_url)``.

Tests build apps with it directly (TestClient) or through ``cachectl serve``
(uvicorn); deployments run several replicas of the same factory over one
PostgreSQL index. All state that matters is in the index.
"""

from __future__ import annotations

import gc
import logging
import os
import signal
import socket
import stat
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import AbstractAsyncContextManager, asynccontextmanager, contextmanager, suppress
from typing import Any

from fastapi import FastAPI, Request
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse
from starlette.concurrency import run_in_threadpool
from starlette.types import Receive, Scope, Send

from cachectl import __version__
from cachectl.core.errors import (
    BadInput,
    CachectlError,
    NotFound,
    http_status,
)
from cachectl.index import open_index
from cachectl.lifecycle import sweep

from . import admin, api, dashboard, entry_routes, executable_routes, health, lease_routes
from .auth import PUBLIC, ROLE_KEY, hides_caches
from .config import WORKER_LOG_LEVEL_ENV, WORKER_SETTINGS_ENV, ServerSettings, settings_from_env
from .fast_lane import ByteFastLane
from .jobs import JobRunner
from .limits import BodyGuard
from .maintenance import Scheduler
from .metrics import Metrics, MetricsMiddleware
from .state import ServerState

log = logging.getLogger("cachectl.server")


def _openapi(app: FastAPI) -> dict[str, Any]:
    """OpenAPI with a bearer scheme on every non-public operation."""
    if app.openapi_schema:
        return app.openapi_schema
    schema = get_openapi(
        title=app.title, version=app.version, description=app.description, routes=app.routes
    )
    schema.setdefault("components", {}).setdefault("securitySchemes", {})["bearer"] = {
        "type": "http",
        "scheme": "bearer",
        "description": "A token from `cachectl token create`",
    }
    for methods in schema.get("paths", {}).values():
        for operation in methods.values():
            if isinstance(operation, dict) and operation.get(ROLE_KEY, PUBLIC) != PUBLIC:
                operation["security"] = [{"bearer": []}]
    app.openapi_schema = schema
    return schema


def freeze_startup_heap() -> int:
    """Take what is alive before the first request (modules, the app, SQLAlchemy's mappers) out of
    the garbage collector's scans, for a server process; returns how many objects that is.

    Under load the collector runs a full collection about once a second, and it scanned all of it
    with the event loop stopped: that pause was POST telemetry's p99 at 16 clients (BENCHMARKS.md).
    Frozen, a full collection scans only what requests made. Not for test processes
    that build many apps: frozen objects are never collected."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


def _lifespan(state: ServerState) -> Callable[[FastAPI], AbstractAsyncContextManager[None]]:
    """Startup and shutdown: stale spool files swept, the maintenance timer, the job workers."""

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        # Spool files of uploads a killed server never finished (never a live server's).
        swept = await run_in_threadpool(sweep.sweep_spool, state.settings.upload_dir)
        if swept:
            log.info("removed %d spool file(s) of uploads whose server is gone", swept)
        if state.maintenance is not None:
            state.maintenance.start()
        try:
            yield
        finally:
            if state.maintenance is not None:
                state.maintenance.stop()
            state.jobs.shutdown()

    return lifespan


async def library_error(request: Request, exc: Exception) -> JSONResponse:
    """A library error as its HTTP status (cachectl.core.errors.ERRORS), with its class named."""
    if not isinstance(exc, CachectlError):  # registered for CachectlError only
        return await unexpected(request, exc)
    token = getattr(request.state, "token", None)
    if (
        isinstance(exc, NotFound)
        and token is not None
        and await run_in_threadpool(hides_caches, request, token)
    ):
        # A scoped token's cache is gone: 403, and never the list of caches the 404 names.
        return JSONResponse(
            {
                "detail": f"token {token.name!r} (role {token.role}) may not act on cache "
                f"{request.path_params.get('cache')!r}: it does not exist (any more)",
                "error": "PermissionDenied",
            },
            status_code=403,
        )
    return JSONResponse(
        {"detail": exc.message, "error": type(exc).__name__}, status_code=http_status(exc)
    )


async def unexpected(_request: Request, exc: Exception) -> JSONResponse:
    """Anything else: logged with its traceback, answered without it."""
    log.error("unhandled %s", type(exc).__name__, exc_info=exc)
    return JSONResponse(
        {"detail": f"internal error ({type(exc).__name__}); see the server log"},
        status_code=500,
    )


def _state(settings: ServerSettings) -> ServerState:
    """The app's state over a freshly opened index, with its job workers and maintenance timer."""
    index = open_index(settings.db)
    state = ServerState(settings, index, Metrics(index))
    state.jobs = JobRunner(state, settings.job_workers)
    if settings.maintenance_interval_s:
        state.maintenance = Scheduler(
            state,
            settings.maintenance_interval_s,
            initial_delay_s=settings.maintenance_initial_delay_s,
        )
    return state


class CachectlApp(FastAPI):
    """FastAPI whose GETs and HEADs of stored bytes are offered to server/fast_lane.py first,
    outside the middleware stack (the lane counts and logs what it answers itself)."""

    fast_lane: ByteFastLane | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        lane = self.fast_lane
        if lane is not None and scope["type"] == "http" and scope["method"] in ("GET", "HEAD"):
            scope["app"] = self
            if await lane.answer(scope, receive, send):
                return
        await super().__call__(scope, receive, send)


def create_app(
    settings: ServerSettings | str, *, byte_fast_lane: bool = True, **overrides: Any
) -> FastAPI:
    """Build the app over the index at ``settings.db`` (or a bare index URL).

    ``byte_fast_lane=False`` leaves every request to FastAPI's routing (server/fast_lane.py: the
    tests compare the two)."""
    if isinstance(settings, str):
        settings = ServerSettings(db=settings)
    settings = settings.with_overrides(**overrides)
    state = _state(settings)
    app = CachectlApp(
        title="cachectl",
        version=__version__,
        description="Shared JAX persistent compilation caches over HTTP: the cachectl library behind tokens.",
        lifespan=_lifespan(state),
        # The spec is at /openapi.json; FastAPI's /docs and /redoc pages load scripts from a CDN.
        docs_url=None,
        redoc_url=None,
    )
    app.state.cachectl = state
    app.add_exception_handler(CachectlError, library_error)
    app.add_exception_handler(Exception, unexpected)
    # Routes match in order: the entry byte routes (most of a fleet's requests) first.
    app.include_router(health.router)
    app.include_router(entry_routes.router)
    app.include_router(executable_routes.router)
    app.include_router(api.router)
    app.include_router(lease_routes.router)
    app.include_router(admin.router)
    app.include_router(dashboard.router)
    app.openapi = lambda: _openapi(app)  # type: ignore[method-assign]
    if byte_fast_lane:
        app.fast_lane = ByteFastLane(state=state, library_error=library_error)
    app.add_middleware(
        BodyGuard, settings=settings
    )  # inside metrics: its 401s and 413s are counted
    app.add_middleware(MetricsMiddleware, metrics=state.metrics)
    return app


def worker_app() -> FastAPI:
    """The app factory of `cachectl serve --workers N` (uvicorn imports it in each worker): the
    settings the command resolved, from the environment (server/config.py ``settings_from_env``)."""
    settings = settings_from_env()
    if settings is None:
        raise RuntimeError(f"{WORKER_SETTINGS_ENV} is not set: start workers with cachectl serve")
    level = os.environ.get(WORKER_LOG_LEVEL_ENV, "INFO")
    logging.basicConfig(
        level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s", force=True
    )
    app = create_app(settings)
    freeze_startup_heap()
    return app


UDS_MODE = 0o660  # owner and group may connect (nginx in the group); never every user


def unix_listener(path: str) -> socket.socket:
    """A listening unix socket at ``path``, created 0660 less the umask (uvicorn's own ``uds=``
    makes it 0666 for a moment, or for good). A dead server's socket is replaced; a live one, or
    any other file, is refused, never removed."""
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        raise BadInput(f"--uds {path}: directory {parent} does not exist: create it first")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise BadInput(
            f"--uds {path}: directory {parent} is not writable by this user: pick another"
        )
    if len(os.fsencode(path)) > 107:
        raise BadInput(f"--uds {path}: a unix socket path is at most 107 bytes: use a shorter one")
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        mode = None
    if mode is not None:
        if not stat.S_ISSOCK(mode):
            raise BadInput(
                f"--uds {path}: exists and is not a socket: remove it or pick another path"
            )
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
            try:
                probe.connect(path)
            except OSError:
                os.unlink(path)  # nobody listens: a stopped server's leftover
            else:
                raise BadInput(
                    f"--uds {path}: a server already listens there: stop it or pick another"
                )
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old = os.umask(0o077)
    os.umask(old | (0o777 & ~UDS_MODE))  # the caller's umask, and never o+rwx
    try:
        sock.bind(path)
    except OSError as exc:
        sock.close()
        raise BadInput(f"--uds {path}: cannot listen there ({exc.strerror})") from exc
    finally:
        os.umask(old)
    sock.listen(2048)
    return sock


class _Stopped(BaseException):
    """SIGTERM, re-raised by uvicorn after its graceful shutdown."""


@contextmanager
def listening_on(path: str) -> Iterator[socket.socket]:
    """``unix_listener(path)``, closed and its file removed however the server stops: uvicorn
    re-raises SIGTERM once it has shut down, which would end the process before a ``finally``
    ran. The process still ends by SIGTERM afterwards, as it does on a TCP port."""
    sock = unix_listener(path)
    stopped: list[int] = []

    def on_term(signum: int, _frame: object) -> None:
        stopped.append(signum)
        raise _Stopped

    previous = signal.signal(signal.SIGTERM, on_term)
    try:
        yield sock
    except _Stopped:
        pass
    finally:
        signal.signal(signal.SIGTERM, previous)
        sock.close()
        with suppress(FileNotFoundError):
            os.unlink(path)
    if stopped:
        signal.raise_signal(signal.SIGTERM)
