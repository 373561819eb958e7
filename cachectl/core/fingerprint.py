"""The environment a JAX cache entry belongs to, read from the live runtime.

JAX's cache key is an opaque sha256 (docs/jax-facts.md, fact 9): nobody can tell from a file
name which JAX, hardware or flags produced it. cachectl therefore files every
entry under an Environment it recorded itself. The fields are exactly the
inputs of JAX's key other than the program, so two processes share a namespace
if and only if their keys can match.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import sys
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, fields
from functools import cached_property
from typing import Any

from cachectl.core import jax_seam
from cachectl.core.cpu_isa import host_cpu_isa
from cachectl.core.errors import BadInput

# Config that cachectl forces on every managed process (activate, warm, env).
# enable_xla_caches=none keeps keys independent of the cache path (fact 1);
# max_size=-1 avoids JAX's O(entries) eviction on every write (fact 2).
MANAGED_JAX_CONFIG: dict[str, Any] = {
    "jax_persistent_cache_enable_xla_caches": "none",
    "jax_compilation_cache_max_size": -1,
}

# Flags JAX excludes when the installed version has no list to read (0.10.2's).
_FALLBACK_EXCLUDED_FLAGS = (
    "--xla_dump_compress_protos",
    "--xla_dump_module_metadata",
    "--xla_dump_max_hlo_modules",
    "--xla_dump_include_timestamp",
    "--xla_dump_hlo_pass_re",
    "--xla_dump_hlo_module_re",
    "--xla_dump_hlo_snapshots",
    "--xla_dump_fusion_visualization",
    "--xla_dump_hlo_as_url",
    "--xla_dump_hlo_as_proto",
    "--xla_dump_hlo_as_text",
    "--xla_dump_hlo_as_long_text",
    "--xla_dump_hlo_as_html",
    "--xla_dump_hlo_as_dot",
    "--xla_dump_to",
    "--xla_force_host_platform_device_count",
    "--xla_dump_disable_metadata",
    "--xla_dump_hlo_pipeline_re",
    "--xla_gpu_cuda_data_dir",
    "--xla_gpu_experimental_autotune_cache_mode",
)

FINGERPRINT_VERSION = 1


@dataclass(frozen=True)
class Environment:
    """Everything in JAX's cache key except the program itself."""

    jax_version: str
    jaxlib_version: str
    backend: str
    platform_version: str
    device_kind: str
    device_count: int
    process_count: int
    topology: str
    xla_flags: tuple[str, ...]
    compression: str
    enable_xla_caches: str
    include_metadata_in_key: bool
    # jax_enable_x64: JAX's key need not change with it (a float32 program lowers the same), yet
    # a stored executable refuses a process of the other mode ("different enable_x64 mode").
    enable_x64: bool = False
    # The CPU instruction set XLA:CPU compiles for (cachectl.core.cpu_isa), '' off CPU: an entry
    # compiled with AVX-512 is an illegal instruction on a host without it.
    cpu_isa: str = ""

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["xla_flags"] = list(self.xla_flags)
        return data

    def canonical_json(self) -> str:
        """What the digest hashes: fields added later count only where they differ from their
        default, so every namespace that existed before them keeps its digest."""
        data = {"fingerprint_version": FINGERPRINT_VERSION, **self.to_dict()}
        for name, default in ADDED_FIELDS.items():
            if data[name] == default:
                del data[name]
        return json.dumps(data, sort_keys=True, separators=(",", ":"))

    # Computed once per instance (its fields are immutable): a bundle install asks for both
    # a few dozen times, each a JSON dump and a sha256 (BENCHMARKS.md, "OCI").
    @cached_property
    def digest(self) -> str:
        return hashlib.sha256(self.canonical_json().encode()).hexdigest()

    @cached_property
    def namespace(self) -> str:
        """Path of this environment's namespace relative to a cache root."""
        return "/".join(
            (
                f"jax-{_slug(self.jax_version)}",
                f"{_slug(self.backend)}-{_slug(self.device_kind)}-x{self.device_count}",
                self.digest[:16],
            )
        )

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Environment:
        """Rebuild from env.json or an index row; unknown keys are ignored."""
        names = {f.name for f in fields(cls)}
        missing = names - data.keys() - ADDED_FIELDS.keys()
        if missing:
            raise ValueError(f"missing fields: {', '.join(sorted(missing))}")
        values: dict[str, Any] = {k: data.get(k, ADDED_FIELDS.get(k)) for k in names}
        values["enable_x64"] = bool(values["enable_x64"])
        values["cpu_isa"] = values["cpu_isa"] or ""
        values["xla_flags"] = tuple(values["xla_flags"])
        values["device_count"] = int(values["device_count"])
        values["process_count"] = int(values["process_count"])
        values["include_metadata_in_key"] = bool(values["include_metadata_in_key"])
        return cls(**values)

    @classmethod
    def from_columns(cls, values: Sequence[Any]) -> Environment:
        """Rebuild from an index row's ENVIRONMENT_FIELDS columns, in that order (the JSON
        column as text from the stdlib driver, as a list from SQLAlchemy)."""
        data = dict(zip(ENVIRONMENT_FIELDS, values, strict=True))
        flags = data["xla_flags"]
        data["xla_flags"] = (json.loads(flags) if isinstance(flags, str) else flags) or ()
        return cls.from_dict(data)

    def env_json(self) -> str:
        """The self-describing file stored in each namespace."""
        data = {
            "fingerprint_version": FINGERPRINT_VERSION,
            "digest": self.digest,
            "namespace": self.namespace,
            **self.to_dict(),
        }
        return json.dumps(data, indent=2, sort_keys=True) + "\n"


