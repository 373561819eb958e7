"""The versioned JSON API (/api/v1): caches, environments, entry listings, warm runs, telemetry.

Every handler is a few lines over a library function; responses are the
library's own dataclasses through ``to_jsonable``, so the CLI's client can
rebuild them and print exactly what direct mode prints. Each route names the
model of that JSON (server/responses.py). Jobs and tokens are in server/admin.py,
entry bytes in server/entry_routes.py, health and metrics in server/health.py.
"""

from __future__ import annotations

import time
from typing import Annotated, Any

from fastapi import APIRouter, HTTPException, Path, Query
from fastapi.responses import JSONResponse

from cachectl.core.errors import BadInput, NotFound
from cachectl.core.units import parse_duration, parse_size
from cachectl.index import EnvironmentInfo, warm_runs
from cachectl.index import server_queries as sq
from cachectl.index.misses_queries import misses_facts
from cachectl.index.telemetry_queries import record_telemetry, telemetry_stats
from cachectl.storage.namespace import ensure_namespace
from cachectl.telemetry import FunctionCounts, ServingCounts, SignatureCounts, TelemetryBatch
from cachectl.trust.caches import set_cache
from cachectl.trust.tokens import TokenInfo
from cachectl.usage import inventory

from . import responses as out
from . import schemas
from .auth import check_cache, route
from .deps import CurrentToken, StateDep
from .responses import errors, ok
from .state import ServerState

router = APIRouter(prefix="/api/v1")

# The longest cache name and environment digest a route accepts (server/fast_lane.py checks the same).
MAX_CACHE_NAME = 128
MAX_DIGEST = 64
CacheName = Annotated[str, Path(min_length=1, max_length=MAX_CACHE_NAME)]
# A telemetry window (stats, misses): a duration, e.g. 24h.
Window = Annotated[str, Query(max_length=16, description="Window, e.g. 24h, 7d")]
# No patterns on names and digests: the library validates them with the messages
# direct mode prints (the CLI's client shows the same text); both only ever
# match index rows, never build paths.
Digest = Annotated[
    str,
    Path(
        min_length=1,
        max_length=MAX_DIGEST,
        description="An environment digest or a unique prefix of one (hex).",
    ),
]
AUDITABLE = ("warm", "push", "sync")


def actor(token: TokenInfo) -> str:
    """Who the audit log says acted: the token's name (never its secret)."""
    return f"token:{token.name}"


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
    response_model=out.list_of(out.CacheOut),
)
def list_caches(state: StateDep, token: CurrentToken) -> JSONResponse:
    return ok([c for c in state.index.list_caches() if token.allows("reader", c.name)])


@route(
    router,
    "GET",
    "/caches/{cache}",
    role="reader",
    summary="One cache and its policy",
    response_model=out.CacheOut,
    responses=errors(404),
)
def get_cache(state: StateDep, cache: CacheName) -> JSONResponse:
    return ok(state.index.get_cache(cache))


def _policy(body: schemas.PolicyUpdate) -> dict[str, Any]:
    """The policy fields given, as set_cache takes them (sizes in bytes, retention in seconds)."""
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
    return policy


@route(
    router,
    "PATCH",
    "/caches/{cache}",
    role="admin",
    summary="Change a cache's policy",
    response_model=out.CacheOut,
    responses=errors(400, 404),
)
def update_policy(
    state: StateDep, token: CurrentToken, cache: CacheName, body: schemas.PolicyUpdate
) -> JSONResponse:
    policy = _policy(body)
    state.index.get_cache(cache)  # 404 for an unknown cache (set_cache would create 'default')
    info = set_cache(state.ctx, cache, **policy)
    state.changed()  # this replica applies the new policy from the next request on
    state.index.audit(
        "cache-set", cache=cache, details={k: v for k, v in policy.items()}, who=actor(token)
    )
    return ok(info)


