"""The versioned JSON API (/api/v1): the library's operations, behind tokens.

Every handler is a few lines over a library function; responses are the
library's own dataclasses through ``to_jsonable``, so the CLI's client can
rebuild them and print exactly what direct mode prints.
"""

from __future__ import annotations

import time
from typing import Annotated, Any

from fastapi import APIRouter, HTTPException, Path, Query, Request
from fastapi.responses import JSONResponse, Response
from starlette.concurrency import run_in_threadpool

from cachectl.core.errors import BadInput, NotFound
from cachectl.core.jsonable import REDACTED, to_jsonable
from cachectl.core.units import parse_duration, parse_size
from cachectl.index import EnvironmentInfo, warm_runs
from cachectl.index import server_queries as sq
from cachectl.index.telemetry_queries import record_telemetry, telemetry_stats
from cachectl.lifecycle import prune as prune_lib
from cachectl.storage.namespace import ensure_namespace
from cachectl.telemetry import FunctionCounts, ServingCounts, SignatureCounts, TelemetryBatch
from cachectl.trust import tokens
from cachectl.trust.caches import looks_secret, set_cache
from cachectl.usage import inventory

from . import schemas
from .auth import check_cache, current_token, forbidden, identify, route
from .state import ServerState

router = APIRouter(prefix="/api/v1")

CacheName = Annotated[str, Path(min_length=1, max_length=128)]
# No patterns on names and digests: the library validates them with the messages
# direct mode prints (the CLI's client shows the same text); both only ever
# match index rows, never build paths.
Digest = Annotated[
    str,
    Path(
        min_length=1,
        max_length=64,
        description="An environment digest or a unique prefix of one (hex).",
    ),
]
AUDITABLE = ("warm", "push", "sync")


def state_of(request: Request) -> ServerState:
    return request.app.state.cachectl


_SECRET_WORDS = ("key", "secret", "token", "password", "credential", "auth", "session")


def redact_secrets(value: Any, inside_options: bool = False) -> Any:
    """Storage options may hold credentials: their secret-looking values never leave the server,
    whether the key says so or the value does (a URL with user:password@ in it)."""
    if isinstance(value, dict):
        out = {}
        for k, v in value.items():
            if inside_options and (
                any(w in str(k).lower() for w in _SECRET_WORDS) or looks_secret(str(k), v)
            ):
                out[k] = REDACTED  # the client drops these and uses its own credentials
            else:
                out[k] = redact_secrets(v, inside_options or k == "storage_options")
        return out
    if isinstance(value, list):
        return [
            REDACTED
            if inside_options and looks_secret("", v)
            else redact_secrets(v, inside_options)
            for v in value
        ]
    return value


def ok(value: Any, status: int = 200) -> JSONResponse:
    return JSONResponse(redact_secrets(to_jsonable(value)), status_code=status)


def _actor(request: Request) -> str:
    return f"token:{current_token(request).name}"


def _environment(state: ServerState, cache: str, digest: str) -> EnvironmentInfo:
    """The environment (without totals) by digest or unique prefix: one query."""
    return state.where(cache, digest)[1]


# -- caches -----------------------------------------------------------------------


@route(
    router,
    "GET",
    "/caches",
    role="reader",
    scope="any",
    summary="List caches (those in the token's scope)",
)
def list_caches(request: Request) -> JSONResponse:
    token = current_token(request)
    caches = [c for c in state_of(request).index.list_caches() if token.allows("reader", c.name)]
    return ok(caches)


@route(router, "GET", "/caches/{cache}", role="reader", summary="One cache and its policy")
def get_cache(request: Request, cache: CacheName) -> JSONResponse:
    return ok(state_of(request).index.get_cache(cache))


@route(router, "PATCH", "/caches/{cache}", role="admin", summary="Change a cache's policy")
def update_policy(request: Request, cache: CacheName, body: schemas.PolicyUpdate) -> JSONResponse:
    state = state_of(request)
    policy: dict[str, Any] = {}
    for name in ("max_size", "max_entry_size", "env_max_size"):
        value = getattr(body, name)
        if value is not None:
            policy[name] = parse_size(value)
    if body.retention is not None:
        seconds = (
            body.retention
            if isinstance(body.retention, int)
            else parse_duration(body.retention).total_seconds()
        )
        policy["retention_seconds"] = int(seconds)
    if body.keep_versions is not None:
        policy["keep_versions"] = body.keep_versions
    if body.service_writes is not None:
        policy["service_writes"] = body.service_writes
    if not policy:
        raise BadInput(
            "no policy field given: set max_size, max_entry_size, env_max_size, retention, "
            "keep_versions or service_writes"
        )
    state.index.get_cache(cache)  # 404 for an unknown cache (set_cache would create 'default')
    info = set_cache(state.ctx, cache, **policy)
    state.changed()  # this replica applies the new policy from the next request on
    state.index.audit(
        "cache-set", cache=cache, details={k: v for k, v in policy.items()}, who=_actor(request)
    )
    return ok(info)