# Fields added after namespaces existed, with the value every older namespace had: an env.json,
# bundle or remembered environment without them reads as that value, and the digest leaves them
# out at it (Environment.canonical_json).
ADDED_FIELDS: dict[str, Any] = {"enable_x64": False, "cpu_isa": ""}

# The environment's fields, in order: the index's columns of the same names (index/models.py)
# and every query that reads them (index/reads.py, index/row_records.py) come from this one list.
ENVIRONMENT_FIELDS: tuple[str, ...] = tuple(f.name for f in fields(Environment))


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9.]+", "-", text.lower()).strip("-") or "unknown"


def excluded_xla_flags() -> tuple[str, ...]:
    """The flags JAX leaves out of its key, taken from the installed JAX."""
    excluded = jax_seam.excluded_xla_flags()
    return _FALLBACK_EXCLUDED_FLAGS if excluded is None else excluded


def normalized_xla_flags(
    environ: Mapping[str, str] | None = None, argv: list[str] | None = None
) -> tuple[str, ...]:
    """XLA flags as JAX's key sees them: same sources, sorted, same exclusions."""
    environ = os.environ if environ is None else environ
    argv = sys.argv if argv is None else argv
    prefixes = jax_seam.extra_flag_prefixes()
    flags: list[str] = []
    for var in ("XLA_FLAGS", "LIBTPU_INIT_ARGS"):
        if environ.get(var):
            flags.extend(environ[var].split())
    flags.extend(a for a in argv if a.startswith("--xla") or any(a.startswith(p) for p in prefixes))
    excluded = set(excluded_xla_flags())
    return tuple(f.strip() for f in sorted(flags) if f.split("=")[0] not in excluded)


def compression_name() -> str:
    """The compression name JAX hashes into its key, decided the way JAX decides."""
    zstd = jax_seam.zstandard_compression()
    if zstd is None:  # pragma: no cover - JAX always says
        try:
            import zstandard  # noqa: F401

            return "zstandard"
        except ImportError:
            return "zlib"
    return "zstandard" if zstd else "zlib"


def _topology(devices: list[Any]) -> str:
    """JAX's topology fingerprint, or the device kinds where the backend has none.

    In a multi-process job the fingerprint can differ per process (on CPU it does), yet
    every process must name the same namespace: there it is a digest of the global
    device list (id, process, kind) instead, the same in every process.
    """
    if len({getattr(d, "process_index", 0) for d in devices}) > 1:
        listing = sorted((d.id, d.process_index, d.device_kind) for d in devices)
        return "multi:" + hashlib.sha256(json.dumps(listing).encode()).hexdigest()[:16]
    try:
        return f"{jax_seam.topology_fingerprint(devices):016x}"
    except Exception:  # noqa: BLE001 - any backend error means "no serialized topology"
        return "kinds:" + ",".join(d.device_kind for d in devices)


