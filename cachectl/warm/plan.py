"""Validate a warm before anything compiles, and build every bucket's abstract call."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cachectl.context import Context
from cachectl.core import jax_seam
from cachectl.core.errors import BadInput, EnvironmentMismatch
from cachectl.core.fingerprint import Environment, current_environment
from cachectl.index import CacheInfo
from cachectl.manifest import (
    Bucket,
    LoadedManifest,
    Manifest,
    as_loaded,
    build_call,
    check_imports,
    compiling_for,
    expand,
    jit_function,
    select_shard,
)
from cachectl.trust.permissions import check_writer
from cachectl.warm.compiling import error_text, persistent_cache_off
from cachectl.warm.deviceless import DevicelessTarget, deviceless_import_words, resolve
from cachectl.warm.slice_guard import refuse_concrete_devices

# --------------------------------------------------------------------------- planning


@dataclass(frozen=True)
class WarmPlan:
    """A validated manifest resolved against this machine and a cache."""

    loaded: LoadedManifest  # the file as read, once: its digest is of the bytes compiled
    buckets: list[Bucket]
    cache: CacheInfo
    environment: Environment
    target_problems: list[str]
    search_paths: tuple[str, ...]
    # Compiling for a TPU slice this machine does not have (warm --topology): its devices.
    deviceless: DevicelessTarget | None = None

    @property
    def manifest(self) -> Manifest:
        return self.loaded.manifest

    @property
    def manifest_path(self) -> str:
        return self.loaded.path

    @property
    def manifest_digest(self) -> str:
        return self.loaded.digest


def environment_json(env: Environment) -> dict[str, Any]:
    return {"digest": env.digest, "namespace": env.namespace, **env.to_dict()}


def target_problems(manifest: Manifest, env: Environment) -> list[str]:
    problems = []
    if manifest.target is not None:
        problems.extend(manifest.target.mismatches(env.backend, env.device_kind, env.device_count))
    for spec in manifest.functions:
        if spec.mesh is not None and spec.mesh.size > env.device_count:
            problems.append(
                f"function {spec.name!r} needs a mesh of {spec.mesh.size} devices; "
                f"this machine has {env.device_count}"
            )
    return problems


def plan_warm(
    ctx: Context,
    manifest_path: str | Path | LoadedManifest,
    *,
    cache: str | None = None,
    shard: tuple[int, int] | None = None,
    paths: Sequence[str] = (),
    writer_check: bool = True,
    topology: str | None = None,
    libtpu_startup_warnings: bool = False,
) -> WarmPlan:
    """Validate everything that can fail before compiling: manifest, cache, permission, imports.

    Raises BadInput (2) for the manifest, PermissionDenied (4) for a non-writer;
    a target mismatch is returned in ``target_problems`` (callers exit 3). With ``topology``
    (or the manifest's ``target.topology`` on a machine that is no TPU) the buckets compile
    for that TPU slice's compile-only devices, into the slice's namespace (warm/deviceless.py);
    ``libtpu_startup_warnings`` (-v) lets libtpu print its start-up warnings there.
    A manifest already read (``LoadedManifest``) is not read again.
    """
    loaded = as_loaded(manifest_path, import_paths=paths)  # a bad one: all problems
    manifest = loaded.manifest
    cache_info = ctx.cache(cache or manifest.cache or ctx.settings.cache)
    if writer_check:
        check_writer(cache_info, "warm")
    named = topology or (manifest.target.topology if manifest.target is not None else None)
    deviceless = None
    if topology is None and named is not None:
        # On the slice itself warm compiles as usual. Elsewhere the backend is never opened: with
        # libtpu installed, JAX would try a TPU first and leave libtpu unable to compile.
        chips = jax_seam.tpu_chips_here()
        here = current_environment() if chips is None or chips > 0 else None
        if here is not None and here.backend == "tpu":
            env = here
        else:
            deviceless = resolve(named, startup_warnings=libtpu_startup_warnings)
            env = deviceless.environment
    elif named is not None:
        deviceless = resolve(named, startup_warnings=libtpu_startup_warnings)
        env = deviceless.environment
    else:
        env = current_environment()
    problems = target_problems(manifest, env)
    for spec in manifest.functions:  # a file the executables would be bound to must be there
        missing = spec.missing_depends_on()
        if missing is not None:
            raise missing
    where = "" if deviceless is None else deviceless_import_words(deviceless)
    check_imports(manifest, paths, where)
    buckets = expand(manifest)
    if shard is not None:
        buckets = select_shard(buckets, *shard)
    return WarmPlan(loaded, buckets, cache_info, env, problems, tuple(paths), deviceless)


def environment_mismatch(manifest_path: str, problems: Sequence[str]) -> EnvironmentMismatch:
    fields = "; ".join(problems)
    return EnvironmentMismatch(
        f"{manifest_path}: this machine does not match the manifest's target ({fields}); "
        "nothing was compiled: run warm on the hardware the service runs on"
    )


# --------------------------------------------------------------------------- warming


def raise_build_problems(plan: WarmPlan) -> None:
    """Build every bucket's abstract arguments (pytrees included; nothing compiles) for --dry-run.

    What would fail a real warm before compiling is bad input: BadInput (2), every
    distinct problem on its own line, each naming the manifest's file:line.
    """
    _, calls = build_calls(plan.manifest, plan.buckets, plan.search_paths, target_devices(plan))
    problems = list(dict.fromkeys(c for c in calls.values() if isinstance(c, str)))
    if problems:
        raise BadInput("\n".join(problems))


Call = tuple[tuple[Any, ...], dict[str, Any]]


def target_devices(plan: WarmPlan) -> list[Any] | None:
    """The compile-only devices a deviceless plan compiles for; None: this machine's."""
    return None if plan.deviceless is None else list(plan.deviceless.devices)


def build_calls(
    manifest: Manifest,
    buckets: Sequence[Bucket],
    paths: Sequence[str],
    devices: list[Any] | None = None,
) -> tuple[dict[str, Any], dict[int, Call | str]]:
    """The jitted function of every spec and the abstract call (or the error) of every bucket;
    meshes over ``devices`` when given (compile-only ones), else over this machine's."""
    specs = {spec.name: spec for spec in manifest.functions}
    jitted: dict[str, Any] = {}
    calls: dict[int, Call | str] = {}
    with persistent_cache_off(), compiling_for(devices):
        for position, bucket in enumerate(buckets):
            spec = specs[bucket.function]
            try:
                if spec.name not in jitted:
                    jitted[spec.name] = jit_function(spec, paths)
                calls[position] = build_call(spec, bucket, paths)
            except Exception as exc:  # noqa: BLE001 - one bad bucket must not stop the rest
                calls[position] = error_text(exc)
    return jitted, calls


def refuse_foreign_functions(plan: WarmPlan) -> None:
    """For a TPU slice (warm --topology): a function whose program would be for this machine's
    own devices is refused (BadInput, 2) before anything compiles (warm/slice_guard.py)."""
    devices = target_devices(plan)
    if devices is None:
        return
    firsts = list({b.function: b for b in plan.buckets[::-1]}.values())  # one per function
    jitted, calls = build_calls(plan.manifest, firsts, plan.search_paths, devices)
    refuse_concrete_devices(plan.manifest.functions, firsts, jitted, calls, devices)
