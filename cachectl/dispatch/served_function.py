"""One manifest function served: fit a call to a bucket, call its stored executable (or
``jax.jit``), cut the outputs, count it; and the calls no request makes (warm-up, warm-check).

:class:`~cachectl.dispatch.router.Serving` holds one :class:`ServedFunction` per function of
the manifest and hands it what it needs (its slots, the warning sink, the overflow mode).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

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
from cachectl.dispatch.loading import Slot
from cachectl.dispatch.placement import sharding_difference
from cachectl.dispatch.reports import FunctionReport
from cachectl.manifest import FunctionSpec, build_call, is_jitted, jit_options
from cachectl.storage.executables import ExecutableError, Unbound
from cachectl.telemetry import ServingCounts

log = logging.getLogger("cachectl.dispatch")

# Distinct raw sizes kept per bucketed axis (for bucket advice); beyond, only counted.
MAX_SIZES_PER_AXIS = 4096
# ... and per telemetry flush (one JSON row per function and flush).
MAX_SIZES_PER_FLUSH = 1024


class NoDummyInput(ValueError):
    """A stored executable whose arguments have no zero value to call it with (PRNG keys)."""


class _LeavesNotWarmed(Exception):
    """A pytree argument without leaf_axes whose leaves are not the bucket's: the call goes
    through jit at its own shapes, with a warning naming the leaf and the leaf_axes to declare
    (OutOfBucket is for ``overflow: error`` alone)."""


class _PlacedOtherwise(Exception):
    """An argument on devices with a sharding the stored executable was not compiled for: the
    call goes through jit at the service's own shardings, with a warning naming it."""


def _zeros(info: Any) -> Any:
    """Zeros for one abstract argument (a ``jax.stages.ArgInfo``), typed keys included."""
    try:
        return padding.zeros(info.shape, info.dtype)
    except TypeError:
        raise NoDummyInput(f"no zero value for an argument of dtype {info.dtype}") from None