def x64_enabled() -> bool:
    """Whether this process runs JAX in x64 mode, read the way every JAX version answers it:
    what float64 canonicalizes to (the config attribute's name has moved between versions)."""
    import jax
    import numpy as np

    return bool(jax.dtypes.canonicalize_dtype(np.float64) == np.dtype("float64"))


def current_environment(managed: bool = True) -> Environment:
    """Collect this process's Environment from the live JAX runtime.

    With ``managed`` (the default), the key-affecting config is read as
    activate() and warm set it, so `cachectl path` run before activation names
    the same namespace a managed service will use.
    """
    import jax
    import jaxlib

    backend = jax_seam.default_backend()
    devices = jax.devices()
    flags = normalized_xla_flags()
    # JAX adds its options to Config at run time (setattr): its types declare none of them.
    enable_xla_caches = jax.config.jax_persistent_cache_enable_xla_caches  # type: ignore[attr-defined]
    if managed:
        enable_xla_caches = MANAGED_JAX_CONFIG["jax_persistent_cache_enable_xla_caches"]
    return Environment(
        jax_version=jax.__version__,
        jaxlib_version=getattr(jaxlib, "__version__", "unknown"),
        backend=backend.platform,
        platform_version=str(backend.platform_version),
        device_kind=devices[0].device_kind,
        device_count=len(devices),
        process_count=jax.process_count(),
        topology=_topology(devices),
        xla_flags=flags,
        compression=compression_name(),
        enable_xla_caches=str(enable_xla_caches or ""),
        # JAX adds its options to Config at run time (setattr): its types declare none of them.
        include_metadata_in_key=bool(jax.config.jax_compilation_cache_include_metadata_in_key),  # type: ignore[attr-defined]
        enable_x64=x64_enabled(),
        cpu_isa=host_cpu_isa(flags) if backend.platform == "cpu" else "",
    )


def compile_only_environment(
    devices: list[Any], environ: Mapping[str, str] | None = None
) -> Environment:
    """The Environment a slice of ``devices`` will report, read from compile-only devices.

    What ``cachectl fingerprint`` prints on that slice: the backend is the devices' client
    (libtpu's platform_version), the flags those of ``environ`` (LIBTPU_INIT_ARGS as
    cloud_tpu_init sets it there), one process; the rest is this process's JAX and config,
    managed as activate() sets it. Fields pinned by tests/test_deviceless.py against an env.json
    recorded on a real v5e.
    """
    import jax
    import jaxlib

    client = jax_seam.device_client(devices[0])
    return Environment(
        jax_version=jax.__version__,
        jaxlib_version=getattr(jaxlib, "__version__", "unknown"),
        backend=str(client.platform),
        platform_version=str(client.platform_version),
        device_kind=devices[0].device_kind,
        device_count=len(devices),
        process_count=1,
        topology=_topology(devices),
        xla_flags=normalized_xla_flags(environ, argv=[]),
        compression=compression_name(),
        enable_xla_caches=str(MANAGED_JAX_CONFIG["jax_persistent_cache_enable_xla_caches"]),
        # JAX adds its options to Config at run time (setattr): its types declare none of them.
        include_metadata_in_key=bool(jax.config.jax_compilation_cache_include_metadata_in_key),  # type: ignore[attr-defined]
        enable_x64=x64_enabled(),
    )


def check_version(name: str, value: str) -> None:
    """BadInput unless ``value`` is a PEP 440 version, as every real jax and jaxlib reports:
    prune compares versions, so a made-up string must never be recorded as one."""
    from packaging.version import InvalidVersion, Version

    try:
        Version(value)
    except InvalidVersion:
        raise BadInput(f"{name} {value!r} is not a version (PEP 440, e.g. 0.10.2)") from None


def check_versions(env: Environment) -> None:
    check_version("jax_version", env.jax_version)
    check_version("jaxlib_version", env.jaxlib_version)
