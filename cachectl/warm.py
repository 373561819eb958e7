"""Compile a manifest's buckets into a cache namespace, so a service starts with zero compiles.

``warm`` configures JAX exactly as :func:`cachectl.activate` does (same namespace,
same key-affecting config) plus ``min_compile_time_secs=0`` and
``min_entry_size_bytes=-1``, so every bucket is written under the key a service
will compute. Each bucket is ``jax.jit(fn, **jit).lower(*specs, **static).compile()``
on abstract shapes: no device memory for inputs.

How the key of each bucket is learned: JAX names it in exactly one place, its
DEBUG log (JAX's compiler logger logs the hit or miss with the key before
loading or compiling; its compilation-cache logger logs the write). A logging
filter captures these records into the compiling thread's own list (XLA compiles
run in the calling thread and release the GIL, so buckets compile concurrently
in threads), then drops them below the level the user asked for. The written
file itself is then read back from storage: its size and sha256 are what the
index records, so the index describes bytes that exist.

``check`` proves coverage the way a service sees it: a fresh process calls
``activate(readonly=True)`` and compiles every bucket; each must be a hit.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import cachectl
from cachectl import aot, jax_seam
from cachectl.context import Context
from cachectl.dispatch import Serving, _namespace_reader
from cachectl.entries import AOT_SUFFIX, CACHE_SUFFIX, CorruptEntry, parse_key, read_header, sha256
from cachectl.errors import BadInput, EnvironmentMismatch, OperationFailed
from cachectl.fingerprint import Environment, current_environment
from cachectl.index import CacheInfo, NewEntry, warm_runs
from cachectl.manifest import (
    Bucket,
    Manifest,
    build_call,
    check_imports,
    expand,
    jit_function,
    load_manifest,
    manifest_digest,
    resolve_callable,
    select_shard,
)
from cachectl.permissions import check_writer
from cachectl.runtime import apply_jax_config, jax_config_for
from cachectl.tracebacks import format_user_traceback, location
from cachectl.units import format_size

log = logging.getLogger(__name__)

# Statuses of a bucket in a warm report.
COMPILED = "compiled"      # compiled and written (and indexed)
CACHED = "cached"          # already in the namespace: loaded, not compiled
FAILED = "failed"          # import, shape or compile error; or JAX did not write it
TOO_LARGE = "too-large"    # written, then removed: above the cache's max entry size
SKIPPED = "skipped"        # not attempted: --fail-fast stopped the run first
PLANNED = "planned"        # --dry-run
# Statuses of a bucket in a coverage check.
HIT = "hit"
MISS = "miss"

EXECUTORS = ("thread", "process")
# Chosen from bench/warm.py (BENCHMARKS.md, "Warm"): threads beat processes on CPU.
DEFAULT_EXECUTOR = "thread"
HEARTBEAT_SECONDS = 30.0
_ERROR_CHARS = 400

# Settings warm adds to activate()'s: write every program, whatever its compile
# time or size, and never let a JAX-side switch disable the cache.
WARM_EXTRA_CONFIG: dict[str, Any] = {
    "jax_enable_compilation_cache": True,
    "jax_persistent_cache_min_compile_time_secs": 0.0,
    "jax_persistent_cache_min_entry_size_bytes": -1,
}
_JAX_LOGGERS = jax_seam.CACHE_LOGGERS


# --------------------------------------------------------------------------- results


@dataclass(frozen=True)
class BucketResult:
    """One bucket's outcome; the JSON report lists exactly these fields."""

    function: str
    bucket: dict[str, Any]
    status: str
    key: str | None = None
    compile_seconds: float | None = None
    bytes: int | None = None
    error: str | None = None
    # The stored executable (cachectl/aot.py): its size, or why there is none.
    aot_bytes: int | None = None
    aot_error: str | None = None
    traceback: str | None = None  # the user's frames of a failure; not in the JSON report


@dataclass(frozen=True)
class WarmSummary:
    buckets: int
    compiled: int
    cached: int
    failed: int
    compile_seconds: float
    wall_seconds: float


@dataclass(frozen=True)
class WarmReport:
    """What `cachectl warm` did; :meth:`to_json` is the contract scripts read."""

    environment: dict[str, Any]
    namespace: str
    summary: WarmSummary
    buckets: list[BucketResult]
    cache: str = ""
    manifest: str = ""
    run_id: int | None = None
    jobs: int = 1
    executor: str = DEFAULT_EXECUTOR
    dry_run: bool = False
    target_problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.summary.failed == 0 and not self.target_problems

    def to_json(self) -> dict[str, Any]:
        s = self.summary
        return {
            "environment": self.environment,
            "namespace": self.namespace,
            "summary": {
                "buckets": s.buckets, "compiled": s.compiled, "cached": s.cached, "failed": s.failed,
                "compile_seconds": round(s.compile_seconds, 3), "wall_seconds": round(s.wall_seconds, 3),
            },
            "buckets": [
                {"function": b.function, "bucket": b.bucket, "status": b.status, "key": b.key,
                 "compile_seconds": None if b.compile_seconds is None else round(b.compile_seconds, 3),
                 "bytes": b.bytes, "error": b.error, "aot_bytes": b.aot_bytes,
                 "aot_error": b.aot_error}
                for b in self.buckets
            ],
        }

    @property
    def executables(self) -> int:
        return sum(b.aot_bytes is not None for b in self.buckets)


