"""The runtime object: :class:`Serving`, its functions' call path and their counters."""

from __future__ import annotations

import json
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from cachectl import telemetry as telemetry_mod
from cachectl.core import jax_seam
from cachectl.dispatch import padding
from cachectl.dispatch.calls import (
    DeclaredLeaves,
    OutOfBucket,
    StructureMismatch,
    arg_plans,
    covering,
    coverings,
    first_difference,
    fit_pytree,
    pad_to,
    pytree_sizes,
    smallest_first,
)
from cachectl.dispatch.loading import Executables, Slot, Verified, namespace_reader
from cachectl.dispatch.reports import FunctionReport, ServingReport
from cachectl.manifest import (
    FunctionSpec,
    Manifest,
    build_call,
    check_imports,
    expand,
    is_jitted,
    jit_options,
    load_manifest,
    resolve_callable,
)
from cachectl.service.activate import activate
from cachectl.storage.executables import ExecutableError, Unbound, source_digest, spec_digest
from cachectl.telemetry import ServingCounts

log = logging.getLogger("cachectl.dispatch")

OVERFLOW_MODES = ("error", "compile")
# Distinct raw sizes kept per bucketed axis (for bucket advice); beyond, only counted.
MAX_SIZES_PER_AXIS = 4096
# ... and per telemetry flush (one JSON row per function and flush).
MAX_SIZES_PER_FLUSH = 1024
# Warm-up calls of every bucket through the request path, after its executable's first run.
SERVED_WARMUP_PASSES = 2


class NoDummyInput(ValueError):
    """A stored executable whose arguments have no zero value to call it with (PRNG keys)."""


def _zeros(info: Any) -> Any:
    """Zeros for one abstract argument (a ``jax.stages.ArgInfo``), typed keys included."""
    try:
        return padding.zeros(info.shape, info.dtype)
    except TypeError:
        raise NoDummyInput(f"no zero value for an argument of dtype {info.dtype}") from None


