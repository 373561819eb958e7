"""`cachectl doctor`: why would this process miss its warmed cache?

JAX's key is an opaque hash (docs/jax-facts.md, fact 9): a different XLA flag, jaxlib,
device count or compression library silently gives every entry a new key.
Doctor compares this process's Environment with the ones in the index, names
the nearest and says, field by field and in plain words (env_differences.py), what differs; then
checks the process config and the cache itself for the known traps. Every
finding has a severity and a fix; any error makes the CLI exit 1.
"""

from __future__ import annotations

import os
import stat
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from cachectl.context import Context
from cachectl.core.config import TRUE_WORDS, Settings, config_path, state_dir
from cachectl.core.errors import CachectlError, Unreachable
from cachectl.core.fingerprint import Environment
from cachectl.core.sqlite_file import sqlite_path
from cachectl.core.topologies import tpu_compiler
from cachectl.core.units import format_size
from cachectl.index import CacheInfo, EnvironmentInfo
from cachectl.service.env_differences import Difference, nearest
from cachectl.service.service_index import fail_fast_options
from cachectl.storage.entries import Kind, classify, keys_lacking_atime
from cachectl.storage.node_tier import node_dir, via_server
from cachectl.storage.store import Store, normalize_url

ERROR, WARNING, INFO = "error", "warning", "info"
_ORDER = {ERROR: 0, WARNING: 1, INFO: 2}


@dataclass(frozen=True)
class Diagnosis:
    severity: str
    check: str
    message: str
    fix: str | None = None


@dataclass(frozen=True)
class DoctorReport:
    cache: str
    root: str | None
    environment: str
    namespace: str
    warmed_entries: int | None
    nearest: str | None
    nearest_namespace: str | None
    differences: list[Difference]
    findings: list[Diagnosis] = field(default_factory=list)

    __json_extra__ = ("errors", "warnings", "ok")

    @property
    def errors(self) -> int:
        return sum(f.severity == ERROR for f in self.findings)

    @property
    def warnings(self) -> int:
        return sum(f.severity == WARNING for f in self.findings)

    @property
    def ok(self) -> bool:
        return self.errors == 0


# ------------------------------------------------------------- config checks


def _truthy(value: str | None) -> bool:
    return str(value).strip().lower() in TRUE_WORDS


def check_process_config(
    environ: Mapping[str, str], jax_config: Mapping[str, Any], namespace_url: str | None
) -> list[Diagnosis]:
    """JAX settings of this process (environment and config) that break managed keys."""
    out: list[Diagnosis] = []
    cache_dir = environ.get("JAX_COMPILATION_CACHE_DIR") or jax_config.get(
        "jax_compilation_cache_dir"
    )
    xla_env = environ.get("JAX_PERSISTENT_CACHE_ENABLE_XLA_CACHES")
    xla_caches = (
        xla_env if xla_env is not None else jax_config.get("jax_persistent_cache_enable_xla_caches")
    )
    if cache_dir and str(xla_caches) != "none":
        caches = "JAX's default" if xla_caches is None else repr(xla_caches)
        out.append(
            Diagnosis(
                ERROR,
                "config",
                f"this process points JAX at {cache_dir} with enable_xla_caches={caches}: keys then "
                "depend on the cache path, so nothing warm wrote (with 'none') can hit",
                "start the service with cachectl.activate() or `cachectl exec`, or export "
                "JAX_PERSISTENT_CACHE_ENABLE_XLA_CACHES=none",
            )
        )
    elif xla_env is not None and xla_env != "none":
        out.append(
            Diagnosis(
                WARNING,
                "config",
                f"JAX_PERSISTENT_CACHE_ENABLE_XLA_CACHES={xla_env} is set: keys depend on the cache path "
                "(activate() and `cachectl exec` override it; anything that sets the cache dir itself misses)",
                "unset it, or set it to none",
            )
        )
    meta_env = environ.get("JAX_COMPILATION_CACHE_INCLUDE_METADATA_IN_KEY")
    meta = (
        _truthy(meta_env)
        if meta_env is not None
        else bool(jax_config.get("jax_compilation_cache_include_metadata_in_key"))
    )
    if meta:
        out.append(
            Diagnosis(
                WARNING,
                "config",
                "include_metadata_in_key is on: source file names and line numbers go into every key, "
                "so any code edit or another install path changes the keys",
                "unset JAX_COMPILATION_CACHE_INCLUDE_METADATA_IN_KEY (and warm without it)",
            )
        )
    max_size = environ.get("JAX_COMPILATION_CACHE_MAX_SIZE")
    if max_size is None and cache_dir:
        value = jax_config.get("jax_compilation_cache_max_size")
        max_size = None if value in (None, -1) else str(value)
    if max_size is not None and str(max_size).strip() not in ("-1", ""):
        out.append(
            Diagnosis(
                WARNING,
                "max-size",
                f"JAX_COMPILATION_CACHE_MAX_SIZE={max_size} turns on JAX's own eviction: every write then "
                "globs the directory and reads every -atime file, O(entries) per write",
                "unset it; cachectl enforces size limits out of band (`cachectl cache set --max-size`, `cachectl gc`)",
            )
        )
    if cache_dir and namespace_url and str(cache_dir).rstrip("/") != namespace_url.rstrip("/"):
        out.append(
            Diagnosis(
                WARNING,
                "config",
                f"JAX_COMPILATION_CACHE_DIR is {cache_dir}, not this environment's namespace {namespace_url}",
                "drop it and use cachectl.activate() or `cachectl exec`, which set the right directory",
            )
        )
    return out


