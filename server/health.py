"""What load balancers and Prometheus ask: /healthz, /readyz and /metrics.

Split from server/api.py and the app factory. /readyz is public (a load balancer has no token)
and adds details only for a caller that sends one; /metrics is public only when configured.
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Depends
from fastapi.responses import JSONResponse, Response
from starlette.concurrency import run_in_threadpool

from cachectl.trust.tokens import TokenInfo

from . import responses as out
from .auth import route
from .deps import OptionalToken, StateDep, metrics_reader
from .responses import errors
from .state import ServerState

router = APIRouter()
PROMETHEUS_TEXT = "text/plain; version=0.0.4; charset=utf-8"


@route(
    router,
    "GET",
    "/healthz",
    role="public",
    summary="Liveness: the process answers",
    response_model=out.HealthOut,
)
def healthz() -> dict[str, str]:
    return {"status": "ok"}


@route(
    router,
    "GET",
    "/readyz",
    role="public",
    summary="Readiness: the index and every cache's storage answer (details with a token)",
    response_model=out.ReadinessOut,
    responses={503: {"model": out.ReadinessOut, "description": "not ready: see problems"}},
)
async def readyz(state: StateDep, caller: OptionalToken) -> Response:
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


@route(
    router,
    "GET",
    "/metrics",
    role="reader",
    scope="global",
    enforce=False,
    summary="Prometheus metrics (public when configured)",
    response_class=Response,
    responses={
        200: {
            "content": {PROMETHEUS_TEXT: {"schema": {"type": "string"}}},
            "description": "Prometheus text exposition format",
        },
        **errors(401, 403, 413, 422, 503),
    },
)
async def metrics_endpoint(
    state: StateDep, _reader: Annotated[TokenInfo | None, Depends(metrics_reader)]
) -> Response:
    return Response(state.metrics.render(), media_type=PROMETHEUS_TEXT)
