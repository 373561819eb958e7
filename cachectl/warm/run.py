"""warm(): plan, compile every bucket, then record what was written in the index.

Each bucket's outcome is settled (status, stored bytes, index row) in ``settle``;
this module opens the warm-run row, drives the executors and reports the run.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from cachectl.context import Context
from cachectl.core import jax_seam
from cachectl.core.config import default_jobs
from cachectl.core.errors import BadInput
from cachectl.core.jaxlog import CAPTURE
from cachectl.core.probe import ONE_PROCESS_BACKENDS
from cachectl.index import warm_runs
from cachectl.manifest import Bucket, LoadedManifest, as_loaded
from cachectl.storage.entries import CACHE_SUFFIX, EXECUTABLE_SUFFIX
from cachectl.storage.jax_storage import jax_storage
from cachectl.trust import signing
from cachectl.trust.signing import SigningKey
from cachectl.warm.by_running import index_entries
from cachectl.warm.compiling import Outcome, warm_jax_config
from cachectl.warm.executors import run_processes, run_threads
from cachectl.warm.plan import (
    WarmPlan,
    environment_json,
    environment_mismatch,
    plan_warm,
    raise_build_problems,
    refuse_foreign_functions,
)
from cachectl.warm.reports import (
    CACHED,
    COMPILED,
    DEFAULT_EXECUTOR,
    EXECUTORS,
    FAILED,
    PLANNED,
    SKIPPED,
    TOO_LARGE,
    BucketResult,
    WarmReport,
    WarmSummary,
)
from cachectl.warm.server_held import ServerEntries
from cachectl.warm.settle import RunScope, function_bindings, present_check, settle

log = logging.getLogger(__name__)

HEARTBEAT_SECONDS = 30.0

ProgressFn = Callable[[BucketResult, int, int], None]


@dataclass
class _Counts:
    compiled: int = 0
    cached: int = 0
    failed: int = 0

    def add(self, status: str) -> None:
        if status == COMPILED:
            self.compiled += 1
        elif status == CACHED:
            self.cached += 1
        elif status in (FAILED, TOO_LARGE):
            self.failed += 1


class _Heartbeat:
    """Beats the warm run's row from a daemon thread until stopped."""

    def __init__(self, beat: Callable[[], None], every: float = HEARTBEAT_SECONDS) -> None:
        self._beat, self._every = beat, every
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._run, name="cachectl-warm-heartbeat", daemon=True
        )

    def _run(self) -> None:
        while not self._stop.wait(self._every):
            try:
                self._beat()
            except Exception as exc:  # noqa: BLE001 - a missed beat must not stop the warm
                log.warning("warm heartbeat failed: %s", exc)

    def __enter__(self) -> _Heartbeat:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