@route(
    router,
    "GET",
    "/caches/{cache}/stats",
    role="reader",
    summary="Totals for a cache and its environments",
    response_model=out.CacheTotalsOut,
    responses=errors(404),
)
def cache_stats(state: StateDep, cache: CacheName) -> JSONResponse:
    return ok(inventory.cache_totals(state.ctx, [state.index.get_cache(cache)])[0])


@route(
    router,
    "GET",
    "/caches/{cache}/misses-facts",
    role="reader",
    summary="What `cachectl misses` explains: signatures seen and what warm recorded of them",
    response_model=out.MissesFactsOut,
    responses=errors(400, 404),
)
def cache_misses_facts(
    state: StateDep,
    cache: CacheName,
    since: Window = "7d",
) -> JSONResponse:
    state.index.get_cache(cache)  # 404 for a cache the index does not know
    return ok(misses_facts(state.index, cache, parse_duration(since)))


@route(
    router,
    "GET",
    "/caches/{cache}/telemetry",
    role="reader",
    summary="Hit rates per environment and function",
    response_model=out.TelemetryStatsOut,
    responses=errors(400, 404),
)
def cache_telemetry(
    state: StateDep,
    cache: CacheName,
    since: Window = "7d",
) -> JSONResponse:
    return ok(telemetry_stats(state.index, cache, parse_duration(since)))


@route(
    router,
    "GET",
    "/caches/{cache}/audit",
    role="admin",
    summary="The cache's audit log, newest first",
    response_model=out.list_of(out.AuditOut),
    responses=errors(404),
)
def audit_log(
    state: StateDep, cache: CacheName, limit: Annotated[int, Query(ge=1, le=1000)] = 100
) -> JSONResponse:
    state.index.get_cache(cache)
    return ok(state.index.audit_log(cache, limit=limit))


@route(
    router,
    "POST",
    "/caches/{cache}/audit",
    role="writer",
    status_code=201,
    summary="Record a writer's own operation (warm, push, sync) in the audit log",
    response_model=out.RecordedOut,
    responses=errors(400, 404),
)
def append_audit(
    state: StateDep, token: CurrentToken, cache: CacheName, record: schemas.AuditIn
) -> JSONResponse:
    state.index.get_cache(cache)
    if record.operation not in AUDITABLE:
        raise BadInput(
            f"operation {record.operation!r} cannot be reported: use one of {', '.join(AUDITABLE)}"
        )
    state.index.audit(
        record.operation,
        cache=cache,
        entries=record.entries,
        nbytes=record.bytes,
        duration_ms=record.duration_ms,
        details=record.details,
        who=f"{record.actor or 'client'} via {actor(token)}",
    )
    return ok({"recorded": True}, 201)


# -- environments -------------------------------------------------------------------


@route(
    router,
    "GET",
    "/caches/{cache}/environments",
    role="reader",
    summary="Environments with entries and bytes",
    response_model=out.list_of(out.EnvironmentOut),
    responses=errors(404),
)
def list_environments(
    state: StateDep, cache: CacheName, include_deleted: bool = False
) -> JSONResponse:
    state.index.get_cache(cache)
    return ok(state.index.environment_stats(cache, include_deleted=include_deleted))


@route(
    router,
    "GET",
    "/caches/{cache}/environments/{digest}",
    role="reader",
    summary="One environment, by digest or unique prefix",
    response_model=out.EnvironmentOut,
    responses=errors(400, 404),
)
def get_environment(state: StateDep, cache: CacheName, digest: Digest) -> JSONResponse:
    state.index.get_cache(cache)  # unknown cache: 404 naming it
    return ok(state.index.find_environment(cache, digest))  # with its totals


@route(
    router,
    "POST",
    "/caches/{cache}/resolve",
    role="reader",
    summary="Fingerprint -> namespace URL; writers create the environment",
    response_model=out.ResolveOut,
    responses=errors(400, 404),
)
def resolve(
    state: StateDep, token: CurrentToken, cache: CacheName, body: schemas.ResolveRequest
) -> JSONResponse:
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


# -- entries (listing; registration and bytes are in server/entry_routes.py) ------------------


