"""The signatures a manifest's buckets compile to, as a service's are recorded.

Each bucket is lowered (never compiled) in this process with the same pxla tap the
collector uses (cachectl.core.jax_seam), so both sides are JAX's own flat input avals and
shardings: `cachectl misses` compares a service's missed signatures with these
(cachectl/usage/misses_explain.py), `cachectl advise` finds where each bucket axis lives.
"""

from __future__ import annotations

import contextlib
import inspect
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cachectl.core import jax_seam
from cachectl.core.config import distributed_requested
from cachectl.manifest import build_call, expand, jit_function, load_manifest
from cachectl.telemetry import SignatureTap
from cachectl.warm import error_text, persistent_cache_off
from cachectl.warm.job import join


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
    # The lowered program has host callbacks: JAX never writes it, so every call misses.
    host_callbacks: bool = False


class _Capture:
    """Collects (module, leaves) of lowerings in this process through the collector's tap."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, tuple[jax_seam.Leaf, ...]]] = []

    def _on_lowering(self, module: Any, in_avals: Any, in_shardings: Any) -> None:
        self.seen.append((str(module), jax_seam.leaves_of(in_avals, in_shardings)))


@contextlib.contextmanager
def _capturing() -> Iterator[_Capture]:
    capture = _Capture()
    tap = SignatureTap(capture, jax_seam.pxla_logger())
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


@dataclass(frozen=True)
class LoweringFailure:
    """A bucket that did not lower: what `misses` reports instead of a traceback (the moment a
    manifest function fails to lower is when `misses` is needed)."""

    function: str
    bucket: str
    error: str


def expected_signatures(
    manifest_path: str | Path,
    *,
    function: str | None = None,
    failures: list[LoweringFailure] | None = None,
) -> list[ExpectedSignature]:
    """Lower every bucket of the manifest (no compile) and record its signature. With
    ``failures``, a bucket that does not lower is appended there and the others go on; without,
    its error propagates."""

    # A manifest's module may print on import (mujoco's warp warning): never into --json's stdout.
    with contextlib.redirect_stdout(sys.stderr):
        return _expected_signatures(manifest_path, function=function, failures=failures)


def _expected_signatures(
    manifest_path: str | Path,
    *,
    function: str | None = None,
    failures: list[LoweringFailure] | None = None,
) -> list[ExpectedSignature]:
    manifest = load_manifest(manifest_path)
    paths = [str(Path(manifest.path).parent)]
    specs = {s.name: s for s in manifest.functions}
    out: list[ExpectedSignature] = []
    jitted: dict[str, Any] = {}
    if distributed_requested(None):
        # Inside a jax.distributed job (every process runs the command) its meshes span the
        # job's devices: join it first, as its services do, or a mesh over them cannot be built.
        join()
    import jax

    jax.clear_caches()  # a lowering already cached in this process would not be logged again
    with persistent_cache_off():
        for bucket in expand(manifest):
            spec = specs[bucket.function]
            if spec.name not in jitted:
                jitted[spec.name] = jit_function(spec, paths)
            fn = jitted[spec.name]
            try:
                args, kwargs = build_call(spec, bucket, paths)
                with _capturing() as capture:
                    lowered = (
                        fn.trace(*args, **kwargs).lower()
                        if hasattr(fn, "trace")
                        else fn.lower(*args, **kwargs)
                    )
            except Exception as exc:  # noqa: BLE001 - the user's function: said, never a traceback
                if failures is None:
                    raise
                if function is None or function == spec.name:
                    failures.append(LoweringFailure(spec.name, bucket.label, error_text(exc)))
                continue
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
                    jax_seam.lowered_has_host_callbacks(lowered),
                )
            )
    return out
