"""`cachectl warm` inside a multi-process JAX job (`jax.distributed`): TPU pod slices, GPU hosts.

Every process of the job runs the same command. Each one:

1. joins the job (``jax.distributed.initialize``: the coordinator from
   ``JAX_COORDINATOR_ADDRESS``, the count and rank from ``JAX_NUM_PROCESSES`` and
   ``JAX_PROCESS_ID``, else JAX's own cluster detection) before anything that could
   fail on it alone;
2. plans (process 0 first: it may create the index) and publishes what it would
   warm (manifest digest, environment digest, cache, buckets, target problems) in
   the job's key-value store and compares it with
   every other process: any difference, or a target mismatch anywhere, and every
   process refuses (exit 3) before compiling;
3. compiles every bucket (each process compiles its part of every program, as a
   multi-process service does). JAX writes the persistent cache from process 0
   only (docs/jax-facts.md, fact 6), so process 0 alone stores executables, records the
   entries (once) and the warm run; the others wait for its results and check
   that they looked up the same keys;
4. reports for itself (``process`` in the JSON: index, count, writer 0).

Every step is an exchange (``_exchange``) each process publishes to, with its result or
its failure, and every wait is bounded (``CACHECTL_DISTRIBUTED_TIMEOUT``): no process is
ever left waiting for one that has failed or gone.
"""

from __future__ import annotations

import dataclasses
import json
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cachectl import warm as warm_mod
from cachectl.context import Context
from cachectl.core import jax_seam
from cachectl.core.config import default_jobs
from cachectl.core.errors import (
    CachectlError,
    EnvironmentMismatch,
    OperationFailed,
    Unreachable,
    error_named,
)
from cachectl.manifest import LoadedManifest, as_loaded
from cachectl.storage import ingest, ingest_rules
from cachectl.storage.entries import CACHE_SUFFIX, parse_key, sha256
from cachectl.storage.jax_storage import jax_storage
from cachectl.warm.compiling import Outcome, warm_jax_config
from cachectl.warm.executors import run_threads
from cachectl.warm.job import (  # noqa: F401 - joining the job lives there; re-exported
    DEFAULT_TIMEOUT_S,
    TIMEOUT_ENV,
    WRITER,
    ProcessInfo,
    first_line,
    join,
    timeout_seconds,
)
from cachectl.warm.reports import (
    CACHED,
    COMPILED,
    FAILED,
    SKIPPED,
    TOO_LARGE,
    BucketResult,
    WarmSummary,
)
from cachectl.warm.settle import settle_peer

_PREFIX = "cachectl/warm"
# Every process of a JAX job compiles every bucket together (each program spans the job's
# devices), so the job is the unit of work: a shard of the manifest per process would leave
# each program compiled by part of the job, and --shard auto reads a per-process index.
SHARD_REFUSAL = (
    "--distributed and --shard do not combine: every process of a JAX job compiles every "
    "bucket together; to split a manifest across jobs, give each job its own manifest"
)
_SEQUENCE = [0]  # one exchange namespace per collective warm of this process


@dataclass(frozen=True)
class DistributedWarmReport:
    """One process's view of a collective warm."""

    process: ProcessInfo
    report: Any  # cachectl.warm.WarmReport

    @property
    def ok(self) -> bool:
        return self.report.ok

    def to_json(self) -> dict[str, Any]:
        return {
            **self.report.to_json(),
            "process": {
                "index": self.process.index,
                "count": self.process.count,
                "writer": self.process.writer,
            },
        }


def _client() -> Any:
    return jax_seam.distributed_client()


def _error_view(exc: Exception) -> dict[str, Any]:
    text = getattr(exc, "message", None) or first_line(exc)
    return {"error": text, "kind": type(exc).__name__ if isinstance(exc, CachectlError) else None}