@route(
    router,
    "GET",
    "/caches/{cache}/stats",
    role="reader",
    summary="Totals for a cache and its environments",
)
def cache_stats(request: Request, cache: CacheName) -> JSONResponse:
    state = state_of(request)
    return ok(inventory.cache_totals(state.ctx, [state.index.get_cache(cache)])[0])


@route(
    router,
    "GET",
    "/caches/{cache}/telemetry",
    role="reader",
    summary="Hit rates per environment and function",
)
def cache_telemetry(
    request: Request,
    cache: CacheName,
    since: Annotated[str, Query(max_length=16, description="Window, e.g. 24h, 7d")] = "7d",
) -> JSONResponse:
    return ok(telemetry_stats(state_of(request).index, cache, parse_duration(since)))


@route(
    router,
    "GET",
    "/caches/{cache}/audit",
    role="admin",
    summary="The cache's audit log, newest first",
)
def audit_log(
    request: Request, cache: CacheName, limit: Annotated[int, Query(ge=1, le=1000)] = 100
) -> JSONResponse:
    state = state_of(request)
    state.index.get_cache(cache)
    return ok(state.index.audit_log(cache, limit=limit))


@route(
    router,
    "POST",
    "/caches/{cache}/audit",
    role="writer",
    status_code=201,
    summary="Record a writer's own operation (warm, push, sync) in the audit log",
)
def append_audit(request: Request, cache: CacheName, record: schemas.AuditIn) -> JSONResponse:
    state = state_of(request)
    state.index.get_cache(cache)
    if record.operation not in AUDITABLE:
        raise BadInput(
            f"operation {record.operation!r} cannot be reported: use one of {', '.join(AUDITABLE)}"
        )
    who = f"{record.actor or 'client'} via {_actor(request)}"
    state.index.audit(
        record.operation,
        cache=cache,
        entries=record.entries,
        nbytes=record.bytes,
        duration_ms=record.duration_ms,
        details=record.details,
        who=who,
    )
    return ok({"recorded": True}, 201)


# -- environments -------------------------------------------------------------------


@route(
    router,
    "GET",
    "/caches/{cache}/environments",
    role="reader",
    summary="Environments with entries and bytes",
)
def list_environments(
    request: Request, cache: CacheName, include_deleted: bool = False
) -> JSONResponse:
    state = state_of(request)
    state.index.get_cache(cache)
    return ok(state.index.environment_stats(cache, include_deleted=include_deleted))


@route(
    router,
    "GET",
    "/caches/{cache}/environments/{digest}",
    role="reader",
    summary="One environment, by digest or unique prefix",
)
def get_environment(request: Request, cache: CacheName, digest: Digest) -> JSONResponse:
    state = state_of(request)
    state.index.get_cache(cache)  # unknown cache: 404 naming it
    return ok(state.index.find_environment(cache, digest))  # with its totals


@route(
    router,
    "POST",
    "/caches/{cache}/resolve",
    role="reader",
    summary="Fingerprint -> namespace URL; writers create the environment",
)
def resolve(request: Request, cache: CacheName, body: schemas.ResolveRequest) -> JSONResponse:
    state = state_of(request)
    token = current_token(request)
    env = body.environment()
    if body.digest is not None and body.digest != env.digest:
        raise HTTPException(
            422,
            f"digest {body.digest[:16]} does not match the fingerprint's fields ({env.digest[:16]})",
        )
    writer = token.allows("writer", cache)
    created = False
    record: EnvironmentInfo | None = None
    if writer and body.create:
        info = state.index.get_cache(cache)
        store = state.store(info)
        ensure_namespace(store, env, group=info.group)
        record = state.index.ensure_environment(cache, env)
        created = True
    else:
        try:
            info, record = state.where(cache, env.digest)
        except NotFound:
            info = state.index.get_cache(cache)  # NotFound for an unknown cache
        store = state.store(info)
    return ok(
        {
            "cache": cache,
            "digest": env.digest,
            "namespace": env.namespace,
            "url": store.url_for(env.namespace),
            "exists": record is not None,
            "created": created,
            "environment": record,
            "readonly": not writer or info.effective_service_writes == "deny",
            "entries_url": f"/api/v1/caches/{cache}/environments/{env.digest}/entries",
        }
    )


