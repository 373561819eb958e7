"""`cachectl advise`: bucket values chosen from the sizes a service really called with.

For one bucketed axis with observed sizes v_1 < ... < v_m seen c_1 ... c_m times, a set
of k buckets that covers every call costs sum_i c_i * b(v_i) computed elements, where
b(v) is the smallest bucket >= v; the padding waste is 1 - sum c_i v_i / that cost, so
minimising the cost minimises the waste. Optimal buckets are observed sizes (lowering
a bucket to the largest size it serves only saves), the largest is v_m, and

    cost_j(i) = min_{p < i} cost_{j-1}(p) + v_i * (C_i - C_p)        (C: prefix counts)

is an exact dynamic program; the inner minimum is over lines of slope -C_p queried at
increasing v_i, so a monotone convex-hull pass makes each layer O(m).

Axes of one function are chosen independently, each from its own marginal distribution;
the programs to warm are the product of the axes' counts.
"""

from __future__ import annotations

import difflib
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

from sqlalchemy import func, select

from cachectl.core.errors import BadInput
from cachectl.index.models import Cache, Entry
from cachectl.index.models import Environment as EnvRow
from cachectl.index.telemetry_queries import serving_usage, signature_usage
from cachectl.manifest import expand, load_manifest, parse_manifest
from cachectl.usage.misses_expected import expected_signatures


@dataclass(frozen=True)
class Plan:
    """One set of bucket values for an axis, scored against the observed sizes."""

    values: list[int]
    coverage: float  # share of observed calls whose size fits a bucket
    waste: float  # mean padding waste over the covered calls: padded / computed elements


@dataclass(frozen=True)
class AxisAdvice:
    function: str
    axis: str
    calls: int
    distinct_sizes: int
    # "serving" (pre-padding sizes), "signatures" (shapes of compiled programs) or both, "+"-joined
    source: str
    current: Plan
    proposed: Plan


@dataclass(frozen=True)
class FunctionAdvice:
    function: str
    axes: list[AxisAdvice]
    programs_current: int
    programs_proposed: int
    compile_ms_per_program: float | None  # mean of the index's warm-measured compile times
    warm_seconds_current: float | None
    warm_seconds_proposed: float | None


@dataclass(frozen=True)
class AdviseReport:
    manifest: str
    cache: str
    since_seconds: float
    functions: list[FunctionAdvice]
    written: bool
    diff: str
    notes: list[str]


# --------------------------------------------------------------------------- the dynamic program


def _hist(sizes: Mapping[int, int] | Sequence[int]) -> tuple[list[int], list[int]]:
    if isinstance(sizes, Mapping):
        items = sorted((int(v), int(c)) for v, c in sizes.items() if c > 0)
        return [v for v, _ in items], [c for _, c in items]
    import numpy as np

    values, counts = np.unique(np.asarray(sizes, dtype=np.int64), return_counts=True)
    return values.tolist(), counts.tolist()


def score(values: Sequence[int], sizes: Mapping[int, int]) -> Plan:
    """Coverage and mean padding waste of bucket ``values`` over observed ``sizes``."""
    buckets = sorted(set(int(v) for v in values))
    total = covered = 0
    computed = used = 0
    import bisect

    for v, c in sizes.items():
        total += c
        i = bisect.bisect_left(buckets, v)
        if i < len(buckets):
            covered += c
            computed += c * buckets[i]
            used += c * v
    return Plan(
        buckets, covered / total if total else 1.0, 1 - used / computed if computed else 0.0
    )


def _prefix(cs: list[int]) -> list[int]:
    prefix = [0] * (len(cs) + 1)
    for i, c in enumerate(cs):
        prefix[i + 1] = prefix[i] + c
    return prefix


