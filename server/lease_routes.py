"""The compile lease for a process in server mode: the calls cachectl/index/compile_leases.py
runs on an index a process opens, run here on the server's index
(cachectl/service/compile_lease.py ``RemoteLessor`` is the client).

Reading the lease (look, recorded) needs the reader role; taking, renewing, hedging,
finishing and releasing one need the writer role: only a process that may write the cache compiles for others.
"""

from __future__ import annotations

from fastapi import APIRouter, HTTPException
from fastapi.responses import JSONResponse

from cachectl.core.errors import BadInput
from cachectl.index import compile_leases as q

from . import responses as out
from . import schemas
from .api import CacheName, Digest
from .auth import route
from .deps import CurrentToken, StateDep
from .responses import errors, ok
from .state import ServerState

router = APIRouter(prefix="/api/v1")

PATH = "/caches/{cache}/environments/{digest}/compile-lease"
WRITES = ("take", "renew", "hedge", "finish", "release")


def _need(value: str | None, name: str) -> str:
    if not value:
        raise BadInput(f"this compile-lease call needs {name!r}")
    return value


def _runner(state: ServerState) -> q.Runner:
    runner = q.runner_for(state.index)
    if runner is None:  # the server's index is always SQL; a guard for the type checker
        raise HTTPException(503, "the server's index runs no SQL")
    return runner


@route(
    router,
    "POST",
    PATH,
    role="writer",
    summary="Take, renew, hedge, finish or release a program's compile lease",
    response_model=out.CompileLeaseOut,
    responses=errors(400, 404),
)
def compile_lease(
    state: StateDep,
    token: CurrentToken,
    cache: CacheName,
    digest: Digest,
    body: schemas.CompileLeaseIn,
) -> JSONResponse:
    if body.action not in WRITES:
        raise BadInput(f"{body.action!r} is a read: POST it to {PATH}/read")
    env = state.where(cache, digest)[1]
    runner, scope = _runner(state), f"{cache}/{env.digest}"
    key, holder = _need(body.key, "key"), _need(body.holder, "holder")
    result: object
    if body.action == "take":
        got = q.take(
            runner,
            scope,
            key,
            holder,
            ttl_s=body.ttl_s,
            module=body.module,
            stale_sha256=body.stale,
        )
        result = got.to_json() if got else None
    elif body.action == "renew":
        result = q.renew(runner, scope, key, holder, ttl_s=body.ttl_s)
    elif body.action == "hedge":
        result = q.hedge(runner, scope, key, holder)
    elif body.action == "release":
        result = q.release(runner, scope, key, holder)
    else:
        q.finish(runner, scope, key, holder, sha256=body.sha256, compile_ms=body.compile_ms)
        result = True
    return ok({"result": result})


@route(
    router,
    "POST",
    PATH + "/read",
    role="reader",
    summary="Read a program's compile lease, or the longest compile recorded for a module",
    response_model=out.CompileLeaseOut,
    responses=errors(400, 404),
)
def read_compile_lease(
    state: StateDep,
    token: CurrentToken,
    cache: CacheName,
    digest: Digest,
    body: schemas.CompileLeaseIn,
) -> JSONResponse:
    if body.action not in ("look", "recorded"):
        raise BadInput(f"{body.action!r} is a write: POST it to {PATH}")
    env = state.where(cache, digest)[1]
    runner = _runner(state)
    if body.action == "recorded":
        module = _need(body.module, "module")
        return ok(
            {"result": q.recorded_ms(runner, f"{cache}/{env.digest}", cache, env.digest, module)}
        )
    seen = q.look(runner, f"{cache}/{env.digest}", _need(body.key, "key"))
    return ok({"result": seen.to_json() if seen else None})