# -- entries (listing and registration; bytes are in server/entries.py) ------------------


@route(
    router,
    "GET",
    "/caches/{cache}/environments/{digest}/entries",
    role="reader",
    summary="An environment's entries: filters and pagination",
)
def list_entries(
    request: Request,
    cache: CacheName,
    digest: Digest,
    limit: Annotated[int, Query(ge=1, le=5000)] = 100,
    offset: Annotated[int, Query(ge=0, le=2**31)] = 0,
    module: Annotated[str | None, Query(max_length=512)] = None,
    function: Annotated[str | None, Query(max_length=256)] = None,
    origin: Annotated[str | None, Query(max_length=16)] = None,
    key_prefix: Annotated[str | None, Query(max_length=512)] = None,
    unused_for: Annotated[str | None, Query(max_length=16, description="e.g. 30d")] = None,
    order: Annotated[str, Query(pattern="^(key|-created|-size|-hits)$")] = "key",
) -> JSONResponse:
    state = state_of(request)
    env = _environment(state, cache, digest)
    unused_since = sq.utcnow() - parse_duration(unused_for) if unused_for else None
    page = sq.entries_page(
        state.index,
        env.id,
        limit=limit,
        offset=offset,
        module=module,
        function=function,
        origin=origin,
        key_prefix=key_prefix,
        unused_since=unused_since,
        order=order,
    )
    return ok(page)


# -- warm runs ----------------------------------------------------------------------


def _run_in_cache(state: ServerState, cache: str, run_id: int) -> warm_runs.WarmRunInfo:
    run = warm_runs.get_run(state.index, run_id)
    if sq.environment_cache(state.index, run.environment_id) != cache:
        raise NotFound(f"no warm run {run_id} in cache {cache!r}")
    return run


@route(
    router,
    "POST",
    "/caches/{cache}/environments/{digest}/warm-runs",
    role="writer",
    status_code=201,
    summary="Start a warm run (before its first entry is written)",
)
def start_warm_run(
    request: Request, cache: CacheName, digest: Digest, body: schemas.WarmRunStart
) -> JSONResponse:
    state = state_of(request)
    env = _environment(state, cache, digest)
    run = warm_runs.start_run(
        state.index,
        env.id,
        manifest_digest=body.manifest_digest,
        manifest_path=body.manifest_path,
        buckets=body.buckets,
        host=body.host,
        user=f"{body.user or 'unknown'} via token {current_token(request).name}",
    )
    return ok(run, 201)


@route(router, "GET", "/caches/{cache}/warm-runs", role="reader", summary="Warm runs, newest first")
def list_warm_runs(
    request: Request, cache: CacheName, limit: Annotated[int, Query(ge=1, le=1000)] = 50
) -> JSONResponse:
    state = state_of(request)
    state.index.get_cache(cache)
    return ok(warm_runs.list_runs(state.index, cache=cache, limit=limit))


@route(
    router,
    "PATCH",
    "/caches/{cache}/warm-runs/{run_id}",
    role="writer",
    summary="Heartbeat a warm run, or finish it with its final status",
)
def update_warm_run(
    request: Request,
    cache: CacheName,
    run_id: Annotated[int, Path(ge=1, le=2**31)],
    body: schemas.WarmRunUpdate,
) -> JSONResponse:
    state = state_of(request)
    run = _run_in_cache(state, cache, run_id)
    if body.status is None:
        warm_runs.heartbeat(
            state.index, run_id, compiled=body.compiled, cached=body.cached, failed=body.failed
        )
        return ok(warm_runs.get_run(state.index, run_id))
    return ok(
        warm_runs.finish_run(
            state.index,
            run.id,
            body.status,
            compiled=body.compiled or 0,
            cached=body.cached or 0,
            failed=body.failed or 0,
        )
    )


# -- telemetry ----------------------------------------------------------------------