def _next_layer(
    vs: list[int], prefix: list[int], prev: list[float] | None
) -> tuple[list[float], list[int]]:
    """cost_j and argmin_j from cost_{j-1} (``prev``; None for j = 1), each over the first i+1 sizes
    with the last bucket at v_i. Lines y = prev[p] - C_{p+1} x (p < i, slopes decreasing) are
    queried at x = v_i (increasing): a monotone convex hull with a moving pointer, O(m)."""
    m = len(vs)
    if prev is None:
        return [vs[i] * prefix[i + 1] for i in range(m)], [-1] * m
    inf = math.inf
    cost = [inf] * m
    arg = [-1] * m
    hull_m: list[int] = []
    hull_b: list[float] = []
    hull_p: list[int] = []
    ptr = 0
    for i in range(m):
        if i > 0:
            p = i - 1
            slope, icpt = -prefix[p + 1], prev[p]
            if icpt < inf:
                while len(hull_m) >= 2:
                    m1, b1 = hull_m[-2], hull_b[-2]
                    b2 = hull_b[-1]
                    m2 = hull_m[-1]
                    # the last line is never the minimum once the new one overtakes the one before it first
                    if (icpt - b1) * (m1 - m2) <= (b2 - b1) * (m1 - slope):
                        hull_m.pop()
                        hull_b.pop()
                        hull_p.pop()
                    else:
                        break
                hull_m.append(slope)
                hull_b.append(icpt)
                hull_p.append(p)
                ptr = min(ptr, len(hull_m) - 1)
        if hull_m:
            x = vs[i]
            while (
                ptr + 1 < len(hull_m)
                and hull_m[ptr + 1] * x + hull_b[ptr + 1] <= hull_m[ptr] * x + hull_b[ptr]
            ):
                ptr += 1
            cost[i] = hull_m[ptr] * x + hull_b[ptr] + x * prefix[i + 1]
            arg[i] = hull_p[ptr]
    return cost, arg


def _layers(vs: list[int], cs: list[int], k_max: int) -> list[tuple[list[float], list[int]]]:
    """cost_j and argmin_j for j = 1..k_max."""
    prefix = _prefix(cs)
    layers = [_next_layer(vs, prefix, None)]
    while len(layers) < k_max:
        layers.append(_next_layer(vs, prefix, layers[-1][0]))
    return layers


def _values(vs: list[int], layers: list[tuple[list[float], list[int]]], k: int) -> list[int]:
    out = []
    i = len(vs) - 1
    j = k
    while i >= 0 and j >= 1:
        out.append(vs[i])
        i = layers[j - 1][1][i]
        j -= 1
    return sorted(out)


def optimal_buckets(
    sizes: Mapping[int, int] | Sequence[int],
    *,
    max_buckets: int | None = None,
    max_waste: float | None = None,
) -> list[int]:
    """The bucket values with the least padding waste for ``max_buckets`` buckets (exact), or the
    fewest buckets whose waste is at most ``max_waste``; every observed size fits a bucket."""
    vs, cs = _hist(sizes)
    if not vs:
        return []
    m = len(vs)
    if max_waste is not None:
        used = sum(v * c for v, c in zip(vs, cs, strict=True))
        prefix = _prefix(cs)
        layers = [_next_layer(vs, prefix, None)]
        while True:
            cost = layers[-1][0][m - 1]
            if cost < math.inf and 1 - used / cost <= max_waste + 1e-12:
                return _values(vs, layers, len(layers))
            if len(layers) >= m:
                return list(vs)
            layers.append(_next_layer(vs, prefix, layers[-1][0]))  # one more bucket: O(m)
    k = min(max_buckets or 1, m)
    layers = _layers(vs, cs, k)
    best = min(range(1, k + 1), key=lambda j: layers[j - 1][0][m - 1])
    return _values(vs, layers, best)


# --------------------------------------------------------------------------- observed sizes


