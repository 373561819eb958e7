"""The environment variables that make a process hit its managed namespace.

`cachectl env` and `cachectl exec` must never leave a service worse off than
plain JAX: with the index or server down (or its file corrupt) they fall back,
like activate(), to ``CACHECTL_ROOT``, then to the namespace last resolved for
this cache on this machine, then to the embedded default's root, and warn once.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, replace
from pathlib import Path

from cachectl.context import Context
from cachectl.core.config import DEFAULT_CACHE, state_dir
from cachectl.core.errors import BadInput, CachectlError, NotFound
from cachectl.core.fingerprint import Environment
from cachectl.core.probe import (
    MEMO_MAX_BYTES,
    Untrusted,
    read_private,
)
from cachectl.core.temps import atomic_write
from cachectl.service.activate import env_vars_for, jax_config_for
from cachectl.service.exec_hook import child_variables
from cachectl.service.service_index import fail_fast_options
from cachectl.storage.jax_storage import child_env
from cachectl.storage.store import Store, normalize_url


@dataclass(frozen=True)
class ServiceEnv:
    cache: str
    namespace: str
    readonly: bool
    variables: dict[str, str]
    warning: str | None = None


def _state_file() -> Path:
    return state_dir() / "last-namespaces.json"


def _remember(cache: str, url: str, readonly: bool) -> None:
    """Keep the namespace this cache resolved to: the fallback when the index is down later."""
    path = _state_file()
    try:
        known = json.loads(read_private(path, 16 * MEMO_MAX_BYTES)) if path.exists() else {}
        if not isinstance(known, dict):
            known = {}
        if known.get(cache) == {"url": url, "readonly": readonly}:
            return
        known[cache] = {"url": url, "readonly": readonly}
        data = json.dumps(known, indent=1, sort_keys=True).encode()
        atomic_write(str(path), 0o600, lambda fh: fh.write(data))
    except (OSError, ValueError, Untrusted):
        pass  # best effort: only the fallback is lost


def _last_known(cache: str) -> dict[str, object] | None:
    """The namespace last resolved here: only from a file this user alone can write."""
    try:
        known = json.loads(read_private(_state_file(), 16 * MEMO_MAX_BYTES))
    except (OSError, ValueError, Untrusted):
        return None
    entry = known.get(cache) if isinstance(known, dict) else None
    return entry if isinstance(entry, dict) and isinstance(entry.get("url"), str) else None


def service_env(
    ctx: Context, *, readonly: bool | None = None, environment: Environment | None = None
) -> ServiceEnv:
    """Variables for `cachectl env` and `cachectl exec`: the same config activate() sets.

    ``environment``: the one the service will see, where the caller read it (in a child,
    for a command whose JAX child needs the accelerator); else it is read here.
    Raises BadInput only when the index cannot answer and nothing else says
    where the namespace is (no CACHECTL_ROOT, no earlier resolution here).
    """
    env = environment or ctx.environment()
    try:
        cache = ctx.cache()
        ns, _ = ctx.namespace(cache, env)
    except NotFound:
        raise
    except Exception as exc:  # noqa: BLE001 - index or server down, or its file corrupt
        return _fallback(ctx, readonly, exc, env)
    if readonly is None:
        readonly = ctx.settings.readonly
    if readonly is None:
        readonly = cache.effective_service_writes == "deny"
    variables = env_vars_for(jax_config_for(ns.url, ns.environment, readonly))
    # The cache's storage options and bounds, for the service's JAX (storage/jax_storage.py).
    variables.update(
        child_env(cache.root_url, fail_fast_options(cache.root_url, cache.storage_options))
    )
    variables["CACHECTL_CACHE"] = cache.name
    _remember(cache.name, ns.url, readonly)
    return ServiceEnv(cache.name, ns.relpath, readonly, variables)


def exec_variables(
    ctx: Context, *, readonly: bool | None, telemetry: bool, fresh: bool = False
) -> ServiceEnv:
    """What `cachectl exec` adds to its service's environment: service_env's variables, for
    the environment a child read or exec remembered (cachectl.core.probe), and the
    sitecustomize that records telemetry and checks a remembered environment.

    A remembered environment the index never recorded is forgotten and read afresh: a file
    edited by hand never registers a made-up environment."""
    probed = ctx.remembered_environment(fresh=fresh)
    warnings = [probed.warning] if probed.warning else []
    result = service_env(ctx, readonly=readonly, environment=probed.environment)
    warning = "\n".join([*warnings, *([result.warning] if result.warning else [])]) or None
    result = replace(result, warning=warning)
    remembered = str(probed.memo) if probed.remembered and probed.memo else None
    # Always: the child's JAX cache reads only verified entries (service/exec_hook.py).
    added = child_variables(
        probed.environment.to_dict(),
        os.environ.get("PYTHONPATH"),
        telemetry=telemetry,
        remembered=remembered,
    )
    return replace(result, variables={**result.variables, **added})


def _fallback(ctx: Context, readonly: bool | None, exc: Exception, env: Environment) -> ServiceEnv:
    settings = ctx.settings
    reason = exc.message if isinstance(exc, CachectlError) else f"{type(exc).__name__}: {exc}"
    reason = reason.splitlines()[0][:300] if reason else type(exc).__name__
    url: str | None = None
    source = ""
    if settings.root:
        url, source = Store(normalize_url(settings.root)).url_for(env.namespace), "CACHECTL_ROOT"
    else:
        known = _last_known(settings.cache)
        if known is not None and str(known["url"]).rstrip("/").endswith(env.namespace):
            url, source = str(known["url"]), "the namespace last resolved here"
            if readonly is None and settings.readonly is None:
                readonly = bool(known.get("readonly", True))
        elif settings.cache == DEFAULT_CACHE:
            url = Store(normalize_url(settings.default_root)).url_for(env.namespace)
            source = "the embedded default cache"
    if url is None:
        raise BadInput(
            f"index unavailable ({reason}) and no namespace known for cache {settings.cache!r}: "
            f"set CACHECTL_ROOT to cache {settings.cache!r}'s root URL as this machine reaches it "
            "(`cachectl cache list` names it where the index answers) to run without the index"
        )
    if readonly is None:
        readonly = settings.readonly if settings.readonly is not None else True
    variables = env_vars_for(jax_config_for(url, env, readonly))
    variables["CACHECTL_CACHE"] = settings.cache
    warning = f"cachectl: index unavailable ({reason}); using {source}: {url}"
    return ServiceEnv(settings.cache, env.namespace, readonly, variables, warning=warning)
