"""Warm runs in the index: one row per `cachectl warm`, kept alive by a heartbeat.

Lifecycle commands treat an environment with a ``running`` warm whose heartbeat
is recent as in use (``lifecycle_queries.warms_in_progress``), and protect the
entries of the newest finished run, so a warm must start its row before it
writes, beat while it compiles, and always finish it (``succeeded``, ``failed``
when some bucket failed, ``interrupted`` when the process stopped early). A process
killed (kill -9, the OOM killer) or aborted (XLA's own checks) never finishes its row:
``close_dead_runs`` closes a row whose heartbeat stopped as ``interrupted``, whenever a
warm starts or the runs are listed, so no row says ``running`` for a dead process.
"""

from __future__ import annotations

import getpass
import socket
from contextlib import AbstractContextManager
from datetime import timedelta
from typing import Any, Protocol

from sqlalchemy import func, select, update
from sqlalchemy.orm import Session

from cachectl.core.errors import NotFound
from cachectl.core.records import WarmRunInfo
from cachectl.index.models import Cache, WarmRun, utcnow
from cachectl.index.models import Environment as EnvRow
from cachectl.index.plan_reads import WARM_HEARTBEAT_WINDOW


class Index(Protocol):
    """What these functions use of cachectl.index.sql.Index (which calls them: so not imported)."""

    def session(self, *, write: bool = True) -> AbstractContextManager[Session]: ...

    def read_session(self) -> Any: ...


RUNNING = "running"
SUCCEEDED = "succeeded"
FAILED = "failed"
INTERRUPTED = "interrupted"
FINAL_STATUSES = (SUCCEEDED, FAILED, INTERRUPTED)
# A running warm whose heartbeat is older than this is presumed dead (it beats every 30 s).
HEARTBEAT_WINDOW = WARM_HEARTBEAT_WINDOW


def _info(row: WarmRun) -> WarmRunInfo:
    return WarmRunInfo(
        id=row.id,
        environment_id=row.environment_id,
        manifest_digest=row.manifest_digest,
        manifest_path=row.manifest_path,
        host=row.host,
        user=row.user,
        status=row.status,
        started_at=row.started_at,
        finished_at=row.finished_at,
        heartbeat_at=row.heartbeat_at,
        buckets=row.buckets,
        compiled=row.compiled,
        cached=row.cached,
        failed=row.failed,
    )


def _user() -> str:
    try:
        return getpass.getuser()
    except Exception:  # noqa: BLE001 - no passwd entry in some containers
        return "unknown"


def close_dead_runs(index: Index, *, window: timedelta = HEARTBEAT_WINDOW) -> int:
    """Close as ``interrupted`` (it stopped early; lifecycle does not take it for a complete run)
    every running row whose last heartbeat is older than ``window``, finished at that heartbeat;
    how many. One read when there are none."""
    last = func.coalesce(WarmRun.heartbeat_at, WarmRun.started_at)
    dead = (WarmRun.status == RUNNING) & (last < utcnow() - window)
    with index.read_session() as s:
        if s.scalar(select(WarmRun.id).where(dead).limit(1)) is None:
            return 0
    with index.session() as s:
        done = s.execute(
            update(WarmRun)
            .where(dead)
            .values(status=INTERRUPTED, finished_at=last)
            .execution_options(synchronize_session=False)
        )
        return int(getattr(done, "rowcount", 0) or 0)


def start_run(
    index: Index,
    environment_id: int,
    *,
    manifest_digest: str,
    manifest_path: str | None,
    buckets: int,
    host: str | None = None,
    user: str | None = None,
) -> WarmRunInfo:
    """Record a running warm (heartbeat now) before the first entry is written.

    ``host``/``user`` default to this process's; the server passes its client's.
    """
    close_dead_runs(index)
    now = utcnow()
    with index.session() as s:
        row = WarmRun(
            environment_id=environment_id,
            manifest_digest=manifest_digest,
            manifest_path=manifest_path,
            host=host or socket.gethostname(),
            user=user or _user(),
            status=RUNNING,
            started_at=now,
            heartbeat_at=now,
            buckets=buckets,
            compiled=0,
            cached=0,
            failed=0,
        )
        s.add(row)
        s.flush()
        return _info(row)


def heartbeat(
    index: Index,
    run_id: int,
    *,
    compiled: int | None = None,
    cached: int | None = None,
    failed: int | None = None,
) -> None:
    """Say the run is alive (and how far it got), so lifecycle keeps protecting its environment."""
    values: dict[str, object] = {"heartbeat_at": utcnow()}
    for name, value in (("compiled", compiled), ("cached", cached), ("failed", failed)):
        if value is not None:
            values[name] = value
    with index.session() as s:
        s.execute(
            update(WarmRun).where(WarmRun.id == run_id, WarmRun.status == RUNNING).values(**values)
        )


def finish_run(
    index: Index, run_id: int, status: str, *, compiled: int, cached: int, failed: int
) -> WarmRunInfo:
    """Close a run with its final status and counts."""
    if status not in FINAL_STATUSES:
        raise ValueError(f"a finished warm run is one of {FINAL_STATUSES}, not {status!r}")
    now = utcnow()
    with index.session() as s:
        row = s.get(WarmRun, run_id)
        if row is None:
            raise NotFound(f"no warm run {run_id}")
        row.status, row.finished_at, row.heartbeat_at = status, now, now
        row.compiled, row.cached, row.failed = compiled, cached, failed
        s.flush()
        return _info(row)


def get_run(index: Index, run_id: int) -> WarmRunInfo:
    with index.read_session() as s:
        row = s.get(WarmRun, run_id)
        if row is None:
            raise NotFound(f"no warm run {run_id}: see `cachectl warm-runs`")
        return _info(row)


def list_runs(
    index: Index,
    *,
    cache: str | None = None,
    environment_id: int | None = None,
    status: str | None = None,
    limit: int = 50,
) -> list[WarmRunInfo]:
    """Newest first, optionally for one cache, environment or status (dead runs closed first)."""
    close_dead_runs(index)
    with index.read_session() as s:
        q = select(WarmRun).order_by(WarmRun.started_at.desc(), WarmRun.id.desc()).limit(limit)
        if environment_id is not None:
            q = q.where(WarmRun.environment_id == environment_id)
        if status is not None:
            q = q.where(WarmRun.status == status)
        if cache is not None:
            q = (
                q.join(EnvRow, EnvRow.id == WarmRun.environment_id)
                .join(Cache, Cache.id == EnvRow.cache_id)
                .where(Cache.name == cache)
            )
        return [_info(r) for r in s.scalars(q)]