def axis_positions(expected: list[Any], axes: Sequence[str]) -> dict[str, list[tuple[int, int]]]:
    """Where each bucket axis lives among a function's flat inputs: (input, dim) pairs whose size
    is the axis's value in every bucket. Read off the lowered buckets themselves, so it holds
    however the arguments flatten (a Keras model's state, a pytree the manifest builds)."""
    out: dict[str, list[tuple[int, int]]] = {}
    if not expected:
        return out
    n = len(expected[0].leaves)
    same = [e for e in expected if len(e.leaves) == n]
    for axis in axes:
        values = {e.bucket.get(axis) for e in same}
        if len(values) < 2 or not all(isinstance(v, int) for v in values):
            # One value: no dimension can be told from a fixed one by the sizes, but an array
            # argument whose shape names the axis says where it is.
            origins = same[0].origins
            if origins is not None and all(isinstance(v, int) for v in values):
                for i, (_arg, _name, _path, shape) in enumerate(origins):
                    for d, dim in enumerate(shape or ()):
                        if dim == axis:
                            out.setdefault(axis, []).append((i, d))
            continue
        for i in range(n):
            rank = len(same[0].leaves[i][0])
            for d in range(rank):
                if all(
                    len(e.leaves[i][0]) == rank and e.leaves[i][0][d] == e.bucket.get(axis)
                    for e in same
                ):
                    out.setdefault(axis, []).append((i, d))
    return out


def _observed(
    ctx: Any, cache: str, since: timedelta, manifest_path: str, spec: Any
) -> tuple[dict[str, dict[int, int]], str]:
    """{axis: {size: calls}} for one manifest function, from every source there is, each weighted
    by calls: cachectl.serving's raw pre-padding sizes (failed and out-of-bucket calls count as the
    size they were) plus the compile requests of recorded signatures (a plain jit service's calls
    are seen only as compiles)."""
    merged: dict[str, dict[int, int]] = {}
    sources: list[str] = []
    for u in serving_usage(ctx.index, cache, since, function=spec.name):
        for axis, counts in u.sizes.items():
            target = merged.setdefault(axis, {})
            for size, n in counts.items():
                target[int(size)] = target.get(int(size), 0) + int(n)
    if merged:
        sources.append("serving")
    if signature_usage(ctx.index, cache, since):
        expected = expected_signatures(manifest_path, function=spec.name)
        if expected:
            module = expected[0].module
            where = axis_positions(expected, list(spec.buckets))
            found = False
            for row in signature_usage(ctx.index, cache, since, function=module):
                if len(row.leaves) != len(expected[0].leaves):
                    continue
                for axis, places in where.items():
                    # an axis on several inputs (a batch dim): the largest is the call's size
                    dims = [
                        row.leaves[i][0][d]
                        for i, d in places
                        if d < len(row.leaves[i][0]) and isinstance(row.leaves[i][0][d], int)
                    ]
                    if dims:
                        target = merged.setdefault(axis, {})
                        size = max(dims)
                        target[size] = target.get(size, 0) + int(row.requests)
                        found = True
            if found:
                sources.append("signatures")
    return merged, "+".join(sources) or "signatures"


def _compile_ms(ctx: Any, cache: str, function: str) -> float | None:

    with ctx.index.read_session() as s:
        value = s.scalar(
            select(func.avg(Entry.compile_time_ms))
            .join(EnvRow, EnvRow.id == Entry.environment_id)
            .join(Cache, Cache.id == EnvRow.cache_id)
            .where(
                Cache.name == cache, Entry.function == function, Entry.compile_time_ms.is_not(None)
            )
        )
    return None if value is None else float(value)


# --------------------------------------------------------------------------- rewriting the manifest