def _exchange(
    tag: str, me: ProcessInfo, compute: Callable[[], dict[str, Any]]
) -> list[dict[str, Any]]:
    """Run ``compute`` here, publish its value (or its failure) under ``tag``, and return every
    process's, in process order.

    Every process publishes at every step, failed or not, and reads every view before anyone
    raises: so all of them decide the same (go on, or fail with the first failure's exit code)
    and none is left waiting for a peer that has gone. Every wait is bounded.
    """
    failure: Exception | None = None
    try:
        value = compute()
    except Exception as exc:  # noqa: BLE001 - published for the peers, then raised here below
        failure, value = exc, _error_view(exc)
    client = _client()
    timeout = timeout_seconds()
    base = f"{_PREFIX}/{_SEQUENCE[0]}/{tag}"
    views = []
    try:
        client.key_value_set(f"{base}/{me.index}", json.dumps(value, sort_keys=True))
        for i in range(me.count):
            views.append(json.loads(client.blocking_key_value_get(f"{base}/{i}", timeout * 1000)))
        # Nobody leaves (and, being process 0, takes the coordinator with it) before every
        # process has read every view.
        client.wait_at_barrier(f"{base}/read", timeout * 1000)
    except Exception as exc:  # noqa: BLE001 - JAX's runtime errors: a timeout, a lost coordinator
        if failure is not None:
            raise failure from None
        waited = f"process {len(views)} of {me.count}" if len(views) < me.count else "every process"
        detail = first_line(exc).split(" [type.googleapis.com", 1)[0]
        raise Unreachable(
            f"--distributed: {waited} did not reach the {tag!r} step within {timeout} s "
            f"({TIMEOUT_ENV}): {detail}"
        ) from exc
    if failure is not None:
        raise failure
    failed = [(i, v) for i, v in enumerate(views) if v.get("error")]
    if failed:
        i, view = failed[0]
        raise (error_named(view.get("kind")) or OperationFailed)(
            f"process {i} of {me.count} failed: {view['error']}"
        )
    return views


def _agreement(plan: Any) -> dict[str, Any]:
    return {
        "manifest_digest": plan.manifest_digest,
        "environment": plan.environment.digest,
        "cache": plan.cache.name,
        "root": plan.cache.root_url,
        "buckets": [[b.function, sorted(b.values.items())] for b in plan.buckets],
        "target_problems": list(plan.target_problems),
        "fields": plan.environment.to_dict(),
    }


def check_agreement(me: ProcessInfo, views: Sequence[dict[str, Any]]) -> None:
    """Refuse (exit 3) unless every process warms the same manifest into the same target."""
    target = [(i, v["target_problems"]) for i, v in enumerate(views) if v["target_problems"]]
    if target:
        i, problems = target[0]
        raise EnvironmentMismatch(
            f"process {i} of {me.count} does not match the manifest's target "
            f"({'; '.join(problems)}): no process compiled anything"
        )
    labels = {
        "manifest_digest": "manifest digest",
        "environment": "environment",
        "cache": "cache",
        "root": "cache root",
        "buckets": "buckets",
    }
    for field, label in labels.items():
        values = [json.dumps(v[field], sort_keys=True) for v in views]
        if len(set(values)) > 1:
            odd = next(i for i, v in enumerate(values) if v != values[0])
            first, shown = _shown(views[0][field], field), _shown(views[odd][field], field)
            if field == "environment":
                a, b = views[0]["fields"], views[odd]["fields"]
                diff = [
                    f"{k}: {a.get(k)!r} vs {b.get(k)!r}"
                    for k in sorted(set(a) | set(b))
                    if a.get(k) != b.get(k)
                ]
                shown += f" ({'; '.join(diff)})"
            raise EnvironmentMismatch(
                f"the processes of this JAX job differ in {label}: process 0 has "
                f"{first}, process {odd} has {shown}: no process compiled anything"
            )


@dataclass(frozen=True)
class _Request:
    """What every process of the job was asked to warm (the same in each)."""

    manifest_path: str | Path | LoadedManifest
    cache: str | None
    jobs: int | None
    paths: Sequence[str]
    fail_fast: bool
    executables: bool
    progress: Any


def _shown(value: Any, field: str) -> str:
    """An agreement field as a refusal shows it: a digest's first 16 characters, a count of buckets."""
    return f"{len(value)} bucket(s)" if field == "buckets" else str(value)[:16]


def warm(
    ctx: Context,
    manifest_path: str | Path | LoadedManifest,
    *,
    cache: str | None = None,
    jobs: int | None = None,
    paths: Sequence[str] = (),
    fail_fast: bool = False,
    dry_run: bool = False,
    executables: bool = True,
    progress: Any = None,
    prepare: Callable[[LoadedManifest], None] | None = None,
    finish: Callable[[Any], None] | None = None,
) -> DistributedWarmReport:
    """The collective warm: every process of the job calls this with the same arguments.

    ``prepare`` runs in every process before planning, with the manifest as read (the CLI checks
    the signing key there; the manifest is read once per process, in the exchange),
    ``finish`` in process 0 with its report before the last step (the CLI signs there): a
    failure in either reaches every process instead of leaving them waiting.
    """
    me = join()
    _SEQUENCE[0] += 1
    started = time.perf_counter()
    request = _Request(manifest_path, cache, jobs, paths, fail_fast, executables, progress)
    plan = _plan_together(ctx, me, request, dry_run, prepare)
    if dry_run:
        return DistributedWarmReport(
            me,
            warm_mod.warm(
                ctx, plan.loaded, cache=cache, paths=paths, dry_run=True, progress=progress
            ),
        )
    if me.index != WRITER:
        return DistributedWarmReport(me, _follow(ctx, plan, me, request, started))
    return DistributedWarmReport(me, _lead(ctx, plan, me, request, finish))


