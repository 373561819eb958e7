"""`cachectl misses`: every program signature a service missed, explained against the manifest.

The expected signatures are computed the way the service's are recorded: each bucket of
the manifest is lowered (never compiled) in this process with the same pxla tap the
collector uses (cachectl.core.jax_seam), so both sides are JAX's own flat input avals
and shardings. A missed signature is compared with the nearest bucket of its function
(same module name, same number of inputs, fewest differing fields) and every differing
field is said in words a user acts on.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import re
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

from sqlalchemy import select

from cachectl.core import jax_seam
from cachectl.core.errors import BadInput
from cachectl.index.models import Cache, Entry, WarmRun, utcnow
from cachectl.index.models import Environment as EnvRow
from cachectl.index.telemetry_queries import SignatureRow, signature_usage
from cachectl.manifest import build_call, expand, jit_function, load_manifest
from cachectl.telemetry import _SignatureTap
from cachectl.warm import _persistent_cache_off

EXPLOSION = 8  # distinct values of one dimension among a function's misses: bucket it


@dataclass(frozen=True)
class ExpectedSignature:
    """One warmed bucket as JAX lowers it."""

    name: str  # the manifest's function name
    module: str  # JAX's module name (jit_<fn>)
    bucket: dict[str, Any]
    label: str
    leaves: tuple[jax_seam.Leaf, ...]
    # per flat input: (argument position or kwarg name, parameter name, leaf path, array ArgSpec shape)
    origins: tuple[tuple[Any, str | None, str, Any], ...] | None
    statics: dict[str, Any]  # parameter name -> static value
    params: tuple[str, ...] = ()


@dataclass(frozen=True)
class MissFinding:
    """One reason a function missed: which argument and field, what to change."""

    function: str
    name: str | None
    kind: str  # shape, dtype, weak_type, sharding, static, rejit, explosion, not_in_manifest, entry
    message: str
    arg: Any = None
    leaf: str | None = None
    field: str | None = None
    observed: Any = None
    expected: Any = None
    bucket: str | None = None
    requests: int = 0
    misses: int = 0


@dataclass(frozen=True)
class MissedSignature:
    function: str
    digest: str
    leaves: list[Any]
    requests: int
    misses: int
    uncacheable: int
    repeats: int
    nearest: str | None
    last_seen: datetime
    source: str | None = None  # "f at model.py:12", where JAX knew it
    statics: list[Any] | None = None


@dataclass(frozen=True)
class MissesReport:
    cache: str
    since: datetime
    manifest: str | None
    signatures: int
    requests: int
    hits: int
    misses: int
    uncacheable: int
    covered: int | None  # requests whose signature is a bucket of the manifest
    missed: list[MissedSignature]
    findings: list[MissFinding]
    # JAX-internal or fast programs JAX never writes (jit_stage, ...), not in the manifest: {module: requests}
    uncacheable_functions: dict[str, int] = field(default_factory=dict)

    __json_extra__ = ("coverage", "ok")

    @property
    def coverage(self) -> float | None:
        """Share of the service's observed cacheable compile requests that match a bucket."""
        total = self.requests - sum(self.uncacheable_functions.values())
        if self.covered is None or total <= 0:
            return None
        return self.covered / total

    @property
    def ok(self) -> bool:
        """Nothing missed: the exit status and the text say the same (not-cacheable programs and
        hits of a re-jitted function are no misses)."""
        return self.misses == 0


# --------------------------------------------------------------------------- expected signatures