# ------------------------------------------------------------ storage checks


def check_namespace_files(
    store: Store, relpath: str, indexed_entries: int | None
) -> list[Diagnosis]:
    """JAX eviction leftovers and index/storage drift, from one listing of the namespace."""
    out: list[Diagnosis] = []
    files = store.list(relpath)
    names = {f.path[len(relpath) :].lstrip("/") for f in files}
    kinds = {n: classify(n) for n in names}
    entries = sum(kind is Kind.ENTRY for kind in kinds.values())
    lacking = keys_lacking_atime(kinds)
    if lacking is not None:
        if lacking:
            out.append(
                Diagnosis(
                    ERROR,
                    "atime",
                    f"JAX's eviction is on in {store.url_for(relpath)} (.lockfile present) and {len(lacking)} "
                    f"-cache file(s) have no -atime (e.g. {lacking[0]}): every later JAX write there fails "
                    "(jax-ml/jax#39880)",
                    "remove the .lockfile and every *-atime file, and run services without "
                    "JAX_COMPILATION_CACHE_MAX_SIZE (cachectl enforces limits with `cachectl gc`)",
                )
            )
        else:
            out.append(
                Diagnosis(
                    WARNING,
                    "atime",
                    f"a process ran with JAX's own eviction in {store.url_for(relpath)} (.lockfile present): "
                    "its writes cost O(entries)",
                    "find it and unset JAX_COMPILATION_CACHE_MAX_SIZE there; then remove the .lockfile and *-atime files",
                )
            )
    if indexed_entries is not None and indexed_entries != entries:
        out.append(
            Diagnosis(
                WARNING,
                "drift",
                f"the index lists {indexed_entries} entries for this environment, storage holds {entries}",
                "run `cachectl sync`",
            )
        )
    return out


def check_local_permissions(store: Store, relpath: str, cache: CacheInfo | None) -> list[Diagnosis]:
    """World- or group-writable directories and files on a local cache (they can inject code)."""
    if not store.is_local:
        return []
    out: list[Diagnosis] = []
    group_gid = None
    if cache is not None and cache.group:
        import grp

        try:
            group_gid = grp.getgrnam(cache.group).gr_gid
        except KeyError:
            group_gid = None
    parts = [p for p in relpath.split("/") if p]
    paths = [store.url_for("/".join(parts[:i])) for i in range(len(parts) + 1)]
    ns_dir = paths[-1]
    if os.path.isdir(ns_dir):
        paths += [os.path.join(ns_dir, n) for n in sorted(os.listdir(ns_dir))]
    world, group = [], []
    for path in paths:
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            continue
        if stat.S_ISLNK(st.st_mode):
            continue
        if st.st_mode & stat.S_IWOTH:
            world.append(path)
        elif st.st_mode & stat.S_IWGRP and (group_gid is None or st.st_gid != group_gid):
            group.append(path)
    if world:
        out.append(
            Diagnosis(
                ERROR,
                "permissions",
                f"{len(world)} world-writable path(s) in the cache (e.g. {world[0]}): anyone on this machine "
                "can write an entry, and every process that reads the cache runs it",
                f"chmod o-w {world[0]} (and the rest); for a shared cache use "
                "`cachectl cache set NAME --group GROUP` (2775, group-owned)",
            )
        )
    if group:
        out.append(
            Diagnosis(
                WARNING,
                "permissions",
                f"{len(group)} group-writable path(s) not owned by the cache's group (e.g. {group[0]}): "
                "every member of that group can run code in the cache's readers",
                "chmod g-w them, or set the cache's group with `cachectl cache set NAME --group GROUP`",
            )
        )
    return out