def _plan_together(
    ctx: Context,
    me: ProcessInfo,
    request: _Request,
    dry_run: bool,
    prepare: Callable[[LoadedManifest], None] | None,
) -> Any:
    """Plan in every process and refuse unless all agree; returns this process's plan."""
    plans: list[Any] = []

    def planned() -> dict[str, Any]:
        if not plans:
            loaded = as_loaded(request.manifest_path, import_paths=request.paths)
            if prepare is not None:
                prepare(loaded)
            plans.append(
                warm_mod.plan_warm(
                    ctx,
                    loaded,
                    cache=request.cache,
                    paths=request.paths,
                    writer_check=not dry_run and me.index == WRITER,
                )
            )
        return _agreement(plans[0])

    # Process 0 plans first, the others once it has: on a fresh SQLite file it creates the schema
    # (and the default cache), and two processes of one host sharing that file and creating it at
    # once fail ("has tables but no cachectl schema version").
    _exchange("open", me, lambda: planned() if me.index == WRITER else {})
    check_agreement(me, _exchange("plan", me, planned))
    return plans[0]


def _lead(
    ctx: Context,
    plan: Any,
    me: ProcessInfo,
    request: _Request,
    finish: Callable[[Any], None] | None,
) -> Any:
    """Process 0 is a normal warm: JAX writes from it, so it stores, records and reports; then
    it stores the entries only the other processes' keys name."""
    reports: list[Any] = []

    def warmed() -> dict[str, Any]:
        reports.append(
            warm_mod.warm(
                ctx,
                plan.loaded,
                cache=request.cache,
                jobs=request.jobs,
                paths=request.paths,
                fail_fast=request.fail_fast,
                executables=request.executables,
                progress=request.progress,
            )
        )
        return _results_view(reports[0])

    _exchange("result", me, warmed)
    report = reports[0]
    peers = _exchange("peer", me, lambda: {"entries": []})

    def stored() -> dict[str, Any]:
        rows = _store_peer_entries(ctx, plan, peers, report.run_id)
        if finish is not None:
            peer_written = tuple((r.key + CACHE_SUFFIX, r.size, r.sha256) for r in rows)
            finish(dataclasses.replace(report, peer_written=peer_written))
        return {"stored": len(rows)}

    _exchange("done", me, stored)
    return report


def _results_view(report: Any) -> dict[str, Any]:
    """What process 0 publishes of its warm for the others to report and check their keys by."""
    return {
        "buckets": [
            {
                "key": b.key,
                "status": b.status,
                "bytes": b.bytes,
                "aot_bytes": b.aot_bytes,
                "error": b.error,
            }
            for b in report.buckets
        ],
        "run_id": report.run_id,
    }


def _store_peer_entries(
    ctx: Context, plan: Any, views: Sequence[dict[str, Any]], run_id: int | None
) -> list[Any]:
    """Process 0 writes and records the entries other processes compiled under keys of their own.

    JAX's key hashes the topology fingerprint, which on some backends (CPU) differs per
    process: then process 1's programs have other keys than process 0's, JAX would never
    write them, and process 1 of a service would always miss. Each such entry is sent
    here through the job's key-value store and stored once.
    """

    client = _client()
    timeout_ms = timeout_seconds() * 1000
    store = ctx.store(plan.cache)
    env_info = ctx.index.ensure_environment(plan.cache.name, plan.environment)
    known = ctx.index.entry_keys(env_info.id)
    objects = []
    for rank, view in enumerate(views):
        for item in view["entries"]:
            key = item["key"]
            if key in known:
                continue
            data = client.blocking_key_value_get_bytes(
                f"{_PREFIX}/{_SEQUENCE[0]}/blob/{rank}/{item['position']}", timeout_ms
            )
            parsed = parse_key(key)
            if parsed is None:
                continue
            bucket = plan.buckets[item["position"]]
            timed = (
                {}
                if item.get("seconds") is None
                else {"compile_time_ms": int(round(item["seconds"] * 1000))}
            )
            try:
                row = ingest.check_new(
                    plan.cache,
                    parsed,
                    data,
                    origin="warm",
                    function=bucket.function,
                    bucket=dict(bucket.values),
                    warm_run_id=run_id,
                    **timed,
                )
            except ingest_rules.Refused:
                continue
            if row.sha256 != item["sha256"]:
                continue  # changed on the way: never stored
            objects.append(ingest.NewObject(row, data))
            known[key] = (row.size, row.sha256)
    if not objects:
        return []
    published = ingest.publish(ctx.index, plan.cache, plan.environment, env_info.id, store, objects)
    if published.failed:
        raise next(iter(published.failed.values()))[1]
    return list(published.rows)