def rewrite_axes(text: str, manifest: Any, changes: Mapping[tuple[str, str], list[int]]) -> str:
    """``text`` with each (function, axis)'s values replaced in place, comments and layout kept."""
    lines = text.splitlines(keepends=True)
    source = manifest.functions[0]._source if manifest.functions else None
    for spec_index, spec in enumerate(manifest.functions):
        for axis in spec.buckets:
            new = changes.get((spec.name, axis))
            if new is None:
                continue
            assert source is not None  # set from functions[0]: this loop has functions
            lineno = source.line(("functions", spec_index, "buckets", axis)) - 1
            line = lines[lineno]
            values = f"[{', '.join(str(v) for v in new)}]"
            flow = re.match(rf"^(\s*{re.escape(axis)}\s*:\s*)\[[^\]]*\](.*)$", line, re.S)
            if flow:
                lines[lineno] = f"{flow.group(1)}{values}{flow.group(2)}"
                continue
            # A flow mapping: `buckets: {batch: [1, 4], seq: [8, 16]}` on one line.
            inline = list(
                re.finditer(rf"([{{,]\s*{re.escape(axis)}\s*:\s*)\[[^\]]*\]", line.split("#")[0])
            )
            if len(inline) == 1:
                m = inline[0]
                lines[lineno] = f"{line[: m.start()]}{m.group(1)}{values}{line[m.end() :]}"
                continue
            block = re.match(rf"^(\s*){re.escape(axis)}\s*:\s*(#.*)?$", line.rstrip("\n"))
            if not block:
                raise BadInput(
                    f"{manifest.path}:{lineno + 1}: cannot rewrite axis {axis!r} in place "
                    "(write it as `axis: [a, b, c]`)"
                )
            end = lineno + 1
            item = None
            while end < len(lines) and re.match(r"^\s*-\s*[^\s#][^#]*(#.*)?$", lines[end]):
                item = item or re.match(r"^(\s*-\s*)", lines[end]).group(1)  # type: ignore[union-attr]
                end += 1
            if item is None:
                raise BadInput(
                    f"{manifest.path}:{lineno + 1}: cannot find the values of axis {axis!r}"
                )
            lines[lineno + 1 : end] = [f"{item}{v}\n" for v in new]
    return "".join(lines)


# --------------------------------------------------------------------------- the command


@dataclass(frozen=True)
class _Limits:
    """How many buckets an axis gets: ``max_buckets``, the fewest within ``max_waste``, or
    (neither given) as many as it has now."""

    max_buckets: int | None
    max_waste: float | None

    def check(self) -> None:
        if self.max_buckets is not None and self.max_waste is not None:
            raise BadInput("give --max-buckets or --max-waste, not both")
        if self.max_buckets is not None and self.max_buckets < 1:
            raise BadInput("--max-buckets must be at least 1")
        if self.max_waste is not None and not 0 <= self.max_waste < 1:
            raise BadInput(
                "--max-waste is a share of computed elements: 0 <= P < 1 (e.g. 0.1 or 10%)"
            )

    def propose(self, sizes: Mapping[int, int], current: Sequence[Any]) -> list[int]:
        if self.max_buckets is not None:
            k: int | None = self.max_buckets
        else:
            k = None if self.max_waste is not None else len(current)
        return optimal_buckets(sizes, max_buckets=k, max_waste=self.max_waste)


@dataclass(frozen=True)
class _Window:
    """What advice is read from: the cache's index over the window, and the manifest."""

    ctx: Any
    cache: str
    since: timedelta
    manifest: Any
    buckets: list[Any]  # every bucket of the manifest (expand)