OWNED_WALK_LIMIT = 10_000  # paths looked at under the state directory


def _owned_paths(settings: Settings) -> list[str]:
    """Every local path cachectl keeps for this user: the state directory's tree (exec's
    remembered environments, the last namespaces), the config file, the SQLite index with
    its directory, and trusted key files named by path."""
    paths: list[str] = []
    state = str(state_dir())
    if os.path.isdir(state):
        paths.append(state)
        for top, dirs, files in os.walk(state):
            paths += [os.path.join(top, n) for n in (*dirs, *files)]
            if len(paths) > OWNED_WALK_LIMIT:
                break
    paths.append(settings.config_file or str(config_path()))
    index = sqlite_path(settings.db)
    if index is not None:
        paths += [str(index.parent), str(index), f"{index}-wal", f"{index}-shm"]
    for key in settings.trust:
        if not key.startswith("ed25519:"):
            paths.append(os.path.expanduser(key))
    return paths[:OWNED_WALK_LIMIT]


def check_owned_paths(settings: Settings) -> list[Diagnosis]:
    """World-writable paths cachectl owns outside the cache: a planted remembered environment
    steers exec's services, a writable index or trusted key decides what services load."""
    world = []
    for path in _owned_paths(settings):
        try:
            st = os.lstat(path)
        except OSError:
            continue
        if not stat.S_ISLNK(st.st_mode) and st.st_mode & stat.S_IWOTH:
            world.append(path)
    if not world:
        return []
    return [
        Diagnosis(
            ERROR,
            "permissions",
            f"{len(world)} world-writable path(s) cachectl keeps (e.g. {world[0]}): anyone on "
            "this machine can change the index, a trusted key or what `cachectl exec` remembers",
            f"chmod o-w {world[0]} (and the rest)",
        )
    ]


# ---------------------------------------------------------------- diagnose


def _jax_config_values() -> dict[str, Any]:
    """JAX's cache config in this process. Where JAX is not imported, nothing set it: JAX
    would read the variables check_process_config reads first, its defaults reading as unset
    there, so JAX is not imported for them (doctor then answers without JAX)."""
    if "jax" not in sys.modules:
        return {}
    import jax

    names = (
        "jax_compilation_cache_dir",
        "jax_persistent_cache_enable_xla_caches",
        "jax_compilation_cache_include_metadata_in_key",
        "jax_compilation_cache_max_size",
    )
    return {n: getattr(jax.config, n, None) for n in names}


def _lookup_cache(ctx: Context, findings: list[Diagnosis]) -> CacheInfo | None:
    """The cache's row, or None (with the finding) when the index is unreachable."""
    try:
        return ctx.cache()
    except Unreachable as exc:
        findings.append(
            Diagnosis(
                ERROR,
                "index",
                f"index unreachable: {exc.message}",
                "check CACHECTL_DB and the database; services still start from CACHECTL_ROOT meanwhile",
            )
        )
        return None


class _Storage(NamedTuple):
    """The cache's root and, when its URL is usable, its store and this environment's namespace."""

    root: str | None
    store: Store | None
    namespace_url: str | None


def _open_storage(
    ctx: Context, cache: CacheInfo | None, env: Environment, findings: list[Diagnosis]
) -> _Storage:
    root = ctx.settings.root or (cache.root_url if cache else None)
    if not root:
        return _Storage(root, None, None)
    if cache is not None and via_server(ctx.settings, cache.root_url):
        tier = node_dir(ctx.settings, cache.root_url)
        findings.append(
            Diagnosis(
                INFO,
                "storage",
                f"the root {root} is on the server's machine: this machine reads its entries "
                f"through {ctx.settings.server}"
                + (
                    f" into the node tier {tier}"
                    if tier
                    else " (no node tier: CACHECTL_NODE_CACHE=off)"
                ),
            )
        )
        return _Storage(root, None, None)
    try:
        url = normalize_url(root)
        store = Store(url, fail_fast_options(url, cache.storage_options if cache else None))
        return _Storage(root, store, store.url_for(env.namespace))
    except CachectlError as exc:
        findings.append(Diagnosis(ERROR, "storage", exc.message, "fix the cache's root URL"))
        return _Storage(root, None, None)


@dataclass(frozen=True)
class _EnvironmentCheck:
    """This environment against the cache's warmed ones: its entries (None: not indexed) or,
    when it has none, the nearest warmed environment and how it differs."""

    warmed_entries: int | None = None
    nearest: EnvironmentInfo | None = None
    differences: list[Difference] = field(default_factory=list)


