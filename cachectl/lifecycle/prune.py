"""`cachectl prune`: delete what selectors name, planned from the index.

Selectors combine with AND. Environment-level ones (--jax-version,
--superseded, --env) pick namespaces; entry-level ones (--older-than,
--unused-for, --function) pick entries inside them. A namespace whose every
entry is picked goes as one unit (one recursive delete, environment row
marked deleted). Environments with a warm in progress are left alone.
"""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from packaging.specifiers import InvalidSpecifier, SpecifierSet
from packaging.version import InvalidVersion, Version

from cachectl.context import Context
from cachectl.core.cache_info import utcnow
from cachectl.core.config import DELETE_BATCH
from cachectl.core.errors import BadInput
from cachectl.core.units import format_duration, parse_duration
from cachectl.index import CacheInfo
from cachectl.index.plan_reads import (
    EnvSummary,
    environments,
    environments_with_recent_hits,
    selected_counts,
    selected_entries,
    warms_in_progress,
)
from cachectl.lifecycle.plan import (
    DeletionPlan,
    LifecycleResult,
    PlannedEntries,
    PlannedEntry,
    PlannedNamespace,
    Protected,
)
from cachectl.storage.store import Store
from cachectl.trust.permissions import check_writer


@dataclass(frozen=True)
class PruneCriteria:
    """Validated selectors; build with criteria() so bad input fails before anything runs."""

    older_than: timedelta | None = None
    unused_for: timedelta | None = None
    jax_version: str | None = None
    superseded: bool = False
    keep: int | None = None
    env: str | None = None
    function: str | None = None
    from_retention: bool = False

    @property
    def any(self) -> bool:
        return any(
            (
                self.older_than,
                self.unused_for,
                self.jax_version,
                self.superseded,
                self.env,
                self.function,
            )
        )

    @property
    def entry_level(self) -> bool:
        return any((self.older_than, self.unused_for, self.function))


def _specifier(text: str) -> SpecifierSet:
    try:
        spec = SpecifierSet(text.strip())
    except InvalidSpecifier as exc:
        raise BadInput(
            f"bad --jax-version {text!r}: use a PEP 440 specifier such as '<0.10' or '>=0.4,<0.5'"
        ) from exc
    if not str(spec):
        raise BadInput("empty --jax-version: use a PEP 440 specifier such as '<0.10'")
    return spec


def criteria(
    *,
    older_than: str | timedelta | None = None,
    unused_for: str | timedelta | None = None,
    jax_version: str | None = None,
    superseded: bool = False,
    keep: int | None = None,
    env: str | None = None,
    function: str | None = None,
) -> PruneCriteria:
    """Parse and check selectors: one-line BadInput (exit 2) for anything unusable."""

    def duration(flag: str, value: str | timedelta | None) -> timedelta | None:
        if value is None or isinstance(value, timedelta):
            return value
        parsed = parse_duration(value)
        if parsed.total_seconds() <= 0:
            raise BadInput(f"{flag} must be positive, got {value!r}")
        return parsed

    if jax_version is not None:
        _specifier(jax_version)
    if keep is not None and not superseded:
        raise BadInput(
            "--keep only goes with --superseded: e.g. `cachectl prune --superseded --keep 2`"
        )
    if keep is not None and keep < 1:
        raise BadInput(f"--keep must be at least 1, got {keep}")
    if function is not None and not function.strip():
        raise BadInput("empty --function: give a function name as `cachectl ls` shows it")
    if env is not None and not env.strip():
        raise BadInput("empty --env: give a digest prefix from `cachectl ls`")
    return PruneCriteria(
        duration("--older-than", older_than),
        duration("--unused-for", unused_for),
        jax_version,
        superseded,
        keep,
        env,
        function,
    )


def _version(text: str) -> Version | None:
    try:
        return Version(text)
    except InvalidVersion:
        return None


# Scheduled maintenance never deletes an environment that served hits this recently when it
# is the only one of its hardware group that did.
RECENT_HITS_WINDOW = timedelta(days=7)


def _group(e: EnvSummary) -> tuple[object, ...]:
    return (e.backend, e.device_kind, e.device_count, e.xla_flags)


def superseded_envs(envs: list[EnvSummary], keep: int) -> dict[int, str]:
    """environment id -> reason, for all but the newest ``keep`` JAX versions of each hardware group.

    A group is one backend, device kind, device count and set of XLA flags:
    the environments an upgrade replaces are the older versions inside it.
    Only environments that hold entries take part: one recorded without any
    (``resolve`` creates them from any fingerprint a writer sends) neither
    supersedes nor is superseded.
    """
    groups: dict[tuple[object, ...], list[EnvSummary]] = defaultdict(list)
    for e in envs:
        if e.entries > 0:
            groups[_group(e)].append(e)
    out: dict[int, str] = {}
    for members in groups.values():
        versions = sorted(
            {v for e in members if (v := _version(e.jax_version)) is not None}, reverse=True
        )
        kept = versions[:keep]
        if len(versions) <= keep:
            continue
        newest = ", ".join(str(v) for v in kept)
        for e in members:
            v = _version(e.jax_version)
            if v is not None and v not in kept:
                out[e.id] = f"jax {e.jax_version} superseded (keeping {newest})"
    return out


