"""Server mode (CACHECTL_SERVER) for the commands that run as server jobs or read server-side stats."""

from __future__ import annotations

from typing import Any

from cachectl.client import API, _seg
from cachectl.index.telemetry_queries import TelemetryStats
from cachectl.jsonable import from_jsonable
from cachectl.lifecycle.gc import GcResult
from cachectl.lifecycle.plan import LifecycleResult
from cachectl.lifecycle.verify import VerifyResult

RESULT_TYPES: dict[str, type] = {"prune": LifecycleResult, "gc": GcResult, "verify": VerifyResult}


def run_lifecycle(ctx: Any, kind: str, params: dict[str, Any]) -> Any:
    """prune/gc/verify as a server job on ctx's cache; returns the library's own result type."""
    body = {k: v for k, v in params.items() if v is not None and v is not False}
    return ctx.remote.run_job(ctx.settings.cache, kind, body, RESULT_TYPES[kind])


def telemetry_stats(ctx: Any, cache: str, since: str) -> TelemetryStats:
    """`cachectl stats --since` in server mode."""
    return from_jsonable(TelemetryStats, ctx.remote.get(f"{API}/caches/{_seg(cache)}/telemetry", since=since))
