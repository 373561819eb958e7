"""Why a missed signature missed: each field it differs in from the manifest, in words.

A missed signature is compared with the nearest bucket of its function (same module name,
same number of inputs, fewest differing fields, ``distance``) and every differing field is
said as a fix: which argument and leaf, which axis or dimension, what to pad to or add.
Programs of a function not in the manifest, weak-type variants and shape explosions are
said once per function.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from cachectl.core import jax_seam
from cachectl.index.telemetry_queries import SignatureRow
from cachectl.usage.misses_expected import ExpectedSignature

EXPLOSION = 8  # distinct values of one dimension among a function's misses: bucket it


@dataclass(frozen=True)
class MissFinding:
    """One reason a function missed: which argument and field, what to change."""

    function: str
    name: str | None
    # shape, dtype, weak_type, sharding, static, rejit, explosion, not_in_manifest, entry,
    # environment, host-callbacks
    kind: str
    message: str
    arg: Any = None
    leaf: str | None = None
    field: str | None = None
    observed: Any = None
    expected: Any = None
    bucket: str | None = None
    requests: int = 0
    misses: int = 0
    # The missed signature this finding explains (its digest): one signature's findings, one per
    # argument and field, are one line of `cachectl misses`.
    signature: str | None = None


def leaf_of(value: Any) -> jax_seam.Leaf:
    shape, dtype, weak, sharding = value
    return (tuple(shape), str(dtype), bool(weak), sharding)


def _gt(p: Any, q: Any) -> bool:
    return isinstance(p, int) and isinstance(q, int) and p > q


def distance(a: Sequence[jax_seam.Leaf], b: Sequence[jax_seam.Leaf]) -> float:
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


def _gap(a: Sequence[jax_seam.Leaf], b: Sequence[jax_seam.Leaf]) -> int:
    """How far apart two signatures' sizes are, summed over the dimensions that differ."""
    return sum(
        abs(p - q)
        for x, y in zip(a, b, strict=True)
        if len(x[0]) == len(y[0])
        for p, q in zip(x[0], y[0], strict=True)
        if isinstance(p, int) and isinstance(q, int)
    )


def nearest_bucket(
    leaves: Sequence[jax_seam.Leaf], candidates: Sequence[ExpectedSignature]
) -> ExpectedSignature | None:
    """The bucket a missed signature is nearest: fewest differing fields (``distance``), then the
    closest sizes, so a call above every bucket names the largest, not the first."""
    if not candidates:
        return None
    return min(candidates, key=lambda e: (distance(leaves, e.leaves), _gap(leaves, e.leaves)))


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


@dataclass(frozen=True)
class _Input:
    """One flat input of a missed program, as its nearest bucket names it."""

    index: int
    arg: Any  # argument position or kwarg name; None when the arguments do not flatten to it
    pname: str | None
    path: str
    where: str  # how a message names it

    @property
    def leaf(self) -> str | None:
        return self.path or None


def _input(module: str, exp: ExpectedSignature, i: int) -> _Input:
    a, pname, path = _where(module, exp, i)
    return _Input(i, a, pname, path, _arg_text(module, a, pname, path))


class _Findings:
    """A missed signature's findings against one bucket, each said once (by kind, argument,
    field and observed value)."""

    def __init__(self, row: SignatureRow, exp: ExpectedSignature, n_missed: int) -> None:
        self.row, self.exp, self.n_missed = row, exp, n_missed
        self.found: list[MissFinding] = []
        self._said: set[tuple[Any, ...]] = set()

    def add(
        self, inp: _Input, kind: str, message: str, field: str, observed: Any, expected: Any
    ) -> None:
        dedupe = (kind, inp.arg, field, str(observed))
        if dedupe in self._said:
            return
        self._said.add(dedupe)
        self.found.append(
            MissFinding(
                self.row.function,
                self.exp.name,
                kind,
                message,
                arg=inp.arg,
                leaf=inp.leaf,
                field=field,
                observed=observed,
                expected=expected,
                bucket=self.exp.label,
                requests=self.row.requests,
                misses=self.n_missed,
                signature=self.row.digest,
            )
        )


def _axis_message(module: str, inp: _Input, axis: str, ov: Any, values: list[Any]) -> str:
    """A dimension the manifest names by a bucket axis: which bucket to pad to, or to add."""
    head = _arg_text(module, inp.arg, inp.pname, "")
    bigger = [v for v in values if v >= ov]
    if ov in values:
        return f"{head}: {axis}={ov} is a bucket but not with the other axes' values (excluded?)"
    if bigger:
        return f"{head}: {axis} {ov} not a bucket {_fmt(values)}: pad to {bigger[0]}, or add {ov}"
    return f"{head}: {axis} {ov} above the largest bucket {_fmt(values)}: add {ov}"


def _held(i: int, d: int, rank: int, signatures: Sequence[ExpectedSignature]) -> list[Any]:
    """What the buckets really hold at input ``i``'s dimension ``d``: never claim "every
    bucket" unless every bucket has it."""
    return sorted(
        {
            c.leaves[i][0][d]
            for c in signatures
            if i < len(c.leaves)
            and len(c.leaves[i][0]) == rank
            and isinstance(c.leaves[i][0][d], int)
        }
    )