def _follow(ctx: Context, plan: Any, me: ProcessInfo, request: _Request, started: float) -> Any:
    """A process other than 0: compile every bucket as the job does, through warm's executors,
    each settled as warm settles it with nothing stored here (``settle_peer``); hand process 0
    the entries only this process's key names, and report with process 0's results."""

    ns_url = ctx.store(plan.cache).url_for(plan.environment.namespace)
    mine: dict[int, BucketResult] = {}
    entries: dict[int, Outcome] = {}
    lock = threading.Lock()
    jobs = default_jobs() if request.jobs is None else request.jobs

    def record(position: int, bucket: Any, outcome: Outcome | None, error: str | None) -> Any:
        result = settle_peer(bucket, outcome, error)
        with lock:
            mine[position] = result
            if outcome is not None and outcome.entry is not None and result.status == COMPILED:
                entries[position] = outcome
            done = len(mine)
        if request.progress is not None:
            request.progress(result, done, len(plan.buckets))
        return result

    retried = [0]

    def compiled_all() -> dict[str, Any]:
        config = warm_jax_config(ns_url, plan.environment)
        cache = plan.cache
        with jax_storage(cache.root_url, cache.storage_options, ns_url):
            retried[0] = run_threads(plan, config, jobs, request.fail_fast, record, peer_entry=True)
        return {"buckets": [], "run_id": None}

    writer = _exchange("result", me, compiled_all)[WRITER]
    theirs = {i: b for i, b in enumerate(writer["buckets"])}

    def offer() -> dict[str, Any]:
        client = _client()
        offered = []
        for position, outcome in sorted(entries.items()):
            other = theirs.get(position)
            data, key = outcome.entry, outcome.key
            if data is None or key is None or (other is not None and other["key"] == key):
                continue  # process 0 wrote this very key (or it was in the cache already)
            client.key_value_set_bytes(f"{_PREFIX}/{_SEQUENCE[0]}/blob/{me.index}/{position}", data)
            offered.append(
                {
                    "position": position,
                    "key": key,
                    "sha256": sha256(data),
                    "seconds": outcome.seconds,
                }
            )
        return {"entries": offered}

    _exchange("peer", me, offer)
    _exchange("done", me, lambda: {"stored": 0})
    results = []
    for position, bucket in enumerate(plan.buckets):
        result = mine.get(position) or BucketResult(
            bucket.function,
            dict(bucket.values),
            SKIPPED,
            error="not attempted: --fail-fast stopped the run after a failure",
        )
        other = theirs.get(position) or {}
        if result.status != FAILED and other.get("status") == FAILED:
            result = dataclasses.replace(
                result, status=FAILED, error=f"process {WRITER}: {other.get('error')}"
            )
        if result.bytes is None and other.get("bytes") is not None:
            result = dataclasses.replace(result, bytes=other["bytes"])
        results.append(result)
    failed = sum(r.status in (FAILED, TOO_LARGE) for r in results)
    compiled_n = sum(r.status == COMPILED for r in results)
    cached = sum(r.status == CACHED for r in results)
    compile_seconds = sum(r.compile_seconds or 0.0 for r in results if r.status != CACHED)
    wall = time.perf_counter() - started
    summary = WarmSummary(
        len(results),
        compiled_n,
        cached,
        failed,
        compile_seconds,
        wall,
        sum(r.lower_seconds or 0.0 for r in results),
        compile_seconds / (wall * jobs) if wall > 0 else None,
        "thread",
        jobs,
        retried[0],
    )
    return warm_mod.WarmReport(
        warm_mod.environment_json(plan.environment),
        ns_url,
        summary,
        results,
        cache=plan.cache.name,
        manifest=plan.manifest_path,
        run_id=writer["run_id"],
        jobs=jobs,
        executor="thread",
    )