@dataclass(frozen=True)
class _EntrySelectors:
    """The entry-level selectors as the index queries take them, and the reason they give."""

    created_before: datetime | None
    unused_before: datetime | None
    function: str | None
    reasons: tuple[str, ...]

    @classmethod
    def of(cls, crit: PruneCriteria, now: datetime) -> _EntrySelectors:
        created_before = now - crit.older_than if crit.older_than else None
        unused_before = now - crit.unused_for if crit.unused_for else None
        reasons = []
        if created_before:
            reasons.append(f"created before {created_before:%Y-%m-%d %H:%M}")
        if unused_before:
            reasons.append(f"unused since {unused_before:%Y-%m-%d %H:%M}")
        if crit.function:
            reasons.append(f"function {crit.function}")
        return cls(created_before, unused_before, crit.function, tuple(reasons))


def _with_retention(cache: CacheInfo, crit: PruneCriteria) -> PruneCriteria:
    """``crit``, or where it selects nothing the cache's retention as --older-than."""
    if crit.any:
        return crit
    if not cache.retention_seconds:
        raise BadInput(
            "prune needs a selector (--older-than, --unused-for, --jax-version, --superseded, --env, "
            f"--function), or a retention on the cache: `cachectl cache set {cache.name} --retention 30d`"
        )
    return PruneCriteria(older_than=timedelta(seconds=cache.retention_seconds), from_retention=True)


def _select_environments(
    ctx: Context,
    cache: CacheInfo,
    crit: PruneCriteria,
    keep: int,
    all_envs: list[EnvSummary],
    plan: DeletionPlan,
) -> tuple[list[EnvSummary], dict[int, list[str]]]:
    """The environments the environment-level selectors pick (all where none is given), and the
    reasons each was picked for, by environment id."""
    env_reasons: dict[int, list[str]] = {e.id: [] for e in all_envs}
    candidates = list(all_envs)
    if crit.env:
        target = ctx.index.find_environment(cache.name, crit.env)  # unknown/ambiguous: exit 2
        candidates = [e for e in candidates if e.id == target.id]
        for e in candidates:
            env_reasons[e.id].append(f"environment {e.digest[:16]}")
    if crit.jax_version:
        spec = _specifier(crit.jax_version)
        kept = []
        for e in candidates:
            v = _version(e.jax_version)
            if v is None:
                plan.notes.append(
                    f"{e.namespace}: jax version {e.jax_version!r} is not PEP 440; not matched"
                )
            elif spec.contains(v, prereleases=True):
                kept.append(e)
                env_reasons[e.id].append(f"jax {e.jax_version} matches {spec}")
        candidates = kept
    if crit.superseded:
        old = superseded_envs(all_envs, keep)
        candidates = [e for e in candidates if e.id in old]
        for e in candidates:
            env_reasons[e.id].append(old[e.id])
    return candidates, env_reasons


def _spare_warming(
    ctx: Context, plan: DeletionPlan, candidates: list[EnvSummary], now: datetime
) -> list[EnvSummary]:
    """Candidates less those with a warm in progress, which the plan lists as protected."""
    warming = warms_in_progress(ctx.index, [e.id for e in candidates], now=now)
    for e in candidates:
        if e.id in warming:
            w = warming[e.id]
            plan.protected.append(
                Protected(
                    e.namespace,
                    f"warm run {w.run_id} in progress on {w.user}@{w.host}",
                    e.entries,
                    e.bytes,
                )
            )
    return [e for e in candidates if e.id not in warming]


def _planned_entries(
    ctx: Context, selectors: _EntrySelectors, partial: list[int], by_id: dict[int, EnvSummary]
) -> PlannedEntries:
    """The picked entries of environments that stay (``partial``), sorted by (namespace, key)."""
    reason = "; ".join(selectors.reasons)
    rows = selected_entries(
        ctx.index,
        partial,
        created_before=selectors.created_before,
        unused_before=selectors.unused_before,
        function=selectors.function,
    )
    # Each environment's rows come sorted by key.
    ordered = [row for env in sorted(rows, key=lambda i: by_id[i].namespace) for row in rows[env]]
    namespace = {i: e.namespace for i, e in by_id.items()}

    def make(row: tuple[Any, ...]) -> PlannedEntry:
        env_id, key, size, aot_size = row
        return PlannedEntry(env_id, namespace[env_id], key, size, reason, aot_size)

    return PlannedEntries(ordered, make, sum(size + (aot or 0) for _e, _k, size, aot in ordered))