class ServedFunction:
    """A manifest function: call it like the function itself; calls go to stored executables."""

    def __init__(self, rt: Serving, spec: FunctionSpec, fn: Any, slots: list[Slot]) -> None:
        self._rt = rt
        self.name = spec.name
        self.spec = spec
        self._fn = fn
        self._jit_options = jit_options(spec)
        self._jitted: Any = None
        self._plans = arg_plans(spec)
        self._dynamic = [i for i, p in enumerate(self._plans) if p.kind != "value"]
        self._shape_axes = {a for p in self._plans for _, a in p.dims} | {
            a for p in self._plans if p.arg is not None for a in p.arg.pytree_axes()
        }
        self._fixed_kwargs = {k: v for k, v in spec.kwargs.items() if not isinstance(v, dict)}
        self._axis_kwargs = {k: v["axis"] for k, v in spec.kwargs.items() if isinstance(v, dict)}
        self._slots = smallest_first(slots, self._shape_axes, set(self._axis_kwargs.values()))
        self._lock = threading.Lock()
        self.calls = self.aot = self.fallback = self.out_of_bucket = self.padded = 0
        self.fallback_reason: str | None = None
        self._sizes: dict[str, Counter[int]] = {a: Counter() for a in sorted(self._shape_axes)}
        self._warned = False
        self._outputs = spec.outputs
        self._taken = (0, 0, 0, 0, 0)  # counters already handed to telemetry
        self._sizes_new: dict[str, Counter[int]] = {a: Counter() for a in sorted(self._shape_axes)}
        self._exact_pytrees = [
            i for i, p in enumerate(self._plans) if p.kind == "pytree" and not p.has_leaf_axes
        ]
        # Bucket axes that only an undeclared pytree can carry: serving cannot see them.
        unrouted = sorted(set(spec.buckets) - self._shape_axes - set(self._axis_kwargs.values()))
        if not self._exact_pytrees:
            unrouted = []
        self._unrouted = unrouted
        if unrouted:
            rt._warn(padding.undeclared_warning(self.name, unrouted, self._exact_pytrees))

    # -- the call path ------------------------------------------------------

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        static = self._statics(args, kwargs)
        flat: dict[int, DeclaredLeaves] = {}
        raw = self._raw_sizes(args, flat)
        self._count(raw)
        try:
            slot, call_args, padded = self._fit(args, raw, static, flat)
        except padding.Unpaddable as exc:  # refused: never a padded answer that can be wrong
            return self._via_jit(self._convert(args, None)[0], kwargs, str(exc), exact=True)
        if slot is None:
            return self._overflow(args, kwargs, raw, static)
        if padded:
            with self._lock:
                self.padded += 1
        slot.ensure_loaded()
        if isinstance(slot.compiled, Unbound):
            dynamic = tuple(call_args[i] for i in self._dynamic)
            import jax

            try:
                slot.compiled = slot.compiled.bind(jax.tree_util.tree_structure((dynamic, {})))
            except ExecutableError as exc:
                raise StructureMismatch(f"{self.name}: {exc}") from None
        if slot.compiled is not None:
            out = self._call_stored(slot, call_args)
        else:
            out = self._via_jit(call_args, kwargs, slot.error)
        if self._outputs and any(raw[a] != slot.values[a] for a in raw):
            return self._cut(out, raw)
        return out  # nothing to cut: the device arrays as computed, no host copy

    def _fit(self, args: Any, raw: Any, static: Any, flat: Any) -> tuple[Any, list[Any], bool]:
        """The smallest covering bucket (None: none) and the call padded to it (padding.fit)."""
        try:
            return padding.fit(coverings(self._slots, raw, static), self._convert, args, flat)
        except padding.Unpaddable as exc:
            raise padding.Unpaddable.explained(exc, self.name, self._plans) from None
        except padding.PadFnRefused as exc:
            raise self._out(f"{self.name}: {exc}") from None

    def _statics(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
        """The call's bucket-axis keywords, by axis; refuses a count of arguments, a keyword or
        a static value the manifest does not list."""
        plans = self._plans
        if len(args) != len(plans):
            raise TypeError(
                f"{self.name}() takes {len(plans)} positional arguments as the manifest "
                f"lists them, got {len(args)}"
            )
        static: dict[str, Any] = {}
        for name, value in kwargs.items():
            axis = self._axis_kwargs.get(name)
            if axis is not None:
                static[axis] = value
            elif name in self._fixed_kwargs:
                if value != self._fixed_kwargs[name]:
                    raise self._out(
                        f"{self.name}: static {name}={value!r}; the manifest warmed "
                        f"{name}={self._fixed_kwargs[name]!r}"
                    )
            else:
                raise TypeError(
                    f"{self.name}() got keyword {name!r}, which the manifest does not list"
                )
        for name, axis in self._axis_kwargs.items():
            if axis not in static:
                raise TypeError(f"{self.name}() needs keyword {name!r} (bucket axis {axis!r})")
        for i, p in enumerate(plans):
            if p.kind == "value" and args[i] != p.value:
                raise self._out(
                    f"{self.name}: static argument {i} is {args[i]!r}; the manifest warmed "
                    f"{p.value!r}"
                )
        return static

    def _raw_sizes(
        self, args: tuple[Any, ...], flat: dict[int, DeclaredLeaves] | None = None
    ) -> dict[str, int]:
        """Each bucketed axis's size in this call: the largest of the dimensions it names
        (``flat`` keeps each pytree argument as flattened, for :meth:`_convert`)."""
        raw: dict[str, int] = {}
        for i, p in enumerate(self._plans):
            if p.has_leaf_axes:
                declared = pytree_sizes(p, args[i], raw)
                if flat is not None:
                    flat[i] = declared
            elif p.dims:
                shape = np.shape(args[i])
                if len(shape) != len(p.shape):
                    raise TypeError(
                        f"{self.name}: argument {i} has {len(shape)} dimensions; the "
                        f"manifest's shape {list(p.shape)} has {len(p.shape)}"
                    )
                for d, axis in p.dims:
                    if shape[d] > raw.get(axis, -1):
                        raw[axis] = shape[d]
        return raw

    def _count(self, raw: dict[str, int]) -> None:
        """Count the call and its raw sizes (bounded per axis, and per telemetry flush)."""
        with self._lock:
            self.calls += 1
            for axis, size in raw.items():
                sizes = self._sizes[axis]
                if size in sizes or len(sizes) < MAX_SIZES_PER_AXIS:
                    sizes[size] += 1
                fresh = self._sizes_new[axis]
                if size in fresh or len(fresh) < MAX_SIZES_PER_FLUSH:
                    fresh[size] += 1

    def _call_stored(self, slot: Slot, call_args: list[Any]) -> Any:
        """Call the bucket's stored executable; a structure it was not compiled for says why."""
        assert slot.compiled is not None
        try:
            out = slot.compiled(*[call_args[i] for i in self._dynamic])
        except TypeError as exc:
            if "compiled with" in str(exc) and self._unrouted:
                dynamic = tuple(call_args[i] for i in self._dynamic)
                raise self._out(
                    f"{self.name}: the call's pytree leaves are not bucket {slot.values}'s: "
                    + padding.undeclared(slot, dynamic, self._dynamic, self._unrouted)
                    + " ("
                    + "; ".join(str(exc).splitlines()[1:3])
                    + ")"
                ) from None
            if "pytree" in str(exc):
                raise StructureMismatch(
                    f"{self.name}: the arguments' structure differs from the warmed one: "
                    f"{first_difference(slot.compiled.in_tree, ((tuple(call_args[i] for i in self._dynamic)), {}))}"
                ) from None
            raise
        with self._lock:
            self.aot += 1
        return out

    def _zeros_call(self, slot: Slot, paths: Sequence[str]) -> None:
        """Call the bucket's stored executable once on zeros of its abstract arguments and wait
        for it: what warm-check runs in a child process. Raises whatever the call raises."""
        import jax

        slot.ensure_loaded()
        if slot.compiled is None:
            raise ValueError(slot.error or "no stored executable loaded")
        if isinstance(slot.compiled, Unbound):  # the structure comes from the manifest
            args, _ = build_call(self.spec, slot.bucket, paths)
            dynamic = tuple(args[i] for i in self._dynamic)
            slot.compiled = slot.compiled.bind(jax.tree_util.tree_structure((dynamic, {})))
        args, kwargs = jax.tree_util.tree_map(_zeros, slot.compiled.args_info)
        jax.block_until_ready(slot.compiled(*args, **kwargs))

    def _stored_call(self, slot: Slot, args: tuple[Any, ...]) -> Any:
        """The bucket's stored executable called on ``args`` (the whole call, statics included),
        its outputs waited for: warm-check's canary. Raises whatever the call raises."""
        import jax

        slot.ensure_loaded()
        if slot.compiled is None:
            raise ValueError(slot.error or "no stored executable loaded")
        dynamic = tuple(args[i] for i in self._dynamic)
        if isinstance(slot.compiled, Unbound):
            slot.compiled = slot.compiled.bind(jax.tree_util.tree_structure((dynamic, {})))
        return jax.block_until_ready(slot.compiled(*dynamic))

    def _warm_up(self, slot: Slot, paths: Sequence[str]) -> float:
        """``warmup=True``: the bucket's first execution (XLA's first run of a loaded executable
        is slower than the next) on zeros, before any request; seconds spent. One that raises
        is not called again: its bucket is served through jax.jit."""
        started = time.perf_counter()
        if slot.compiled is None:  # not loaded, or its first warm-up call raised
            return 0.0
        try:
            self._zeros_call(slot, paths)
        except NoDummyInput:
            pass  # nothing to call it with: the first request pays its first run
        except Exception as exc:  # noqa: BLE001 - that bucket falls back, the service starts
            slot.compiled, slot.error = None, f"its warm-up call raised {type(exc).__name__}: {exc}"
        return time.perf_counter() - started

    def _served_warm_up(self, slot: Slot) -> None:
        """One call of the bucket through ``__call__`` on zeros of its arguments, counted nowhere;
        a call that fails here only leaves its first request cold."""
        import jax

        if slot.compiled is None or isinstance(slot.compiled, Unbound):
            return
        try:
            dynamic, _ = jax.tree_util.tree_map(_zeros, slot.compiled.args_info)
        except NoDummyInput:
            return
        given = iter(dynamic)
        args = [p.value if p.kind == "value" else next(given) for p in self._plans]
        kwargs = {name: slot.values[axis] for name, axis in self._axis_kwargs.items()}
        try:
            if (
                covering(
                    self._slots, self._raw_sizes(tuple(args)), self._statics(tuple(args), kwargs)
                )
                is not slot
            ):
                return  # routed elsewhere (a bucket of the same sizes): nothing to warm here
        except (TypeError, ValueError, OutOfBucket):
            return
        with self._lock:
            saved = (self.calls, self.aot, self.fallback, self.out_of_bucket, self.padded)
            sizes = {a: c.copy() for a, c in self._sizes.items()}
            fresh = {a: c.copy() for a, c in self._sizes_new.items()}
        try:
            jax.block_until_ready(self(*args, **kwargs))
        except Exception as exc:  # noqa: BLE001 - best effort: the service starts regardless
            log.debug("cachectl.serving: %s: warm-up through the request path: %s", self.name, exc)
        finally:
            with self._lock:
                self.calls, self.aot, self.fallback, self.out_of_bucket, self.padded = saved
                self._sizes, self._sizes_new = sizes, fresh

    def _out(self, message: str) -> OutOfBucket:
        with self._lock:
            self.out_of_bucket += 1
        return OutOfBucket(message)

    def _convert(
        self,
        args: tuple[Any, ...],
        values: dict[str, Any] | None,
        flat: dict[int, DeclaredLeaves] | None = None,
    ) -> tuple[list[Any], bool]:
        """Pad bucketed dimensions to ``values`` (None: no padding) and match the manifest's dtypes,
        on the host."""
        out = list(args)
        padded = False
        for i, p in enumerate(self._plans):
            if p.has_leaf_axes and values is not None:
                out[i], did = fit_pytree(
                    p, i, args[i], values, (flat or {}).get(i), self._rt._paths
                )
                padded = padded or did
                continue
            if p.kind != "array":
                continue
            x = args[i]
            target = p.target(values) if p.dims and values is not None else None
            if target is not None and np.shape(x) != target:
                out[i] = pad_to(x, target, p.pad, p.dtype)
                padded = True
            elif getattr(x, "dtype", None) != p.dtype:
                out[i] = np.asarray(x, dtype=p.dtype)
        return out, padded

    def _jit(self) -> Any:
        if self._jitted is None:
            import jax

            self._jitted = (
                self._fn if is_jitted(self._fn) else jax.jit(self._fn, **self._jit_options)
            )
        return self._jitted

    def _via_jit(
        self, call_args: list[Any], kwargs: dict[str, Any], reason: str | None, exact: bool = False
    ) -> Any:
        """The same padded call through jax.jit, which hits the persistent cache warm filled
        (``exact``: the call unpadded, at its own shapes, which compile)."""
        with self._lock:
            self.fallback += 1
            first = not self._warned
            self._warned = True
            if self.fallback_reason is None:
                self.fallback_reason = reason
        jit_args, jit_kwargs = self._jit_args(call_args), {**self._fixed_kwargs, **kwargs}
        if first:
            if self._host_callbacks(jit_args, jit_kwargs):  # warm cannot help: say what can
                reason = jax_seam.host_callbacks_cause([self.name])
                with self._lock:
                    self.fallback_reason = reason
            message = (
                f"cachectl.serving: {self.name}: serving through jax.jit"
                + ("" if exact else " and the persistent cache")
                + f": {reason or 'no stored executable'}"
            )
            self._rt._warn(message)
        return self._jit()(*jit_args, **jit_kwargs)

    def _host_callbacks(self, args: list[Any], kwargs: dict[str, Any]) -> bool:
        """Whether this call's program has host callbacks (lowered once, at the first fallback:
        jit's own call reuses the trace); False when lowering says nothing."""
        try:
            return jax_seam.lowered_has_host_callbacks(self._jit().lower(*args, **kwargs))
        except Exception:  # noqa: BLE001 - the jit call itself raises what is wrong
            return False

    def _jit_args(self, call_args: list[Any]) -> list[Any]:
        """Give jit the manifest's abstract form, so the program (and key) is warm's."""
        out = list(call_args)
        for i, p in enumerate(self._plans):
            if p.kind == "array" and p.weak and np.ndim(out[i]) == 0:
                out[i] = np.asarray(out[i]).item()
        return out

    def _overflow(
        self,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        raw: dict[str, int],
        static: dict[str, Any],
    ) -> Any:
        if self._rt.overflow == "compile":
            with self._lock:
                self.out_of_bucket += 1
            converted, _ = self._convert(args, None)
            return self._jit()(*self._jit_args(converted), **{**self._fixed_kwargs, **kwargs})
        largest = {a: max(s.values[a] for s in self._slots) for a in raw} if self._slots else {}
        over = [
            f"{a}={n} (largest bucket {largest[a]})"
            for a, n in raw.items()
            if n > largest.get(a, -1)
        ]
        detail = (
            ", ".join(over) or ", ".join(f"{a}={v!r}" for a, v in static.items()) + " not warmed"
        )
        raise self._out(
            f"{self.name}: no warmed bucket covers {detail}; add a bucket to the manifest "
            "or use overflow='compile'"
        )

    def _cut(self, out: Any, raw: dict[str, int]) -> Any:
        """Cut declared outputs back to the request's sizes, on the host (slicing on device compiles)."""
        import jax

        leaves, tree = jax.tree_util.tree_flatten(out)
        specs = self._outputs or []
        for n, spec in enumerate(specs[: len(leaves)]):
            if spec is None:
                continue
            index = tuple(
                slice(0, raw[d]) if isinstance(d, str) and d in raw else slice(None)
                for d in spec.shape
            )
            leaves[n] = padding.host_slice(leaves[n], index)
        return jax.tree_util.tree_unflatten(tree, leaves)

    # -- reporting ------------------------------------------------------------

    def take_counts(self) -> Any:
        """What changed since the last take, for telemetry (cachectl.telemetry.ServingCounts)."""
        with self._lock:
            now = (self.calls, self.aot, self.fallback, self.out_of_bucket, self.padded)
            calls, aot, fallback, out_of_bucket, padded = (
                a - b for a, b in zip(now, self._taken, strict=True)
            )
            self._taken = now
            sizes = {a: dict(c) for a, c in self._sizes_new.items() if c}
            self._sizes_new = {a: Counter() for a in self._sizes_new}
        return ServingCounts(calls, aot, fallback, out_of_bucket, padded, sizes=sizes)

    def report(self) -> FunctionReport:
        with self._lock:
            return FunctionReport(
                self.calls,
                self.aot,
                self.fallback,
                self.out_of_bucket,
                self.padded,
                len(self._slots),
                sum(s.compiled is not None for s in self._slots),
                self.fallback_reason or next((s.error for s in self._slots if s.error), None),
                {a: dict(c) for a, c in self._sizes.items()},
            )

    @property
    def buckets(self) -> list[dict[str, Any]]:
        return [dict(s.values) for s in self._slots]


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
            digests = (spec_digest(spec), source_digest(fn))
            slots = []
            for bucket in (b for b in buckets if b.function == spec.name):
                slot = Slot(bucket)
                executables.bind(slot, spec, digests)
                slots.append(slot)
            self._functions[spec.name] = ServedFunction(self, spec, fn, slots)
            slots_all.extend(slots)
        self._slots = slots_all
        self._paths = tuple(paths)
        todo = [s for s in slots_all if s._loader is not None] if preload or warmup else []
        owner = {id(s): f for f in self._functions.values() for s in f._slots}
        self.warmup_seconds = 0.0
        self.warm_ready_seconds: float | None = None
        with ThreadPoolExecutor(
            max_workers=workers or min(8, max(1, len(todo))), thread_name_prefix="cachectl-load"
        ) as pool:
            list(pool.map(Slot.ensure_loaded, todo))
            self.ready_seconds = time.perf_counter() - started
            # Warm-up apart from loading, so that both readinesses are known.
            if warmup:
                self.warmup_seconds = sum(
                    pool.map(lambda s: owner[id(s)]._warm_up(s, self._paths), todo)
                )
        if warmup:
            # Then through the request path (pick, pad, convert, call), here, where requests
            # often arrive, every bucket in turn, twice: after one pass the first requests
            # still ran about 1.15x of steady state, after two at it (bench/field.py).
            t = time.perf_counter()
            for _ in range(SERVED_WARMUP_PASSES):
                for s in todo:
                    owner[id(s)]._served_warm_up(s)
            self.warmup_seconds += time.perf_counter() - t
            self.warm_ready_seconds = time.perf_counter() - started

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
        """(function, bucket JSON) -> None when its executable is loaded, else why not."""
        return {
            (s.bucket.function, json.dumps(s.values, sort_keys=True)): None
            if s.compiled is not None
            else (s.error or "not loaded")
            for s in self._slots
        }

    def stored(self) -> dict[tuple[str, str], tuple[str | None, str | None]]:
        """(function, bucket JSON) -> (its stored executable's key, None when loaded else why not)."""
        return {
            (s.bucket.function, json.dumps(s.values, sort_keys=True)): (
                s.key,
                None if s.compiled is not None else (s.error or "not loaded"),
            )
            for s in self._slots
        }

    def call_stored(self, function: str, bucket: str) -> None:
        """Call one bucket's stored executable on zeros (``bucket``: its values as sorted JSON)."""
        fn, slot = self._slot(function, bucket)
        fn._zeros_call(slot, self._paths)

    def stored_outputs(self, function: str, bucket: str, args: tuple[Any, ...]) -> Any:
        """One bucket's stored executable called on ``args``: its outputs (warm-check's canary)."""
        fn, slot = self._slot(function, bucket)
        return fn._stored_call(slot, args)

    def _slot(self, function: str, bucket: str) -> tuple[ServedFunction, Slot]:
        fn = self[function]
        for slot in fn._slots:
            if json.dumps(slot.values, sort_keys=True) == bucket:
                return fn, slot
        raise KeyError(f"{function} has no bucket {bucket}")

    def report(self) -> ServingReport:
        return ServingReport(
            self.namespace,
            {n: f.report() for n, f in self._functions.items()},
            sum(s.load_seconds for s in self._slots),
            self.ready_seconds,
            list(self._warnings),
            self.warmup_seconds,
            self.warm_ready_seconds,
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

    ``preload`` loads all of them now, in a thread pool (readiness is the
    slowest load, not their sum); otherwise each loads at its bucket's first
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
    if collector is not None:
        collector.add_serving_source(rt.take_counts)
    return rt
