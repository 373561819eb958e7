"""Point this process's JAX at its managed namespace.

A service calls ``cachectl.activate()`` before its first compile. Whatever is
down (index, bucket), the service must never be worse off than plain JAX: a
failure here costs one warning, never an exception, except when the caller
asked for something contradictory (JAX already compiled with another cache).
"""

from __future__ import annotations

import atexit
import logging
import os
import sys
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from cachectl import telemetry
from cachectl.core import jax_seam
from cachectl.core.cache_info import CacheInfo
from cachectl.core.config import (
    DEFAULT_CACHE,
    Settings,
    load_settings,
)
from cachectl.core.errors import BadInput, CachectlError
from cachectl.core.fingerprint import MANAGED_JAX_CONFIG, Environment, current_environment
from cachectl.core.temps import current_umask
from cachectl.core.urls import is_object_store, normalize_url
from cachectl.index.open import driver
from cachectl.service import node_source, server_roots
from cachectl.service.namespace_verifier import (  # noqa: F401 - exec_hook calls it here
    install_verifier,
    run_unverified,
    verify_exec_cache,
)
from cachectl.service.service_index import fail_fast_options, open_service_index
from cachectl.service.telemetry_sinks import IndexSink, ServerSink
from cachectl.storage.backends import s3 as s3_backend
from cachectl.storage.jax_storage import JaxStorageRefused, hand_to_jax
from cachectl.storage.store import Store

if TYPE_CHECKING:
    from cachectl.index.protocol import IndexBackend
    from cachectl.index.stdlib import StdlibReads
    from cachectl.service.mirror import PullResult


log = logging.getLogger(__name__)
T = TypeVar("T")

# How long exit waits for the environment's record (an index locked by a writer may hold it).
RECORD_EXIT_TIMEOUT_S = 5.0

# Set min_compile_time this high and JAX reads the cache but never writes it (fact 4).
READONLY_MIN_COMPILE_SECS = 1e9


class ActivationError(BadInput):
    """activate() was asked for something JAX cannot do in this process."""


@dataclass(frozen=True)
class Activation:
    """What activate() did: where JAX now reads (and maybe writes) its cache."""

    cache: str
    namespace: str
    path: str
    digest: str
    readonly: bool
    indexed: bool
    telemetry: str | None = None
    warning: str | None = None
    mirror: str | None = None
    pull: PullResult | None = None
    compiled_before: bool = False
    # The caller (or CACHECTL_RUN_UNVERIFIED_CODE) accepted unverified cache content.
    run_unverified_code: bool = False

    @property
    def active(self) -> bool:
        return bool(self.path)

    @property
    def index(self) -> IndexBackend | None:
        """The index activate() opened (cachectl.index.open, role "service"), held for this
        process and closed at its exit: cachectl.serving and JAX's verifier read through it
        rather than open another. Not a field: the record stays plain data (asdict, JSON).
        None in a process forked since (a connection is not shared across fork)."""
        held: tuple[IndexBackend, int] | None = self.__dict__.get("_index")
        return held[0] if held is not None and held[1] == os.getpid() else None

    @property
    def storage_options(self) -> dict[str, Any]:
        """The cache's storage options for ``path`` (none for a mirror): every store a service
        opens on its namespace carries them (cachectl.serving's listing included), or the
        environment's endpoint would collide with the one handed to JAX. Not a field either."""
        return dict(self.__dict__.get("_options") or {})

    def holding(
        self, index: IndexBackend | None, options: dict[str, Any] | None = None
    ) -> Activation:
        """This record, holding ``index`` (see ``index``) and the storage ``options``."""
        object.__setattr__(self, "_index", None if index is None else (index, os.getpid()))
        object.__setattr__(self, "_options", dict(options or {}))
        return self


def jax_config_for(path: str, env: Environment, readonly: bool) -> dict[str, Any]:
    """The JAX settings that make a process hit what warm wrote."""
    config: dict[str, Any] = {
        "jax_compilation_cache_dir": path,
        **MANAGED_JAX_CONFIG,
        "jax_compilation_cache_include_metadata_in_key": env.include_metadata_in_key,
    }
    if readonly:
        config["jax_persistent_cache_min_compile_time_secs"] = READONLY_MIN_COMPILE_SECS
    return config


def env_vars_for(config: dict[str, Any]) -> dict[str, str]:
    """JAX reads each option from JAX_<NAME> too: the same settings for `cachectl env`."""

    def text(value: Any) -> str:
        return str(value).lower() if isinstance(value, bool) else str(value)

    return {name.upper(): text(value) for name, value in config.items()}