@route(
    router,
    "GET",
    "/caches/{cache}/environments/{digest}/entries",
    role="reader",
    summary="An environment's entries: filters and pagination",
    response_model=out.EntryPageOut,
    responses=errors(400, 404),
)
def list_entries(
    state: StateDep,
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
    response_model=out.WarmRunOut,
    responses=errors(400, 404),
)
def start_warm_run(
    state: StateDep,
    token: CurrentToken,
    cache: CacheName,
    digest: Digest,
    body: schemas.WarmRunStart,
) -> JSONResponse:
    env = _environment(state, cache, digest)
    run = warm_runs.start_run(
        state.index,
        env.id,
        manifest_digest=body.manifest_digest,
        manifest_path=body.manifest_path,
        buckets=body.buckets,
        host=body.host,
        user=f"{body.user or 'unknown'} via token {token.name}",
    )
    return ok(run, 201)


@route(
    router,
    "GET",
    "/caches/{cache}/warm-runs",
    role="reader",
    summary="Warm runs, newest first",
    response_model=out.list_of(out.WarmRunOut),
    responses=errors(404),
)
def list_warm_runs(
    state: StateDep, cache: CacheName, limit: Annotated[int, Query(ge=1, le=1000)] = 50
) -> JSONResponse:
    state.index.get_cache(cache)
    return ok(warm_runs.list_runs(state.index, cache=cache, limit=limit))


@route(
    router,
    "PATCH",
    "/caches/{cache}/warm-runs/{run_id}",
    role="writer",
    summary="Heartbeat a warm run, or finish it with its final status",
    response_model=out.WarmRunOut,
    responses=errors(404),
)
def update_warm_run(
    state: StateDep,
    cache: CacheName,
    run_id: Annotated[int, Path(ge=1, le=2**31)],
    body: schemas.WarmRunUpdate,
) -> JSONResponse:
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


def _batch(b: schemas.TelemetryBatchIn, env: EnvironmentInfo) -> TelemetryBatch:
    """One wire batch as the library's TelemetryBatch, for the environment it names."""
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
    serving = {
        s.function: ServingCounts(
            s.calls,
            s.aot,
            s.fallback,
            s.out_of_bucket,
            s.padded,
            {axis: {int(size): n for size, n in sizes.items()} for axis, sizes in s.sizes.items()},
        )
        for s in b.serving
    }
    return TelemetryBatch(
        process=b.process,
        cache=b.cache,
        environment_digest=env.digest,
        started_at=b.started_at,
        ended_at=b.ended_at,
        functions=functions,
        hit_keys={k.key: (k.count, k.at) for k in b.hit_keys},
        dropped=b.dropped,
        serving=serving,
        signatures=_signatures(b.signatures),
        signatures_dropped=b.signatures_dropped,
    )


@route(
    router,
    "POST",
    "/telemetry",
    role="reader",
    scope="object",
    summary="Batched hit/miss telemetry from activate()",
    response_model=out.TelemetryAcceptedOut,
    responses=errors(400),
)
def ingest_telemetry(
    state: StateDep, token: CurrentToken, body: schemas.TelemetryIn
) -> JSONResponse:
    for b in body.batches:
        check_cache(token, "reader", b.cache)  # object scope: each batch names its cache
    accepted = unknown = rows = 0
    for b in body.batches:
        try:
            env = _environment(state, b.cache, b.environment_digest)
        except NotFound:
            unknown += 1  # not resolved by a writer yet: nothing to count against
            continue
        batch = _batch(b, env)
        rows += record_telemetry(state.index, env.id, batch)
        totals = batch.totals()
        state.metrics.telemetry_requests.labels(b.cache).inc(totals.requests)
        state.metrics.telemetry_hits.labels(b.cache).inc(totals.hits)
        state.metrics.telemetry_misses.labels(b.cache).inc(totals.misses)
        accepted += 1
    return ok({"accepted": accepted, "unknown_environments": unknown, "rows": rows})
