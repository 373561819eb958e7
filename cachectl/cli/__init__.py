"""The cachectl command line: thin commands over library functions."""

from __future__ import annotations

import logging
from typing import Any

import click

from cachectl import __version__
from cachectl.config import load_settings
from cachectl.context import Context
from cachectl.errors import CachectlError, ProblemsReported


class CachectlGroup(click.Group):
    """Turns library errors into one line on stderr and the contract's exit code (130 on Ctrl-C)."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except CachectlError as exc:
            # The one place a library error becomes an exit code (cachectl.errors.ERRORS).
            # A message of several problems (a manifest's) prints one error line each; a
            # report that printed its own problems (ProblemsReported) adds only its summary.
            if isinstance(exc, ProblemsReported):
                if exc.message:
                    click.echo(exc.message, err=True)
            else:
                for line in exc.message.splitlines() or [""]:
                    click.echo(f"cachectl: error: {line}", err=True)
            ctx.exit(exc.exit_code)
        except KeyboardInterrupt:
            click.echo("cachectl: interrupted", err=True)
            ctx.exit(130)


@click.group(
    cls=CachectlGroup,
    context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100},
)
@click.option(
    "--db",
    envvar="CACHECTL_DB",
    metavar="URL",
    help="Index database (sqlite:///PATH or postgresql+psycopg://...). [env: CACHECTL_DB]",
)
@click.option(
    "--cache",
    "cache_name",
    envvar="CACHECTL_CACHE",
    metavar="NAME",
    help="Cache to work on (default: 'default'). [env: CACHECTL_CACHE]",
)
@click.option("-v", "--verbose", count=True, help="More log output (-vv for debug).")
@click.version_option(__version__, prog_name="cachectl")
@click.pass_context
def cli(ctx: click.Context, db: str | None, cache_name: str | None, verbose: int) -> None:
    """Manage shared JAX persistent compilation caches.

    Every cache entry is filed under the environment (JAX version, backend,
    devices, XLA flags) that produced it, in an index that prune, gc and
    verify query. With no setup, the embedded default uses an SQLite index and
    a cache named 'default' under your XDG directories.

    \b
    Exit codes: 0 ok, 1 problems found, 2 bad input,
                3 hardware/environment mismatch, 4 permission denied.
    """
    logging.basicConfig(
        level=(logging.WARNING, logging.INFO, logging.DEBUG)[min(verbose, 2)],
        format="%(levelname)s %(name)s: %(message)s",
    )
    ctx.obj = Context(load_settings(db=db, cache=cache_name))
    ctx.call_on_close(ctx.obj.close)


# One module per command group; groups land as their modules do.
_COMMAND_MODULES = (
    "cache_cmds",
    "db_cmds",
    "env_cmds",
    "inventory_cmds",
    "sync_cmds",
    "warm_cmds",
    "lifecycle_cmds",
    "service_cmds",
    "server_cmds",
    "usage_cmds",
    "bundle_cmds",
)


def _register() -> None:
    import importlib

    for name in _COMMAND_MODULES:
        try:
            module = importlib.import_module(f"cachectl.cli.{name}")
        except ModuleNotFoundError as exc:
            if exc.name != f"cachectl.cli.{name}":
                raise
            continue
        module.register(cli)


_register()


def main() -> None:
    cli.main(prog_name="cachectl")
