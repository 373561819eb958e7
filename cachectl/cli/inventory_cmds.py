"""`cachectl ls` and `cachectl stats`: what a cache holds."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING

import click

from cachectl.cli.render import (
    digest,
    emit,
    json_option,
    key,
    size,
    stdout,
    table,
    unproven_because,
    when,
    whole,
    wide_option,
)
from cachectl.core.units import parse_duration

if TYPE_CHECKING:
    from cachectl.core.records import EnvironmentInfo
    from cachectl.index.usage import TelemetryStats, UsageRow
    from cachectl.usage import inventory

# cachectl.usage.inventory and cachectl.operations (the index, SQLAlchemy) are imported by the command
# bodies when they run, never at import: `cachectl ls --help` stays cheap.


def _proven(e: EnvironmentInfo) -> str:
    """The warm-checks on the hardware: "yes, <when> on <devices> (<host>)" when a check proved
    every entry the namespace holds, "no: <why>; <when> on ..." (one manifest's check of part of
    it: how many entries it proved), or "-"; where the table fits a width (``whole``), "yes" or
    "no: <why>" alone."""
    proof = e.proof
    if proof is None:
        return "-"
    covering = [p for p in e.proofs if p.proven and (p.entries_proven or 0) >= e.entries]
    shown = max(covering, key=lambda p: p.at) if covering else proof
    where = f"{when(shown.at)} on {shown.devices} ({shown.host})"
    if e.proven:
        return f"yes, {where}" if whole() else "yes"
    partial = [p for p in e.proofs if p.proven]
    if partial:
        best = max(partial, key=lambda p: p.entries_proven or 0)
        named = Path(best.manifest).name if best.manifest else "a manifest"
        proved = "an unrecorded number" if best.entries_proven is None else best.entries_proven
        why = [f"{named} proved {proved} of {e.entries} entries"]
        shown = best
        where = f"{when(shown.at)} on {shown.devices} ({shown.host})"
    else:
        why = unproven_because(proof)
    return f"no: {', '.join(why)}" + (f"; {where}" if whole() else "")


def _print_environments(listing: inventory.EnvironmentListing) -> None:
    rows = [
        (
            digest(e.digest),
            e.environment.jax_version,
            e.environment.backend,
            f"{e.environment.device_kind} x{e.environment.device_count}",
            " ".join(e.environment.xla_flags) or "-",
            e.entries,
            e.executables,
            size(e.aot_bytes),
            size(e.bytes),
            when(e.last_access_at),
            _proven(e),
        )
        for e in listing.environments
    ]
    stdout.print(
        table(
            f"cache {listing.cache} at {listing.root}"
            + (
                f" (on the server's machine: read here through {listing.through_server})"
                if listing.through_server
                else ""
            ),
            [
                "environment",
                "jax",
                "backend",
                "devices",
                "xla flags",
                "entries",
                "executables",
                "aot bytes",
                "bytes",
                "last access",
                "proven",
            ],
            rows,
            justify_right=("entries", "executables", "aot bytes", "bytes"),
            keep=("environment", "last access"),
            optional=("aot bytes", "executables", "xla flags", "backend", "last access"),
        )
    )


def _print_entries(listing: inventory.EntryListing) -> None:
    rows = [
        (
            key(e.key),
            e.function or e.module,
            ",".join(f"{k}={v}" for k, v in (e.bucket or {}).items()) or "-",
            size(e.size),
            size(e.aot_size),
            e.compile_time_ms if e.compile_time_ms is not None else "-",
            e.origin,
            when(e.created_at),
            when(e.last_access_at),
            e.hit_count,
        )
        for e in listing.entries
    ]
    env = listing.environment
    stdout.print(
        table(
            f"{listing.cache} / {env.namespace}",
            [
                "key",
                "function",
                "bucket",
                "bytes",
                "aot",
                "compile ms",
                "origin",
                "created",
                "last access",
                "hits",
            ],
            rows,
            justify_right=("bytes", "aot", "compile ms", "hits"),
            keep=("key", "bucket", "created", "last access"),
            optional=("origin", "created", "compile ms", "aot", "last access"),
        )
    )


@click.command("ls")
@click.option(
    "--env", "env_prefix", metavar="DIGEST-PREFIX", help="List one environment's entries."
)
@json_option
@wide_option
@click.pass_obj
def ls(ctx, env_prefix: str | None, as_json: bool) -> None:
    """List a cache's environments, or one environment's entries."""
    from cachectl.usage import inventory

    cache = ctx.cache()
    if env_prefix:
        emit(inventory.list_entries(ctx, cache, env_prefix), as_json, _print_entries)
    else:
        emit(inventory.list_environments(ctx, cache), as_json, _print_environments)


def _print_totals(items: list[inventory.CacheTotals]) -> None:
    rows = [
        (
            t.cache.name,
            t.cache.root_url,
            t.environments,
            f"{t.proven}/{t.environments}",
            t.entries,
            t.executables,
            size(t.aot_bytes),
            size(t.bytes),
            size(t.cache.max_size),
            when(t.last_access_at),
        )
        for t in items
    ]
    stdout.print(
        table(
            "caches",
            [
                "cache",
                "root",
                "environments",
                "proven",
                "entries",
                "executables",
                "aot bytes",
                "bytes",
                "max size",
                "last access",
            ],
            rows,
            justify_right=("environments", "entries", "executables", "aot bytes", "bytes"),
            keep=("cache", "max size", "last access"),
            optional=("aot bytes", "executables", "max size", "last access"),
        )
    )
    from cachectl.usage.inventory import EnvironmentListing

    for t in items:
        if t.per_environment:
            _print_environments(
                EnvironmentListing(t.cache.name, t.cache.root_url, t.per_environment)
            )


NO_TELEMETRY_HINT = (
    "no service telemetry in this window. Telemetry comes from services that call "
    "cachectl.activate() (telemetry=True is the default) and compile with JAX while running; "
    "warm, warm-check and `cachectl exec` record none. Try: python -c 'import cachectl, jax; "
    "cachectl.activate(); jax.jit(lambda x: x + 1)(1.0)' and run this again."
)


_CATEGORIES_NOTE = (
    "hit rate: hits / (hits + misses), JAX's own count. A miss was looked up and not found, "
    "written or not (a program under the minimum compile time or a read-only service's is still "
    "a miss); not cacheable: JAX-internal staging programs (jit_stage from jnp.asarray(numpy), "
    "convert_element_type, ...) and programs with host callbacks (JAX never writes one, so no "
    "warm can help: named per function above), counted apart; loads: stored executables cachectl.serving "
    "loaded, which JAX never looks up; served: (hits + loads) / (hits + loads + misses), what "
    "the cache served"
)

DEFAULT_WINDOW = "24h"  # plain `cachectl stats`: the hit rate over the last day (ccache's habit)


def _rate(r: UsageRow) -> str:
    return f"{r.hit_rate:.0%}" if r.hit_rate is not None else "-"


def _served(r: UsageRow) -> str:
    return f"{r.served_rate:.0%}" if r.served_rate is not None else "-"


def _label(r: UsageRow) -> str:
    if r.function is None:
        return "(unattributed)"
    return f"{r.name} ({r.function})" if r.name and r.name != r.function else r.function


# Left out first where the usage tables must fit a width: requests, hits, misses, hit rate stay.
_USAGE_OPTIONAL = ("writes", "saved", "not cacheable", "loads", "served", "procs")


def _print_usage(u: TelemetryStats, explain: bool = False) -> None:
    if not u.environments:
        stdout.print(f"cache {u.cache}: {NO_TELEMETRY_HINT}", highlight=False)
        return
    columns = [
        "requests",
        "hits",
        "misses",
        "not cacheable",
        "hit rate",
        "loads",
        "served",
        "writes",
        "saved",
    ]
    right = ("procs", *columns)

    def values(r: UsageRow) -> tuple:
        return (
            r.requests,
            r.hits,
            r.misses,
            r.uncacheable,
            _rate(r),
            r.loads,
            _served(r),
            r.writes,
            f"{r.saved_estimate_seconds:.1f}s",
        )

    env_rows = [(digest(r.environment), r.processes, *values(r)) for r in u.environments]
    stdout.print(
        table(
            f"cache {u.cache}: service telemetry since {when(u.since)} UTC",
            ["environment", "procs", *columns],
            env_rows,
            justify_right=right,
            keep=("environment",),
            optional=_USAGE_OPTIONAL,
        )
    )
    if u.functions:
        several = len(u.environments) > 1
        fn_rows = [
            (_label(r) + (f" @{r.environment[:8]}" if several else ""), *values(r))
            for r in u.functions
        ]
        stdout.print(
            table(
                "per function",
                ["function", *columns],
                fn_rows,
                justify_right=right,
                optional=_USAGE_OPTIONAL,
            )
        )
        for r in u.functions:
            if r.cause:
                stdout.print(
                    f"{_label(r)}: {r.host_callbacks} not cacheable: {r.cause}",
                    highlight=False,
                    markup=False,
                )
    if explain:
        stdout.print(_CATEGORIES_NOTE, highlight=False)
        stdout.print(
            "saved (an estimate): hits x (a miss's compile stage as services measured it, else "
            "warm's compile time) - what the hits still cost",
            highlight=False,
        )
    dropped = sum(r.dropped for r in u.environments)
    if dropped:
        stdout.print(
            f"{dropped} telemetry events were dropped by services (buffer full or index down)"
        )


def _print_hit_rates(items: list[inventory.CacheTotals]) -> None:
    """Plain `stats` ends with each cache's hit rate over the default window."""
    for t in items:
        u = t.telemetry
        envs = u.environments if u is not None else []
        hits = sum(r.hits for r in envs)
        misses = sum(r.misses for r in envs)
        unc = sum(r.uncacheable for r in envs)
        loads = sum(r.loads for r in envs)
        if not (hits or misses or unc or loads):
            stdout.print(
                f"cache {t.cache.name}: no service telemetry in the last {DEFAULT_WINDOW}",
                highlight=False,
            )
            continue
        if loads:  # cachectl.serving: its buckets never reach JAX's count (UsageRow.served_rate)
            served = f"{t.served_rate:.1%}" if t.served_rate is not None else "-"
            line = (
                f"served from the cache {served} over the last {DEFAULT_WINDOW} ({loads} stored "
                f"executables loaded, {hits} hits, {misses} misses; {unc} not cacheable counted "
                "apart)"
            )
        else:
            rate = f"{t.hit_rate:.1%}" if t.hit_rate is not None else "-"
            line = (
                f"hit rate {rate} over the last {DEFAULT_WINDOW} ({hits} hits, {misses} misses; "
                f"{unc} not cacheable and {loads} loads counted apart)"
            )
        stdout.print(f"cache {t.cache.name}: {line}", highlight=False)
        if len(envs) > 1:
            for r in envs:
                what = (
                    f"served {_served(r)} ({r.loads} loads, {r.hits} hits, {r.misses} misses)"
                    if r.loads
                    else f"hit rate {_rate(r)} ({r.hits} hits, {r.misses} misses)"
                )
                stdout.print(f"  environment {digest(r.environment)}: {what}", highlight=False)