def _initialized_cache_dir() -> str | None:
    """The directory JAX's persistent cache already opened in this process, if any."""
    return jax_seam.opened_cache_dir()


def _check_not_opened_elsewhere(wanted: str) -> None:
    opened = _initialized_cache_dir()
    if opened is not None and opened.rstrip("/") != str(wanted).rstrip("/"):
        raise ActivationError(
            f"JAX already compiled with the persistent cache at {opened}; call cachectl.activate() "
            "before the first jax.jit compile (or use `cachectl exec`)"
        )


def apply_jax_config(config: dict[str, Any]) -> None:
    """Set JAX's config; refuse if JAX already opened a different cache directory."""
    import jax

    _check_not_opened_elsewhere(config["jax_compilation_cache_dir"])
    opened = _initialized_cache_dir()
    for name, value in config.items():
        jax.config.update(name, value)
    if opened is None:
        jax_seam.reset_persistent_cache()  # let JAX open the new directory at its next compile


def _jax_compiled_already() -> bool:
    """True once JAX compiled anything in this process (it checks its cache on the first compile)."""
    return jax_seam.cache_checked()


# botocore's defaults (5 attempts with backoff, per operation) make an
# unreachable bucket cost JAX ~25 s at its first compile; one attempt fails
# within the storage bounds (config.storage_bounds: connect, silence, whole
# request). s3fs keeps its own retries for throttling and dropped connections.
# A retry policy the process set itself (fsspec's s3 defaults) stays;
# CACHECTL_S3_FAIL_FAST=0 leaves botocore's.
_FAIL_FAST_S3 = s3_backend.FAIL_FAST


def _fail_fast() -> dict[str, Any]:
    """botocore settings for JAX's own object-store client: one attempt per request unless
    CACHECTL_S3_FAIL_FAST=0 (the storage bounds apply either way)."""
    if os.environ.get("CACHECTL_S3_FAIL_FAST", "1").strip().lower() in ("0", "false", "no"):
        return {}
    return dict(_FAIL_FAST_S3)


def _record_environment(settings: Settings, env: Environment) -> None:
    """Record this environment in the index, off the start path; failures only logged."""
    index, cache_info = open_service_index(settings, [])
    if index is None or cache_info is None:
        return
    try:
        index.ensure_environment(cache_info.name, env)
    except Exception as exc:  # noqa: BLE001 - best effort
        log.debug("cachectl: could not record environment %s: %s", env.digest[:16], exc)
    finally:
        index.close()


def _touch_environment_later(index: StdlibReads, cache: str, env: Environment) -> None:
    """Mark a known environment seen from a thread, through the held index: the write and its
    commit stay off the service's start. Exit waits for it (bounded), then closes the index."""

    def run() -> None:
        try:
            index.ensure_environment(cache, env)
        except Exception as exc:  # noqa: BLE001 - a service runs on without it
            log.info("cachectl: could not record environment (%s)", exc)

    thread = threading.Thread(target=run, name="cachectl-record-env", daemon=True)
    thread.start()
    atexit.register(thread.join, RECORD_EXIT_TIMEOUT_S)


def _close_at_exit(index: IndexBackend, pid: int) -> None:
    """Close the held index in the process that opened it (never a forked child's copy)."""
    if os.getpid() == pid:
        index.close()


