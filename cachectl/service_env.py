"""The environment variables that make a process hit its managed namespace."""

from __future__ import annotations

from dataclasses import dataclass

from cachectl.context import Context
from cachectl.runtime import env_vars_for, jax_config_for


@dataclass(frozen=True)
class ServiceEnv:
    cache: str
    namespace: str
    readonly: bool
    variables: dict[str, str]


def service_env(ctx: Context, *, readonly: bool | None = None) -> ServiceEnv:
    """Variables for `cachectl env` and `cachectl exec`: the same config activate() sets."""
    cache = ctx.cache()
    ns, _ = ctx.namespace(cache)
    if readonly is None:
        readonly = ctx.settings.readonly
    if readonly is None:
        readonly = cache.effective_service_writes == "deny"
    variables = env_vars_for(jax_config_for(ns.url, ns.environment, readonly))
    variables["CACHECTL_CACHE"] = cache.name
    return ServiceEnv(cache.name, ns.relpath, readonly, variables)
