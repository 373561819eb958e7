"""``warm-check --padding``: proof that padding a call to its bucket changes no answer.

For each bucket of each function, a few raw sizes below it on each padded axis (the axes an
array's ``shape`` or a pytree's ``leaf_axes`` names; the previous bucket + 1, one in between,
the bucket - 1), the other axes at the bucket's values. At each, in the calling child of
warm-check (cachectl.warm.check.call_main, whose ``Serving`` loaded every executable through
the verified path), seeded random inputs at the raw size are padded to the bucket exactly as
``cachectl.serving`` pads a request (``ServedFunction.padded_call``: the same ``_convert`` and
``_cut``), the bucket's stored executable runs on them, and the outputs, cut back as serving
cuts them, are compared with plain ``jax.jit`` at the raw shape (persistent cache off), within
a tolerance per dtype. A model that lets padded positions leak (a mean over the padded axis)
differs; one that ignores them (a sum, a masked mean) does not.

Inputs at the raw size: floats uniform in [0, 1), integers in [0, 8) (token ids of a small
vocabulary), typed keys from random key data, and every bool leaf all True: the valid region,
which serving's padding extends with False, the mask ``cachectl.mask`` gives.
"""

from __future__ import annotations

import json
import zlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from cachectl.core.jsonable import to_jsonable
from cachectl.dispatch import padding as pads
from cachectl.manifest import build_call, expand
from cachectl.manifest.buckets import Bucket
from cachectl.manifest.schema import FunctionSpec, Manifest
from cachectl.warm.canary import fresh_outputs
from cachectl.warm.compiling import error_text

EQUAL, DIFFERS, SKIPPED, NOT_RUN = "equal", "differs", "skipped", "not-run"
NOT_PADDED = "not-padded"  # serving does not pad this call (it goes through jax.jit)

# (rtol, atol) per floating dtype: a few units in the last place, for reductions whose order
# differs between the padded and the raw program. Other floats (float8_*): 2 eps and eps.
TOLERANCES: dict[str, tuple[float, float]] = {
    "float64": (1e-10, 1e-12),
    "float32": (1e-5, 1e-6),
    "bfloat16": (1.6e-2, 1e-2),
    "float16": (2e-3, 1e-3),
}
_COMPLEX = {"complex64": "float32", "complex128": "float64"}


@dataclass(frozen=True)
class PaddingLeaf:
    """One output leaf: its largest difference over the samples and where it was."""

    leaf: int
    dtype: str
    max_abs: float
    rtol: float
    atol: float
    ok: bool
    axis: str | None = None
    bucket: dict[str, Any] | None = None
    raw: int | None = None
    # The function declares no ``outputs:``: serving returns this leaf padded, so it was
    # compared in the region jit's output covers.
    uncut: bool = False
    # False: the manifest declares this output ``null`` (returned as computed, padded: what its
    # padded positions hold is the caller's to ignore, as a kv cache's beyond the prompt); its
    # difference is shown and fails nothing.
    judged: bool = True


@dataclass(frozen=True)
class PaddingFunction:
    """One function's verdict: equal, differs, skipped (nothing padded) or not-run (why)."""

    function: str
    status: str
    samples: int = 0  # raw sizes compared
    max_abs: float | None = None
    axis: str | None = None
    bucket: dict[str, Any] | None = None
    raw: int | None = None
    # The padded axes along which some sample differs (or could not run).
    axes: list[str] = field(default_factory=list)
    leaves: list[PaddingLeaf] = field(default_factory=list)
    note: str | None = None


@dataclass(frozen=True)
class PaddingReport:
    functions: list[PaddingFunction]
    rtol: float | None = None  # --rtol/--atol: None where the dtype's default applies
    atol: float | None = None

    @property
    def failed(self) -> list[PaddingFunction]:
        return [f for f in self.functions if f.status in (DIFFERS, NOT_RUN)]

    @property
    def ok(self) -> bool:
        return not self.failed

    def to_json(self) -> dict[str, Any]:
        return to_jsonable(self)


# --------------------------------------------------------------------------- what is sampled


