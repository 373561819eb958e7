"""Prune, gc and verify as jobs: a row in ``jobs``, run in a worker thread, polled by id.

A job is the library call the CLI makes (prune/gc/verify), so the lifecycle
lease, the plan-then-execute order and the audit record are the library's.
At most one job per cache is queued or running, across replicas: the jobs
table says so before a job is created (409 otherwise), and the lifecycle
lease decides should two replicas race past that check. A job whose replica
died is noticed (its lease is gone) and marked failed, so it never blocks
the cache for good.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from typing import Any

from fastapi import HTTPException
from sqlalchemy import select

from cachectl.context import Context
from cachectl.core.errors import CachectlError
from cachectl.core.jsonable import to_jsonable
from cachectl.core.units import parse_duration
from cachectl.index import CacheInfo
from cachectl.index import server_queries as sq
from cachectl.index.models import Lease, utcnow
from cachectl.lifecycle import gc as gc_lib
from cachectl.lifecycle import prune as prune_lib
from cachectl.lifecycle import verify as verify_lib
from cachectl.lifecycle.lease import lease_name
from cachectl.lifecycle.verify_records import VerifyOptions

log = logging.getLogger("cachectl.server.jobs")

KINDS = ("prune", "gc", "verify")
# Job params that describe the job rather than select what it acts on.
META_PARAMS = ("dry_run", "scheduled", "actor")
# A queued job waits at most this long for a worker; a running one whose
# cache lease is gone this long after it started has lost its replica.
STALE_QUEUED = timedelta(minutes=30)
STALE_RUNNING_GRACE = timedelta(seconds=60)
# A read-only job (verify, dry runs) holds no lease: presumed lost after this long.
STALE_READONLY = timedelta(hours=6)


def _prune(ctx: Context, cache: CacheInfo, params: dict[str, Any]) -> Any:
    selectors = {k: v for k, v in params.items() if k not in META_PARAMS}
    crit = prune_lib.criteria(**selectors)
    # Scheduled runs never delete the only environment of a hardware group still serving hits.
    return prune_lib.prune(
        ctx,
        cache,
        crit,
        dry_run=bool(params.get("dry_run")),
        protect_active=bool(params.get("scheduled")),
    )


def _gc(ctx: Context, cache: CacheInfo, params: dict[str, Any]) -> Any:
    return gc_lib.gc(
        ctx,
        cache,
        policy=params.get("policy") or "lru",
        max_size=params.get("max_size"),
        protect_warm=bool(params.get("protect_warm")),
        dry_run=bool(params.get("dry_run")),
    )


def _verify(ctx: Context, cache: CacheInfo, params: dict[str, Any]) -> Any:
    extra: dict[str, Any] = {}
    min_age = params.get("min_age")
    if min_age is not None:  # as `cachectl verify --min-age` reads it
        extra["min_age"] = (
            timedelta(0) if str(min_age).strip() in ("0", "") else parse_duration(min_age)
        )
    options = VerifyOptions.from_flags(
        quarantine=bool(params.get("quarantine")),
        repair=bool(params.get("repair")),
        dry_run=bool(params.get("dry_run")),
        env_prefix=params.get("env"),
        **extra,
    )
    return verify_lib.verify(ctx, cache, options)


RUNNERS: dict[str, Callable[[Context, CacheInfo, dict[str, Any]], Any]] = {
    "prune": _prune,
    "gc": _gc,
    "verify": _verify,
}


def bytes_freed(result: Any) -> int:
    """What a prune or gc result freed (0 for dry runs and verify)."""
    execution = getattr(result, "execution", None)
    return int(getattr(execution, "bytes_freed", 0) or 0)


def takes_lease(job: sq.JobInfo) -> bool:
    """Whether the library holds the cache's lifecycle lease while running this job."""
    if job.params.get("dry_run"):
        return False
    if job.kind == "verify":
        return bool(job.params.get("quarantine") or job.params.get("repair"))
    return True


