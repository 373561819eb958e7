"""Run a plan's buckets: one by one, in a thread pool, or in spawned processes."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from typing import Any

from cachectl.core import jax_seam
from cachectl.core.jaxlog import CAPTURE
from cachectl.manifest import Bucket, check_imports, compiling_for, expand, load_manifest
from cachectl.service.activate import apply_jax_config
from cachectl.warm.compiling import Outcome, compile_bucket, error_text, jax_configured
from cachectl.warm.plan import WarmPlan, build_calls, target_devices
from cachectl.warm.reports import FAILED, TOO_LARGE, BucketResult
from cachectl.warm.slice_guard import only_target_programs

RecordFn = Callable[[int, Bucket, "Outcome | None", "str | None"], BucketResult]


def _drive(
    submit: Callable[[int], Future[Any]] | None,
    run: Callable[[int], Any] | None,
    buckets: Sequence[Bucket],
    errors: dict[int, str],
    fail_fast: bool,
    record: RecordFn,
    written: set[str] | None = None,
) -> int:
    """Compile every bucket and record each result as it finishes; returns how many buckets
    were retried alone.

    With ``submit`` buckets go to a pool; with ``run`` they compile one by one in
    this thread, in manifest order (so ``fail_fast`` stops exactly at the first
    failure). ``errors`` holds buckets whose arguments could not be built. With both, a
    bucket that raised in the pool is run again with ``run``, alone, once the pool is done,
    and only that outcome is recorded: tracing in threads at once races on libraries'
    process-global state (NumPyro's effect-handler stack), which no bucket alone does.
    ``written`` gathers the keys worker processes say they wrote.
    """

    def settle(position: int, value: Any, exc: BaseException | None) -> bool:
        if exc is not None:
            result = record(position, buckets[position], None, error_text(exc))
        elif isinstance(value, dict):  # from a worker process
            outcome, error = _outcome_from(value, written)
            result = record(position, buckets[position], outcome, error)
        else:
            result = record(position, buckets[position], value, None)
        return result.status in (FAILED, TOO_LARGE)

    def alone(position: int) -> bool:
        assert run is not None
        try:
            return settle(position, run(position), None)
        except Exception as exc:  # noqa: BLE001 - this bucket's error
            return settle(position, None, exc)

    if submit is None:
        for position, bucket in enumerate(buckets):
            if position in errors:
                failed = record(position, bucket, None, errors[position]).status == FAILED
            else:
                failed = alone(position)
            if failed and fail_fast:
                return 0
        return 0

    for position, message in sorted(errors.items()):
        record(position, buckets[position], None, message)
        if fail_fast:
            return 0
    retry: list[int] = []
    pending = {submit(p): p for p in range(len(buckets)) if p not in errors}
    while pending:
        done, _ = wait(pending, return_when=FIRST_COMPLETED)
        for future in done:
            position = pending.pop(future)
            if future.cancelled():
                continue
            error = future.exception()
            if error is not None and run is not None:
                retry.append(position)  # failed only next to others, maybe: judged alone later
                continue
            failed = settle(position, None if error else future.result(), error)
            if failed and fail_fast:
                for other in pending:
                    other.cancel()
                fail_fast = False  # running buckets still finish and are recorded
    for n, position in enumerate(sorted(retry)):
        if alone(position) and fail_fast:
            return n + 1
    return len(retry)


def run_threads(
    plan: WarmPlan,
    config: dict[str, Any],
    jobs: int,
    fail_fast: bool,
    record: RecordFn,
    executables: bool = False,
    present: Callable[[str, Bucket], bool] | None = None,
    peer_entry: bool = False,
) -> int:
    """In this process: one by one (``jobs`` 1) or in a pool; ``present`` skips stored buckets;
    ``peer_entry``: compile_bucket's, for a process JAX never writes from.

    Returns how many buckets failed in the pool and were run again alone (see ``_drive``)."""
    devices = target_devices(plan)
    jitted, calls = build_calls(plan.manifest, plan.buckets, plan.search_paths, devices)
    errors = {p: c for p, c in calls.items() if isinstance(c, str)}

    def task(position: int) -> Outcome:
        call = calls[position]
        assert not isinstance(call, str)  # buckets in errors are never compiled
        args, kwargs = call
        bucket = plan.buckets[position]
        return compile_bucket(
            jitted[bucket.function],
            args,
            kwargs,
            executables=executables,
            present=None if present is None else (lambda key: present(key, bucket)),
            peer_entry=peer_entry,
        )

    with (
        jax_configured(config),
        CAPTURE.installed(),
        compiling_for(devices),
        only_target_programs(devices),
    ):
        if jobs == 1:
            return _drive(None, task, plan.buckets, errors, fail_fast, record)
        with ThreadPoolExecutor(max_workers=jobs, thread_name_prefix="cachectl-warm") as pool:
            return _drive(
                lambda p: pool.submit(task, p), task, plan.buckets, errors, fail_fast, record
            )


# -- processes ---------------------------------------------------------------

_WORKER: dict[str, Any] = {}
_WORKER_SCOPE = contextlib.ExitStack()  # what a worker keeps open until it exits


def _worker_init(
    manifest_path: str,
    paths: Sequence[str],
    indices: Sequence[int],
    config: dict[str, Any],
    executables: bool = False,
) -> None:
    """A spawned worker: import the functions, build every call, then configure JAX like the parent.

    Calls are built before the cache is configured, as in the parent, so programs
    user code compiles on the way (e.g. in ``param_specs``) are not written. Every key JAX
    writes in the worker is recorded from here on, and handed back with the next bucket's result.
    """
    _WORKER["written_keys"] = _WORKER_SCOPE.enter_context(CAPTURE.writes())
    jax_seam.record_puts()
    manifest = load_manifest(manifest_path)
    check_imports(manifest, paths)
    full = expand(manifest)
    buckets = [full[i] for i in indices]
    jitted, calls = build_calls(manifest, buckets, paths)
    jax_seam.reset_persistent_cache()
    apply_jax_config(config)
    _WORKER.update(buckets=buckets, jitted=jitted, calls=calls, executables=executables)


def _worker_task(position: int) -> dict[str, Any]:
    """Compile the plan's bucket ``position``; plain data back to the parent, with the keys
    this worker wrote since its last result (``written_keys``: a failed bucket's too)."""
    call = _WORKER["calls"][position]
    if isinstance(call, str):
        return {"error": call, "written_keys": _written_since()}
    try:
        outcome = compile_bucket(
            _WORKER["jitted"][_WORKER["buckets"][position].function],
            *call,
            executables=_WORKER["executables"],
        )
    except Exception as exc:  # noqa: BLE001 - reported as this bucket's error
        return {"error": error_text(exc), "written_keys": _written_since()}
    return {**dataclasses.asdict(outcome), "written_keys": _written_since()}


def _written_since() -> dict[str, tuple[str, ...]]:
    """The keys the worker wrote since it last said (one written meanwhile goes with the next),
    each with the sha256s of what it handed JAX there (jax_seam.record_puts)."""
    written: set[str] = _WORKER["written_keys"]
    keys = sorted(written)
    written.difference_update(keys)
    return {k: jax_seam.put_sha256s(k) for k in keys}


def _outcome_from(
    data: dict[str, Any], written: set[str] | None
) -> tuple[Outcome | None, str | None]:
    data = dict(data)
    keys = data.pop("written_keys", {})
    for key, shas in keys.items():  # a worker's puts count as this run's (side programs)
        jax_seam.remember_puts(key, shas)
    if written is not None:
        written.update(keys)
    if "error" in data:
        return None, data["error"]  # an ErrorText, traceback included
    return Outcome(**data), None


def run_processes(
    plan: WarmPlan,
    config: dict[str, Any],
    jobs: int,
    fail_fast: bool,
    record: RecordFn,
    executables: bool = False,
    written: set[str] | None = None,
) -> None:
    """One spawned JAX process per job (fork is unsafe once JAX has started threads);
    ``written`` gathers the keys the workers wrote (CAPTURE.writes in each)."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(
        max_workers=min(jobs, max(1, len(plan.buckets))),
        mp_context=context,
        initializer=_worker_init,
        initargs=(
            plan.manifest_path,
            plan.search_paths,
            [b.index for b in plan.buckets],
            config,
            executables,
        ),
    ) as pool:
        _drive(
            lambda p: pool.submit(_worker_task, p),
            None,
            plan.buckets,
            {},
            fail_fast,
            record,
            written,
        )
