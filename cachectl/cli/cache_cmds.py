"""`cachectl cache`: register caches and set their policies."""

from __future__ import annotations

from datetime import timedelta
from typing import TYPE_CHECKING, Any

import click

from cachectl.cli.render import emit, json_option, size, stdout, table
from cachectl.core.config import SERVICE_WRITES
from cachectl.core.units import format_duration, parse_duration, parse_size

if TYPE_CHECKING:
    from cachectl.context import Context
    from cachectl.index import CacheInfo

# cachectl.trust.caches (and the index behind it) is imported by the command bodies when they run,
# never at import: `cachectl cache add --help` builds its options from cachectl.core.config alone.


def _policy(
    max_size: str | None,
    max_entry_size: str | None,
    env_max_size: str | None,
    retention: str | None,
    writers: str | None,
    service_writes: str | None,
    group: str | None,
    storage_option: tuple[str, ...] = (),
) -> dict[str, Any]:
    from cachectl.trust.caches import parse_storage_options
    from cachectl.trust.permissions import parse_writers

    return {
        "storage_options": parse_storage_options(storage_option) if storage_option else None,
        "max_size": parse_size(max_size) if max_size else None,
        "max_entry_size": parse_size(max_entry_size) if max_entry_size else None,
        "env_max_size": parse_size(env_max_size) if env_max_size else None,
        "retention_seconds": int(parse_duration(retention).total_seconds()) if retention else None,
        "writers": parse_writers(writers),
        "service_writes": service_writes,
        "group": group,
    }


def _policy_options(fn: Any) -> Any:
    options = [
        click.option(
            "--max-size", metavar="SIZE", help="Total size limit enforced by gc, e.g. 50GiB."
        ),
        click.option("--max-entry-size", metavar="SIZE", help="Largest entry kept, e.g. 500MB."),
        click.option("--env-max-size", metavar="SIZE", help="Size limit per environment."),
        click.option("--retention", metavar="DUR", help="Default age for prune, e.g. 30d."),
        click.option(
            "--writers",
            metavar="LIST",
            help="Users and @groups allowed to write, e.g. alice,@mlops ('' = anyone).",
        ),
        click.option(
            "--service-writes",
            type=click.Choice(SERVICE_WRITES),
            help="May services write entries on a miss? (default: deny for object stores, allow locally)",
        ),
        click.option(
            "--group",
            metavar="GROUP",
            help="Local disk: make the tree group-owned and setgid (2775).",
        ),
        click.option(
            "--storage-option",
            multiple=True,
            metavar="KEY=VALUE",
            help="fsspec option for the root, e.g. endpoint_url=http://minio:9000 (no secrets: "
            "credentials come from the environment).",
        ),
    ]
    for option in reversed(options):
        fn = option(fn)
    return fn


def _print_caches(items: list[CacheInfo]) -> None:
    rows = [
        (
            c.name,
            c.root_url,
            size(c.max_size),
            size(c.max_entry_size),
            format_duration(timedelta(seconds=c.retention_seconds)) if c.retention_seconds else "-",
            ",".join(c.writers) or "anyone",
            c.effective_service_writes,
        )
        for c in items
    ]
    stdout.print(
        table(
            None,
            ["cache", "root", "max size", "max entry", "retention", "writers", "service writes"],
            rows,
        )
    )


@click.group("cache")
def cache_group() -> None:
    """Register caches (a root URL plus a policy)."""


@cache_group.command("add")
@click.argument("name")
@click.argument("url")
@_policy_options
@json_option
@click.pass_obj
def add(ctx: Context, name: str, url: str, as_json: bool, **opts: Any) -> None:
    """Register cache NAME rooted at URL (a path, file://, or an object store's, e.g. s3://bucket/prefix)."""
    from cachectl.trust import caches

    info = caches.add_cache(ctx, name, url, **_policy(**opts))
    emit(info, as_json, lambda c: stdout.print(f"added cache {c.name} at {c.root_url}"))


@cache_group.command("list")
@json_option
@click.pass_obj
def list_(ctx: Context, as_json: bool) -> None:
    """List registered caches and their policies."""
    ctx.cache("default")  # the embedded default exists from first use
    emit(ctx.index.list_caches(), as_json, _print_caches)


@cache_group.command("set")
@click.argument("name")
@click.option(
    "--url", "root_url", metavar="URL", help="Move the cache's root (files are not moved)."
)
@click.option(
    "--trust",
    multiple=True,
    metavar="PUBKEY",
    help="Accept only content signed by these Ed25519 public keys (ed25519:... or a .pub file; "
    "repeatable; replaces the list; --trust '' clears it).",
)
@_policy_options
@json_option
@click.pass_obj
def set_(
    ctx: Context,
    name: str,
    root_url: str | None,
    trust: tuple[str, ...],
    as_json: bool,
    **opts: Any,
) -> None:
    """Change a cache's policy."""
    from cachectl.trust import caches
    from cachectl.trust.signing import parse_public_key

    policy = _policy(**opts)
    if root_url:
        policy["root_url"] = root_url
    if trust:
        policy["trusted_keys"] = sorted({parse_public_key(k) for k in trust if k.strip()})
    info = caches.set_cache(ctx, name, **policy)
    emit(info, as_json, lambda c: _print_caches([c]))


@cache_group.command("rm")
@click.argument("name")
@click.option(
    "--purge", is_flag=True, help="Also delete every namespace of the cache from storage."
)
@click.option("--dry-run", is_flag=True, help="Show what would be removed.")
@json_option
@click.pass_obj
def rm(ctx: Context, name: str, purge: bool, dry_run: bool, as_json: bool) -> None:
    """Unregister a cache (refuses a non-empty cache unless --purge)."""
    from cachectl.trust import caches

    result = caches.remove_cache(ctx, name, purge=purge, dry_run=dry_run)
    verb = "would remove" if dry_run else "removed"
    emit(
        result,
        as_json,
        lambda r: stdout.print(
            f"{verb} cache {r.name}"
            + (
                f" and {r.environments} environment(s), {r.entries} entries, {size(r.bytes)}"
                if r.purged
                else ""
            )
        ),
    )


def register(cli: click.Group) -> None:
    cli.add_command(cache_group)