def plan_prune(
    ctx: Context,
    cache: CacheInfo,
    crit: PruneCriteria,
    *,
    now: datetime | None = None,
    store: Store | None = None,
    protect_active: bool = False,
) -> DeletionPlan:
    """Build the prune plan from index queries alone.

    ``protect_active`` (scheduled maintenance): a whole environment is never deleted when it
    served hits within RECENT_HITS_WINDOW and no other environment of its hardware group that
    stays did; it is listed as protected instead.
    """
    now = now or utcnow()
    store = store or ctx.store(cache)
    crit = _with_retention(cache, crit)
    keep = crit.keep or cache.keep_versions or 1
    plan = DeletionPlan("prune", cache.name, store.url, _criteria_dict(crit, keep))
    if crit.from_retention:
        plan.notes.append(
            f"no selector given: using the cache's retention, --older-than "
            f"{format_duration(crit.older_than)}"
        )
    all_envs = environments(ctx.index, cache.name)
    candidates, env_reasons = _select_environments(ctx, cache, crit, keep, all_envs, plan)
    candidates = _spare_warming(ctx, plan, candidates, now)
    selectors = _EntrySelectors.of(crit, now)
    by_id = {e.id: e for e in candidates}
    if crit.entry_level:
        picked = selected_counts(
            ctx.index,
            list(by_id),
            created_before=selectors.created_before,
            unused_before=selectors.unused_before,
            function=selectors.function,
        )
        whole = [by_id[i] for i, n in picked.items() if n == by_id[i].entries]
        partial = sorted(i for i, n in picked.items() if n < by_id[i].entries)
    else:
        whole, partial = candidates, []
    if protect_active and whole:
        whole = _protect_active(ctx, plan, all_envs, whole, now)
    for e in sorted(whole, key=lambda e: e.namespace):
        reason = "; ".join(env_reasons[e.id] + list(selectors.reasons)) or "selected"
        if crit.entry_level:
            reason += "; every entry selected"
        plan.namespaces.append(
            PlannedNamespace(e.id, e.digest, e.namespace, e.jax_version, e.entries, e.bytes, reason)
        )
    if partial:
        plan.entries = _planned_entries(ctx, selectors, partial, by_id)
    return plan


def _protect_active(
    ctx: Context,
    plan: DeletionPlan,
    all_envs: list[EnvSummary],
    candidates: list[EnvSummary],
    now: datetime,
) -> list[EnvSummary]:
    """Candidates less each one that is its group's only environment with recent hits."""
    active = environments_with_recent_hits(
        ctx.index, [e.id for e in all_envs], now - RECENT_HITS_WINDOW
    )
    leaving = {e.id for e in candidates}
    served: dict[tuple[object, ...], bool] = defaultdict(bool)
    for e in all_envs:
        if e.id not in leaving and e.id in active:
            served[_group(e)] = True
    kept = []
    for e in candidates:
        if e.id in active and not served[_group(e)]:
            plan.protected.append(
                Protected(
                    e.namespace,
                    "the only environment of its hardware group with hits "
                    f"in the last {format_duration(RECENT_HITS_WINDOW)}",
                    e.entries,
                    e.bytes,
                )
            )
        else:
            kept.append(e)
    return kept


def _criteria_dict(crit: PruneCriteria, keep: int) -> dict[str, object]:
    out: dict[str, object] = {}
    if crit.older_than:
        out["older_than"] = format_duration(crit.older_than)
    if crit.unused_for:
        out["unused_for"] = format_duration(crit.unused_for)
    if crit.jax_version:
        out["jax_version"] = crit.jax_version
    if crit.superseded:
        out["superseded"] = True
        out["keep"] = keep
    if crit.env:
        out["env"] = crit.env
    if crit.function:
        out["function"] = crit.function
    if crit.from_retention:
        out["from_retention"] = True
    return out


def prune(
    ctx: Context,
    cache: CacheInfo,
    crit: PruneCriteria,
    *,
    dry_run: bool = False,
    batch_size: int = DELETE_BATCH,
    now: datetime | None = None,
    protect_active: bool = False,
) -> LifecycleResult:
    """Plan, and unless ``dry_run``, execute under the cache's lifecycle lease."""
    if dry_run:
        started = time.monotonic()
        plan = plan_prune(ctx, cache, crit, now=now, protect_active=protect_active)
        return LifecycleResult(plan, None, True, time.monotonic() - started)
    # Imported here: executing needs the SQL index, which planning (--dry-run) never loads.
    from cachectl.lifecycle import lease as leases
    from cachectl.lifecycle.execute import execute_plan

    check_writer(cache, "prune")
    store = ctx.store(cache)
    with leases.held(ctx.index.sql, cache.name, "prune") as lease:
        started = time.monotonic()
        plan = plan_prune(ctx, cache, crit, now=now, store=store, protect_active=protect_active)
        planning = time.monotonic() - started
        execution = execute_plan(ctx.index.sql, store, plan, lease=lease, batch_size=batch_size)
    return LifecycleResult(plan, execution, False, planning)