class ServedFunction:
    """A manifest function: call it like the function itself; calls go to stored executables."""

    def __init__(
        self,
        spec: FunctionSpec,
        fn: Any,
        slots: list[Slot],
        *,
        warn: Callable[[str], None],
        paths: Sequence[str],
        overflow: str,
    ) -> None:
        self._warn, self._paths, self.overflow = warn, tuple(paths), overflow
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
        self._warmed_abstract: dict[int, Any] = {}  # slot -> its abstract call (mesh placement)
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
            warn(padding.undeclared_warning(self.name, unrouted, self._exact_pytrees))

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
            try:
                self._bind(slot, call_args, {**self._fixed_kwargs, **kwargs})
            except ExecutableError as exc:
                raise StructureMismatch(f"{self.name}: {exc}") from None
        if slot.compiled is not None:
            try:
                out = self._call_stored(slot, call_args)
            except (_LeavesNotWarmed, _PlacedOtherwise) as exc:  # jit: right, if slower
                return self._via_jit(self._convert(args, None)[0], kwargs, str(exc), exact=True)
        else:
            out = self._via_jit(self._placed_as_warmed(slot, call_args), kwargs, slot.error)
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
            if "pytree" in str(exc):
                raise StructureMismatch(
                    f"{self.name}: the arguments' structure differs from the warmed one: "
                    f"{first_difference(slot.compiled.in_tree, ((tuple(call_args[i] for i in self._dynamic)), {}))}"
                ) from None
            if "compiled with" in str(exc) and self._exact_pytrees:
                dynamic = tuple(call_args[i] for i in self._dynamic)
                axes = self._unrouted or sorted(slot.values)
                raise _LeavesNotWarmed(
                    f"the call's pytree leaves are not bucket {slot.values}'s: "
                    + padding.undeclared(slot, dynamic, self._dynamic, axes)
                    + " ("
                    + "; ".join(str(exc).splitlines()[1:3])
                    + ")"
                ) from None
            raise
        except ValueError as exc:
            if "compiled for input shardings" not in str(exc):
                raise
            # The service placed an argument otherwise than warm did (its own NamedSharding
            # over its mesh): jit at the service's shardings, as plain JAX would, never a raise.
            dynamic = tuple(call_args[i] for i in self._dynamic)
            raise _PlacedOtherwise(
                sharding_difference(slot.compiled, dynamic, self._dynamic)
            ) from None
        with self._lock:
            self.aot += 1
        return out

    def zeros_call(self, slot: Slot, paths: Sequence[str]) -> None:
        """Call the bucket's stored executable once on zeros of its abstract arguments and wait
        for it: what warm-check runs in a child process. Raises whatever the call raises."""
        import jax

        slot.ensure_loaded()
        if slot.compiled is None:
            raise ValueError(slot.error or "no stored executable loaded")
        if isinstance(slot.compiled, Unbound):  # the structure comes from the manifest
            self._bind(slot, *build_call(self.spec, slot.bucket, paths))
        args, kwargs = jax.tree_util.tree_map(_zeros, slot.compiled.args_info)
        jax.block_until_ready(slot.compiled(*args, **kwargs))

    def stored_call(self, slot: Slot, args: tuple[Any, ...]) -> Any:
        """The bucket's stored executable called on ``args`` (the whole call, statics included),
        its outputs waited for: warm-check's canary. Raises whatever the call raises."""
        import jax

        slot.ensure_loaded()
        if slot.compiled is None:
            raise ValueError(slot.error or "no stored executable loaded")
        dynamic = tuple(args[i] for i in self._dynamic)
        if isinstance(slot.compiled, Unbound):
            self._bind(slot, args, build_call(self.spec, slot.bucket, self._paths)[1])
        return jax.block_until_ready(slot.compiled(*dynamic))

    def _bind(self, slot: Slot, call_args: Sequence[Any], kwargs: dict[str, Any]) -> None:
        """Bind the slot's Unbound executable to this call's input structure and, where the
        outputs' was not stored (static callables in a train state), to the outputs' structure of
        the function traced on this call: what jit would return, the service's own objects in it."""
        import jax

        dynamic = tuple(call_args[i] for i in self._dynamic)
        out_tree = None
        if slot.compiled.needs_out_tree:
            out_tree = jax.tree_util.tree_structure(
                jax.eval_shape(self._jit(), *call_args, **kwargs)
            )
        slot.compiled = slot.compiled.bind(jax.tree_util.tree_structure((dynamic, {})), out_tree)

    def warm_up(self, slot: Slot, paths: Sequence[str]) -> float:
        """``warmup=True``: the bucket's first execution (XLA's first run of a loaded executable
        is slower than the next) on zeros, before any request; seconds spent. One that raises
        is not called again: its bucket is served through jax.jit."""
        started = time.perf_counter()
        if slot.compiled is None:  # not loaded, or its first warm-up call raised
            return 0.0
        try:
            self.zeros_call(slot, paths)
        except NoDummyInput:
            pass  # nothing to call it with: the first request pays its first run
        except Exception as exc:  # noqa: BLE001 - that bucket falls back, the service starts
            slot.compiled, slot.error = None, f"its warm-up call raised {type(exc).__name__}: {exc}"
        return time.perf_counter() - started

    def served_warm_up(self, slot: Slot) -> None:
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
                out[i], did = fit_pytree(p, i, args[i], values, (flat or {}).get(i), self._paths)
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
            self._warn(message)
        return self._jit()(*jit_args, **jit_kwargs)

    def _placed_as_warmed(self, slot: Slot, call_args: list[Any]) -> list[Any]:
        """The call's host arrays placed with the shardings warm lowered the bucket with (a
        mesh function's NamedShardings): jit then traces warm's program, hits its entry and
        gives its output shardings. Device arrays keep the service's own placement; a call
        whose structure is not the manifest's is left as it is (jit says what is wrong)."""
        if self.spec.mesh is None and not any(a.sharding for a in self.spec.args):
            return call_args
        import jax

        abstract = self._warmed_abstract.get(id(slot))
        if abstract is None:  # built once per bucket: a fallback call is a request's hot path
            abstract = self._warmed_abstract[id(slot)] = build_call(
                self.spec, slot.bucket, self._paths
            )[0]

        def place(leaf: Any, want: Any) -> Any:
            sharding = getattr(want, "sharding", None)
            if sharding is None or isinstance(leaf, jax.Array):
                return leaf
            return jax.device_put(leaf, sharding)

        out = list(call_args)
        for i in self._dynamic:
            with contextlib.suppress(TypeError, ValueError):
                out[i] = jax.tree_util.tree_map(place, call_args[i], abstract[i])
        return out

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
        if self.overflow == "compile":
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