def _print_totals_and_rates(items: list[inventory.CacheTotals]) -> None:
    _print_totals(items)
    _print_hit_rates(items)


@click.command("stats")
@click.option("--all", "all_caches", is_flag=True, help="Every registered cache, not just --cache.")
@click.option(
    "--since",
    metavar="DUR",
    help="Service telemetry over this window instead: hit rate, misses, writes and compile "
    "time saved per environment and function, e.g. 24h.",
)
@click.option(
    "--explain",
    is_flag=True,
    help="With --since: what each column counts (hit rate, served, saved).",
)
@json_option
@wide_option
@click.pass_obj
def stats(ctx, all_caches: bool, since: str | None, explain: bool, as_json: bool) -> None:
    """Totals per cache and per environment with the hit rate over the last 24h; with --since,
    hits and misses from services per environment and function."""
    from cachectl.operations import operations
    from cachectl.usage import inventory

    if since is not None:
        parse_duration(since)  # bad input before the index is opened
    caches = ctx.index.list_caches() if all_caches else [ctx.cache()]
    ops = operations(ctx)
    if since is not None:
        result = [ops.telemetry_stats(c.name, since) for c in caches]

        def human(r: TelemetryStats | list[TelemetryStats]) -> None:
            for u in r if isinstance(r, list) else [r]:
                _print_usage(u, explain)

        emit(result if all_caches else result[0], as_json, human)
        return
    totals = [
        dataclasses.replace(t, telemetry=ops.telemetry_stats(t.cache.name, DEFAULT_WINDOW))
        for t in inventory.cache_totals(ctx, caches)
    ]
    emit(totals, as_json, _print_totals_and_rates)


def register(cli: click.Group) -> None:
    cli.add_command(ls)
    cli.add_command(stats)