class _Capture:
    """Collects (module, leaves) of lowerings in this process through the collector's tap."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, tuple[jax_seam.Leaf, ...]]] = []

    def _on_lowering(self, module: Any, in_avals: Any, in_shardings: Any) -> None:
        self.seen.append((str(module), jax_seam.leaves_of(in_avals, in_shardings)))


@contextlib.contextmanager
def _capturing() -> Iterator[_Capture]:
    capture = _Capture()
    tap = _SignatureTap(capture, jax_seam.pxla_logger())  # type: ignore[arg-type]
    tap.install()
    try:
        yield capture
    finally:
        tap.uninstall()


def _param_names(fn: Any) -> list[str]:
    target = getattr(fn, "__wrapped__", fn)
    try:
        return [
            p.name
            for p in inspect.signature(target).parameters.values()
            if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
        ]
    except (TypeError, ValueError):
        return []


def _origins(
    spec: Any,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    names: list[str],
    *,
    values_are_inputs: bool = False,
) -> list[tuple[Any, str | None, str, Any]]:
    """Per flat input of the call: (argument, parameter name, leaf path, the ArgSpec's shape).
    ``values_are_inputs``: a non-static ``value`` argument is traced too (a Python scalar)."""
    import jax

    static_nums = set(spec.jit.static_argnums)
    static_names = set(spec.jit.static_argnames)
    out: list[tuple[Any, str | None, str, Any]] = []
    for a, value in enumerate(args):
        pname = names[a] if a < len(names) else None
        if (
            a in static_nums
            or (pname is not None and pname in static_names)
            or (spec.args[a].kind == "value" and not values_are_inputs)
        ):
            continue
        shape = spec.args[a].shape if spec.args[a].kind == "array" else None
        for path, _leaf in jax.tree_util.tree_flatten_with_path(value)[0]:
            out.append((a, pname, jax.tree_util.keystr(path), shape))
    for k in sorted(kwargs):
        if k in static_names:
            continue
        for path, _leaf in jax.tree_util.tree_flatten_with_path(kwargs[k])[0]:
            out.append((k, k, jax.tree_util.keystr(path), None))
    return out


def _statics(spec: Any, bucket_values: dict[str, Any], names: list[str]) -> dict[str, Any]:
    """The static values of one bucket by parameter name: kwargs (a fixed value or an axis's value)
    and positional ``{value}`` arguments."""
    out: dict[str, Any] = {}
    for k, v in spec.kwargs.items():
        if k in spec.jit.static_argnames:
            out[k] = bucket_values[v["axis"]] if isinstance(v, dict) else v
    for a, arg in enumerate(spec.args):
        if arg.kind == "value":
            out[names[a] if a < len(names) else str(a)] = arg.value
    return out


def expected_signatures(
    manifest_path: str | Path, *, function: str | None = None
) -> list[ExpectedSignature]:
    """Lower every bucket of the manifest (no compile) and record its signature."""

    # A manifest's module may print on import (mujoco's warp warning): never into --json's stdout.
    with contextlib.redirect_stdout(sys.stderr):
        return _expected_signatures(manifest_path, function=function)


def _expected_signatures(
    manifest_path: str | Path, *, function: str | None = None
) -> list[ExpectedSignature]:
    manifest = load_manifest(manifest_path)
    paths = [str(Path(manifest.path).parent)]
    specs = {s.name: s for s in manifest.functions}
    out: list[ExpectedSignature] = []
    jitted: dict[str, Any] = {}
    import jax

    jax.clear_caches()  # a lowering already cached in this process would not be logged again
    with _persistent_cache_off():
        for bucket in expand(manifest):
            spec = specs[bucket.function]
            if spec.name not in jitted:
                jitted[spec.name] = jit_function(spec, paths)
            fn = jitted[spec.name]
            args, kwargs = build_call(spec, bucket, paths)
            with _capturing() as capture:
                lowered = (
                    fn.trace(*args, **kwargs).lower()
                    if hasattr(fn, "trace")
                    else fn.lower(*args, **kwargs)
                )
            module = str(lowered.compiler_ir("stablehlo").operation.attributes["sym_name"]).strip(
                '"'
            )
            if function is not None and function not in (module, spec.name):
                continue
            leaves = capture.seen[-1][1] if capture.seen else ()
            names = _param_names(fn)
            origins = _origins(spec, args, kwargs, names)
            if len(origins) != len(leaves):
                origins = _origins(spec, args, kwargs, names, values_are_inputs=True)
            out.append(
                ExpectedSignature(
                    spec.name,
                    module,
                    dict(bucket.values),
                    bucket.label,
                    leaves,
                    tuple(origins) if len(origins) == len(leaves) else None,
                    _statics(spec, bucket.values, names),
                    tuple(names),
                )
            )
    return out


# --------------------------------------------------------------------------- explaining


def _leaf(value: Any) -> jax_seam.Leaf:
    shape, dtype, weak, sharding = value
    return (tuple(shape), str(dtype), bool(weak), sharding)


def _gt(p: Any, q: Any) -> bool:
    return isinstance(p, int) and isinstance(q, int) and p > q


def _distance(a: Sequence[jax_seam.Leaf], b: Sequence[jax_seam.Leaf]) -> float:
    d = 0.0
    for x, y in zip(a, b, strict=True):
        if x[0] != y[0]:
            if len(x[0]) == len(
                y[0]
            ):  # a bucket the size pads into is nearer than one it overflows
                d += 1 + sum(
                    1.5 if _gt(p, q) else 1 for p, q in zip(x[0], y[0], strict=True) if p != q
                )
            else:
                d += 8
        d += (x[1] != y[1]) + (x[2] != y[2]) + (x[3] != y[3])
    return d


def _where(module: str, exp: ExpectedSignature, i: int) -> tuple[Any, str | None, str]:
    """(argument, parameter name, leaf path) of flat input ``i``; (None, None, "input i of n")
    when the manifest's arguments do not flatten to the program's inputs."""
    if exp.origins is None:
        return None, None, f"input {i} of {len(exp.leaves)}"
    a, pname, path, _shape = exp.origins[i]
    return a, pname, path


def _arg_text(module: str, a: Any, pname: str | None, path: str) -> str:
    if a is None:  # no argument known: the flat input's position, said as such
        return f"{module} {path}" if path else module
    text = f"{module} arg {a}" + (f" ({pname})" if pname and pname != a else "")
    return text + (f" leaf {path}" if path else "")


def _fmt(values: Sequence[Any]) -> str:
    return "(" + ", ".join(str(v) for v in values) + ")"


_PY_SCALAR = {
    "float32": "float",
    "float64": "float",
    "int32": "int",
    "int64": "int",
    "bool": "bool",
    "complex64": "complex",
}


def _explain(
    row: SignatureRow,
    exp: ExpectedSignature,
    buckets: dict[str, list[Any]],
    n_missed: int,
    candidates: Sequence[ExpectedSignature] = (),
) -> list[MissFinding]:
    module = row.function
    observed = [_leaf(x) for x in row.leaves]
    found: list[MissFinding] = []
    said: set[tuple[Any, ...]] = set()

    def add(kind: str, message: str, **kw: Any) -> None:
        dedupe = (kind, kw.get("arg"), kw.get("field"), str(kw.get("observed")))
        if dedupe in said:
            return
        said.add(dedupe)
        found.append(
            MissFinding(
                module,
                exp.name,
                kind,
                message,
                bucket=exp.label,
                requests=row.requests,
                misses=n_missed,
                **kw,
            )
        )

    for i, (o, e) in enumerate(zip(observed, exp.leaves, strict=True)):
        a, pname, path = _where(module, exp, i)
        where = _arg_text(module, a, pname, path)
        if o[0] != e[0]:
            spec_shape = exp.origins[i][3] if exp.origins is not None else None
            if len(o[0]) == len(e[0]):
                for d, (ov, ev) in enumerate(zip(o[0], e[0], strict=True)):
                    if ov == ev:
                        continue
                    axis = (
                        spec_shape[d]
                        if spec_shape is not None and isinstance(spec_shape[d], str)
                        else None
                    )
                    if axis is not None and axis in buckets:
                        values = sorted(buckets[axis])
                        bigger = [v for v in values if v >= ov]
                        if ov in values:
                            fix = f"{axis}={ov} is a bucket but not with the other axes' values (excluded?)"
                            msg = f"{_arg_text(module, a, pname, '')}: {fix}"
                        elif bigger:
                            msg = (
                                f"{_arg_text(module, a, pname, '')}: {axis} {ov} not a bucket {_fmt(values)}: "
                                f"pad to {bigger[0]}, or add {ov}"
                            )
                        else:
                            msg = (
                                f"{_arg_text(module, a, pname, '')}: {axis} {ov} above the largest bucket "
                                f"{_fmt(values)}: add {ov}"
                            )
                        add(
                            "shape",
                            msg,
                            arg=a,
                            leaf=path or None,
                            field=f"shape[{d}]:{axis}",
                            observed=ov,
                            expected=values,
                        )
                    else:
                        # What the buckets really hold at this dim: never claim "every bucket"
                        # unless every bucket has it.
                        held = sorted(
                            {
                                c.leaves[i][0][d]
                                for c in (*candidates, exp)
                                if i < len(c.leaves)
                                and len(c.leaves[i][0]) == len(o[0])
                                and isinstance(c.leaves[i][0][d], int)
                            }
                        )
                        named = next(
                            (ax for ax, vals in buckets.items() if sorted(set(vals)) == held),
                            None,
                        )
                        if len(held) <= 1:
                            msg = f"{where}: dim {d} is {ov} vs {ev} in every bucket: fix it or bucket it"
                        elif named is not None:  # an axis a pytree function takes: name it
                            bigger = [
                                v
                                for v in held
                                if isinstance(v, int) and isinstance(ov, int) and v >= ov
                            ]
                            msg = (
                                f"{where}: {named} {ov} not a bucket {_fmt(held)}: pad to {bigger[0]}, "
                                f"or add {ov}"
                                if bigger
                                else f"{where}: {named} {ov} above the largest bucket {_fmt(held)}: add {ov}"
                            )
                        else:
                            bigger = [
                                v
                                for v in held
                                if isinstance(v, int) and isinstance(ov, int) and v >= ov
                            ]
                            fix = f"pad to {bigger[0]}, or add {ov}" if bigger else f"add {ov}"
                            msg = f"{where}: dim {d} is {ov}, not a bucket {_fmt(held)}: {fix}"
                        add(
                            "shape",
                            msg,
                            arg=a,
                            leaf=path or None,
                            field=f"shape[{d}]",
                            observed=ov,
                            expected=held if len(held) > 1 else ev,
                        )
            else:
                add(
                    "shape",
                    f"{where}: shape {list(o[0])} vs {list(e[0])}: another rank",
                    arg=a,
                    leaf=path or None,
                    field="shape",
                    observed=list(o[0]),
                    expected=list(e[0]),
                )
        if o[1] != e[1]:
            add(
                "dtype",
                f"{where}: dtype {o[1]} vs {e[1]}: cast it to {e[1]}",
                arg=a,
                leaf=path or None,
                field="dtype",
                observed=o[1],
                expected=e[1],
            )
        if o[2] != e[2]:
            if o[2]:
                py = _PY_SCALAR.get(o[1], "scalar")
                msg = f"{where}: {o[1]} weak_type (a Python {py}) vs {e[1]}: pass np.{e[1]}(...)"
            else:
                msg = f"{where}: {o[1]} vs {e[1]} weak_type in the manifest: pass a Python scalar, or drop weak_type"
            add(
                "weak_type",
                msg,
                arg=a,
                leaf=path or None,
                field="weak_type",
                observed=o[2],
                expected=e[2],
            )
        if o[3] != e[3]:
            if o[3] is not None and e[3] is None:
                fix = (
                    "add sharding: single_device"
                    if o[3].startswith("SingleDeviceSharding")
                    else "add the mesh and sharding it uses"
                )
                msg = f"{where}: sharding {o[3]} vs none: the service commits its arrays; {fix}"
            elif o[3] is None:
                msg = (
                    f"{where}: sharding none vs {e[3]}: the service passes uncommitted arrays; "
                    "drop sharding from the manifest, or jax.device_put them"
                )
            else:
                msg = f"{where}: sharding {o[3]} vs {e[3]}: match the manifest's sharding to the service's"
            add(
                "sharding",
                msg,
                arg=a,
                leaf=path or None,
                field="sharding",
                observed=o[3],
                expected=e[3],
            )
    return found


def _static_finding(
    row: SignatureRow, exp: ExpectedSignature, statics: dict[str, list[Any]], n_missed: int
) -> MissFinding:
    module = row.function
    for k, text in row.statics or []:
        name = exp.params[k] if isinstance(k, int) and k < len(exp.params) else str(k)
        warmed = statics.get(name)
        if warmed is not None and text not in {repr(v) for v in warmed}:
            return MissFinding(
                module,
                exp.name,
                "static",
                f"{module} static {name}={text} not among {_fmt(warmed)}",
                arg=name,
                field="static",
                observed=text,
                expected=warmed,
                bucket=exp.label,
                requests=row.requests,
                misses=n_missed,
            )
    if statics:
        known = "; ".join(f"{k} among {_fmt(v)}" for k, v in statics.items())
        msg = (
            f"{module} arguments match bucket [{exp.label}] but the program differs: a static argument "
            f"value is not a bucket (warmed: {known}), or a jit option differs"
        )
    else:
        msg = (
            f"{module} arguments match bucket [{exp.label}] but the program differs: a static argument "
            "or a jit option differs from the manifest's"
        )
    return MissFinding(
        module,
        exp.name,
        "static",
        msg,
        field="static",
        expected=statics or None,
        bucket=exp.label,
        requests=row.requests,
        misses=n_missed,
    )


# An installed package's files: where a library-internal program's Python function lives.
_LIBRARY = re.compile(r"[/\\](?:site|dist)-packages[/\\]([A-Za-z0-9_]+)")


def _library(source: str | None) -> str | None:
    """The installed package a program's function comes from ("numpyro", "jax"), else None."""
    m = _LIBRARY.search(source or "")
    return m.group(1) if m else None


def _not_in_manifest(
    module: str, rows: list[SignatureRow], *, manifest: bool = True, warmed: int = 0
) -> MissFinding:
    """One finding per function the manifest does not name (or, with no manifest, per missed
    function), however many signatures it missed. ``warmed``: programs of this module the cache
    already holds, none of them with a key the service looked up."""
    n_missed = sum(r.misses for r in rows)
    requests = sum(r.requests for r in rows)
    library = next((lib for lib in map(_library, (r.source for r in rows)) if lib), None)
    # The same inputs compiled to several programs: what differs is inside the program.
    inputs = [repr((r.leaves, r.statics)) for r in rows]
    constants = len(set(inputs)) < len(inputs)
    count = f" ({len(rows)} programs)" if len(rows) > 1 else ""
    if library is not None:
        msg = f"{module}{count} is internal to {library}: no manifest function names it"
        if constants:
            msg += (
                "; the same inputs compiled to different programs, so data is closed over as "
                "constants and every dataset is a new key (NumPyro: MCMC(..., jit_model_args=True) "
                "passes it as arguments)"
            )
        elif warmed:
            msg += (
                f"; the cache holds {warmed} program{'s' if warmed != 1 else ''} of it, none the "
                "one the service looked up: it was called with other input shapes, or data is "
                "closed over as constants and every dataset is a new key (NumPyro: "
                "MCMC(..., jit_model_args=True) passes it as arguments)"
            )
        msg += (
            "; where a manifest cannot name it, warm it by running the service once against a "
            "writable cache (cachectl exec -- python service.py)"
        )
    elif not manifest:
        msg = (
            f"{module}{count} missed and no manifest names it: warm a manifest that does (or "
            "pass --manifest), or warm it by running the service (cachectl warm-run)"
        )
    else:
        msg = f"{module}{count} is not in the manifest: add it (or stop compiling it)"
        if constants:
            msg += (
                "; the same inputs compiled to different programs: values closed over as "
                "constants differ, pass them as arguments"
            )
    return MissFinding(
        module,
        None,
        "not_in_manifest" if library is None else "library_internal",
        msg,
        field="function",
        observed=library,
        requests=requests,
        misses=n_missed,
    )


def _weak_variants(
    module: str, name: str | None, rows: list[SignatureRow], expected: list[ExpectedSignature]
) -> list[MissFinding]:
    """Programs of one function that differ only in weak types: name each leaf that differs."""
    groups: dict[str, list[SignatureRow]] = {}
    for r in rows:
        strong = [[list(x[0]), x[1], x[3]] for x in r.leaves]
        groups.setdefault(repr(strong), []).append(r)
    out = []
    exp = next((e for e in expected if e.origins is not None), None)
    for group in groups.values():
        if len(group) < 2:
            continue
        n = len(group[0].leaves)
        differ = [i for i in range(n) if len({bool(r.leaves[i][2]) for r in group}) > 1]
        if not differ:
            continue
        wheres = []
        for i in differ:
            if exp is not None and len(exp.leaves) == n:
                wheres.append(_arg_text(module, *_where(module, exp, i)))
            else:
                wheres.append(f"{module} input {i} of {n}")
        shown = "; ".join(wheres[:4]) + (f"; and {len(wheres) - 4} more" if len(wheres) > 4 else "")
        out.append(
            MissFinding(
                module,
                name,
                "weak_type",
                f"{module} compiled {len(group)} programs for the same shapes and dtypes that "
                f"differ only in weak_type at {shown}: one caller passes weakly typed values (a "
                "Python scalar, or the result of jnp ops on one), another strongly typed: cast "
                "them to one dtype (jnp.asarray(x, dtype)) where they are made",
                field="weak_type",
                observed=[w.removeprefix(f"{module} ") for w in wheres],
                requests=sum(r.requests for r in group),
                misses=sum(r.misses for r in group),
            )
        )
    return out


def _explosions(
    module: str, name: str | None, rows: list[SignatureRow], expected: list[ExpectedSignature]
) -> list[MissFinding]:
    by_dim: dict[tuple[int, int], set[int]] = {}
    for r in rows:
        for i, leaf in enumerate(r.leaves):
            for d, v in enumerate(leaf[0]):
                if isinstance(v, int):
                    by_dim.setdefault((i, d), set()).add(v)
    out = []
    done: set[str] = set()
    for (i, d), values in sorted(by_dim.items()):
        if len(values) < EXPLOSION:
            continue
        axis = None
        if expected and expected[0].origins is not None and i < len(expected[0].origins):
            shape = expected[0].origins[i][3]
            if shape is not None and d < len(shape) and isinstance(shape[d], str):
                axis = shape[d]
        label = axis or f"arg {i} dim {d}"
        if label in done:
            continue
        done.add(label)
        what = f"{axis} lengths" if axis else f"sizes of input {i} dim {d}"
        out.append(
            MissFinding(
                module,
                name,
                "explosion",
                f"{module} compiled {len(values)} distinct {what} ({min(values)}..{max(values)}): "
                f"bucket {axis or f'input {i} dim {d}'}",
                field=f"shape[{d}]" + (f":{axis}" if axis else ""),
                observed=sorted(values),
                requests=sum(r.requests for r in rows),
                misses=len(rows),
            )
        )
    return out


# --------------------------------------------------------------------------- the command


def _warmed_programs(ctx: Any, cache: str, missed: dict[str, list[SignatureRow]]) -> dict[str, int]:
    """{module: programs of it the cache's index holds}, for the missed modules; the keys the
    service looked up are not among them (a hit would have found them)."""
    looked_up = {r.key for rows in missed.values() for r in rows if r.key}
    with ctx.index.read_session() as s:
        rows = s.execute(
            select(Entry.module, Entry.key)
            .join(EnvRow, EnvRow.id == Entry.environment_id)
            .join(Cache, Cache.id == EnvRow.cache_id)
            .where(Cache.name == cache, Entry.module.in_(sorted(missed)))
        ).all()
    out: dict[str, int] = {}
    for module, key in rows:
        if key not in looked_up:
            out[module] = out.get(module, 0) + 1
    return out


def warmed_manifest(index: Any, cache: str) -> str | None:
    """The manifest of the latest finished warm run into ``cache`` that still exists on disk."""
    with index.read_session() as s:
        paths = s.scalars(
            select(WarmRun.manifest_path)
            .join(EnvRow, EnvRow.id == WarmRun.environment_id)
            .join(Cache, Cache.id == EnvRow.cache_id)
            .where(Cache.name == cache, WarmRun.manifest_path.is_not(None))
            .order_by(WarmRun.started_at.desc())
        ).all()
    for p in paths:
        if p and Path(p).is_file():
            return str(p)
    return None


def misses(
    ctx: Any,
    *,
    since: timedelta,
    function: str | None = None,
    manifest: str | Path | None = None,
    cache: str | None = None,
) -> MissesReport:
    """Every missed signature in ``cache`` over the window, explained against the manifest."""
    info = ctx.cache(cache)
    rows = signature_usage(ctx.index, info.name, since, function=None)
    if manifest is None:
        manifest = warmed_manifest(ctx.index, info.name)
    elif not Path(manifest).is_file():
        raise BadInput(f"--manifest: no such file: {manifest}")
    expected: list[ExpectedSignature] = []
    if manifest is not None:
        previous = logging.getLogger("jax").level
        expected = expected_signatures(manifest)
        logging.getLogger("jax").setLevel(previous)
    names = {e.module: e.name for e in expected}
    if function is not None:
        modules = {m for m, n in names.items() if function in (m, n)} or {function}
        rows = [r for r in rows if r.function in modules]
        expected = [e for e in expected if e.module in modules]
    by_module: dict[str, list[ExpectedSignature]] = {}
    for e in expected:
        by_module.setdefault(e.module, []).append(e)
    buckets_of: dict[str, dict[str, list[Any]]] = {}
    for e in expected:
        axes = buckets_of.setdefault(e.module, {})
        for k, v in e.bucket.items():
            if v not in axes.setdefault(k, []):
                axes[k].append(v)
    expected_sets = {(e.module, e.leaves) for e in expected}

    findings: list[MissFinding] = []
    missed: list[MissedSignature] = []
    uncacheable_fns: dict[str, int] = {}
    covered = 0
    per_module_missed: dict[str, list[SignatureRow]] = {}
    not_in_manifest: dict[str, list[SignatureRow]] = {}
    for r in rows:
        leaves = tuple(_leaf(x) for x in r.leaves)
        if (r.function, leaves) in expected_sets:
            covered += r.requests
        in_manifest = r.function in by_module
        if r.uncacheable and not r.misses and not r.hits:
            # JAX-internal staging: not cacheable, never a miss, never a re-jit to fix
            uncacheable_fns[r.function] = uncacheable_fns.get(r.function, 0) + r.requests
            continue
        n_missed = r.misses  # a miss is a miss, written or not; a manifest function's always is
        if not n_missed:
            continue
        nearest: ExpectedSignature | None = None
        candidates = [e for e in by_module.get(r.function, []) if len(e.leaves) == len(leaves)]
        if candidates:
            nearest = min(candidates, key=lambda e: _distance(leaves, e.leaves))
        missed.append(
            MissedSignature(
                r.function,
                r.digest,
                r.leaves,
                r.requests,
                n_missed,
                r.uncacheable,
                r.repeats,
                nearest.label if nearest else None,
                r.last_seen,
                r.source,
                r.statics,
            )
        )
        if r.repeats:
            findings.append(
                MissFinding(
                    r.function,
                    names.get(r.function),
                    "rejit",
                    f"{r.function} compiled {r.requests} programs with identical shapes: the function object "
                    "changes per call (a lambda or partial jitted inside a loop): jit it once at module level",
                    field="function",
                    observed=r.requests,
                    requests=r.requests,
                    misses=n_missed,
                )
            )
        per_module_missed.setdefault(r.function, []).append(r)
        if r.digest == "*":
            findings.append(
                MissFinding(
                    r.function or "?",
                    None,
                    "overflow",
                    f"{r.requests} compile requests beyond the signature bound were not "
                    "recorded one by one",
                    requests=r.requests,
                    misses=n_missed,
                )
            )
        elif not in_manifest:  # with no manifest, every missed function
            not_in_manifest.setdefault(r.function, []).append(r)
        elif nearest is None:
            findings.append(
                MissFinding(
                    r.function,
                    names.get(r.function),
                    "shape",
                    f"{r.function}: {len(leaves)} inputs, no bucket has that many "
                    "(another pytree structure?)",
                    field="structure",
                    observed=len(leaves),
                    requests=r.requests,
                    misses=n_missed,
                )
            )
        else:
            diffs = _explain(r, nearest, buckets_of.get(r.function, {}), n_missed, candidates)
            if diffs:
                findings.extend(diffs)
            else:
                statics: dict[str, list[Any]] = {}
                for e in by_module[r.function]:
                    for k, v in e.statics.items():
                        if v not in statics.setdefault(k, []):
                            statics[k].append(v)
                findings.append(_static_finding(r, nearest, statics, n_missed))
    warmed = _warmed_programs(ctx, info.name, not_in_manifest) if not_in_manifest else {}
    for module, mrows in not_in_manifest.items():
        findings.append(
            _not_in_manifest(module, mrows, manifest=bool(by_module), warmed=warmed.get(module, 0))
        )
    for module, mrows in per_module_missed.items():
        findings.extend(_weak_variants(module, names.get(module), mrows, by_module.get(module, [])))
    for module, mrows in per_module_missed.items():
        findings.extend(_explosions(module, names.get(module), mrows, by_module.get(module, [])))
    total = [r for r in rows]
    return MissesReport(
        cache=info.name,
        since=utcnow() - since,
        manifest=str(manifest) if manifest else None,
        signatures=len(total),
        requests=sum(r.requests for r in total),
        hits=sum(r.hits for r in total),
        misses=sum(r.misses for r in total),
        uncacheable=sum(r.uncacheable for r in total),
        covered=covered if expected else None,
        missed=missed,
        findings=findings,
        uncacheable_functions=uncacheable_fns,
    )
