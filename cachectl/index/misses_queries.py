"""What `cachectl misses` reads from the index, in one answer.

The explanation itself (lowering the manifest's buckets, comparing signatures) runs where the
manifest and JAX are: the user's machine. The index's part is these facts, read here on the SQL
index in direct mode and on the server in server mode (``GET /caches/{cache}/misses-facts``),
so that `misses` works the same on a node that reaches the cache only through the server.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from sqlalchemy import func, select

from cachectl.core.errors import NotFound
from cachectl.index.models import Cache, Entry, WarmRun
from cachectl.index.models import Environment as EnvRow
from cachectl.index.telemetry_queries import SignatureRow, signature_usage

# How many entry keys of one module are sent: enough to count a manifest function's programs.
MAX_PROGRAM_KEYS = 10_000


@dataclass(frozen=True)
class MissesFacts:
    """The signatures services looked up over a window, and what warm recorded about them."""

    rows: list[SignatureRow]
    # module -> the manifest of the latest warm run that stored a program of it (any path; the
    # caller keeps those still on its disk)
    manifests_by_module: dict[str, list[str]] = field(default_factory=dict)
    # every warm run's manifest into the cache, latest first
    warm_manifests: list[str] = field(default_factory=list)
    # the rows' keys that warm stored for a manifest function
    warmed_keys: list[str] = field(default_factory=list)
    # module -> keys of the entries the index holds of it (for the rows' modules)
    programs: dict[str, list[str]] = field(default_factory=dict)
    # the environments warm filled, newest first, then every row's environment, as dicts
    warmed_environments: list[dict[str, Any]] = field(default_factory=list)
    environments: dict[str, dict[str, Any]] = field(default_factory=dict)


def _cache_entries(cache: str) -> Any:
    return (
        select(Entry.module, Entry.key)
        .join(EnvRow, EnvRow.id == Entry.environment_id)
        .join(Cache, Cache.id == EnvRow.cache_id)
        .where(Cache.name == cache)
    )


def _environment(index: Any, cache: str, digest: str) -> dict[str, Any] | None:
    try:
        return dict(index.get_environment(cache, digest).environment.to_dict())
    except NotFound:  # deleted since the rows were written
        return None


def misses_facts(index: Any, cache: str, since: timedelta) -> MissesFacts:
    """The facts `misses` explains, read from the SQL index ``index``."""
    rows = signature_usage(index, cache, since, function=None)
    modules = sorted({r.function for r in rows})
    keys = sorted({r.key for r in rows if r.key})
    by_module: dict[str, list[str]] = {}
    programs: dict[str, list[str]] = {}
    warmed: set[str] = set()
    with index.read_session() as s:
        latest = func.max(WarmRun.started_at)
        for module, path, _ in s.execute(
            select(Entry.module, WarmRun.manifest_path, latest)
            .join(WarmRun, WarmRun.id == Entry.warm_run_id)
            .join(EnvRow, EnvRow.id == Entry.environment_id)
            .join(Cache, Cache.id == EnvRow.cache_id)
            .where(
                Cache.name == cache,
                Entry.module.in_(modules),
                WarmRun.manifest_path.is_not(None),
            )
            .group_by(Entry.module, WarmRun.manifest_path)
            .order_by(latest.desc())
        ):
            by_module.setdefault(module, []).append(str(path))
        paths = s.scalars(
            select(WarmRun.manifest_path)
            .join(EnvRow, EnvRow.id == WarmRun.environment_id)
            .join(Cache, Cache.id == EnvRow.cache_id)
            .where(Cache.name == cache, WarmRun.manifest_path.is_not(None))
            .order_by(WarmRun.started_at.desc())
        ).all()
        for module, key in s.execute(_cache_entries(cache).where(Entry.module.in_(modules))):
            held = programs.setdefault(module, [])
            if len(held) < MAX_PROGRAM_KEYS:
                held.append(key)
        for i in range(0, len(keys), 500):
            warmed.update(
                s.scalars(
                    select(Entry.key)
                    .join(EnvRow, EnvRow.id == Entry.environment_id)
                    .join(Cache, Cache.id == EnvRow.cache_id)
                    .where(
                        Cache.name == cache,
                        Entry.function.is_not(None),
                        Entry.key.in_(keys[i : i + 500]),
                    )
                )
            )
        digests = s.scalars(
            select(EnvRow.digest)
            .join(WarmRun, WarmRun.environment_id == EnvRow.id)
            .join(Cache, Cache.id == EnvRow.cache_id)
            .where(Cache.name == cache)
            .order_by(WarmRun.started_at.desc())
        ).all()
    known = {d: _environment(index, cache, d) for d in dict.fromkeys(digests)}
    warmed_envs = [e for e in known.values() if e is not None]
    envs: dict[str, dict[str, Any]] = {}
    for d in dict.fromkeys(r.environment for r in rows):
        e = known[d] if d in known else _environment(index, cache, d)
        if e is not None:
            envs[d] = e
    return MissesFacts(
        rows=rows,
        manifests_by_module=by_module,
        warm_manifests=[str(p) for p in dict.fromkeys(paths) if p],
        warmed_keys=sorted(warmed),
        programs=programs,
        warmed_environments=warmed_envs,
        environments=envs,
    )
