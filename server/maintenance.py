"""Scheduled maintenance: each cache's policy enforced on a timer, once across replicas.

Per cache, up to three schedules: ``retention`` (prune with the cache's
retention), ``superseded`` (prune JAX versions older than the newest
``keep_versions`` per hardware group) and ``size`` (gc down to max_size /
env_max_size). Every replica ticks; for each (cache, schedule) a replica
takes a short index lease ``maintenance:<cache>:<schedule>``, checks under
it whether the schedule is due (no scheduled job started within the
interval), and only then creates and runs the job. So with N replicas each
due run happens exactly once, and a replica that ticks late finds it done.
Each run lands in the audit log as ``maintenance`` (the library's own
prune/gc records come with it). Every tick also deletes telemetry rows older
than the server's ``--telemetry-retention`` (default 30d); scheduled prunes
never delete the only environment of a hardware group that served hits in
the last week.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from cachectl.core.errors import CachectlError
from cachectl.index import CacheInfo
from cachectl.index import server_queries as sq
from cachectl.index.models import utcnow
from cachectl.index.telemetry_queries import prune_telemetry
from cachectl.lifecycle.lease import LeaseHeld, acquire

log = logging.getLogger("cachectl.server.maintenance")

# Due when the last scheduled run started at least this fraction of the interval ago:
# replicas tick at different phases, and a tick's own delay must not skip a period.
DUE_FRACTION = 0.9


@dataclass(frozen=True)
class Schedule:
    name: str
    kind: str
    params: dict[str, Any]


def schedules_for(cache: CacheInfo) -> list[Schedule]:
    """What the cache's policy asks the server to enforce."""
    out = []
    if cache.retention_seconds:
        out.append(Schedule("retention", "prune", {}))
    if cache.keep_versions:
        out.append(
            Schedule("superseded", "prune", {"superseded": True, "keep": cache.keep_versions})
        )
    if cache.max_size or cache.env_max_size:
        out.append(Schedule("size", "gc", {"policy": "lru"}))
    return out


@dataclass(frozen=True)
class MaintenanceRun:
    cache: str
    schedule: str
    job: sq.JobInfo


class Scheduler:
    """A daemon thread that runs due schedules every ``interval_s`` (first tick after ``initial_delay_s``)."""

    def __init__(
        self, state: Any, interval_s: float, *, initial_delay_s: float | None = None
    ) -> None:
        self.state = state
        self.interval_s = interval_s
        self.initial_delay_s = min(60.0, interval_s) if initial_delay_s is None else initial_delay_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        if self._thread is None:
            self._stop.clear()
            self._thread = threading.Thread(
                target=self._loop, name="cachectl-maintenance", daemon=True
            )
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
            self._thread = None

    def _loop(self) -> None:
        delay = self.initial_delay_s
        while not self._stop.wait(delay):
            try:
                self.run_once()
            except Exception:  # noqa: BLE001 - the loop must survive an index outage
                log.exception("scheduled maintenance failed; retrying next interval")
            delay = self.interval_s

    def run_once(self) -> list[MaintenanceRun]:
        """One tick: drop telemetry past its retention, then run every due schedule of every
        cache this replica can lease."""
        self._prune_telemetry()
        runs: list[MaintenanceRun] = []
        for cache in self.state.index.list_caches():
            for schedule in schedules_for(cache):
                if self._stop.is_set():
                    return runs
                run = self._maybe_run(cache, schedule)
                if run is not None:
                    runs.append(run)
        return runs

    def _prune_telemetry(self) -> None:
        retention = self.state.settings.telemetry_retention_s
        if not retention:
            return
        try:
            removed = prune_telemetry(self.state.index, timedelta(seconds=retention))
        except CachectlError as exc:
            log.warning("could not prune telemetry: %s", exc.message)
            return
        if removed:
            log.info("telemetry retention: deleted %d rows older than %ds", removed, int(retention))

    def _maybe_run(self, cache: CacheInfo, schedule: Schedule) -> MaintenanceRun | None:
        index = self.state.index
        try:
            lease = acquire(
                index,
                f"maintenance:{cache.name}:{schedule.name}",
                f"scheduled-{schedule.kind}",
                ttl_s=max(600.0, self.interval_s),
            )
        except LeaseHeld:
            log.debug("maintenance %s on %s: another replica holds it", schedule.name, cache.name)
            return None
        try:
            last = sq.last_scheduled_job(index, cache.name, schedule.name)
            due_after = timedelta(seconds=self.interval_s * DUE_FRACTION)
            if (
                last is not None
                and last.created_at is not None
                and utcnow() - last.created_at < due_after
            ):
                log.debug(
                    "maintenance %s on %s: not due (last run %s)",
                    schedule.name,
                    cache.name,
                    last.id,
                )
                return None
            if self.state.jobs.reap(cache.name):
                log.info(
                    "maintenance %s on %s: a job is running on the cache; next tick",
                    schedule.name,
                    cache.name,
                )
                return None
            job = sq.create_job(
                index,
                cache.name,
                schedule.kind,
                {**schedule.params, "scheduled": schedule.name, "actor": "scheduler"},
            )
            done = self.state.jobs.run(job, trigger="schedule")
            freed = int(((done.result or {}).get("execution") or {}).get("bytes_freed") or 0)
            entries = int(((done.result or {}).get("execution") or {}).get("entries_deleted") or 0)
            try:
                index.audit(
                    "maintenance",
                    cache=cache.name,
                    entries=entries,
                    nbytes=freed,
                    details={
                        "schedule": schedule.name,
                        "kind": schedule.kind,
                        "job": done.id,
                        "status": done.status,
                        "error": done.error,
                    },
                    who="cachectl-server scheduler",
                )
            except CachectlError as exc:
                log.warning("could not audit maintenance run %s: %s", done.id, exc.message)
            log.info(
                "maintenance %s on %s: %s (freed %d bytes)",
                schedule.name,
                cache.name,
                done.status,
                freed,
            )
            return MaintenanceRun(cache.name, schedule.name, done)
        finally:
            try:
                lease.release()
            except CachectlError as exc:
                log.warning("could not release maintenance lease: %s", exc.message)