def warm(
    ctx: Context,
    manifest_path: str | Path | LoadedManifest,
    *,
    cache: str | None = None,
    jobs: int | None = None,
    shard: tuple[int, int] | None = None,
    paths: Sequence[str] = (),
    fail_fast: bool = False,
    dry_run: bool = False,
    executor: str = DEFAULT_EXECUTOR,
    progress: ProgressFn | None = None,
    executables: bool = True,
    signer: SigningKey | None = None,
    topology: str | None = None,
    libtpu_startup_warnings: bool = False,
) -> WarmReport:
    """Compile every bucket of a manifest into this environment's namespace and index them.

    Order of refusals, all before anything is compiled: bad manifest or
    unimportable function (BadInput, 2), not a writer (PermissionDenied, 4),
    wrong hardware (EnvironmentMismatch, 3). A bucket that fails later is
    reported in the result and the others continue (unless ``fail_fast``).
    With ``executables`` each bucket's compiled program is also stored
    (cachectl/storage/executables.py) for :func:`cachectl.serving`. With a ``signer`` a stored file counts
    as warmed only when a list it trusts signed it (signing.carried_files): any other file at a
    key of the manifest is removed and compiled again, so the signer signs only its own work.
    With ``topology`` ("v5e:2x2") the buckets compile for that TPU slice without one
    (warm/deviceless.py), into the namespace the slice's own fingerprint names;
    ``libtpu_startup_warnings`` (-v) lets libtpu print its start-up warnings.
    """
    if executor not in EXECUTORS:
        raise BadInput(f"unknown executor {executor!r}: use one of {', '.join(EXECUTORS)}")
    jobs = default_jobs() if jobs is None else jobs
    if jobs < 1:
        raise BadInput(f"--jobs must be at least 1, got {jobs}")
    started = time.perf_counter()
    plan = plan_warm(
        ctx,
        manifest_path,
        cache=cache,
        shard=shard,
        paths=paths,
        writer_check=not dry_run,
        topology=topology,
        libtpu_startup_warnings=libtpu_startup_warnings,
    )
    env = plan.environment
    if executor == "process" and plan.deviceless is not None:
        raise BadInput(
            "--executor process cannot compile for a TPU topology (its workers would each "
            "start libtpu); use --executor thread"
        )
    if executor == "process" and env.backend in ONE_PROCESS_BACKENDS:
        raise BadInput(
            f"--executor process cannot run on {env.backend}: one process at a time holds "
            "the accelerator, and this one already does; use --executor thread"
        )
    if not plan.target_problems:
        refuse_foreign_functions(plan)  # warm --topology: nothing for this machine's devices
    if dry_run:
        if not plan.target_problems:  # on other hardware a mesh cannot be built: exit 3 says so
            raise_build_problems(plan)
        store = ctx.store(plan.cache)
        results = [BucketResult(b.function, dict(b.values), PLANNED) for b in plan.buckets]
        return WarmReport(
            environment_json(env),
            store.url_for(env.namespace),
            WarmSummary(len(results), 0, 0, 0, 0.0, time.perf_counter() - started),
            results,
            cache=plan.cache.name,
            manifest=plan.manifest_path,
            jobs=jobs,
            executor=executor,
            dry_run=True,
            target_problems=plan.target_problems,
        )
    if plan.target_problems:
        raise environment_mismatch(plan.manifest_path, plan.target_problems)
    opts = _Options(jobs, fail_fast, executor, progress, executables, signer)
    return _execute(ctx, plan, opts, started)


@dataclass(frozen=True)
class _Options:
    """How warm() was asked to run: the knobs every stage after planning reads."""

    jobs: int
    fail_fast: bool
    executor: str
    progress: ProgressFn | None
    executables: bool
    signer: SigningKey | None


class _Tally:
    """The results recorded so far, by position, and their counts; shared by the workers."""

    def __init__(self, scope: RunScope, progress: ProgressFn | None) -> None:
        self.scope, self.progress = scope, progress
        self.counts = _Counts()
        self.results: dict[int, BucketResult] = {}
        self._lock = threading.Lock()

    def record(
        self, position: int, bucket: Bucket, outcome: Outcome | None, error: str | None
    ) -> BucketResult:
        """Settle one bucket and count it (the executors' RecordFn)."""
        result = settle(self.scope, bucket, outcome, error)
        with self._lock:
            self.results[position] = result
            self.counts.add(result.status)
        if self.progress is not None:
            self.progress(result, len(self.results), len(self.scope.plan.buckets))
        return result

    def ordered(self) -> list[BucketResult]:
        """Every bucket's result in manifest order; those never attempted are ``skipped``."""
        return [
            self.results.get(i)
            or BucketResult(
                b.function,
                dict(b.values),
                SKIPPED,
                error="not attempted: --fail-fast stopped the run after a failure",
            )
            for i, b in enumerate(self.scope.plan.buckets)
        ]


def signer_for(
    ctx: Context,
    manifest: str | Path | LoadedManifest,
    cache: str | None,
    sign_key: str | None,
    paths: Sequence[str] = (),
) -> SigningKey | None:
    """The signing key (``--sign-key``, else the environment's), checked against the target
    cache's trusted keys before anything compiles; None: the warm signs nothing."""
    key = signing.signing_key(sign_key)
    loaded = as_loaded(manifest, import_paths=paths).manifest  # a bad one: all its problems
    target = ctx.cache(cache or loaded.cache or ctx.settings.cache)
    signing.require_signer(target, key, "warm")
    return key