class _NotActivated(Exception):
    """Why this process runs on without the managed cache (one warning, never raised out)."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


def activate(
    cache: str | None = None,
    *,
    root: str | None = None,
    readonly: bool | None = None,
    telemetry: bool = True,
    mirror: str | os.PathLike[str] | None = None,
    db: str | None = None,
    run_unverified_code: bool | None = None,
) -> Activation:
    """Resolve this process's namespace and point JAX's persistent cache at it.

    Call it before the first compile. ``readonly`` defaults to the cache's
    policy (``--service-writes``; deny for object stores), overridden by the
    argument or ``CACHECTL_READONLY``. With ``mirror=DIR`` the namespace's
    verified entries are pulled to DIR first and JAX reads DIR (writes there
    stay local until `cachectl push`). ``telemetry`` installs the hit/miss
    collector that flushes to the index in the background.

    With only a root URL (argument or ``CACHECTL_ROOT``) no index is needed; if
    the index is unreachable the process still activates and logs one warning.
    With a root *and* a mode (``readonly`` or ``CACHECTL_READONLY``) the index
    is not consulted at all before JAX starts (the policy only supplies
    defaults): the environment is recorded by the telemetry thread, and
    ``Activation.indexed`` is False.
    Nothing here raises for a broken index or bucket; the only error is asking
    for a different cache directory than the one JAX already opened.

    JAX reads only entries it can verify (cachectl/trust/gate.py: a trusted key's signed
    list, else the sha256s the index recorded), asked once at the first compile; anything else
    compiles in memory, with one warning. ``run_unverified_code=True`` (or
    ``CACHECTL_RUN_UNVERIFIED_CODE=1``) reads whatever is there when nothing can verify.
    """
    settings = load_settings(db=db, cache=cache, root=root, readonly=readonly)
    cache_name = settings.cache
    _warn_umask_000()
    env = current_environment()
    compiled_before = _jax_compiled_already()
    problems: list[str] = []
    # Root and mode both given: nothing is needed from the index before JAX can
    # start, so skip it (and the SQLAlchemy import, ~40% of JAX's own import
    # time); the environment is recorded from a background thread instead.
    deferred = settings.root is not None and settings.readonly is not None and mirror is None
    index, cache_info = (None, None) if deferred else open_service_index(settings, problems)
    try:
        target = _target(settings, mirror, cache_info, env, problems)
        _check_not_opened_elsewhere(target.path)
    except (_NotActivated, ActivationError) as exc:
        if index is not None:
            index.close()
        if isinstance(exc, ActivationError):
            raise
        _warn(exc.message)
        return _inactive(cache_name, env, exc.message, compiled_before)
    if index is not None:
        # Held for the process (Activation.index), closed at exit after the record thread.
        atexit.register(_close_at_exit, index, os.getpid())
    pulled = _prepare_storage(target, index, cache_info, env, mirror, problems)
    _start_jax(target, env, compiled_before, problems)
    unverified_ok = run_unverified(run_unverified_code)
    if mirror is None:
        install_verifier(
            settings,
            env,
            target.path,
            target.options,
            target.node,
            not target.readonly,
            unverified_ok,
            index,
        )
    indexed = _record_now(index, cache_info, env, problems)
    collector = _after_start(settings, env, telemetry, deferred, problems)

    warning = None
    if problems:
        warning = "cachectl: " + "; ".join(problems)
        _warn(warning)
    activation = Activation(
        cache_name,
        env.namespace,
        target.path,
        env.digest,
        target.readonly,
        indexed,
        telemetry=collector,
        warning=warning,
        mirror=target.path if mirror is not None else None,
        pull=pulled,
        compiled_before=compiled_before,
        run_unverified_code=unverified_ok,
    )
    return activation.holding(index, target.options if mirror is None else None)


_UMASK_WARNED: list[bool] = []


def _warn_umask_000() -> None:
    """One warning per process under umask 000: what cachectl and JAX write here is kept from
    being world-writable file by file, but anything else the process writes is not."""
    if _UMASK_WARNED or current_umask() != 0:
        return
    _UMASK_WARNED.append(True)
    _warn(
        "cachectl: this process runs under umask 000: the cache files and state it writes are "
        "kept from being world-writable, anything else it writes is writable by every user "
        "(run it under umask 022)"
    )


def _inactive(cache: str, env: Environment, warning: str, compiled_before: bool) -> Activation:
    """The Activation of a process JAX runs in without the managed cache."""
    return Activation(
        cache, "", "", env.digest, False, False, warning=warning, compiled_before=compiled_before
    )


def _root_url(settings: Settings, cache_info: CacheInfo | None, problems: list[str]) -> str:
    """The cache's root URL, normalized: the setting, else the policy's, else the embedded
    default's; _NotActivated when there is none or it is not a URL cachectl manages."""
    root_url = settings.root or (cache_info.root_url if cache_info else None)
    if root_url is None and settings.cache == DEFAULT_CACHE:
        root_url = settings.default_root
    if root_url is None and settings.server:  # the server down: the root it named last time
        root_url = server_roots.remembered(settings.server, settings.cache)
    if root_url is None:
        raise _NotActivated(
            f"cachectl: cache {settings.cache!r} not activated: {'; '.join(problems)}; "
            f"set CACHECTL_ROOT to cache {settings.cache!r}'s root URL as this machine reaches "
            "it (`cachectl cache list` names it where the index answers) to run without the index"
        )
    try:
        return normalize_url(root_url)
    except CachectlError as exc:
        raise _NotActivated(
            f"cachectl: cache {settings.cache!r} not activated: {exc.message}"
        ) from None


