"""What a cache holds: environments, entries and totals, straight from the index."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from cachectl.context import Context
from cachectl.index import CacheInfo, EntryInfo, EnvironmentInfo
from cachectl.index.usage import TelemetryStats, served_rate
from cachectl.storage.node_tier import via_server


@dataclass(frozen=True)
class EnvironmentListing:
    cache: str
    root: str
    environments: list[EnvironmentInfo]
    # server mode on a machine without the root: the server this machine reads it through
    through_server: str | None = None


@dataclass(frozen=True)
class EntryListing:
    cache: str
    environment: EnvironmentInfo
    entries: list[EntryInfo]


@dataclass(frozen=True)
class CacheTotals:
    cache: CacheInfo
    environments: int
    entries: int
    bytes: int  # entries and their stored executables
    last_access_at: datetime | None
    per_environment: list[EnvironmentInfo]
    executables: int = 0
    aot_bytes: int = 0
    # Namespaces whose every entry a warm-check proved on their hardware (EnvironmentInfo.proven).
    proven: int = 0
    # service telemetry over the default window (plain `cachectl stats`): per environment too
    telemetry: TelemetryStats | None = None

    __json_extra__ = ("hit_rate", "served_rate")

    @property
    def hit_rate(self) -> float | None:
        """Hits over the cacheable requests of every environment in ``telemetry``'s window."""
        if self.telemetry is None:
            return None
        hits = sum(r.hits for r in self.telemetry.environments)
        n = sum(r.cacheable_requests for r in self.telemetry.environments)
        return min(hits / n, 1.0) if n else None

    @property
    def served_rate(self) -> float | None:
        """Hits and loaded executables over those and the misses (see usage.served_rate)."""
        if self.telemetry is None:
            return None
        envs = self.telemetry.environments
        return served_rate(
            sum(r.hits for r in envs), sum(r.misses for r in envs), sum(r.loads for r in envs)
        )


def list_environments(ctx: Context, cache: CacheInfo) -> EnvironmentListing:
    through = ctx.settings.server if via_server(ctx.settings, cache.root_url) else None
    return EnvironmentListing(
        cache.name, cache.root_url, ctx.index.environment_stats(cache.name), through
    )


def list_entries(ctx: Context, cache: CacheInfo, env_prefix: str) -> EntryListing:
    env = ctx.index.find_environment(cache.name, env_prefix)
    return EntryListing(cache.name, env, ctx.index.list_entries(env.id))


def cache_totals(ctx: Context, caches: list[CacheInfo]) -> list[CacheTotals]:
    out = []
    for cache in caches:
        envs = ctx.index.environment_stats(cache.name)
        accesses = [e.last_access_at for e in envs if e.last_access_at]
        out.append(
            CacheTotals(
                cache,
                len(envs),
                sum(e.entries for e in envs),
                sum(e.bytes for e in envs),
                max(accesses) if accesses else None,
                envs,
                executables=sum(e.executables for e in envs),
                aot_bytes=sum(e.aot_bytes for e in envs),
                proven=sum(e.proven for e in envs),
            )
        )
    return out