def _signatures(items: list[schemas.SignatureIn]) -> dict[tuple[Any, ...], SignatureCounts]:
    """Signatures as the collector keeps them; seen-times are a claim: never later than now."""
    now = time.time()
    out: dict[tuple[Any, ...], SignatureCounts] = {}
    for n, s in enumerate(items):
        out[(s.function, n)] = SignatureCounts(
            tuple(
                (tuple(shape), dtype, weak, sharding) for shape, dtype, weak, sharding in s.leaves
            ),
            s.key,
            s.requests,
            s.hits,
            s.misses,
            s.uncacheable,
            s.repeats,
            min(s.first_seen, now),
            min(s.last_seen, now),
            s.source,
            None if s.statics is None else tuple((a, r) for a, r in s.statics),
        )
    return out


@route(
    router,
    "POST",
    "/telemetry",
    role="reader",
    scope="object",
    summary="Batched hit/miss telemetry from activate()",
)
def ingest_telemetry(request: Request, body: schemas.TelemetryIn) -> JSONResponse:
    state = state_of(request)
    token = current_token(request)
    for b in body.batches:
        check_cache(token, "reader", b.cache)
    accepted = unknown = rows = 0
    for b in body.batches:
        try:
            env = _environment(state, b.cache, b.environment_digest)
        except NotFound:
            unknown += 1  # not resolved by a writer yet: nothing to count against
            continue
        functions = {
            f.function: FunctionCounts(
                f.requests,
                f.hits,
                f.writes,
                f.saved_seconds,
                f.retrieval_seconds,
                uncacheable=f.uncacheable,
                loads=f.loads,
                miss_seconds=f.miss_seconds,
                hit_seconds=f.hit_seconds,
            )
            for f in b.functions
        }
        batch = TelemetryBatch(
            process=b.process,
            cache=b.cache,
            environment_digest=env.digest,
            started_at=b.started_at,
            ended_at=b.ended_at,
            functions=functions,
            hit_keys={k.key: (k.count, k.at) for k in b.hit_keys},
            dropped=b.dropped,
            serving={
                s.function: ServingCounts(
                    s.calls,
                    s.aot,
                    s.fallback,
                    s.out_of_bucket,
                    s.padded,
                    {
                        axis: {int(size): n for size, n in sizes.items()}
                        for axis, sizes in s.sizes.items()
                    },
                )
                for s in b.serving
            },
            signatures=_signatures(b.signatures),
            signatures_dropped=b.signatures_dropped,
        )
        rows += record_telemetry(state.index, env.id, batch)
        totals = batch.totals()
        state.metrics.telemetry_requests.labels(b.cache).inc(totals.requests)
        state.metrics.telemetry_hits.labels(b.cache).inc(totals.hits)
        state.metrics.telemetry_misses.labels(b.cache).inc(totals.misses)
        accepted += 1
    return ok({"accepted": accepted, "unknown_environments": unknown, "rows": rows})


# -- jobs -----------------------------------------------------------------------------


def _job_response(request: Request, cache: str, kind: str, params: dict[str, Any]) -> JSONResponse:
    state = state_of(request)
    state.index.get_cache(cache)
    job = state.jobs.submit(cache, kind, params, actor=_actor(request))
    return ok(job, 202)


@route(
    router,
    "POST",
    "/caches/{cache}/prune",
    role="admin",
    status_code=202,
    summary="Start a prune job",
)
def prune_job(request: Request, cache: CacheName, body: schemas.PruneParams) -> JSONResponse:
    params = body.model_dump()
    prune_lib.criteria(
        **{k: v for k, v in params.items() if k != "dry_run"}
    )  # bad selectors: 400 now
    return _job_response(request, cache, "prune", params)


@route(
    router, "POST", "/caches/{cache}/gc", role="admin", status_code=202, summary="Start a gc job"
)
def gc_job(request: Request, cache: CacheName, body: schemas.GcParams) -> JSONResponse:
    if body.max_size is not None and parse_size(body.max_size) <= 0:
        raise BadInput(f"--max-size must be positive, got {body.max_size!r}")
    return _job_response(request, cache, "gc", body.model_dump())


@route(
    router,
    "POST",
    "/caches/{cache}/verify",
    role="admin",
    status_code=202,
    summary="Start a verify job",
)
def verify_job(request: Request, cache: CacheName, body: schemas.VerifyParams) -> JSONResponse:
    if body.min_age is not None and body.min_age.strip() not in ("0", ""):
        parse_duration(body.min_age)  # a bad duration: 400 now, not a failed job later
    return _job_response(request, cache, "verify", body.model_dump())


