"""`cachectl fingerprint`, `path`, `env`, `exec`: this machine's environment and namespace."""

from __future__ import annotations

import json
import os
import shlex
import sys
from typing import TYPE_CHECKING

import click

from cachectl.cli.render import emit, json_option, stdout, table
from cachectl.core.errors import BadInput, CachectlError

if TYPE_CHECKING:
    from cachectl.context import Context
    from cachectl.service.env import ServiceEnv

# cachectl.service.env (and the index behind it) is imported by the command bodies when they run,
# never at import: `cachectl env --help` stays cheap.


@click.command("fingerprint")
@json_option
@click.pass_obj
def fingerprint(ctx: Context, as_json: bool) -> None:
    """Show this machine's environment: everything in JAX's cache key but the program."""
    env = ctx.environment(registers=False)
    data = {"digest": env.digest, "namespace": env.namespace, **env.to_dict()}

    def human(d: dict) -> None:
        rows = [(k, " ".join(v) if isinstance(v, list) else v) for k, v in d.items()]
        stdout.print(table(None, ["field", "value"], rows))

    emit(data, as_json, human)


@click.command("path")
@json_option
@click.pass_obj
def path(ctx: Context, as_json: bool) -> None:
    """Print the managed namespace for this environment (created if missing)."""
    cache = ctx.cache()
    ns, _ = ctx.namespace(cache)
    emit(ns, as_json, lambda n: click.echo(n.url))


def _format_env(result: ServiceEnv, fmt: str) -> str:
    if fmt == "json":
        return json.dumps(result.variables, indent=2) + "\n"
    if fmt == "dotenv":
        return "".join(f"{k}={v}\n" for k, v in result.variables.items())
    return "".join(f"export {k}={shlex.quote(v)}\n" for k, v in result.variables.items())


def _env_format(fmt: str | None, as_json: bool) -> str:
    """``--json`` is ``--format json``: every reporting command takes ``--json``."""
    if as_json and fmt not in (None, "json"):
        raise BadInput(f"--json and --format {fmt} contradict each other: give one of them")
    return "json" if as_json else fmt or "sh"


@click.command("env")
@click.option(
    "--format",
    "fmt",
    type=click.Choice(["sh", "json", "dotenv"]),
    default=None,
    help="Output format.  [default: sh]",
)
@click.option("--json", "as_json", is_flag=True, help="Same as --format json.")
@click.option(
    "--readonly/--writable",
    default=None,
    help="Read the cache but never write it (default: the cache's policy).",
)
@click.pass_obj
def env(ctx: Context, fmt: str | None, as_json: bool, readonly: bool | None) -> None:
    """Print the variables a service needs to hit this environment's namespace.

    \b
    eval "$(cachectl env)"      # sh
    cachectl env --json         # = --format json
    cachectl env --format dotenv > service.env
    """
    from cachectl.service.env import service_env

    fmt = _env_format(fmt, as_json)
    result = service_env(ctx, readonly=readonly)
    if result.warning:
        click.echo(result.warning, err=True)
    click.echo(_format_env(result, fmt), nl=False)


@click.command(
    "exec", context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False}
)
@click.option(
    "--readonly/--writable",
    default=None,
    help="Read the cache but never write it (default: the cache's policy).",
)
@click.option(
    "--telemetry/--no-telemetry",
    default=True,
    show_default=True,
    help="Record the service's compile requests, hits and signatures as activate() does "
    "(a Python service: through a sitecustomize on PYTHONPATH that starts when JAX is imported).",
)
@click.option(
    "--fresh",
    is_flag=True,
    help="Read this machine's environment afresh in a child process, not the one the last "
    "exec remembered (a TPU is opened once more: about 10 s).",
)
@click.argument("command", nargs=-1, required=True, type=click.UNPROCESSED)
@click.pass_obj
def exec_(
    ctx: Context, readonly: bool | None, telemetry: bool, fresh: bool, command: tuple[str, ...]
) -> None:
    """Run COMMAND with the environment `cachectl env` prints (for services that cannot call activate()).

    The environment is read by a child process (an accelerator this process opened would
    stay held across the exec) and remembered until the boot, the packages or the variables
    it depends on change; the service checks it against its own runtime.

    \b
    cachectl exec -- printenv JAX_COMPILATION_CACHE_DIR
    cachectl exec --readonly -- python my_service.py
    """
    from cachectl.service.env import exec_variables

    try:
        result = exec_variables(ctx, readonly=readonly, telemetry=telemetry, fresh=fresh)
        variables = result.variables
        if result.warning:
            click.echo(result.warning, err=True)
    except Exception as exc:  # noqa: BLE001 - never refuse to start the service: plain JAX runs
        message = exc.message if isinstance(exc, CachectlError) else f"{type(exc).__name__}: {exc}"
        click.echo(
            f"cachectl: {message.splitlines()[0] if message else type(exc).__name__}; running "
            f"{command[0]} without a managed cache",
            err=True,
        )
        variables = {}
    environ = {**os.environ, **variables}
    sys.stdout.flush()
    try:
        os.execvpe(command[0], list(command), environ)
    except FileNotFoundError:
        raise BadInput(f"command not found: {command[0]}") from None


def register(cli: click.Group) -> None:
    for cmd in (fingerprint, path, env, exec_):
        cli.add_command(cmd)