def resign_written(ctx: Context, report: WarmReport, signer: SigningKey) -> None:
    """Sign the namespace's content list with what this warm wrote (and what a list the cache
    trusts signed); one warning on stderr when indexed files are left out."""
    signing.report_resigned(
        signing.resign(ctx, report.cache, report.environment["digest"], signer, report.written)
    )


def _execute(ctx: Context, plan: WarmPlan, opts: _Options, started: float) -> WarmReport:
    """Compile and settle every bucket under a warm-run row, then audit and report it."""
    scope, ns_url, signed = _open_run(ctx, plan, opts)
    tally = _Tally(scope, opts.progress)
    written: set[str] = set()
    executor, retried = _compile_all(scope, ns_url, opts, tally, signed, written)
    ordered = tally.ordered()
    side, side_written = _index_side_programs(scope, written, ordered)
    counts = tally.counts
    wall = time.perf_counter() - started
    # Every compile this run paid for, a failed bucket's too (JAX compiled it, then did not
    # write it): the summary agrees with the per-bucket column.
    compile_seconds = sum(
        r.compile_seconds or 0.0 for r in ordered if r.status in (COMPILED, TOO_LARGE, FAILED)
    )
    summary = WarmSummary(
        len(ordered),
        counts.compiled,
        counts.cached,
        counts.failed,
        compile_seconds,
        wall,
        sum(r.lower_seconds or 0.0 for r in ordered),
        compile_seconds / (wall * opts.jobs) if wall > 0 else None,
        executor,
        opts.jobs,
        retried,
    )
    _audit(scope, summary, ordered)
    return WarmReport(
        environment_json(plan.environment),
        ns_url,
        summary,
        ordered,
        cache=plan.cache.name,
        manifest=plan.manifest_path,
        run_id=scope.run_id,
        jobs=opts.jobs,
        executor=executor,
        side_programs=side,
        side_written=side_written,
    )


def _index_side_programs(
    scope: RunScope, written: set[str], ordered: list[BucketResult]
) -> tuple[list[str], tuple[tuple[str, int, str], ...]]:
    """Index the programs this run's JAX wrote (``written``: this process's keys and its
    workers') that are no bucket's: what a function ran eagerly while tracing (equinox's
    ``jit_convert_element_type``), or a module imported while tracing in a worker process. Left
    unindexed they are ``unknown-writer`` files to verify; each passes ingest's rules as
    warm-run's entries do (a refused one is removed). A file that appeared in the namespace
    from anyone else (another shard's pod writing there meanwhile) is not this run's: its
    writer indexes it. (module names, the files written, for a signer.)"""
    ctx, plan = scope.ctx, scope.plan
    side = written - set(scope.indexed) - {r.key for r in ordered if r.key}
    if not side:
        return [], ()
    entries = index_entries(
        ctx,
        plan.cache,
        plan.environment,
        scope.env_id,
        scope.store,
        scope.ns_rel,
        [k + CACHE_SUFFIX for k in sorted(side)],
        scope.run_id,
        {k: set(jax_seam.put_sha256s(k)) for k in side},
    )
    for e in entries:
        if e.status != "written":
            log.warning(
                "warm: %s, written while tracing, was refused and removed: %s", e.module, e.error
            )
    rows = ctx.index.entry_keys(scope.env_id)
    files = tuple(
        (e.key + CACHE_SUFFIX, *rows[e.key])
        for e in entries
        if e.status == "written" and e.key in rows
    )
    return [e.module for e in entries if e.status == "written"], files


