"""The runtime object: :class:`Serving` (the manifest's functions by name, every bucket's
executable loaded, in the background (preload.py) or before it returns when warmed up, the
reports) and :func:`serving`, which builds it.

Each function's call path is :class:`~cachectl.dispatch.served_function.ServedFunction`.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from cachectl import telemetry as telemetry_mod
from cachectl.core.fingerprint import current_environment
from cachectl.dispatch import write_back
from cachectl.dispatch.loading import Executables, Slot, Verified, namespace_reader
from cachectl.dispatch.preload import Preloader
from cachectl.dispatch.reports import ServingReport
from cachectl.dispatch.served_function import ServedFunction
from cachectl.dispatch.siblings import closest_environment_hint
from cachectl.manifest import (
    Manifest,
    check_imports,
    expand,
    load_manifest,
    resolve_callable,
)
from cachectl.service.activate import activate
from cachectl.storage.executables import FunctionBinding

log = logging.getLogger("cachectl.dispatch")

OVERFLOW_MODES = ("error", "compile")
# Warm-up calls of every bucket through the request path, after its executable's first run.
SERVED_WARMUP_PASSES = 2


class Serving:
    """The manifest's functions, served from stored executables; build it with :func:`serving`."""

    def __init__(
        self,
        manifest: Manifest,
        *,
        namespace: str,
        read: Callable[[str], bytes],
        names: list[str],
        indexed: Verified | None,
        paths: Sequence[str],
        overflow: str,
        preload: bool,
        workers: int | None,
        on_load: Callable[[str, str], None] | None,
        warnings: list[str],
        warmup: bool = False,
    ) -> None:
        started = time.perf_counter()
        self.manifest = manifest
        self.namespace = namespace
        self.overflow = overflow
        self._warnings = list(warnings)
        self._warn_lock = threading.Lock()
        for message in warnings:
            log.warning(message)
        executables = Executables(read, names, indexed, on_load, self._warn, workers)
        self._functions: dict[str, ServedFunction] = {}
        slots_all: list[Slot] = []
        buckets = expand(manifest)
        for spec in manifest.functions:
            fn = resolve_callable(spec.fn, paths)
            binding = FunctionBinding.of(spec, fn)
            slots = []
            for bucket in (b for b in buckets if b.function == spec.name):
                slot = Slot(bucket)
                executables.bind(slot, spec, binding)
                slots.append(slot)
            self._functions[spec.name] = ServedFunction(
                spec, fn, slots, warn=self._warn, paths=paths, overflow=overflow
            )
            slots_all.extend(slots)
        self._slots = slots_all
        self._paths = tuple(paths)
        todo = [s for s in slots_all if s._loader is not None] if preload or warmup else []
        owner = {id(s): f for f in self._functions.values() for s in f._slots}
        self.warmup_seconds = 0.0
        self.warm_ready_seconds: float | None = None
        self._preloader: Preloader | None = None
        self._loaded_seconds: float | None = None
        if not warmup:
            # The first answer waits for no other bucket: loads run behind it, in manifest
            # order; a call to a bucket not loaded yet loads that one at once (preload.py).
            # warmup=True keeps its meaning: every bucket loaded and warmed up before this
            # returns.
            if todo:
                self._preloader = Preloader(todo, workers or 8, started)
            self.ready_seconds = time.perf_counter() - started
            if preload and not todo:
                self._loaded_seconds = self.ready_seconds
            return
        with ThreadPoolExecutor(
            max_workers=workers or min(8, max(1, len(todo))), thread_name_prefix="cachectl-load"
        ) as pool:
            list(pool.map(Slot.ensure_loaded, todo))
            self.ready_seconds = self._loaded_seconds = time.perf_counter() - started
            # Warm-up apart from loading, so that both readinesses are known.
            self.warmup_seconds = sum(
                pool.map(lambda s: owner[id(s)].warm_up(s, self._paths), todo)
            )
        # Then through the request path (pick, pad, convert, call), here, where requests
        # often arrive, every bucket in turn, twice: after one pass the first requests
        # still ran about 1.15x of steady state, after two at it (bench/field.py).
        t = time.perf_counter()
        for _ in range(SERVED_WARMUP_PASSES):
            for s in todo:
                owner[id(s)].served_warm_up(s)
        self.warmup_seconds += time.perf_counter() - t
        self.warm_ready_seconds = time.perf_counter() - started

    @property
    def loaded_seconds(self) -> float | None:
        """Construction to every bucket's executable loaded (or failed to); None while loads
        are still running, or with ``preload=False`` (each loads at its first call)."""
        if self._preloader is not None:
            return self._preloader.loaded_seconds
        return self._loaded_seconds

    def wait_loaded(self, timeout: float | None = None) -> bool:
        """Wait for the background loads (every bucket loaded or failed to, as ``preload=True``
        used to before returning); False when ``timeout`` seconds came first."""
        return self._preloader.wait(timeout) if self._preloader is not None else True

    def _warn(self, message: str) -> None:
        with self._warn_lock:
            self._warnings.append(message)
        log.warning(message)

    def __getitem__(self, name: str) -> ServedFunction:
        try:
            return self._functions[name]
        except KeyError:
            raise KeyError(
                f"{name!r} is not a function of the manifest "
                f"(functions: {', '.join(self._functions)})"
            ) from None

    def __contains__(self, name: object) -> bool:
        return name in self._functions

    @property
    def names(self) -> list[str]:
        return list(self._functions)

    def take_counts(self) -> dict[str, Any]:
        """Every function's counters since the last take: the telemetry collector's source."""
        return {name: f.take_counts() for name, f in self._functions.items()}

    def executables(self) -> dict[tuple[str, str], str | None]:
        """(function, bucket JSON) -> None when its executable is loaded, else why not (after
        the background loads)."""
        self.wait_loaded()
        return {
            (s.bucket.function, json.dumps(s.values, sort_keys=True)): None
            if s.compiled is not None
            else (s.error or "not loaded")
            for s in self._slots
        }

    def stored(self) -> dict[tuple[str, str], tuple[str | None, str | None, bool]]:
        """(function, bucket JSON) -> (its stored executable's key, None when loaded else why
        not, whether one is stored for it that this process will not use: refused or failed),
        after the background loads."""
        self.wait_loaded()
        return {
            (s.bucket.function, json.dumps(s.values, sort_keys=True)): (
                s.key,
                None if s.compiled is not None else (s.error or "not loaded"),
                s.compiled is None and (s.refused or s.key is not None),
            )
            for s in self._slots
        }

    def call_stored(self, function: str, bucket: str) -> None:
        """Call one bucket's stored executable on zeros (``bucket``: its values as sorted JSON)."""
        fn, slot = self._slot(function, bucket)
        fn.zeros_call(slot, self._paths)

    def stored_outputs(self, function: str, bucket: str, args: tuple[Any, ...]) -> Any:
        """One bucket's stored executable called on ``args``: its outputs (warm-check's canary)."""
        fn, slot = self._slot(function, bucket)
        return fn.stored_call(slot, args)

    def padded_outputs(self, function: str, bucket: str, args: tuple[Any, ...]) -> Any:
        """``args``, smaller than the bucket, padded to it as a request is, its stored executable
        called and the outputs cut back as a request's are (warm-check --padding)."""
        fn, slot = self._slot(function, bucket)
        return fn.padded_call(slot, args)

    def _slot(self, function: str, bucket: str) -> tuple[ServedFunction, Slot]:
        fn = self[function]
        for slot in fn._slots:
            if json.dumps(slot.values, sort_keys=True) == bucket:
                return fn, slot
        raise KeyError(f"{function} has no bucket {bucket}")

    def report(self, wait: bool = True) -> ServingReport:
        """What was loaded and how calls were served; ``wait`` (default) first waits for the
        background loads, so that every count is whole; ``wait=False``: as of now."""
        if wait:
            self.wait_loaded()
        return ServingReport(
            self.namespace,
            {n: f.report() for n, f in self._functions.items()},
            sum(s.load_seconds for s in self._slots),
            self.ready_seconds,
            list(self._warnings),
            self.warmup_seconds,
            self.warm_ready_seconds,
            self.loaded_seconds,
        )