@dataclass(frozen=True)
class CheckBucket:
    function: str
    bucket: dict[str, Any]
    status: str  # hit | miss | failed
    key: str | None = None
    seconds: float | None = None
    error: str | None = None
    # The stored executable, loaded in the same fresh process: "loaded", else why not.
    aot: str | None = None


@dataclass(frozen=True)
class CheckReport:
    """Coverage as a fresh, read-only service process sees it."""

    environment: dict[str, Any]
    namespace: str
    cache: str
    buckets: list[CheckBucket]
    warning: str | None = None

    @property
    def hits(self) -> int:
        return sum(b.status == HIT for b in self.buckets)

    @property
    def coverage(self) -> float:
        """Percent of buckets that hit; an empty manifest shard is fully covered."""
        return 100.0 * self.hits / len(self.buckets) if self.buckets else 100.0

    @property
    def ok(self) -> bool:
        return self.hits == len(self.buckets)

    @property
    def aot_loaded(self) -> int:
        return sum(b.aot == "loaded" for b in self.buckets)

    @property
    def aot_coverage(self) -> float:
        return 100.0 * self.aot_loaded / len(self.buckets) if self.buckets else 100.0

    def to_json(self) -> dict[str, Any]:
        return {
            "environment": self.environment,
            "namespace": self.namespace,
            "summary": {
                "buckets": len(self.buckets), "hits": self.hits,
                "misses": sum(b.status == MISS for b in self.buckets),
                "failed": sum(b.status == FAILED for b in self.buckets),
                "coverage": round(self.coverage, 2),
                "aot_loaded": self.aot_loaded, "aot_coverage": round(self.aot_coverage, 2),
            },
            "buckets": [
                {"function": b.function, "bucket": b.bucket, "status": b.status, "key": b.key,
                 "seconds": None if b.seconds is None else round(b.seconds, 3), "error": b.error,
                 "aot": b.aot}
                for b in self.buckets
            ],
        }


# --------------------------------------------------------------------------- capturing keys


@dataclass
class _Event:
    kind: str  # hit | miss | write | skip
    key: str | None
    text: str


class _KeyCapture(logging.Filter):
    """Routes JAX's cache log records to the compiling thread's sink; hides the DEBUG ones.

    Installed as a logger filter, so it sees every record the (temporarily DEBUG)
    logger emits, and returns False for those below the level the logger had
    before: the user's logging output is unchanged.
    """

    def __init__(self) -> None:
        super().__init__()
        self._local = threading.local()
        self._floors: dict[str, int] = {}
        self._saved: dict[str, int] = {}
        self._installs = 0
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def installed(self) -> Iterator[_KeyCapture]:
        with self._lock:
            if self._installs == 0:
                for name in _JAX_LOGGERS:
                    logger = logging.getLogger(name)
                    self._saved[name] = logger.level
                    self._floors[name] = logger.getEffectiveLevel()
                    logger.setLevel(logging.DEBUG)
                    logger.addFilter(self)
            self._installs += 1
        try:
            yield self
        finally:
            with self._lock:
                self._installs -= 1
                if self._installs == 0:
                    for name in _JAX_LOGGERS:
                        logger = logging.getLogger(name)
                        logger.removeFilter(self)
                        logger.setLevel(self._saved.get(name, logging.NOTSET))

    @contextlib.contextmanager
    def sink(self) -> Iterator[list[_Event]]:
        events: list[_Event] = []
        self._local.sink = events
        try:
            yield events
        finally:
            self._local.sink = None

    def filter(self, record: logging.LogRecord) -> bool:
        sink = getattr(self._local, "sink", None)
        if sink is not None:
            event = _classify(record)
            if event is not None:
                sink.append(event)
        return record.levelno >= self._floors.get(record.name, logging.WARNING)


def _classify(record: logging.LogRecord) -> _Event | None:
    found = jax_seam.classify_record(record)
    return None if found is None else _Event(*found)


_CAPTURE = _KeyCapture()


@dataclass(frozen=True)
class _Outcome:
    """What JAX did with one program: looked it up under ``key``, hit or compiled, wrote or not."""

    lookup: str | None  # hit | miss | None (JAX did not consult the persistent cache)
    key: str | None
    written: bool
    seconds: float
    skip_reason: str | None = None
    # aot.payload_of() of the compiled program, or why JAX could not serialize it.
    payload: bytes | None = None
    aot_error: str | None = None


def _clear_in_memory_executables() -> None:
    """Forget what this process compiled (lowerings memoize their executables), so JAX
    consults the persistent cache again."""
    import jax

    jax.clear_caches()


def _compile_once(jitted: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
                  ) -> tuple[list[_Event], float, Any]:
    lowered = jitted.lower(*args, **kwargs)
    with _CAPTURE.sink() as events:
        started = time.perf_counter()
        compiled = lowered.compile()
        seconds = time.perf_counter() - started
    return events, seconds, compiled


