"""warm(): plan, compile every bucket, then record what was written in the index.

The written file itself is read back from storage: its size and sha256 are what
the index records, so the index describes bytes that exist.
"""

from __future__ import annotations

import logging
import shutil
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from cachectl.context import Context
from cachectl.core.config import default_jobs
from cachectl.core.errors import BadInput
from cachectl.core.units import format_size
from cachectl.index import NewEntry, warm_runs
from cachectl.manifest import Bucket, manifest_digest, resolve_callable
from cachectl.storage import executables as aot
from cachectl.storage import ingest
from cachectl.storage.entries import (
    AOT_SUFFIX,
    CACHE_SUFFIX,
    CorruptEntry,
    EntryName,
    parse_key,
    read_header,
    sha256,
)
from cachectl.trust import signing
from cachectl.trust.signing import SigningKey
from cachectl.warm.compiling import _Outcome, warm_jax_config
from cachectl.warm.executors import _run_processes, _run_threads
from cachectl.warm.plan import (
    WarmPlan,
    _environment_json,
    _mismatch,
    _raise_build_problems,
    plan_warm,
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
    manifest_path: str | Path,
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
    """
    if executor not in EXECUTORS:
        raise BadInput(f"unknown executor {executor!r}: use one of {', '.join(EXECUTORS)}")
    jobs = default_jobs() if jobs is None else jobs
    if jobs < 1:
        raise BadInput(f"--jobs must be at least 1, got {jobs}")
    started = time.perf_counter()
    plan = plan_warm(
        ctx, manifest_path, cache=cache, shard=shard, paths=paths, writer_check=not dry_run
    )
    env = plan.environment
    if dry_run:
        if not plan.target_problems:  # on other hardware a mesh cannot be built: exit 3 says so
            _raise_build_problems(plan)
        store = ctx.store(plan.cache)
        results = [BucketResult(b.function, dict(b.values), PLANNED) for b in plan.buckets]
        return WarmReport(
            _environment_json(env),
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
        raise _mismatch(plan)
    return _execute(
        ctx,
        plan,
        jobs=jobs,
        fail_fast=fail_fast,
        executor=executor,
        progress=progress,
        started=started,
        executables=executables,
        signer=signer,
    )


def _execute(
    ctx: Context,
    plan: WarmPlan,
    *,
    jobs: int,
    fail_fast: bool,
    executor: str,
    progress: ProgressFn | None,
    started: float,
    executables: bool,
    signer: SigningKey | None = None,
) -> WarmReport:
    env = plan.environment
    ns, env_info = ctx.namespace(plan.cache, env)
    assert env_info is not None
    store = ctx.store(plan.cache)
    run = ctx.index.start_warm_run(
        env_info.id,
        manifest_digest=manifest_digest(plan.manifest_path),
        manifest_path=str(Path(plan.manifest_path).resolve()),
        buckets=len(plan.buckets),
    )
    indexed = ctx.index.entry_keys(env_info.id)
    stored_aot = ctx.index.aot_keys(env_info.id) if executables else None
    carried = None
    if signer is not None:  # what no trusted list signed is not this run's to keep
        carried = signing.carried_files(ctx.index, plan.cache, env_info, signer)
    if carried is not None:
        indexed = {k: v for k, v in indexed.items() if carried.get(k + CACHE_SUFFIX) == v}
        if stored_aot is not None:
            stored_aot = {
                k: v
                for k, v in stored_aot.items()
                if k in indexed and carried.get(k + AOT_SUFFIX) == v
            }
    digests = _function_digests(plan) if executables else {}
    counts = _Counts()
    results: dict[int, BucketResult] = {}
    lock = threading.Lock()

    def record(
        position: int, bucket: Bucket, outcome: _Outcome | None, error: str | None
    ) -> BucketResult:
        result = _settle(
            ctx,
            plan,
            store,
            ns.relpath,
            env_info.id,
            run.id,
            indexed,
            bucket,
            outcome,
            error,
            stored_aot,
            digests,
        )
        with lock:
            results[position] = result
            counts.add(result.status)
        if progress is not None:
            progress(result, len(results), len(plan.buckets))
        return result

    def beat() -> None:
        ctx.index.heartbeat_warm_run(
            run.id, compiled=counts.compiled, cached=counts.cached, failed=counts.failed
        )

    status = warm_runs.INTERRUPTED
    retried = 0
    try:
        with _Heartbeat(beat):
            config = warm_jax_config(ns.url, env)
            if executor == "process" and jobs > 1:
                _run_processes(plan, config, jobs, fail_fast, record, executables)
            else:
                executor = "thread"  # one job runs in this process, whatever was asked
                retried = _run_threads(
                    plan,
                    config,
                    jobs,
                    fail_fast,
                    record,
                    executables,
                    present=_present(
                        store, ns.relpath, indexed, stored_aot, replace=carried is not None
                    ),
                )
        status = warm_runs.FAILED if counts.failed else warm_runs.SUCCEEDED
    finally:
        ctx.index.finish_warm_run(
            run.id, status, compiled=counts.compiled, cached=counts.cached, failed=counts.failed
        )
    ordered = [
        results.get(i)
        or BucketResult(
            b.function,
            dict(b.values),
            SKIPPED,
            error="not attempted: --fail-fast stopped the run after a failure",
        )
        for i, b in enumerate(plan.buckets)
    ]
    wall = time.perf_counter() - started
    compile_seconds = sum(
        r.compile_seconds or 0.0 for r in ordered if r.status in (COMPILED, TOO_LARGE)
    )
    written = sum(r.bytes or 0 for r in ordered if r.status == COMPILED)
    lower_seconds = sum(r.lower_seconds or 0.0 for r in ordered)
    summary = WarmSummary(
        len(ordered),
        counts.compiled,
        counts.cached,
        counts.failed,
        compile_seconds,
        wall,
        lower_seconds,
        compile_seconds / (wall * jobs) if wall > 0 else None,
        executor,
        jobs,
        retried,
    )
    ctx.index.audit(
        "warm",
        cache=plan.cache.name,
        entries=counts.compiled,
        nbytes=written,
        duration_ms=int(wall * 1000),
        details={
            "manifest": plan.manifest_path,
            "namespace": ns.relpath,
            "warm_run": run.id,
            "buckets": len(ordered),
            "compiled": counts.compiled,
            "cached": counts.cached,
            "failed": counts.failed,
            "jobs": jobs,
            "executor": executor,
            "retried_alone": retried,
            "executables": sum(r.aot_bytes is not None for r in ordered),
        },
    )
    return WarmReport(
        _environment_json(env),
        ns.url,
        summary,
        ordered,
        cache=plan.cache.name,
        manifest=plan.manifest_path,
        run_id=run.id,
        jobs=jobs,
        executor=executor,
    )


def _present(
    store: Any,
    ns_rel: str,
    indexed: dict[str, tuple[int, str]],
    stored_aot: dict[str, tuple[int, str]] | None,
    replace: bool = False,
) -> Callable[[str], bool]:
    """Whether a key is fully warmed already: indexed, its entry (and stored executable) on storage.

    Called from the compiling threads once a bucket is lowered; a yes means
    the bucket is ``cached`` without being compiled or loaded. With ``replace`` (a signed
    warm: ``indexed`` holds only signed entries) a file at a key it does not hold is removed
    first, so JAX compiles the bucket and writes it again instead of loading that file.
    """

    def present(key: str) -> bool:
        entry = f"{ns_rel}/{key}{CACHE_SUFFIX}"
        if key not in indexed:
            if replace and store.exists(entry):
                log.warning("warm: %s is not signed: removed, compiling it again", entry)
                store.delete([entry, f"{ns_rel}/{key}{AOT_SUFFIX}"])
            return False
        if not store.exists(entry):
            return False
        return stored_aot is None or (
            key in stored_aot and store.exists(f"{ns_rel}/{key}{AOT_SUFFIX}")
        )

    return present


def _settle(
    ctx: Context,
    plan: WarmPlan,
    store: Any,
    ns_rel: str,
    env_id: int,
    run_id: int,
    indexed: dict[str, tuple[int, str]],
    bucket: Bucket,
    outcome: _Outcome | None,
    error: str | None,
    stored_aot: dict[str, tuple[int, str]] | None = None,
    digests: dict[str, tuple[str, str | None]] | None = None,
) -> BucketResult:
    """Turn what JAX did into a status; read the stored bytes; index them; enforce max entry size.

    With executables on (``stored_aot`` not None), a bucket is ``cached`` only
    when its JAX entry and its stored executable are both there already.
    """
    values = dict(bucket.values)
    base: dict[str, Any] = {"function": bucket.function, "bucket": values}
    if error is not None or outcome is None:
        return BucketResult(
            **base,
            status=FAILED,
            error=str(error or "no result"),
            traceback=getattr(error, "traceback", None),
        )
    base["lower_seconds"] = outcome.lower_seconds
    seconds = outcome.seconds
    if outcome.lookup is None or outcome.key is None:
        return BucketResult(
            **base,
            status=FAILED,
            compile_seconds=seconds,
            error="JAX did not consult the persistent cache for this program",
        )
    key = outcome.key
    rel = f"{ns_rel}/{key}{CACHE_SUFFIX}"
    if outcome.lookup == "miss" and not outcome.written:
        reason = outcome.skip_reason or "see the warning JAX printed"
        broken = _broken_entry(store, rel)
        if broken:  # JAX never rewrites an existing file: a broken one would stay for ever
            reason = f"{broken}; removed it, rerun warm"
        return BucketResult(
            **base,
            status=FAILED,
            key=key,
            compile_seconds=seconds,
            error=f"compiled but JAX did not write it: {reason}",
        )
    parsed = parse_key(key)
    module = parsed.module if parsed else key
    entry: dict[str, Any] = {
        "key": key,
        "module": module,
        "function": bucket.function,
        "bucket": values,
        "warm_run_id": run_id,
    }
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
        # A hit belongs to this run too: lifecycle protects the newest run's entries.
        row = NewEntry(**entry, size=size, sha256=digest, origin="observed")
        aot_size, aot_error, wrote, aot_file = _publish(
            ctx, plan, env_id, store, ns_rel, row, bucket, outcome, stored_aot, digests
        )
        return BucketResult(
            **base,
            status=COMPILED if wrote else CACHED,
            key=key,
            compile_seconds=seconds,
            bytes=size,
            aot_bytes=aot_size,
            aot_error=aot_error,
            # JAX loaded the entry, this run did not write it: only a new executable is its own
            # (signed only beside an entry a trusted list already signed).
            written=_written(key, aot=aot_file if wrote else None),
        )
    try:
        data = store.read_bytes(rel)
    except FileNotFoundError:
        return BucketResult(
            **base,
            status=FAILED,
            key=key,
            compile_seconds=seconds,
            error=f"JAX reported writing {rel} but it is not in the cache",
        )
    size = len(data)
    problem = _entry_problem(data)
    if problem is not None:
        store.delete([rel])
        return BucketResult(
            **base,
            status=FAILED,
            key=key,
            compile_seconds=seconds,
            bytes=size,
            error=f"JAX wrote a broken entry ({problem}){_space_hint(store, ns_rel)}; "
            "removed it: a rerun with space compiles it again",
        )
    try:  # the rules every new entry meets (ingest.py): max entry size, a JAX entry, its sha256
        row = ingest.check_new(
            plan.cache,
            EntryName(key, module),
            data,
            origin="warm",
            compile_time_ms=int(round(seconds * 1000)),
            function=bucket.function,
            bucket=values,
            warm_run_id=run_id,
        )
    except ingest.Refused as exc:
        store.delete([rel])
        limit = plan.cache.max_entry_size
        if exc.rule == ingest.TOO_LARGE and limit is not None:
            return BucketResult(
                **base,
                status=TOO_LARGE,
                key=key,
                compile_seconds=seconds,
                bytes=size,
                error=f"entry is {format_size(size)}, above the max entry size of cache "
                f"{plan.cache.name!r} ({format_size(limit)}): removed, not kept",
            )
        return BucketResult(
            **base,
            status=FAILED,
            key=key,
            compile_seconds=seconds,
            bytes=size,
            error=f"JAX wrote an entry that is not kept ({exc.message}); removed it",
        )
    aot_size, aot_error, wrote, aot_file = _publish(
        ctx, plan, env_id, store, ns_rel, row, bucket, outcome, stored_aot, digests
    )
    indexed[key] = (size, row.sha256)
    return BucketResult(
        **base,
        status=COMPILED,
        key=key,
        compile_seconds=seconds,
        bytes=size,
        aot_bytes=aot_size,
        aot_error=aot_error,
        written=_written(key, (size, row.sha256), aot_file if wrote else None),
    )


def _written(
    key: str, entry: tuple[int, str] | None = None, aot: tuple[int, str] | None = None
) -> tuple[tuple[str, int, str], ...]:
    """(name, size, sha256) of the files a bucket wrote: what its signer signs."""
    files = [(key + CACHE_SUFFIX, *entry)] if entry is not None else []
    if aot is not None:
        files.append((key + AOT_SUFFIX, *aot))
    return tuple(files)


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


def _publish(
    ctx: Context,
    plan: WarmPlan,
    env_id: int,
    store: Any,
    ns_rel: str,
    row: NewEntry,
    bucket: Bucket,
    outcome: _Outcome,
    stored: dict[str, tuple[int, str]] | None,
    digests: dict[str, tuple[str, str | None]] | None,
) -> tuple[int | None, str | None, bool, tuple[int, str] | None]:
    """Index the entry JAX wrote, with ``<key>-aot`` written beside it unless the same one is there,
    through ingest.publish: (executable's size, its error, whether it was written now, and then
    its size and sha256)."""
    key = row.key
    data: bytes | None = None
    error: str | None = None
    known = stored.get(key) if stored is not None else None
    if stored is None:
        pass
    elif known is not None and (outcome.stored or store.exists(f"{ns_rel}/{key}{AOT_SUFFIX}")):
        row = replace(row, aot_size=known[0], aot_sha256=known[1])  # stored: present() just looked
    elif outcome.payload is None:
        error = outcome.aot_error or "no executable to store"
    else:
        spec_digest, source = (digests or {}).get(bucket.function, (None, None))
        data = aot.pack(
            outcome.payload,
            key=key,
            entry_sha256=row.sha256,
            function=bucket.function,
            bucket=dict(bucket.values),
            spec_digest=spec_digest,
            source_digest=source,
            custom_calls=outcome.custom_calls,
        )
        row = replace(row, aot_size=len(data), aot_sha256=sha256(data))
    published = ingest.publish(
        ctx.index,
        plan.cache,
        plan.environment,
        env_id,
        store,
        [ingest.NewObject(row, executable=data, in_storage=True)],
        quota=False,
        namespace_ready=True,
    )
    failure = published.failed.get(key)
    if failure is not None:
        return None, f"could not store the executable: {failure[1]}", False, None
    if data is not None and stored is not None:
        stored[key] = (len(data), row.aot_sha256 or "")
    if data is None:
        return row.aot_size, error, False, None
    return row.aot_size, error, True, (len(data), row.aot_sha256 or "")