def _open_run(ctx: Context, plan: WarmPlan, opts: _Options) -> tuple[RunScope, str, bool]:
    """Start the warm-run row and read what the index holds: (the scope, the namespace's URL,
    whether only signed files count as warmed)."""
    ns, env_info = ctx.namespace(plan.cache, plan.environment)
    assert env_info is not None
    run = ctx.index.start_warm_run(
        env_info.id,
        manifest_digest=plan.manifest_digest,
        manifest_path=str(Path(plan.manifest_path).resolve()),
        buckets=len(plan.buckets),
    )
    indexed = ctx.index.entry_keys(env_info.id)
    stored_aot = ctx.index.aot_keys(env_info.id) if opts.executables else None
    carried = None
    if opts.signer is not None:  # what no trusted list signed is not this run's to keep
        carried = signing.carried_files(ctx.index, plan.cache, env_info, opts.signer)
    if carried is not None:
        indexed = {k: v for k, v in indexed.items() if carried.get(k + CACHE_SUFFIX) == v}
        if stored_aot is not None:
            stored_aot = {
                k: v
                for k, v in stored_aot.items()
                if k in indexed and carried.get(k + EXECUTABLE_SUFFIX) == v
            }
    via_server = ctx.reads_via_server(plan.cache)
    scope = RunScope(
        ctx,
        plan,
        ctx.store(plan.cache),
        ns.relpath,
        env_info.id,
        run.id,
        indexed,
        stored_aot,
        function_bindings(plan) if opts.executables else {},
        via_server,
        ServerEntries(ctx, plan.cache, plan.environment) if via_server else None,
    )
    return scope, ns.url, carried is not None


def _compile_all(
    scope: RunScope, ns_url: str, opts: _Options, tally: _Tally, signed: bool, written: set[str]
) -> tuple[str, int]:
    """Run the executor under a heartbeat and finish the warm-run row whatever happens:
    (the executor that ran, how many buckets were retried alone). ``written`` gets the key of
    every entry JAX wrote meanwhile, in this process and in its workers."""
    ctx, plan, counts = scope.ctx, scope.plan, tally.counts

    def beat() -> None:
        ctx.index.heartbeat_warm_run(
            scope.run_id, compiled=counts.compiled, cached=counts.cached, failed=counts.failed
        )

    executor, jobs = opts.executor, opts.jobs
    status = warm_runs.INTERRUPTED
    retried = 0
    try:
        cache = plan.cache
        with (
            _Heartbeat(beat),
            jax_storage(cache.root_url, cache.storage_options, ns_url),
            CAPTURE.writes(written),
        ):
            config = warm_jax_config(ns_url, plan.environment)
            if executor == "process" and jobs > 1:
                run_processes(
                    plan, config, jobs, opts.fail_fast, tally.record, opts.executables, written
                )
            else:
                executor = "thread"  # one job runs in this process, whatever was asked
                retried = run_threads(
                    plan,
                    config,
                    jobs,
                    opts.fail_fast,
                    tally.record,
                    opts.executables,
                    present=present_check(scope, replace=signed),
                )
        status = warm_runs.FAILED if counts.failed else warm_runs.SUCCEEDED
    finally:
        ctx.index.finish_warm_run(
            scope.run_id,
            status,
            compiled=counts.compiled,
            cached=counts.cached,
            failed=counts.failed,
        )
    return executor, retried


def _audit(scope: RunScope, summary: WarmSummary, ordered: list[BucketResult]) -> None:
    """The audit-log row of a finished warm."""
    plan = scope.plan
    scope.ctx.index.audit(
        "warm",
        cache=plan.cache.name,
        entries=summary.compiled,
        nbytes=sum(r.bytes or 0 for r in ordered if r.status == COMPILED),
        duration_ms=int(summary.wall_seconds * 1000),
        details={
            "manifest": plan.manifest_path,
            "namespace": scope.ns_rel,
            "warm_run": scope.run_id,
            "buckets": len(ordered),
            "compiled": summary.compiled,
            "cached": summary.cached,
            "failed": summary.failed,
            "jobs": summary.jobs,
            "executor": summary.executor,
            "retried_alone": summary.retried_alone,
            "executables": sum(r.aot_bytes is not None for r in ordered),
        },
    )