def _payload(compiled: Any) -> tuple[bytes | None, str | None]:
    try:
        return aot.payload_of(compiled), None
    except aot.AotError as exc:
        return None, str(exc)


def compile_bucket(jitted: Any, args: tuple[Any, ...], kwargs: dict[str, Any], *,
                   executables: bool = False) -> _Outcome:
    """Lower and compile one bucket, and say what the persistent cache did.

    A program this process already compiled comes from JAX's in-memory cache and
    never reaches the persistent one (no key is logged); then the in-memory
    executables are dropped and the bucket compiled again, which now hits.
    """
    with _CAPTURE.installed():
        events, seconds, compiled = _compile_once(jitted, args, kwargs)
        if not any(e.kind in ("hit", "miss") for e in events):
            _clear_in_memory_executables()
            events, seconds, compiled = _compile_once(jitted, args, kwargs)
    lookups = [e for e in events if e.kind in ("hit", "miss")]
    if not lookups:
        return _Outcome(None, None, False, seconds)
    last = lookups[-1]
    written = any(e.kind == "write" and e.key == last.key for e in events)
    skip = next((e.text for e in events if e.kind == "skip"), None)
    payload, aot_error = _payload(compiled) if executables else (None, None)
    return _Outcome(last.kind, last.key, written, seconds, skip, payload, aot_error)


class ErrorText(str):
    """A bucket's one-line error that also carries the traceback of the user's code (for ``-v``).

    A str, so it travels unchanged wherever warm passes error messages (and pickles
    back from worker processes with its traceback).
    """

    traceback: str | None = None


def _error_text(exc: BaseException) -> ErrorText:
    """One line: the error, ended by ``(at file:line)`` of the user's code that raised it."""
    if isinstance(exc, BadInput):
        message = exc.message
    else:
        text = str(exc).strip().splitlines()
        first = text[0] if text else ""
        message = f"{type(exc).__name__}: {first}" if first else type(exc).__name__
        if len(message) > _ERROR_CHARS:
            message = message[: _ERROR_CHARS - 3] + "..."
    where = location(exc)
    result = ErrorText(f"{message} (at {where})" if where else message)
    result.traceback = format_user_traceback(exc)
    return result


# --------------------------------------------------------------------------- JAX configuration


def warm_jax_config(path: str, env: Environment) -> dict[str, Any]:
    """activate()'s settings for ``path`` (writable) plus warm's: write everything."""
    return {**jax_config_for(path, env, readonly=False), **WARM_EXTRA_CONFIG}


@contextlib.contextmanager
def jax_configured(config: dict[str, Any]) -> Iterator[None]:
    """Point JAX at warm's namespace for the duration, then put the previous config back.

    warm owns the process's persistent cache while it runs: any cache JAX had
    opened is closed first, and reopened lazily afterwards with the old settings.
    """
    import jax

    saved = {name: getattr(jax.config, name) for name in config}
    jax_seam.reset_persistent_cache()
    apply_jax_config(config)
    _clear_in_memory_executables()
    try:
        yield
    finally:
        for name, value in saved.items():
            jax.config.update(name, value)
        jax_seam.reset_persistent_cache()


@contextlib.contextmanager
def _persistent_cache_off() -> Iterator[None]:
    """Build abstract arguments without writing what user code compiles on the way.

    A pytree function such as ``param_specs`` may run JAX eagerly (e.g.
    ``jax.random.key(0)``); those programs are not buckets and stay out of the namespace.
    JAX decides once per process whether to use its cache (``is_cache_used``), so
    the switch is flipped with a reset on both sides; no bucket compiles meanwhile.
    """
    import jax

    saved = jax.config.jax_enable_compilation_cache
    jax.config.update("jax_enable_compilation_cache", False)
    jax_seam.reset_persistent_cache()
    try:
        yield
    finally:
        jax.config.update("jax_enable_compilation_cache", saved)
        jax_seam.reset_persistent_cache()


# --------------------------------------------------------------------------- planning


@dataclass(frozen=True)
class WarmPlan:
    """A validated manifest resolved against this machine and a cache."""

    manifest: Manifest
    manifest_path: str
    buckets: list[Bucket]
    cache: CacheInfo
    environment: Environment
    target_problems: list[str]
    search_paths: tuple[str, ...]


def _environment_json(env: Environment) -> dict[str, Any]:
    return {"digest": env.digest, "namespace": env.namespace, **env.to_dict()}


def _target_problems(manifest: Manifest, env: Environment) -> list[str]:
    problems = []
    if manifest.target is not None:
        problems.extend(manifest.target.mismatches(env.backend, env.device_kind, env.device_count))
    for spec in manifest.functions:
        if spec.mesh is not None and spec.mesh.size > env.device_count:
            problems.append(f"function {spec.name!r} needs a mesh of {spec.mesh.size} devices; "
                            f"this machine has {env.device_count}")
    return problems


