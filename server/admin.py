"""The admin part of /api/v1: prune, gc and verify as jobs, and tokens.

Split from server/api.py; the same shape: a few lines over a library call (server/jobs.py runs
the jobs), the response's model named on each route (server/responses.py).
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Path, Query
from fastapi.responses import JSONResponse

from cachectl.core.errors import BadInput
from cachectl.core.units import parse_duration, parse_size
from cachectl.index import server_queries as sq
from cachectl.lifecycle import prune as prune_lib
from cachectl.trust import tokens
from cachectl.trust.tokens import TokenInfo

from . import responses as out
from . import schemas
from .api import CacheName, actor
from .auth import check_cache, forbidden, route
from .deps import CurrentToken, StateDep
from .responses import errors, ok
from .state import ServerState

router = APIRouter(prefix="/api/v1")
JobId = Annotated[str, Path(max_length=36, pattern=r"^[0-9a-f-]+$")]

# -- jobs -----------------------------------------------------------------------------

JOB_ROUTE: dict[str, Any] = {
    "role": "admin",
    "status_code": 202,
    "response_model": out.JobOut,
    "responses": errors(400, 404, 409),
}


def _job_response(
    state: ServerState, token: TokenInfo, cache: str, kind: str, params: dict[str, Any]
) -> JSONResponse:
    state.index.get_cache(cache)
    job = state.jobs.submit(cache, kind, params, actor=actor(token))
    return ok(job, 202)


@route(router, "POST", "/caches/{cache}/prune", summary="Start a prune job", **JOB_ROUTE)
def prune_job(
    state: StateDep, token: CurrentToken, cache: CacheName, body: schemas.PruneParams
) -> JSONResponse:
    params = body.model_dump()
    prune_lib.criteria(
        **{k: v for k, v in params.items() if k != "dry_run"}
    )  # bad selectors: 400 now
    return _job_response(state, token, cache, "prune", params)


@route(router, "POST", "/caches/{cache}/gc", summary="Start a gc job", **JOB_ROUTE)
def gc_job(
    state: StateDep, token: CurrentToken, cache: CacheName, body: schemas.GcParams
) -> JSONResponse:
    if body.max_size is not None and parse_size(body.max_size) <= 0:
        raise BadInput(f"--max-size must be positive, got {body.max_size!r}")
    return _job_response(state, token, cache, "gc", body.model_dump())


@route(router, "POST", "/caches/{cache}/verify", summary="Start a verify job", **JOB_ROUTE)
def verify_job(
    state: StateDep, token: CurrentToken, cache: CacheName, body: schemas.VerifyParams
) -> JSONResponse:
    if body.min_age is not None and body.min_age.strip() not in ("0", ""):
        parse_duration(body.min_age)  # a bad duration: 400 now, not a failed job later
    return _job_response(state, token, cache, "verify", body.model_dump())


@route(
    router,
    "GET",
    "/jobs/{job_id}",
    role="admin",
    scope="object",
    summary="A job's progress and result",
    response_model=out.JobOut,
    responses=errors(404),
)
def get_job(state: StateDep, token: CurrentToken, job_id: JobId) -> JSONResponse:
    job = sq.get_job(state.index, job_id)
    if not token.allows("admin", job.cache):  # object scope: the job's cache
        raise forbidden(token, f"see jobs of cache {job.cache!r}")
    return ok(job)


@route(
    router,
    "GET",
    "/jobs",
    role="admin",
    scope="any",
    summary="Recent jobs, newest first",
    response_model=out.list_of(out.JobOut),
)
def list_jobs(
    state: StateDep,
    token: CurrentToken,
    cache: Annotated[str | None, Query(max_length=128)] = None,
    limit: Annotated[int, Query(ge=1, le=500)] = 50,
) -> JSONResponse:
    if cache is not None:
        check_cache(token, "admin", cache)
    return ok(sq.list_jobs(state.index, cache=cache, caches=token.caches, limit=limit))


# -- tokens ----------------------------------------------------------------------------


@route(
    router,
    "GET",
    "/tokens",
    role="admin",
    scope="global",
    summary="Tokens (never their secrets)",
    response_model=out.list_of(out.TokenOut),
)
def list_tokens(state: StateDep) -> JSONResponse:
    return ok(tokens.list_tokens(state.index))


@route(
    router,
    "POST",
    "/tokens",
    role="admin",
    scope="global",
    status_code=201,
    summary="Create a token; the secret is in this response only",
    response_model=out.CreatedTokenOut,
    responses=errors(400),
)
def create_token(state: StateDep, token: CurrentToken, body: schemas.TokenCreate) -> JSONResponse:
    expires = parse_duration(body.expires) if body.expires else None
    created = tokens.create_token(state.index, body.name, body.role, body.caches, expires)
    state.index.audit(
        "token-create",
        cache=None,
        details={"name": body.name, "role": body.role, "caches": body.caches},
        who=actor(token),
    )
    return ok(created, 201)


@route(
    router,
    "DELETE",
    "/tokens/{name}",
    role="admin",
    scope="global",
    summary="Revoke a token",
    response_model=out.TokenOut,
    responses=errors(404),
)
def revoke_token(
    state: StateDep, token: CurrentToken, name: Annotated[str, Path(max_length=128)]
) -> JSONResponse:
    info = tokens.revoke_token(state.index, name)
    state.changed()  # refused by this replica from the next request on
    state.index.audit("token-revoke", cache=None, details={"name": name}, who=actor(token))
    return ok(info)