def _held_message(
    inp: _Input, d: int, ov: Any, ev: Any, held: list[Any], buckets: dict[str, list[Any]]
) -> str:
    """A dimension no axis of the argument names: said against the sizes the buckets hold."""
    named = next((ax for ax, vals in buckets.items() if sorted(set(vals)) == held), None)
    if len(held) <= 1:
        return f"{inp.where}: dim {d} is {ov} vs {ev} in every bucket: fix it or bucket it"
    bigger = [v for v in held if isinstance(v, int) and isinstance(ov, int) and v >= ov]
    if named is not None:  # an axis a pytree function takes: name it
        if bigger:
            return f"{inp.where}: {named} {ov} not a bucket {_fmt(held)}: pad to {bigger[0]}, or add {ov}"
        return f"{inp.where}: {named} {ov} above the largest bucket {_fmt(held)}: add {ov}"
    fix = f"pad to {bigger[0]}, or add {ov}" if bigger else f"add {ov}"
    return f"{inp.where}: dim {d} is {ov}, not a bucket {_fmt(held)}: {fix}"


def _shape_findings(
    found: _Findings,
    inp: _Input,
    observed: tuple[Any, ...],
    expected: tuple[Any, ...],
    buckets: dict[str, list[Any]],
    candidates: Sequence[ExpectedSignature],
) -> None:
    """Another rank, or each dimension that differs: by its bucket axis where the manifest
    names one, else against what the buckets hold."""
    exp = found.exp
    if len(observed) != len(expected):
        message = f"{inp.where}: shape {list(observed)} vs {list(expected)}: another rank"
        found.add(inp, "shape", message, "shape", list(observed), list(expected))
        return
    spec_shape = exp.origins[inp.index][3] if exp.origins is not None else None
    for d, (ov, ev) in enumerate(zip(observed, expected, strict=True)):
        if ov == ev:
            continue
        axis = spec_shape[d] if spec_shape is not None and isinstance(spec_shape[d], str) else None
        if axis is not None and axis in buckets:
            values = sorted(buckets[axis])
            message = _axis_message(found.row.function, inp, axis, ov, values)
            found.add(inp, "shape", message, f"shape[{d}]:{axis}", ov, values)
            continue
        held = _held(inp.index, d, len(observed), (*candidates, exp))
        message = _held_message(inp, d, ov, ev, held, buckets)
        found.add(inp, "shape", message, f"shape[{d}]", ov, held if len(held) > 1 else ev)


def _weak_message(where: str, o: jax_seam.Leaf, e: jax_seam.Leaf, leaf: bool = False) -> str:
    if o[2]:
        py = _PY_SCALAR.get(o[1], "scalar")
        return f"{where}: {o[1]} weak_type (a Python {py}) vs {e[1]}: pass np.{e[1]}(...)"
    if leaf:  # a pytree function's leaf: jax.eval_shape of a Python scalar is weakly typed
        return (
            f"{where}: {o[1]} vs {e[1]} weak_type in the manifest's pytree (a Python scalar "
            f"through jax.eval_shape), and it changed the program: make that leaf "
            f"jnp.{e[1]}(...) in the pytree function"
        )
    return f"{where}: {o[1]} vs {e[1]} weak_type in the manifest: pass a Python scalar, or drop weak_type"


def _sharding_message(where: str, observed: Any, expected: Any) -> str:
    if observed is not None and expected is None:
        fix = (
            "add sharding: single_device"
            if observed.startswith("SingleDeviceSharding")
            else "add the mesh and sharding it uses"
        )
        return f"{where}: sharding {observed} vs none: the service commits its arrays; {fix}"
    if observed is None:
        return (
            f"{where}: sharding none vs {expected}: the service passes uncommitted arrays; "
            "drop sharding from the manifest, or jax.device_put them"
        )
    return f"{where}: sharding {observed} vs {expected}: match the manifest's sharding to the service's"


def explain(
    row: SignatureRow,
    exp: ExpectedSignature,
    buckets: dict[str, list[Any]],
    n_missed: int,
    candidates: Sequence[ExpectedSignature] = (),
) -> list[MissFinding]:
    """Every field in which a missed program's inputs differ from its nearest bucket's."""
    found = _Findings(row, exp, n_missed)
    observed = [leaf_of(x) for x in row.leaves]
    for i, (o, e) in enumerate(zip(observed, exp.leaves, strict=True)):
        inp = _input(row.function, exp, i)
        if o[0] != e[0]:
            _shape_findings(found, inp, o[0], e[0], buckets, candidates)
        if o[1] != e[1]:
            message = f"{inp.where}: dtype {o[1]} vs {e[1]}: cast it to {e[1]}"
            found.add(inp, "dtype", message, "dtype", o[1], e[1])
        if o[2] != e[2]:
            message = _weak_message(inp.where, o, e, leaf=bool(inp.path))
            found.add(inp, "weak_type", message, "weak_type", o[2], e[2])
        if o[3] != e[3]:
            message = _sharding_message(inp.where, o[3], e[3])
            found.add(inp, "sharding", message, "sharding", o[3], e[3])
    return found.found


# A mesh function's jax.jit in_shardings/out_shardings are in its program (the result's sharding
# is written into it), and a manifest's `jit:` cannot declare them: what to name instead.
_MESH_JIT_OPTIONS = (
    "; over a mesh, jax.jit's in_shardings and out_shardings are part of the program: where the "
    "service jits with them, name its jitted function in the manifest (fn: module:jitted)"
)


def static_finding(
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
                signature=row.digest,
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
    if any((leaf[3] or "").startswith("NamedSharding") for leaf in exp.leaves):
        msg += _MESH_JIT_OPTIONS
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
        signature=row.digest,
    )


# An installed package's files: where a library-internal program's Python function lives.
_LIBRARY = re.compile(r"[/\\](?:site|dist)-packages[/\\]([A-Za-z0-9_]+)")


def _library(source: str | None) -> str | None:
    """The installed package a program's function comes from ("numpyro", "jax"), else None."""
    m = _LIBRARY.search(source or "")
    return m.group(1) if m else None


def not_in_manifest_finding(
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


def weak_variants(
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


def explosion_findings(
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