def _check_environment(
    ctx: Context, cache: CacheInfo, env: Environment, findings: list[Diagnosis]
) -> _EnvironmentCheck:
    try:
        envs = ctx.index.environment_stats(cache.name)
    except Unreachable as exc:
        envs = []
        findings.append(
            Diagnosis(
                ERROR,
                "index",
                f"index unreachable: {exc.message}",
                "check CACHECTL_DB and the database",
            )
        )
    mine = next((e for e in envs if e.digest == env.digest), None)
    if mine is not None and mine.entries > 0:
        findings.append(
            Diagnosis(
                INFO,
                "environment",
                f"this environment ({env.digest[:16]}) is warmed: {mine.entries} entries, "
                f"{format_size(mine.bytes)} in {env.namespace}",
            )
        )
        return _EnvironmentCheck(mine.entries)
    warmed_entries = mine.entries if mine is not None else None
    found = nearest(env, [e for e in envs if e.entries > 0 and e.digest != env.digest])
    if found is None:
        findings.append(
            Diagnosis(
                WARNING,
                "environment",
                f"cache {cache.name!r} holds no warmed environment: every compile misses until warm runs",
                "run `cachectl warm MANIFEST` on the hardware the service runs on",
            )
        )
        return _EnvironmentCheck(warmed_entries)
    near, diffs = found
    findings.append(
        Diagnosis(
            ERROR,
            "environment",
            f"no entries for this environment ({env.digest[:16]}) in cache {cache.name!r}: every "
            f"compile will miss. Nearest warmed environment: {near.namespace} ({near.entries} entries), "
            f"{len(diffs)} difference(s)",
            "make this process match it (below), or warm on this machine",
        )
    )
    findings.extend(Diagnosis(ERROR, f"env:{d.field}", d.message, d.fix) for d in diffs)
    return _EnvironmentCheck(warmed_entries, near, diffs)


def _check_storage(
    storage: _Storage, env: Environment, cache: CacheInfo | None, warmed_entries: int | None
) -> list[Diagnosis]:
    """The namespace's files and permissions; an unreachable or unreadable bucket is a finding."""
    store = storage.store
    if store is None:
        return []
    out: list[Diagnosis] = []
    try:
        store.check_reachable()
        out.extend(check_namespace_files(store, env.namespace, warmed_entries))
        out.extend(check_local_permissions(store, env.namespace, cache))
    except Unreachable as exc:
        out.append(
            Diagnosis(
                ERROR,
                "storage",
                exc.message,
                "check the bucket, its endpoint (AWS_ENDPOINT_URL / STORAGE_EMULATOR_HOST) and credentials; "
                "services still run, compiling everything",
            )
        )
    except Exception as exc:  # noqa: BLE001 - a listing error is a finding, not a crash
        out.append(
            Diagnosis(
                ERROR,
                "storage",
                f"cannot read {storage.root}: {type(exc).__name__}: {exc}".splitlines()[0],
                "check the storage and its credentials",
            )
        )
    return out


def _tpu_compile_finding() -> Diagnosis:
    """Whether ``warm --topology`` can compile for TPU here, and with which libtpu (info only)."""
    can = tpu_compiler()
    return Diagnosis(
        INFO, "tpu-compile", can.detail, None if can.ok else "pip install 'cachectl-jax[tpu]'"
    )


def diagnose(
    ctx: Context,
    *,
    env: Environment | None = None,
    environ: Mapping[str, str] | None = None,
    jax_config: Mapping[str, Any] | None = None,
) -> DoctorReport:
    """Check this process' setup against its cache; never raises for a broken index or bucket."""
    env = env or ctx.environment()
    environ = os.environ if environ is None else environ
    jax_config = _jax_config_values() if jax_config is None else jax_config
    cache_name = ctx.settings.cache
    findings: list[Diagnosis] = []
    cache = _lookup_cache(ctx, findings)
    storage = _open_storage(ctx, cache, env, findings)
    checked = _EnvironmentCheck()
    if cache is not None:
        checked = _check_environment(ctx, cache, env, findings)
    findings.extend(check_process_config(environ, jax_config, storage.namespace_url))
    findings.extend(_check_storage(storage, env, cache, checked.warmed_entries))
    findings.extend(check_owned_paths(ctx.settings))
    findings.append(_tpu_compile_finding())
    findings.sort(key=lambda f: _ORDER.get(f.severity, 3))
    near = checked.nearest
    return DoctorReport(
        cache=cache_name,
        root=storage.root,
        environment=env.digest,
        namespace=env.namespace,
        warmed_entries=checked.warmed_entries,
        nearest=near.digest if near else None,
        nearest_namespace=near.namespace if near else None,
        differences=checked.differences,
        findings=findings,
    )