def _visible_job(request: Request, job_id: str) -> sq.JobInfo:
    job = sq.get_job(state_of(request).index, job_id)
    token = current_token(request)
    if not token.allows("admin", job.cache):
        raise forbidden(token, f"see jobs of cache {job.cache!r}")
    return job


@route(
    router,
    "GET",
    "/jobs/{job_id}",
    role="admin",
    scope="object",
    summary="A job's progress and result",
)
def get_job(
    request: Request, job_id: Annotated[str, Path(max_length=36, pattern=r"^[0-9a-f-]+$")]
) -> JSONResponse:
    return ok(_visible_job(request, job_id))


@route(router, "GET", "/jobs", role="admin", scope="any", summary="Recent jobs, newest first")
def list_jobs(
    request: Request,
    cache: Annotated[str | None, Query(max_length=128)] = None,
    limit: Annotated[int, Query(ge=1, le=500)] = 50,
) -> JSONResponse:
    token = current_token(request)
    if cache is not None:
        check_cache(token, "admin", cache)
    return ok(sq.list_jobs(state_of(request).index, cache=cache, caches=token.caches, limit=limit))


# -- tokens ----------------------------------------------------------------------------


@route(
    router, "GET", "/tokens", role="admin", scope="global", summary="Tokens (never their secrets)"
)
def list_tokens(request: Request) -> JSONResponse:
    return ok(tokens.list_tokens(state_of(request).index))


@route(
    router,
    "POST",
    "/tokens",
    role="admin",
    scope="global",
    status_code=201,
    summary="Create a token; the secret is in this response only",
)
def create_token(request: Request, body: schemas.TokenCreate) -> JSONResponse:
    state = state_of(request)
    expires = parse_duration(body.expires) if body.expires else None
    created = tokens.create_token(state.index, body.name, body.role, body.caches, expires)
    state.index.audit(
        "token-create",
        cache=None,
        details={"name": body.name, "role": body.role, "caches": body.caches},
        who=_actor(request),
    )
    return ok(created, 201)


@route(router, "DELETE", "/tokens/{name}", role="admin", scope="global", summary="Revoke a token")
def revoke_token(request: Request, name: Annotated[str, Path(max_length=128)]) -> JSONResponse:
    state = state_of(request)
    info = tokens.revoke_token(state.index, name)
    state.changed()  # refused by this replica from the next request on
    state.index.audit("token-revoke", cache=None, details={"name": name}, who=_actor(request))
    return ok(info)


# -- health ----------------------------------------------------------------------------

health = APIRouter()


@route(health, "GET", "/healthz", role="public", summary="Liveness: the process answers")
def healthz() -> dict[str, str]:
    return {"status": "ok"}


@route(
    health,
    "GET",
    "/readyz",
    role="public",
    summary="Readiness: the index and every cache's storage answer (details with a token)",
)
async def readyz(request: Request) -> Response:
    state = state_of(request)
    try:
        caller = await identify(request)
    except HTTPException:
        caller = None
    names, problems = await run_in_threadpool(_readiness_problems, state)
    status = "ready" if not problems else "unavailable"
    body: dict[str, Any] = {"status": status}
    if caller is not None:
        # Cache names and storage errors are for token holders: a load balancer needs only the status.
        visible = [p for p in problems if p[0] is None or caller.allows("reader", p[0])]
        body.update(
            {
                "problems": [text for _c, text in visible],
                "caches": len([n for n in names if caller.allows("reader", n)]),
            }
        )
    return JSONResponse(body, status_code=200 if not problems else 503)


def _readiness_problems(state: ServerState) -> tuple[list[str], list[tuple[str | None, str]]]:
    problems: list[tuple[str | None, str]] = []
    caches = []
    try:
        caches = state.index.list_caches()
    except Exception as exc:  # noqa: BLE001 - report, never crash
        problems.append((None, f"index: {getattr(exc, 'message', type(exc).__name__)}"))
    for cache in caches:
        try:
            state.store(cache).check_reachable()
        except Exception as exc:  # noqa: BLE001
            problems.append(
                (cache.name, f"cache {cache.name}: {getattr(exc, 'message', type(exc).__name__)}")
            )
    return [c.name for c in caches], problems
