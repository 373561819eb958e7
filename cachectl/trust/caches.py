"""Registering caches and their policies."""

from __future__ import annotations

import re
import time
from dataclasses import dataclass
from typing import Any

from cachectl.context import Context
from cachectl.core.config import SERVICE_WRITES
from cachectl.core.errors import BadInput
from cachectl.index import CacheInfo
from cachectl.storage.namespace import check_local_root, prepare_root
from cachectl.storage.store import Store, normalize_url
from cachectl.trust.permissions import check_writer

_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")


@dataclass(frozen=True)
class RemovedCache:
    name: str
    purged: bool
    environments: int
    entries: int
    bytes: int
    dry_run: bool


# Option names that carry credentials: those come from the environment, never the index. Matched
# against the name lowercased without '_', '-' or '.': account_key, accountKey and AccountKey
# alike.
_SECRET_HINTS = (
    "secret",
    "password",
    "token",
    "credential",
    "keyid",
    "accesskey",
    "session",
    "accountkey",  # Azure: adlfs's account_key, connection_string, sas_token
    "connectionstring",
)
# A value that carries an Azure key or signature (a connection string, a SAS): a credential.
_AZURE_CREDENTIALS = re.compile(r"(AccountKey|SharedAccessSignature|sig)=", re.IGNORECASE)


# A URL with a password in it (scheme://user:password@host): a credential whatever its key.
_URL_CREDENTIALS = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://[^/@\s]*:[^/@\s]*@")


def looks_secret(key: str, value: Any) -> bool:
    """A storage option that carries a credential, by its name or by its value."""
    name = re.sub(r"[_.\-]", "", str(key)).lower()
    if any(hint in name for hint in _SECRET_HINTS):
        return True
    return isinstance(value, str) and bool(
        _URL_CREDENTIALS.match(value.strip()) or _AZURE_CREDENTIALS.search(value)
    )


def parse_storage_options(pairs: tuple[str, ...] | list[str]) -> dict[str, Any]:
    """``endpoint_url=http://...`` pairs -> fsspec storage options, refusing secrets. A dotted
    key sets a nested option: ``client_kwargs.region_name=eu-west-1`` (where s3fs takes a region)."""
    options: dict[str, Any] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        key = key.strip()
        parts = key.split(".")
        if not sep or not key or not all(part.strip() for part in parts):
            raise BadInput(
                f"bad storage option {pair!r}: use KEY=VALUE, e.g. endpoint_url=http://127.0.0.1:9000"
                " (a nested one: client_kwargs.region_name=eu-west-1)"
            )
        if looks_secret(key, value):
            raise BadInput(
                f"storage option {key!r} looks like a credential: the index never stores secrets; "
                "set it in the environment (AWS_*, GOOGLE_APPLICATION_CREDENTIALS, AZURE_STORAGE_*) instead"
            )
        target = options
        for part in parts[:-1]:
            target = target.setdefault(part.strip(), {})
            if not isinstance(target, dict):
                raise BadInput(f"bad storage option {pair!r}: {part!r} is already set to a value")
        if isinstance(target.get(parts[-1].strip()), dict):
            raise BadInput(f"bad storage option {pair!r}: {key!r} already holds nested options")
        lowered = value.strip().lower()
        target[parts[-1].strip()] = {"true": True, "false": False}.get(lowered, value)
    return options


def _check_name(name: str) -> None:
    if not _NAME_RE.match(name):
        raise BadInput(
            f"bad cache name {name!r}: use letters, digits, '.', '_' or '-' (at most 128)"
        )


def _check_policy(policy: dict[str, Any]) -> dict[str, Any]:
    for key in ("max_size", "max_entry_size", "env_max_size", "retention_seconds"):
        value = policy.get(key)
        if value is not None and value <= 0:
            raise BadInput(f"{key.replace('_', '-')} must be positive")
    sw = policy.get("service_writes")
    if sw is not None and sw not in SERVICE_WRITES:
        raise BadInput(f"bad --service-writes {sw!r}: use allow or deny")
    return {k: v for k, v in policy.items() if v is not None}


def add_cache(ctx: Context, name: str, url: str, **policy: Any) -> CacheInfo:
    """Validate and register a cache; a local root is created (group-shared if asked)."""
    _check_name(name)
    root = normalize_url(url)
    policy = _check_policy(policy)
    store = Store(root, policy.get("storage_options"))
    store.check_reachable()
    prepare_root(store, policy.get("group"))
    return ctx.index.add_cache(name, root, **policy)


def set_cache(ctx: Context, name: str, **policy: Any) -> CacheInfo:
    cache = ctx.cache(name)
    check_writer(cache, "change")
    policy = _check_policy(policy)
    if "root_url" in policy:
        policy["root_url"] = normalize_url(policy["root_url"])
        new_root = Store(policy["root_url"], cache.storage_options)
        if new_root.is_local:
            check_local_root(new_root.url)
        new_root.check_reachable()
    if policy.get("group"):
        prepare_root(
            Store(policy.get("root_url", cache.root_url), cache.storage_options), policy["group"]
        )
    return ctx.index.update_cache(name, **policy)


def remove_cache(
    ctx: Context, name: str, *, purge: bool = False, dry_run: bool = False
) -> RemovedCache:
    """Unregister a cache; with ``purge`` delete its namespaces first (storage, then index)."""
    cache = ctx.index.get_cache(name)
    envs = ctx.index.environment_stats(name)
    entries = sum(e.entries for e in envs)
    nbytes = sum(e.bytes for e in envs)
    result = RemovedCache(name, purge, len(envs), entries, nbytes, dry_run)
    if envs and not purge:
        raise BadInput(
            f"cache {name!r} holds {len(envs)} environment(s) with {entries} entries: "
            f"pass --purge to delete them, or `cachectl prune` first"
        )
    if dry_run:
        return result
    check_writer(cache, "remove")
    started = time.monotonic()
    if purge:
        store = Store(cache.root_url, cache.storage_options)
        for env in envs:
            store.delete_tree(env.namespace)
            ctx.index.mark_environment_deleted(env.id)
    ctx.index.remove_cache(name)
    ctx.index.audit(
        "cache-rm",
        cache=name,
        entries=entries,
        nbytes=nbytes,
        duration_ms=int((time.monotonic() - started) * 1000),
        details={"purged": purge},
    )
    return result
