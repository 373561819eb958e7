"""Point this process's JAX at its managed namespace.

A service calls ``cachectl.activate()`` before its first compile. Whatever is
down (index, bucket), the service must never be worse off than plain JAX: a
failure here costs one warning, never an exception, except when the caller
asked for something contradictory (JAX already compiled with another cache).
"""

from __future__ import annotations

import logging
import warnings
from dataclasses import dataclass
from typing import Any

from cachectl.config import DEFAULT_CACHE, load_settings
from cachectl.errors import BadInput, CachectlError
from cachectl.fingerprint import MANAGED_JAX_CONFIG, Environment, current_environment
from cachectl.namespace import ensure_namespace
from cachectl.store import Store, normalize_url

log = logging.getLogger(__name__)

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

    @property
    def active(self) -> bool:
        return bool(self.path)


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
    from jax._src import compilation_cache as cc

    cache = getattr(cc, "_cache", None)
    if cache is None:
        return None
    return str(getattr(cache, "_path", "") or "") or None


def apply_jax_config(config: dict[str, Any]) -> None:
    """Set JAX's config; refuse if JAX already opened a different cache directory."""
    import jax
    from jax._src import compilation_cache as cc

    wanted = config["jax_compilation_cache_dir"]
    opened = _initialized_cache_dir()
    if opened is not None and opened.rstrip("/") != str(wanted).rstrip("/"):
        raise ActivationError(
            f"JAX already compiled with the persistent cache at {opened}; call cachectl.activate() "
            "before the first jax.jit compile (or use `cachectl exec`)"
        )
    for name, value in config.items():
        jax.config.update(name, value)
    if opened is None:
        cc.reset_cache()  # let JAX open the new directory at its next compile


def activate(cache: str | None = None, *, root: str | None = None, readonly: bool | None = None,
             db: str | None = None) -> Activation:
    """Resolve this process's namespace and point JAX's persistent cache at it.

    With only a root URL (argument or ``CACHECTL_ROOT``) no index is needed; if
    the index is unreachable the process still activates and logs one warning.
    """
    settings = load_settings(db=db, cache=cache, root=root, readonly=readonly)
    cache_name = settings.cache
    env = current_environment()
    problems: list[str] = []
    cache_info = None
    index = None
    try:
        from cachectl.index import open_index

        index = open_index(settings.db)
        if cache_name == DEFAULT_CACHE:
            cache_info = index.ensure_cache(cache_name, normalize_url(settings.default_root))
        else:
            cache_info = index.get_cache(cache_name)
    except CachectlError as exc:
        problems.append(f"index unavailable ({exc.message})")
    except Exception as exc:  # noqa: BLE001 - a service must start anyway
        problems.append(f"index unavailable ({type(exc).__name__}: {exc})")

    root_url = settings.root or (cache_info.root_url if cache_info else None)
    if root_url is None and cache_name == DEFAULT_CACHE:
        root_url = settings.default_root
    if root_url is None:
        message = f"cachectl: cache {cache_name!r} not activated: {'; '.join(problems)}; set CACHECTL_ROOT to run without the index"
        _warn(message)
        return Activation(cache_name, "", "", env.digest, False, False, warning=message)

    if settings.readonly is not None:
        ro = settings.readonly
    elif cache_info is not None:
        ro = cache_info.effective_service_writes == "deny"
    else:
        ro = normalize_url(root_url).startswith(("s3://", "gs://"))

    store = Store(root_url, cache_info.storage_options if cache_info else None)
    path = store.url_for(env.namespace)
    try:
        ensure_namespace(store, env, group=cache_info.group if cache_info else None)
    except Exception as exc:  # noqa: BLE001 - JAX itself will warn if the dir is unusable
        problems.append(f"could not prepare namespace {path} ({type(exc).__name__}: {exc})")

    apply_jax_config(jax_config_for(path, env, ro))

    indexed = False
    if index is not None and cache_info is not None:
        try:
            index.ensure_environment(cache_info.name, env)
            indexed = True
        except Exception as exc:  # noqa: BLE001
            problems.append(f"could not record environment ({exc})")
    warning = None
    if problems:
        warning = "cachectl: " + "; ".join(problems)
        _warn(warning)
    return Activation(cache_name, env.namespace, path, env.digest, ro, indexed, warning=warning)


def _warn(message: str) -> None:
    log.warning(message)
    warnings.warn(message, RuntimeWarning, stacklevel=3)