@dataclass(frozen=True)
class _Target:
    """Where JAX's persistent cache goes: the root, its storage options, the directory JAX
    reads (and maybe writes), and the root's Store (None for a mirror or a failed client)."""

    root_url: str
    options: dict[str, Any]
    readonly: bool
    store: Store | None
    path: str
    # The node tier JAX's reads and cachectl.serving's go through (service/node_source.py).
    node: node_source.RemoteFiles | None = None


def _target(
    settings: Settings,
    mirror: str | os.PathLike[str] | None,
    cache_info: CacheInfo | None,
    env: Environment,
    problems: list[str],
) -> _Target:
    """The directory JAX uses and whether it only reads there (the object-store client of JAX
    bounded to fail fast first); _NotActivated without a root URL cachectl manages."""
    root_url = _root_url(settings, cache_info, problems)
    readonly = _readonly(settings, mirror, cache_info, root_url)
    options = dict(cache_info.storage_options) if cache_info else {}
    node = (
        None
        if mirror is not None
        else node_source.for_service(settings, root_url, options, env, _warn, problems)
    )
    if settings.server and cache_info is not None and settings.root is None:
        server_roots.remember(settings.server, settings.cache, root_url)
    if node is not None and node.via_server:  # JAX opens the node tier's directory itself
        return _Target(root_url, options, readonly, None, node.directory, node)
    store, path = _jax_path(root_url, options, env, mirror, problems)
    if mirror is None:
        _storage_to_jax(settings.cache, root_url, options, path)
    return _Target(root_url, options, readonly, store, path, node)


def _storage_to_jax(cache: str, root_url: str, options: dict[str, Any], path: str) -> None:
    """Hand JAX's own filesystem the cache's storage options and bounds (and, unless
    CACHECTL_S3_FAIL_FAST=0, one attempt per request); _NotActivated where it cannot take them:
    JAX would read the storage somewhere else (storage/jax_storage.py)."""
    try:
        hand_to_jax(root_url, options, path, client_config=_fail_fast())
    except (JaxStorageRefused, BadInput) as exc:  # BadInput: a bad CACHECTL_STORAGE_* bound
        raise _NotActivated(
            f"cachectl: cache {cache!r} not activated, JAX runs without it: {exc.message}"
        ) from None


def _prepare_storage(
    target: _Target,
    index: IndexBackend | None,
    cache_info: CacheInfo | None,
    env: Environment,
    mirror: str | os.PathLike[str] | None,
    problems: list[str],
) -> PullResult | None:
    """Before JAX starts: pull the namespace into the mirror, or create it for a writer."""
    root_url, options = target.root_url, target.options
    if mirror is not None:
        # The object-store client is built only if the mirror lacks something. Imported here:
        # the pull needs the entry format and, for its reads, SQLAlchemy's index.
        from cachectl.service.index_access import prepare_mirror

        return prepare_mirror(
            index, cache_info, env, lambda: Store(root_url, options), target.path, problems
        )
    if not target.readonly and target.store is not None:
        _prepare_namespace(
            root_url, fail_fast_options(root_url, options), env, cache_info, problems
        )
    return None


def _start_jax(
    target: _Target, env: Environment, compiled_before: bool, problems: list[str]
) -> None:
    """Point JAX's config at the target; say so when JAX compiled before without a cache."""
    if compiled_before and _initialized_cache_dir() is None:
        problems.append(
            "JAX compiled before cachectl.activate(): those programs were not read from "
            "or written to the managed cache; call activate() before the first jax.jit"
        )
    apply_jax_config(jax_config_for(target.path, env, target.readonly))


def _readonly(
    settings: Settings,
    mirror: str | os.PathLike[str] | None,
    cache_info: CacheInfo | None,
    root_url: str,
) -> bool:
    """Whether JAX only reads: the setting, else writable for a mirror, else the policy."""
    if settings.readonly is not None:
        return settings.readonly
    if mirror is not None:
        return False  # a mirror is local: writes stay there until `cachectl push`
    if cache_info is not None and cache_info.root_url == root_url:
        return cache_info.effective_service_writes == "deny"
    # No policy for this root (no index, or CACHECTL_ROOT overrides it): object stores read only.
    return is_object_store(root_url)