def serving(
    manifest: str | Path,
    *,
    cache: str | None = None,
    readonly: bool = True,
    preload: bool = True,
    overflow: str = "error",
    db: str | None = None,
    root: str | None = None,
    paths: Sequence[str] = (),
    telemetry: bool = True,
    workers: int | None = None,
    mirror: str | None = None,
    warmup: bool = False,
    run_unverified_code: bool | None = None,
) -> Serving:
    """Activate the cache as :func:`cachectl.activate` does and load every bucket's executable.

    ``preload`` loads all of them in background threads (``workers``, default 8), in manifest
    order, behind the first calls: a call to a bucket not loaded yet loads it at once, and
    :meth:`Serving.wait_loaded` waits for the rest; otherwise each loads at its bucket's first
    call. ``overflow`` says what a call above the largest bucket does:
    ``"error"`` raises :class:`OutOfBucket`, ``"compile"`` runs ``jax.jit`` at
    the exact shape. Raises BadInput for a bad manifest; a cache, index or
    executable that is unavailable costs a warning, never an exception.
    ``mirror=DIR`` serves from a local mirror that activate() pulls first
    (entries and executables, verified against the index). ``warmup`` (which loads every
    bucket, whatever ``preload`` says) then calls each stored executable once on zeros in
    the same pool, so that no request pays XLA's first run of an executable, and twice more
    through the request path in this thread (counted nowhere); the report gives
    ``warmup_seconds`` and ``warm_ready_seconds`` apart from load and readiness.
    ``run_unverified_code`` is activate()'s: only with it does a cache that nothing can verify
    (no index, no trusted key) load what it holds.
    """
    if overflow not in OVERFLOW_MODES:
        raise ValueError(f"overflow must be one of {', '.join(OVERFLOW_MODES)}, got {overflow!r}")
    spec = load_manifest(manifest)  # validated without importing the user's code
    search = [*paths]
    activation = activate(
        cache or spec.cache,
        readonly=readonly,
        db=db,
        root=root,
        telemetry=telemetry,
        mirror=mirror,
        run_unverified_code=run_unverified_code,
    )
    # Imported only now: a module that compiles when imported (an env or model built at import)
    # then reads the cache, instead of compiling outside it.
    check_imports(spec, search)
    warnings: list[str] = []
    read, names, indexed = namespace_reader(activation, db, warnings)
    if activation.active and not names:  # say so when another mode of this machine was warmed
        hint = closest_environment_hint(activation, current_environment())
        if hint is not None:
            warnings.append(hint)
    on_load = None
    collector = None
    if telemetry:
        collector = telemetry_mod.current()
        on_load = collector.record_load if collector is not None else None
    rt = Serving(
        spec,
        namespace=activation.path,
        read=read,
        names=names,
        indexed=indexed,
        paths=search,
        overflow=overflow,
        preload=preload,
        workers=workers,
        on_load=on_load,
        warnings=warnings,
        warmup=warmup,
    )
    wb = write_back.for_serving(activation, tuple(search), rt._warn)
    for served in rt._functions.values():
        served.write_back = wb
    if collector is not None:
        collector.add_serving_source(rt.take_counts)
    return rt
