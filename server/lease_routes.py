"""The compile lease for a process in server mode: the calls cachectl/index/compile_leases.py
runs on an index a process opens, run here on the server's index
(cachectl/service/compile_lease.py ``RemoteLessor`` is the client).

Reading the lease (look, recorded) needs the reader role; taking, renewing, hedging and
finishing one need the writer role: only a process that may write the cache compiles for others.
"""

from __future__ import annotations

from typing import Annotated, Literal

from fastapi import APIRouter, HTTPException, Path

from cachectl.core.errors import BadInput
from cachectl.index import compile_leases as q

from . import responses as out
from . import schemas
from .api import CacheName, Digest
from .auth import check_cache, route
from .deps import CurrentToken, StateDep
from .responses import errors, ok

router = APIRouter(prefix="/api/v1")

Action = Literal["take", "look", "renew", "hedge", "finish", "recorded"]
READS = ("look", "recorded")


def _need(value: str | None, name: str) -> str:
    if not value:
        raise BadInput(f"this compile-lease call needs {name!r}")
    return value


@route(
    router,
    "POST",
    "/caches/{cache}/environments/{digest}/compile-lease/{action}",
    role="reader",
    summary="Take, read, renew, hedge or finish a program's compile lease",
    response_model=out.CompileLeaseOut,
    responses=errors(400, 404),
)
def compile_lease(
    state: StateDep,
    token: CurrentToken,
    cache: CacheName,
    digest: Digest,
    action: Annotated[Action, Path()],
    body: schemas.CompileLeaseIn,
) -> object:
    if action not in READS:
        check_cache(token, "writer", cache)
    env = state.where(cache, digest)[1]
    runner = q.runner_for(state.index)
    if runner is None:  # the server's index is always SQL; a guard for the type checker
        raise HTTPException(503, "the server's index runs no SQL")
    scope = f"{cache}/{env.digest}"
    result: object
    if action == "recorded":
        result = q.recorded_ms(runner, scope, cache, env.digest, _need(body.module, "module"))
    else:
        key = _need(body.key, "key")
        if action == "look":
            seen = q.look(runner, scope, key)
            result = seen.to_json() if seen else None
        else:
            holder = _need(body.holder, "holder")
            if action == "take":
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
            elif action == "renew":
                result = q.renew(runner, scope, key, holder, ttl_s=body.ttl_s)
            elif action == "hedge":
                result = q.hedge(runner, scope, key, holder)
            else:
                q.finish(runner, scope, key, holder, sha256=body.sha256, compile_ms=body.compile_ms)
                result = True
    return ok({"result": result})