def _function_advice(
    window: _Window,
    spec: Any,
    axes: list[str],
    limits: _Limits,
    notes: list[str],
    changes: dict[tuple[str, str], list[int]],
) -> FunctionAdvice | None:
    """One function's advice per axis, or None when no axis has observed sizes; axes worth
    changing go into ``changes``, axes with nothing to say into ``notes``."""
    observed, source = _observed(
        window.ctx, window.cache, window.since, str(window.manifest.path), spec
    )
    advice: list[AxisAdvice] = []
    for a in axes:
        sizes = observed.get(a, {})
        current_values = spec.buckets[a]
        if not sizes:
            notes.append(f"{spec.name}.{a}: no observed sizes since the window started")
            continue
        if not all(isinstance(v, int) for v in current_values):
            notes.append(f"{spec.name}.{a}: not an integer axis")
            continue
        proposal = limits.propose(sizes, current_values)
        advice.append(
            AxisAdvice(
                spec.name,
                a,
                sum(sizes.values()),
                len(sizes),
                source,
                score(current_values, sizes),
                score(proposal, sizes),
            )
        )
        if proposal != sorted(current_values):
            changes[(spec.name, a)] = proposal
    if not advice:
        return None
    current_programs = sum(1 for b in window.buckets if b.function == spec.name)
    counts = {a: len(spec.buckets[a]) for a in spec.buckets}
    counts.update({x.axis: len(x.proposed.values) for x in advice})
    proposed_programs = math.prod(counts.values())
    ms = _compile_ms(window.ctx, window.cache, spec.name)
    return FunctionAdvice(
        spec.name,
        advice,
        current_programs,
        proposed_programs,
        ms,
        None if ms is None else ms * current_programs / 1000,
        None if ms is None else ms * proposed_programs / 1000,
    )


def _write(manifest: Any, changes: Mapping[tuple[str, str], list[int]], new_text: str) -> None:
    """Write the rewritten manifest, only if no exclude entry names a dropped value and it
    still parses (BadInput otherwise, nothing written)."""
    for spec in manifest.functions:
        for e, entry in enumerate(spec.exclude):
            for a, v in entry.items():
                if (spec.name, a) in changes and v not in changes[(spec.name, a)]:
                    raise BadInput(
                        f"{manifest.path}: {spec.name} exclude entry {e} names {a}={v}, which "
                        "the proposal drops: remove that entry first; nothing written"
                    )
    parse_manifest(new_text, str(manifest.path), Path(manifest.path).parent)
    Path(manifest.path).write_text(new_text)


def advise(
    ctx: Any,
    manifest_path: str | Path,
    *,
    function: str | None = None,
    axis: str | None = None,
    max_buckets: int | None = None,
    max_waste: float | None = None,
    since: timedelta,
    write: bool = False,
    cache: str | None = None,
) -> AdviseReport:
    """Propose bucket values per axis from observed sizes; with ``write``, rewrite the manifest."""
    limits = _Limits(max_buckets, max_waste)
    limits.check()
    manifest = load_manifest(manifest_path)
    info = ctx.cache(cache or manifest.cache)
    specs = [s for s in manifest.functions if function in (None, s.name)]
    if function is not None and not specs:
        raise BadInput(
            f"{manifest_path}: no function {function!r} (functions: {', '.join(manifest.names)})"
        )
    window = _Window(ctx, info.name, since, manifest, expand(manifest))
    notes: list[str] = []
    out: list[FunctionAdvice] = []
    changes: dict[tuple[str, str], list[int]] = {}
    for spec in specs:
        axes = [a for a in spec.buckets if axis in (None, a)]
        if axis is not None and not axes:
            if function is not None:
                raise BadInput(
                    f"{spec.name}: no bucket axis {axis!r} (axes: {', '.join(spec.buckets) or 'none'})"
                )
            continue
        advice = _function_advice(window, spec, axes, limits, notes, changes)
        if advice is not None:
            out.append(advice)
    text = Path(manifest.path).read_text()
    new_text = rewrite_axes(text, manifest, changes) if changes else text
    diff = "".join(
        difflib.unified_diff(
            text.splitlines(keepends=True),
            new_text.splitlines(keepends=True),
            fromfile=str(manifest.path),
            tofile=str(manifest.path),
        )
    )
    if write and changes:
        _write(manifest, changes, new_text)
    return AdviseReport(
        str(manifest.path),
        info.name,
        since.total_seconds(),
        out,
        write and bool(changes),
        diff,
        notes,
    )