def padded_axes(spec: FunctionSpec) -> list[str]:
    """The bucket axes serving pads: named in an array's shape or a pytree's leaf_axes."""
    axes: set[str] = set()
    for arg in spec.args:
        if arg.kind == "array":
            axes.update(d for d in arg.shape or [] if isinstance(d, str))
        elif arg.kind == "pytree" and arg.leaf_axes:
            axes.update(arg.pytree_axes())
    return sorted(a for a in axes if a in spec.buckets)


def raw_sizes(buckets: Sequence[Bucket], bucket: Bucket, axis: str) -> list[int]:
    """Up to three sizes below ``bucket`` on ``axis`` that serving pads to it: the previous
    bucket (same values on the other axes) + 1, one in between, the bucket - 1."""
    size = bucket.values[axis]
    if not isinstance(size, int) or isinstance(size, bool):
        return []
    others = {a: v for a, v in bucket.values.items() if a != axis}
    below = (
        b.values[axis]
        for b in buckets
        if isinstance(b.values[axis], int)
        and b.values[axis] < size
        and all(b.values.get(a) == v for a, v in others.items())
    )
    lo, hi = max(below, default=0) + 1, size - 1
    return sorted({r for r in (lo, (lo + hi) // 2, hi) if 1 <= lo <= r <= hi})


def samples(manifest: Manifest, buckets: Sequence[Bucket], bucket: Bucket) -> list[tuple[str, int]]:
    """(axis, raw size) of every sample of ``bucket``."""
    spec = manifest.function(bucket.function)
    same = [b for b in buckets if b.function == bucket.function]
    return [(a, r) for a in padded_axes(spec) for r in raw_sizes(same, bucket, a)]


# --------------------------------------------------------------------------- the calling child


def raw_inputs(
    spec: FunctionSpec, bucket: Bucket, paths: Sequence[str], seed: int
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The call at ``bucket``'s (raw) sizes with seeded random host values (the rule above)."""
    import jax

    args, kwargs = build_call(spec, bucket, paths)
    rng = np.random.default_rng(seed)

    def concrete(leaf: Any) -> Any:
        if not isinstance(leaf, jax.ShapeDtypeStruct):
            return leaf
        shape = tuple(leaf.shape)
        if pads.is_key(leaf.dtype):
            impl = leaf.dtype._impl
            data = rng.integers(0, 2**32, shape + tuple(impl.key_shape), dtype=np.uint32)
            return jax.random.wrap_key_data(data, impl=impl.name)  # type: ignore[arg-type]
        dtype = np.dtype(leaf.dtype)
        if dtype == np.bool_:
            return np.ones(shape, np.bool_)
        if np.issubdtype(dtype, np.integer):
            return rng.integers(0, 8, shape).astype(dtype)
        return rng.random(shape).astype(dtype)

    return jax.tree_util.tree_map(concrete, args), kwargs


def check_bucket(rt: Any, request: dict[str, Any], function: str, bucket: str) -> list[Any]:
    """Every sample of one bucket (``bucket``: its values as sorted JSON), in the calling child:
    [axis, raw, status, leaves or None, why or None]."""
    buckets = expand(rt.manifest)
    which = next(
        b
        for b in buckets
        if b.function == function and json.dumps(dict(b.values), sort_keys=True) == bucket
    )
    options = request.get("padding") or {}
    return [
        _sample(rt, request["paths"], function, bucket, which, axis, raw, options)
        for axis, raw in samples(rt.manifest, buckets, which)
    ]


def _sample(
    rt: Any,
    paths: Sequence[str],
    function: str,
    bucket: str,
    which: Bucket,
    axis: str,
    raw: int,
    options: dict[str, Any],
) -> list[Any]:
    spec = rt[function].spec
    small = Bucket(function, {**which.values, axis: raw}, which.index)
    seed = zlib.crc32(f"{function}/{bucket}/{axis}/{raw}".encode())
    try:
        args, _ = raw_inputs(spec, small, paths, seed)
        served = rt.padded_outputs(function, bucket, args)
    except (pads.Unpaddable, pads.PadFnRefused) as exc:
        return [axis, raw, NOT_PADDED, None, str(exc)]
    except Exception as exc:  # noqa: BLE001 - said in the report; the check fails on it
        return [axis, raw, NOT_RUN, None, f"the stored executable, padded: {error_text(exc)}"]
    try:
        # Inputs of their own (same seed): the stored call may have donated its arguments.
        args, kwargs = raw_inputs(spec, small, paths, seed)
        fresh = fresh_outputs(spec, paths, args, kwargs)
    except Exception as exc:  # noqa: BLE001
        return [axis, raw, NOT_RUN, None, f"jax.jit at the raw shape: {error_text(exc)}"]
    leaves, why = compare(served, fresh, options.get("rtol"), options.get("atol"))
    if why is not None:
        return [axis, raw, DIFFERS, None, why]
    declared = spec.outputs or []
    for x in leaves:  # `outputs: [..., null]`: returned as computed, padded; shown, not judged
        x["judged"] = not (x["leaf"] < len(declared) and declared[x["leaf"]] is None)
    same = all(x["ok"] or not x["judged"] for x in leaves)
    return [axis, raw, EQUAL if same else DIFFERS, leaves, None]


# --------------------------------------------------------------------------- comparing


def tolerance(dtype: str, rtol: float | None, atol: float | None) -> tuple[float, float] | None:
    """(rtol, atol) for a floating dtype, ``--rtol``/``--atol`` first; None: compared exactly."""
    name = _COMPLEX.get(dtype, dtype)
    default = TOLERANCES.get(name)
    if default is None:
        if not name.startswith("float"):
            return None  # integers, bools, typed keys
        import jax.numpy as jnp

        eps = float(jnp.finfo(name).eps)
        default = (2 * eps, eps)
    return (default[0] if rtol is None else rtol, default[1] if atol is None else atol)


def _host(leaf: Any) -> tuple[str, np.ndarray]:
    """(dtype name, numpy values): bfloat16 and float8 as float64, typed keys by their data."""
    dtype = getattr(leaf, "dtype", None)
    if dtype is not None and pads.is_key(dtype):
        import jax

        return str(dtype), np.asarray(jax.random.key_data(leaf))
    array = np.asarray(leaf)
    if array.dtype.kind == "V" or str(array.dtype) not in np.sctypeDict:
        return str(array.dtype), array.astype(np.float64)
    return str(array.dtype), array


def compare(
    served: Any, fresh: Any, rtol: float | None, atol: float | None
) -> tuple[list[dict[str, Any]], str | None]:
    """Per output leaf: the largest absolute difference and whether it is within tolerance
    (NaN equal to NaN); or why the outputs cannot be compared (count, dtype, shape)."""
    import jax

    a = [_host(x) for x in jax.tree_util.tree_leaves(served)]
    b = [_host(x) for x in jax.tree_util.tree_leaves(fresh)]
    if len(a) != len(b):
        return [], f"{len(a)} outputs served, {len(b)} from jit"
    out = []
    for i, ((da, xa), (db, xb)) in enumerate(zip(a, b, strict=True)):
        uncut = False
        if xa.shape != xb.shape:
            if xa.ndim != xb.ndim or any(p < r for p, r in zip(xa.shape, xb.shape, strict=True)):
                return [], f"output {i}: {da}{list(xa.shape)} served, {db}{list(xb.shape)} by jit"
            xa, uncut = xa[tuple(slice(0, r) for r in xb.shape)], True
        if da != db:
            return [], f"output {i}: {da} served, {db} by jit"
        tol = tolerance(da, rtol, atol)
        inexact = xa.dtype.kind in "fc"
        diff = np.abs(xa.astype(np.complex128 if xa.dtype.kind == "c" else np.float64) - xb)
        finite = np.isfinite(diff) if inexact else np.ones(diff.shape, bool)
        worst = float(diff[finite].max(initial=0.0))
        if tol is None:
            ok = bool(np.array_equal(xa, xb))
            r_, a_ = 0.0, 0.0
        else:
            r_, a_ = tol
            ok = bool(np.allclose(xa, xb, rtol=r_, atol=a_, equal_nan=True))
        if inexact and bool((np.isnan(xa) != np.isnan(xb)).any()):
            ok, worst = False, float("inf")
        out.append(
            {
                "leaf": i,
                "dtype": da,
                "max_abs": worst,
                "rtol": r_,
                "atol": a_,
                "ok": ok,
                "uncut": uncut,
            }
        )
    return out, None


# --------------------------------------------------------------------------- the report


def report(
    manifest: Manifest,
    buckets: Sequence[Bucket],
    results: dict[tuple[str, str], list[Any]],
    ran: set[tuple[str, str]],
    rtol: float | None,
    atol: float | None,
    checked: Sequence[Bucket] | None = None,
) -> PaddingReport:
    """Each function's verdict from the calling children's samples (``results``, by function
    and bucket JSON); ``buckets``: the manifest's, ``checked``: those of them checked (a
    shard's; None: all); ``ran``: the buckets whose stored executable ran on zeros."""
    functions = []
    for spec in manifest.functions:
        mine = [b for b in checked or buckets if b.function == spec.name]
        if not mine:
            continue
        functions.append(_verdict(manifest, buckets, spec, mine, results, ran))
    return PaddingReport(functions, rtol, atol)


def _verdict(
    manifest: Manifest,
    buckets: Sequence[Bucket],
    spec: FunctionSpec,
    mine: list[Bucket],
    results: dict[tuple[str, str], list[Any]],
    ran: set[tuple[str, str]],
) -> PaddingFunction:
    name = spec.name
    if not padded_axes(spec):
        return PaddingFunction(name, SKIPPED, note="no padded axis: its buckets are all static")
    rows: list[tuple[Bucket, list[Any]]] = []
    not_run: list[str] = []
    for b in mine:
        where = (name, json.dumps(dict(b.values), sort_keys=True))
        wanted = samples(manifest, buckets, b)
        if not wanted:
            continue
        if where not in ran or where not in results:
            not_run.append(f"{b.label}: its stored executable did not run")
            continue
        rows.extend((b, row) for row in results[where])
    if not rows and not not_run:
        return PaddingFunction(name, SKIPPED, note="no raw size below any bucket: nothing to pad")
    compared = [(b, r) for b, r in rows if r[2] in (EQUAL, DIFFERS)]
    differing = [(b, r) for b, r in compared if r[2] == DIFFERS]
    not_run += [f"{b.label}, {r[0]}={r[1]}: {r[4]}" for b, r in rows if r[2] == NOT_RUN]
    leaves = _worst_leaves(compared)
    if not compared and not not_run:
        note = next(r[4] for _, r in rows)
        return PaddingFunction(name, SKIPPED, note=f"serving does not pad its calls: {note}")
    status = DIFFERS if differing else NOT_RUN if not_run else EQUAL
    pool = differing or compared
    axes = sorted({r[0] for _, r in differing}) or sorted(
        {r[0] for _, r in rows if r[2] == NOT_RUN}
    )
    note = "; ".join(not_run[:3]) + (f" (and {len(not_run) - 3} more)" if len(not_run) > 3 else "")
    if differing and any(r[3] is None for _, r in differing):
        note = "; ".join(str(r[4]) for _, r in differing if r[3] is None)
    if not pool:
        return PaddingFunction(name, status, axes=axes, note=note or None)
    b, r = max(pool, key=lambda br: _largest(br[1][3]))
    worst = _largest(r[3])
    return PaddingFunction(
        name,
        status,
        samples=len(compared),
        max_abs=worst,
        axis=r[0],
        bucket=dict(b.values),
        raw=r[1],
        axes=axes,
        leaves=leaves,
        note=note or None,
    )


def _largest(leaves: list[dict[str, Any]] | None) -> float:
    """A sample's largest difference over the leaves it judges (all of them when it judges
    none); infinite when its outputs could not be compared."""
    if leaves is None:
        return float("inf")
    judged = [x for x in leaves if x.get("judged", True)] or leaves
    return max((x["max_abs"] for x in judged), default=0.0)


def _worst_leaves(compared: list[tuple[Bucket, list[Any]]]) -> list[PaddingLeaf]:
    """Per output leaf, the sample with its largest difference (a failing one first)."""
    best: dict[int, tuple[tuple[bool, float], PaddingLeaf]] = {}
    for b, (axis, raw, _, leaves, _) in compared:
        for x in leaves or []:
            rank = (not x["ok"] and x.get("judged", True), x["max_abs"])
            if x["leaf"] not in best or rank > best[x["leaf"]][0]:
                best[x["leaf"]] = (
                    rank,
                    PaddingLeaf(**x, axis=axis, bucket=dict(b.values), raw=raw),
                )
    return [best[i][1] for i in sorted(best)]