def plan_warm(ctx: Context, manifest_path: str | Path, *, cache: str | None = None,
              shard: tuple[int, int] | None = None, paths: Sequence[str] = (),
              writer_check: bool = True) -> WarmPlan:
    """Validate everything that can fail before compiling: manifest, cache, permission, imports.

    Raises BadInput (2) for the manifest, PermissionDenied (4) for a non-writer;
    a target mismatch is returned in ``target_problems`` (callers exit 3).
    """
    manifest = load_manifest(manifest_path)
    cache_info = ctx.cache(cache or manifest.cache or ctx.settings.cache)
    if writer_check:
        check_writer(cache_info, "warm")
    env = current_environment()
    problems = _target_problems(manifest, env)
    check_imports(manifest, paths)
    buckets = expand(manifest)
    if shard is not None:
        buckets = select_shard(buckets, *shard)
    return WarmPlan(manifest, str(manifest_path), buckets, cache_info, env, problems, tuple(paths))


def _mismatch(plan: WarmPlan) -> EnvironmentMismatch:
    fields = "; ".join(plan.target_problems)
    return EnvironmentMismatch(
        f"{plan.manifest_path}: this machine does not match the manifest's target ({fields}); "
        "nothing was compiled: run warm on the hardware the service runs on"
    )


# --------------------------------------------------------------------------- warming


