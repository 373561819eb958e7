"""`cachectl ls` and `cachectl stats`: what a cache holds."""

from __future__ import annotations

import click

from cachectl import inventory
from cachectl.cli.render import emit, json_option, size, stdout, table, when


def _print_environments(listing: inventory.EnvironmentListing) -> None:
    rows = [
        (e.digest[:16], e.environment.jax_version, e.environment.backend,
         f"{e.environment.device_kind} x{e.environment.device_count}",
         " ".join(e.environment.xla_flags) or "-", e.entries, size(e.bytes), when(e.last_access_at))
        for e in listing.environments
    ]
    stdout.print(table(f"cache {listing.cache} at {listing.root}",
                       ["environment", "jax", "backend", "devices", "xla flags", "entries", "bytes", "last access"],
                       rows, justify_right=("entries", "bytes")))


def _print_entries(listing: inventory.EntryListing) -> None:
    rows = [
        (e.key[:48] + ("…" if len(e.key) > 48 else ""), e.function or e.module,
         ",".join(f"{k}={v}" for k, v in (e.bucket or {}).items()) or "-", size(e.size),
         e.compile_time_ms if e.compile_time_ms is not None else "-", e.origin, when(e.created_at),
         when(e.last_access_at), e.hit_count)
        for e in listing.entries
    ]
    env = listing.environment
    stdout.print(table(f"{listing.cache} / {env.namespace}",
                       ["key", "function", "bucket", "bytes", "compile ms", "origin", "created", "last access", "hits"],
                       rows, justify_right=("bytes", "compile ms", "hits")))


@click.command("ls")
@click.option("--env", "env_prefix", metavar="DIGEST-PREFIX", help="List one environment's entries.")
@json_option
@click.pass_obj
def ls(ctx, env_prefix: str | None, as_json: bool) -> None:
    """List a cache's environments, or one environment's entries."""
    cache = ctx.cache()
    if env_prefix:
        emit(inventory.list_entries(ctx, cache, env_prefix), as_json, _print_entries)
    else:
        emit(inventory.list_environments(ctx, cache), as_json, _print_environments)


def _print_totals(items: list[inventory.CacheTotals]) -> None:
    rows = [(t.cache.name, t.cache.root_url, t.environments, t.entries, size(t.bytes),
             size(t.cache.max_size), when(t.last_access_at)) for t in items]
    stdout.print(table("caches", ["cache", "root", "environments", "entries", "bytes", "max size", "last access"],
                       rows, justify_right=("environments", "entries", "bytes")))
    for t in items:
        if t.per_environment:
            _print_environments(inventory.EnvironmentListing(t.cache.name, t.cache.root_url, t.per_environment))


@click.command("stats")
@click.option("--all", "all_caches", is_flag=True, help="Every registered cache, not just --cache.")
@json_option
@click.pass_obj
def stats(ctx, all_caches: bool, as_json: bool) -> None:
    """Totals per cache and per environment."""
    caches = ctx.index.list_caches() if all_caches else [ctx.cache()]
    emit(inventory.cache_totals(ctx, caches), as_json, _print_totals)


def register(cli: click.Group) -> None:
    cli.add_command(ls)
    cli.add_command(stats)