def _jax_path(
    root_url: str,
    options: dict[str, Any],
    env: Environment,
    mirror: str | os.PathLike[str] | None,
    problems: list[str],
) -> tuple[Store | None, str]:
    """Where JAX reads: the namespace under the root (and its Store, None when the storage
    client failed) or the mirror directory."""
    if mirror is not None:
        return None, os.path.abspath(os.path.expanduser(os.fspath(mirror)))
    try:
        store = Store(root_url, options)
        return store, store.url_for(env.namespace)
    except Exception as exc:  # noqa: BLE001 - JAX gets the URL and warns itself if it cannot use it
        problems.append(
            f"storage client for {root_url} failed ({type(exc).__name__}: {exc})".splitlines()[0]
        )
        return None, f"{root_url.rstrip('/')}/{env.namespace}"


def _record_now(
    index: IndexBackend | None,
    cache_info: CacheInfo | None,
    env: Environment,
    problems: list[str],
) -> bool:
    """Record this environment in the index opened before JAX started; whether it is recorded.
    A known one on the stdlib driver is marked seen from a thread (off the start path)."""
    if index is None or cache_info is None:
        return False
    try:
        # The stdlib driver (imported only when open_index chose it) knows a known one at once.
        stdlib = sys.modules.get("cachectl.index.stdlib")
        if (
            stdlib is not None
            and isinstance(index, stdlib.StdlibReads)
            and index.environment_id(cache_info.name, env.digest) is not None
        ):
            _touch_environment_later(index, cache_info.name, env)
        else:
            index.ensure_environment(cache_info.name, env)
        return True
    except Exception as exc:  # noqa: BLE001
        problems.append(f"could not record environment ({exc})")
        return False


def _after_start(
    settings: Settings, env: Environment, telemetry: bool, deferred: bool, problems: list[str]
) -> str | None:
    """Start the telemetry collector (it records a deferred environment), else record a
    deferred one from a thread: where telemetry goes, or None."""
    if telemetry:
        return start_telemetry(settings, settings.cache, env, problems)
    if deferred and not settings.server:
        threading.Thread(
            target=_record_environment,
            args=(settings, env),
            name="cachectl-record-env",
            daemon=True,
        ).start()
    return None


def _prepare_namespace(
    root_url: str,
    options: dict[str, Any],
    env: Environment,
    cache_info: CacheInfo | None,
    problems: list[str],
) -> None:
    """Create the namespace and its env.json for a writer (bounded on object stores).

    cachectl.storage.namespace (and the entry format it pulls in) is imported here, not at the top: a
    read-only service never needs it, and every object its import leaves behind brings the
    service's first full garbage collection closer."""
    from cachectl.storage.namespace import ensure_namespace

    try:
        store = Store(root_url, options)
        ensure_namespace(store, env, group=cache_info.group if cache_info else None)
    except Exception as exc:  # noqa: BLE001 - JAX itself will warn if the dir is unusable
        message = f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
        problems.append(f"could not prepare namespace {root_url}/{env.namespace} ({message})")


def _default_root(settings: Settings) -> str | None:
    """Where the embedded default cache is created if the index has none yet."""
    if settings.cache != DEFAULT_CACHE:
        return None
    try:
        return normalize_url(settings.default_root)
    except CachectlError:
        return None


def start_telemetry(
    settings: Settings, cache_name: str, env: Environment, problems: list[str]
) -> str | None:
    try:
        sink: telemetry.TelemetrySink
        if settings.server:  # server mode: batches go to POST /api/v1/telemetry
            sink = ServerSink(driver("http")(settings, "service"))
        else:
            sink = IndexSink(
                settings.with_overrides(cache=cache_name),
                env,
                create_cache_at=_default_root(settings),
            )
        telemetry.start(cache=cache_name, environment=env, sink=sink)
        return sink.describe()
    except Exception as exc:  # noqa: BLE001 - telemetry is optional
        problems.append(f"telemetry off ({type(exc).__name__}: {exc})")
        return None


def start_exec_telemetry(environment: dict[str, Any]) -> None:
    """Telemetry for a service `cachectl exec` started, for the environment exec resolved
    (cachectl.service.exec_hook: reading it here would open the backend early)."""
    settings = load_settings()
    start_telemetry(settings, settings.cache, Environment.from_dict(environment), [])


def _warn(message: str) -> None:
    """One warning, through logging (its last-resort handler prints it if none is set up)."""
    log.warning(message)