def default_jobs() -> int:
    """The cores this process may use."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # pragma: no cover - not Linux
        return max(1, os.cpu_count() or 1)


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
        self._thread = threading.Thread(target=self._run, name="cachectl-warm-heartbeat", daemon=True)

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


def warm(ctx: Context, manifest_path: str | Path, *, cache: str | None = None, jobs: int | None = None,
         shard: tuple[int, int] | None = None, paths: Sequence[str] = (), fail_fast: bool = False,
         dry_run: bool = False, executor: str = DEFAULT_EXECUTOR,
         progress: ProgressFn | None = None, executables: bool = True) -> WarmReport:
    """Compile every bucket of a manifest into this environment's namespace and index them.

    Order of refusals, all before anything is compiled: bad manifest or
    unimportable function (BadInput, 2), not a writer (PermissionDenied, 4),
    wrong hardware (EnvironmentMismatch, 3). A bucket that fails later is
    reported in the result and the others continue (unless ``fail_fast``).
    With ``executables`` each bucket's compiled program is also stored
    (cachectl/aot.py) for :func:`cachectl.serving`.
    """
    if executor not in EXECUTORS:
        raise BadInput(f"unknown executor {executor!r}: use one of {', '.join(EXECUTORS)}")
    jobs = default_jobs() if jobs is None else jobs
    if jobs < 1:
        raise BadInput(f"--jobs must be at least 1, got {jobs}")
    started = time.perf_counter()
    plan = plan_warm(ctx, manifest_path, cache=cache, shard=shard, paths=paths, writer_check=not dry_run)
    env = plan.environment
    if dry_run:
        if not plan.target_problems:  # on other hardware a mesh cannot be built: exit 3 says so
            _raise_build_problems(plan)
        store = ctx.store(plan.cache)
        results = [BucketResult(b.function, dict(b.values), PLANNED) for b in plan.buckets]
        return WarmReport(_environment_json(env), store.url_for(env.namespace),
                          WarmSummary(len(results), 0, 0, 0, 0.0, time.perf_counter() - started),
                          results, cache=plan.cache.name, manifest=plan.manifest_path, jobs=jobs,
                          executor=executor, dry_run=True, target_problems=plan.target_problems)
    if plan.target_problems:
        raise _mismatch(plan)
    return _execute(ctx, plan, jobs=jobs, fail_fast=fail_fast, executor=executor,
                    progress=progress, started=started, executables=executables)


def _raise_build_problems(plan: WarmPlan) -> None:
    """Build every bucket's abstract arguments (pytrees included; nothing compiles) for --dry-run.

    What would fail a real warm before compiling is bad input: BadInput (2), every
    distinct problem on its own line, each naming the manifest's file:line.
    """
    _, calls = _build_calls(plan.manifest, plan.buckets, plan.search_paths)
    problems = list(dict.fromkeys(c for c in calls.values() if isinstance(c, str)))
    if problems:
        raise BadInput("\n".join(problems))


def _execute(ctx: Context, plan: WarmPlan, *, jobs: int, fail_fast: bool, executor: str,
             progress: ProgressFn | None, started: float, executables: bool) -> WarmReport:
    env = plan.environment
    ns, env_info = ctx.namespace(plan.cache, env)
    assert env_info is not None
    store = ctx.store(plan.cache)
    run = ctx.index.start_warm_run(env_info.id, manifest_digest=manifest_digest(plan.manifest_path),
                                   manifest_path=str(Path(plan.manifest_path).resolve()),
                                   buckets=len(plan.buckets))
    indexed = ctx.index.entry_keys(env_info.id)
    stored_aot = ctx.index.aot_keys(env_info.id) if executables else None
    digests = _function_digests(plan) if executables else {}
    counts = _Counts()
    results: dict[int, BucketResult] = {}
    lock = threading.Lock()

    def record(position: int, bucket: Bucket, outcome: _Outcome | None, error: str | None) -> BucketResult:
        result = _settle(ctx, plan, store, ns.relpath, env_info.id, run.id, indexed, bucket, outcome, error,
                         stored_aot, digests)
        with lock:
            results[position] = result
            counts.add(result.status)
        if progress is not None:
            progress(result, len(results), len(plan.buckets))
        return result

    def beat() -> None:
        ctx.index.heartbeat_warm_run(run.id, compiled=counts.compiled, cached=counts.cached,
                                     failed=counts.failed)

    status = warm_runs.INTERRUPTED
    try:
        with _Heartbeat(beat):
            config = warm_jax_config(ns.url, env)
            if executor == "process" and jobs > 1:
                _run_processes(plan, config, jobs, fail_fast, record, executables)
            else:
                _run_threads(plan, config, jobs, fail_fast, record, executables)
        status = warm_runs.FAILED if counts.failed else warm_runs.SUCCEEDED
    finally:
        ctx.index.finish_warm_run(run.id, status, compiled=counts.compiled, cached=counts.cached,
                                  failed=counts.failed)
    ordered = [
        results.get(i) or BucketResult(b.function, dict(b.values), SKIPPED,
                                       error="not attempted: --fail-fast stopped the run after a failure")
        for i, b in enumerate(plan.buckets)
    ]
    wall = time.perf_counter() - started
    compile_seconds = sum(r.compile_seconds or 0.0 for r in ordered if r.status in (COMPILED, TOO_LARGE))
    written = sum(r.bytes or 0 for r in ordered if r.status == COMPILED)
    summary = WarmSummary(len(ordered), counts.compiled, counts.cached, counts.failed, compile_seconds, wall)
    ctx.index.audit("warm", cache=plan.cache.name, entries=counts.compiled, nbytes=written,
                    duration_ms=int(wall * 1000),
                    details={"manifest": plan.manifest_path, "namespace": ns.relpath, "warm_run": run.id,
                             "buckets": len(ordered), "compiled": counts.compiled, "cached": counts.cached,
                             "failed": counts.failed, "jobs": jobs, "executor": executor,
                             "executables": sum(r.aot_bytes is not None for r in ordered)})
    return WarmReport(_environment_json(env), ns.url, summary, ordered, cache=plan.cache.name,
                      manifest=plan.manifest_path, run_id=run.id, jobs=jobs, executor=executor)


def _settle(ctx: Context, plan: WarmPlan, store: Any, ns_rel: str, env_id: int, run_id: int,
            indexed: dict[str, tuple[int, str]], bucket: Bucket, outcome: _Outcome | None,
            error: str | None, stored_aot: dict[str, tuple[int, str]] | None = None,
            digests: dict[str, tuple[str, str | None]] | None = None) -> BucketResult:
    """Turn what JAX did into a status; read the stored bytes; index them; enforce max entry size.

    With executables on (``stored_aot`` not None), a bucket is ``cached`` only
    when its JAX entry and its stored executable are both there already.
    """
    values = dict(bucket.values)
    base = {"function": bucket.function, "bucket": values}
    if error is not None or outcome is None:
        return BucketResult(**base, status=FAILED, error=str(error or "no result"),
                            traceback=getattr(error, "traceback", None))
    seconds = outcome.seconds
    if outcome.lookup is None or outcome.key is None:
        return BucketResult(**base, status=FAILED, compile_seconds=seconds,
                            error="JAX did not consult the persistent cache for this program")
    key = outcome.key
    rel = f"{ns_rel}/{key}{CACHE_SUFFIX}"
    if outcome.lookup == "miss" and not outcome.written:
        reason = outcome.skip_reason or "see the warning JAX printed"
        broken = _broken_entry(store, rel)
        if broken:  # JAX never rewrites an existing file: a broken one would stay for ever
            reason = f"{broken}; removed it, rerun warm"
        return BucketResult(**base, status=FAILED, key=key, compile_seconds=seconds,
                            error=f"compiled but JAX did not write it: {reason}")
    parsed = parse_key(key)
    module = parsed.module if parsed else key
    entry = {"key": key, "module": module, "function": bucket.function, "bucket": values,
             "warm_run_id": run_id}
    if outcome.lookup == "hit":
        known = indexed.get(key)
        if known is not None:
            size, digest = known
        else:
            try:
                data = store.read_bytes(rel)
            except FileNotFoundError:
                return BucketResult(**base, status=CACHED, key=key, compile_seconds=seconds)
            size, digest = len(data), sha256(data)
        aot_size, aot_digest, aot_error, wrote = _store_executable(
            store, ns_rel, key, digest, bucket, outcome, stored_aot, digests)
        # A hit belongs to this run too: lifecycle protects the newest run's entries.
        ctx.index.upsert_entries(env_id, [NewEntry(**entry, size=size, sha256=digest, origin="observed",
                                                   aot_size=aot_size, aot_sha256=aot_digest)])
        return BucketResult(**base, status=COMPILED if wrote else CACHED, key=key,
                            compile_seconds=seconds, bytes=size, aot_bytes=aot_size, aot_error=aot_error)
    try:
        data = store.read_bytes(rel)
    except FileNotFoundError:
        return BucketResult(**base, status=FAILED, key=key, compile_seconds=seconds,
                            error=f"JAX reported writing {rel} but it is not in the cache")
    size = len(data)
    problem = _entry_problem(data)
    if problem is not None:
        store.delete([rel])
        return BucketResult(**base, status=FAILED, key=key, compile_seconds=seconds, bytes=size,
                            error=f"JAX wrote a broken entry ({problem}){_space_hint(store, ns_rel)}; "
                                  "removed it: a rerun with space compiles it again")
    limit = plan.cache.max_entry_size
    if limit is not None and size > limit:
        store.delete([rel])
        return BucketResult(**base, status=TOO_LARGE, key=key, compile_seconds=seconds, bytes=size,
                            error=f"entry is {format_size(size)}, above the max entry size of cache "
                                  f"{plan.cache.name!r} ({format_size(limit)}): removed, not kept")
    digest = sha256(data)
    aot_size, aot_digest, aot_error, _ = _store_executable(store, ns_rel, key, digest, bucket, outcome,
                                                           stored_aot, digests)
    ctx.index.upsert_entries(env_id, [NewEntry(**entry, size=size, sha256=digest, origin="warm",
                                               compile_time_ms=int(round(seconds * 1000)),
                                               aot_size=aot_size, aot_sha256=aot_digest)])
    indexed[key] = (size, digest)
    return BucketResult(**base, status=COMPILED, key=key, compile_seconds=seconds, bytes=size,
                        aot_bytes=aot_size, aot_error=aot_error)


def _entry_problem(data: bytes) -> str | None:
    """Why bytes JAX wrote are not an entry (a full disk leaves 0-byte or truncated files)."""
    if not data:
        return "0 bytes"
    try:
        read_header(data)
    except CorruptEntry as exc:
        return f"{len(data)} bytes, {exc}"
    return None


def _broken_entry(store: Any, rel: str) -> str | None:
    """A broken file in the way of this key is removed; returns what was wrong with it."""
    try:
        data = store.read_bytes(rel)
    except (FileNotFoundError, OSError):
        return None
    problem = _entry_problem(data)
    if problem is not None:
        store.delete([rel])
        return f"a broken entry was in its place ({problem})"
    return None


def _space_hint(store: Any, ns_rel: str) -> str:
    """', no space left on DIR' when the local disk is (nearly) full."""
    if not getattr(store, "is_local", False):
        return ""
    try:
        path = store.url_for(ns_rel).removeprefix("file://")
        free = shutil.disk_usage(path).free
    except OSError:
        return ""
    return f", no space left on {path} ({free} bytes free)" if free < (1 << 20) else ""


def _function_digests(plan: WarmPlan) -> dict[str, tuple[str, str | None]]:
    """Per function: its manifest entry's and its source file's digests, bound into each executable."""
    out: dict[str, tuple[str, str | None]] = {}
    for spec in plan.manifest.functions:
        try:
            fn = resolve_callable(spec.fn, plan.search_paths)
        except Exception:  # noqa: BLE001 - the bucket reports the import error itself
            fn = None
        out[spec.name] = (aot.spec_digest(spec), aot.source_digest(fn) if fn is not None else None)
    return out


def _store_executable(store: Any, ns_rel: str, key: str, entry_sha256: str, bucket: Bucket,
                      outcome: _Outcome, stored: dict[str, tuple[int, str]] | None,
                      digests: dict[str, tuple[str, str | None]] | None = None
                      ) -> tuple[int | None, str | None, str | None, bool]:
    """Write ``<key>-aot`` unless the same one is there: (size, sha256, error, written)."""
    if stored is None:
        return None, None, None, False
    rel = f"{ns_rel}/{key}{AOT_SUFFIX}"
    known = stored.get(key)
    if known is not None and store.exists(rel):
        return known[0], known[1], None, False
    if outcome.payload is None:
        return None, None, outcome.aot_error or "no executable to store", False
    spec_digest, source = (digests or {}).get(bucket.function, (None, None))
    data = aot.pack(outcome.payload, key=key, entry_sha256=entry_sha256, function=bucket.function,
                    bucket=dict(bucket.values), spec_digest=spec_digest, source_digest=source)
    try:
        store.write_bytes(rel, data)
    except OSError as exc:
        return None, None, f"could not store the executable: {exc}", False
    digest = sha256(data)
    stored[key] = (len(data), digest)
    return len(data), digest, None, True


RecordFn = Callable[[int, Bucket, "_Outcome | None", "str | None"], BucketResult]
Call = tuple[tuple[Any, ...], dict[str, Any]]


def _build_calls(manifest: Manifest, buckets: Sequence[Bucket], paths: Sequence[str]
                 ) -> tuple[dict[str, Any], dict[int, Call | str]]:
    """The jitted function of every spec and the abstract call (or the error) of every bucket."""
    specs = {spec.name: spec for spec in manifest.functions}
    jitted: dict[str, Any] = {}
    calls: dict[int, Call | str] = {}
    with _persistent_cache_off():
        for position, bucket in enumerate(buckets):
            spec = specs[bucket.function]
            try:
                if spec.name not in jitted:
                    jitted[spec.name] = jit_function(spec, paths)
                calls[position] = build_call(spec, bucket, paths)
            except Exception as exc:  # noqa: BLE001 - one bad bucket must not stop the rest
                calls[position] = _error_text(exc)
    return jitted, calls


def _drive(submit: Callable[[int], Future[Any]] | None, run: Callable[[int], Any] | None,
           buckets: Sequence[Bucket], errors: dict[int, str], fail_fast: bool, record: RecordFn) -> None:
    """Compile every bucket and record each result as it finishes.

    With ``submit`` buckets go to a pool; with ``run`` they compile one by one in
    this thread, in manifest order (so ``fail_fast`` stops exactly at the first
    failure). ``errors`` holds buckets whose arguments could not be built.
    """

    def settle(position: int, value: Any, exc: BaseException | None) -> bool:
        if exc is not None:
            result = record(position, buckets[position], None, _error_text(exc))
        elif isinstance(value, dict):  # from a worker process
            outcome, error = _outcome_from(value)
            result = record(position, buckets[position], outcome, error)
        else:
            result = record(position, buckets[position], value, None)
        return result.status in (FAILED, TOO_LARGE)

    if submit is None:
        assert run is not None
        for position, bucket in enumerate(buckets):
            if position in errors:
                failed = record(position, bucket, None, errors[position]).status == FAILED
            else:
                try:
                    failed = settle(position, run(position), None)
                except Exception as exc:  # noqa: BLE001 - this bucket's error
                    failed = settle(position, None, exc)
            if failed and fail_fast:
                return
        return

    for position, message in sorted(errors.items()):
        record(position, buckets[position], None, message)
        if fail_fast:
            return
    pending = {submit(p): p for p in range(len(buckets)) if p not in errors}
    while pending:
        done, _ = wait(pending, return_when=FIRST_COMPLETED)
        for future in done:
            position = pending.pop(future)
            if future.cancelled():
                continue
            exc = future.exception()
            failed = settle(position, None if exc else future.result(), exc)
            if failed and fail_fast:
                for other in pending:
                    other.cancel()
                fail_fast = False  # running buckets still finish and are recorded


def _run_threads(plan: WarmPlan, config: dict[str, Any], jobs: int, fail_fast: bool,
                 record: RecordFn, executables: bool = False) -> None:
    jitted, calls = _build_calls(plan.manifest, plan.buckets, plan.search_paths)
    errors = {p: c for p, c in calls.items() if isinstance(c, str)}

    def task(position: int) -> _Outcome:
        args, kwargs = calls[position]  # type: ignore[misc]
        return compile_bucket(jitted[plan.buckets[position].function], args, kwargs,
                              executables=executables)

    with jax_configured(config), _CAPTURE.installed():
        if jobs == 1:
            _drive(None, task, plan.buckets, errors, fail_fast, record)
            return
        with ThreadPoolExecutor(max_workers=jobs, thread_name_prefix="cachectl-warm") as pool:
            _drive(lambda p: pool.submit(task, p), None, plan.buckets, errors, fail_fast, record)


# -- processes ---------------------------------------------------------------

_WORKER: dict[str, Any] = {}


def _worker_init(manifest_path: str, paths: Sequence[str], indices: Sequence[int],
                 config: dict[str, Any], executables: bool = False) -> None:
    """A spawned worker: import the functions, build every call, then configure JAX like the parent.

    Calls are built before the cache is configured, as in the parent, so programs
    user code compiles on the way (e.g. in ``param_specs``) are not written.
    """
    manifest = load_manifest(manifest_path)
    check_imports(manifest, paths)
    full = expand(manifest)
    buckets = [full[i] for i in indices]
    jitted, calls = _build_calls(manifest, buckets, paths)
    jax_seam.reset_persistent_cache()
    apply_jax_config(config)
    _WORKER.update(buckets=buckets, jitted=jitted, calls=calls, executables=executables)


def _worker_task(position: int) -> dict[str, Any]:
    """Compile the plan's bucket ``position``; plain data back to the parent."""
    call = _WORKER["calls"][position]
    if isinstance(call, str):
        return {"error": call}
    try:
        outcome = compile_bucket(_WORKER["jitted"][_WORKER["buckets"][position].function], *call,
                                 executables=_WORKER["executables"])
    except Exception as exc:  # noqa: BLE001 - reported as this bucket's error
        return {"error": _error_text(exc)}
    return {"lookup": outcome.lookup, "key": outcome.key, "written": outcome.written,
            "seconds": outcome.seconds, "skip_reason": outcome.skip_reason,
            "payload": outcome.payload, "aot_error": outcome.aot_error}