class JobRunner:
    def __init__(self, state: Any, workers: int = 2) -> None:
        self.state = state
        self.pool = ThreadPoolExecutor(
            max_workers=max(1, workers), thread_name_prefix="cachectl-job"
        )
        self._submit_lock = threading.Lock()

    def shutdown(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=False)

    def _lease_held(self, cache: str) -> bool:
        with self.state.index.session() as s:
            row = s.scalar(select(Lease).where(Lease.name == lease_name(cache)))
            return row is not None and row.expires_at > utcnow()

    def reap(self, cache: str) -> list[sq.JobInfo]:
        """Active jobs of a cache, after failing those whose replica is gone."""
        alive = []
        now = utcnow()
        for job in sq.active_jobs(self.state.index, cache):
            queued_too_long = (
                job.status == sq.QUEUED
                and job.created_at is not None
                and now - job.created_at > STALE_QUEUED
            )
            # A running mutating job holds the cache's lease; without it, its replica is gone.
            lost_lease = (
                job.status == sq.RUNNING
                and job.started_at is not None
                and now - job.started_at > STALE_RUNNING_GRACE
                and takes_lease(job)
                and not self._lease_held(cache)
            )
            readonly_too_long = (
                job.status == sq.RUNNING
                and job.started_at is not None
                and not takes_lease(job)
                and now - job.started_at > STALE_READONLY
            )
            if queued_too_long or lost_lease or readonly_too_long:
                sq.set_job_status(
                    self.state.index,
                    job.id,
                    sq.FAILED,
                    error="abandoned: the server running it stopped before it finished",
                )
            else:
                alive.append(job)
        return alive

    def submit(self, cache: str, kind: str, params: dict[str, Any], *, actor: str) -> sq.JobInfo:
        """Create a job (409 if the cache has one queued or running) and start it."""
        if kind not in RUNNERS:
            raise ValueError(kind)
        with self._submit_lock:
            active = self.reap(cache)
            if active:
                other = active[0]
                raise HTTPException(
                    409,
                    f"cache {cache!r} already has a {other.kind} job {other.id} "
                    f"({other.status}): wait for it, see GET /api/v1/jobs/{other.id}",
                )
            job = sq.create_job(self.state.index, cache, kind, {**params, "actor": actor})
        self.pool.submit(self.run, job)
        return job

    def run(self, job: sq.JobInfo, *, trigger: str = "api") -> sq.JobInfo:
        """Run a job to completion in this thread; never raises."""
        state = self.state
        metrics = state.metrics
        sq.set_job_status(state.index, job.id, sq.RUNNING)
        try:
            cache = state.index.get_cache(job.cache)
            result = RUNNERS[job.kind](state.ctx, cache, job.params)
        except CachectlError as exc:
            sq.set_job_status(
                state.index,
                job.id,
                sq.FAILED,
                error=exc.message,
                result={"error": type(exc).__name__, "exit_code": exc.exit_code},
            )
            metrics.maintenance_runs.labels(job.cache, job.kind, "failed", trigger).inc()
        except Exception as exc:  # noqa: BLE001 - a job failure is recorded, not raised
            log.exception("job %s (%s on %s) failed", job.id, job.kind, job.cache)
            sq.set_job_status(
                state.index,
                job.id,
                sq.FAILED,
                error=f"internal error: {type(exc).__name__}: {exc}".splitlines()[0][:500],
                result={"error": type(exc).__name__, "exit_code": 1},
            )
            metrics.maintenance_runs.labels(job.cache, job.kind, "failed", trigger).inc()
        else:
            sq.set_job_status(state.index, job.id, sq.SUCCEEDED, result=to_jsonable(result))
            metrics.maintenance_runs.labels(job.cache, job.kind, "succeeded", trigger).inc()
            freed = bytes_freed(result)
            if freed:
                metrics.bytes_freed.labels(job.cache, job.kind).inc(freed)
        return sq.get_job(state.index, job.id)