def _outcome_from(data: dict[str, Any]) -> tuple[_Outcome | None, str | None]:
    if "error" in data:
        return None, data["error"]  # an ErrorText, traceback included
    return _Outcome(data["lookup"], data["key"], data["written"], data["seconds"], data["skip_reason"],
                    data.get("payload"), data.get("aot_error")), None


def _run_processes(plan: WarmPlan, config: dict[str, Any], jobs: int, fail_fast: bool,
                   record: RecordFn, executables: bool = False) -> None:
    """One spawned JAX process per job (fork is unsafe once JAX has started threads)."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=min(jobs, max(1, len(plan.buckets))), mp_context=context,
                             initializer=_worker_init,
                             initargs=(plan.manifest_path, plan.search_paths,
                                       [b.index for b in plan.buckets], config, executables)) as pool:
        _drive(lambda p: pool.submit(_worker_task, p), None, plan.buckets, {}, fail_fast, record)


# --------------------------------------------------------------------------- coverage check


def check(ctx: Context, manifest_path: str | Path, *, cache: str | None = None,
          shard: tuple[int, int] | None = None, paths: Sequence[str] = (),
          timeout: float | None = None) -> CheckReport:
    """Load every bucket in a fresh, read-only activated process: hit or miss, and coverage.

    A fresh process is the only honest test: this one may hold executables in
    memory, and a service starts from nothing but ``activate()``.
    """
    plan = plan_warm(ctx, manifest_path, cache=cache, shard=shard, paths=paths, writer_check=False)
    if plan.target_problems:
        raise _mismatch(plan)
    request = {
        "manifest": str(Path(plan.manifest_path).resolve()), "paths": [str(Path(p).resolve()) for p in paths],
        "shard": list(shard) if shard else None, "cache": plan.cache.name, "db": ctx.settings.db,
    }
    with tempfile.TemporaryDirectory(prefix="cachectl-check-") as tmp:
        out = Path(tmp) / "result.json"
        request["out"] = str(out)
        proc = subprocess.run(
            [sys.executable, "-c", "from cachectl.warm import _check_main; _check_main()"],
            input=json.dumps(request), text=True, capture_output=True, timeout=timeout,
            cwd=os.getcwd(), env=dict(os.environ),
        )
        if not out.exists():
            tail = (proc.stderr or proc.stdout or "").strip().splitlines()[-5:]
            raise OperationFailed(f"the coverage check process failed (exit {proc.returncode}): "
                                  + " | ".join(tail))
        data = json.loads(out.read_text())
    if "error" in data:
        raise BadInput(data["error"]) if data.get("exit_code") == 2 else OperationFailed(data["error"])
    buckets = [CheckBucket(**b) for b in data["buckets"]]
    return CheckReport(_environment_json(plan.environment), data["namespace"], plan.cache.name, buckets,
                       warning=data.get("warning"))


def _check_main() -> None:
    """Entry point of the fresh check process: request JSON on stdin, result JSON to a file."""
    request = json.loads(sys.stdin.read())
    out = Path(request["out"])
    try:
        result = _check_in_this_process(request)
    except BadInput as exc:
        result = {"error": exc.message, "exit_code": 2}
    except Exception as exc:  # noqa: BLE001 - reported by the parent
        result = {"error": _error_text(exc), "exit_code": 1}
    out.write_text(json.dumps(result))


def _check_in_this_process(request: dict[str, Any]) -> dict[str, Any]:
    manifest = load_manifest(request["manifest"])
    paths = request["paths"]
    check_imports(manifest, paths)
    buckets = expand(manifest)
    if request.get("shard"):
        buckets = select_shard(buckets, *request["shard"])
    activation = cachectl.activate(request["cache"], db=request["db"], readonly=True, telemetry=False)
    if not activation.active:
        raise OperationFailed(activation.warning or "activate() did not activate the cache")
    jitted, calls = _build_calls(manifest, buckets, paths)
    results = []
    for position, bucket in enumerate(buckets):
        base = {"function": bucket.function, "bucket": dict(bucket.values)}
        call = calls[position]
        if isinstance(call, str):
            results.append({**base, "status": FAILED, "error": call})
            continue
        try:
            outcome = compile_bucket(jitted[bucket.function], *call)
        except Exception as exc:  # noqa: BLE001
            results.append({**base, "status": FAILED, "error": _error_text(exc)})
            continue
        status = HIT if outcome.lookup == "hit" else MISS
        error = None if outcome.lookup else "JAX did not consult the persistent cache"
        results.append({**base, "status": status, "key": outcome.key, "seconds": outcome.seconds,
                        "error": error})
    loaded = _executables_in_this_process(manifest, activation, request["db"], paths)
    for result in results:
        result["aot"] = loaded.get((result["function"], json.dumps(result["bucket"], sort_keys=True)),
                                   "not checked")
        if result["aot"] is None:
            result["aot"] = "loaded"
    return {"namespace": activation.path, "warning": activation.warning, "buckets": results}


def _executables_in_this_process(manifest: Manifest, activation: Any, db: str | None,
                                 paths: Sequence[str]) -> dict[tuple[str, str], str | None]:
    """Load every bucket's stored executable as cachectl.serving would (same checks)."""
    warnings: list[str] = []
    read, names, indexed = _namespace_reader(activation, db, warnings)
    rt = Serving(manifest, namespace=activation.path, read=read, names=names, indexed=indexed,
                 paths=paths, overflow="error", preload=True, workers=None, on_load=None,
                 warnings=[])
    return rt.executables()
