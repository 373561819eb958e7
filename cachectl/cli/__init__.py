"""The cachectl command line: thin commands over library functions.

Commands load lazily: ``COMMANDS`` names each command's module, attribute and
short help, so ``cachectl --help`` lists them all without importing one, and a
command's module (with whatever it imports: JAX, SQLAlchemy...) is imported only
when that command runs or shows its own help.
"""

from __future__ import annotations

import importlib
import logging
from typing import TYPE_CHECKING, Any

import click

from cachectl import __version__
from cachectl.cli.render import want_wide
from cachectl.core.config import load_settings
from cachectl.core.errors import BadInput, CachectlError, ProblemsReported, from_os_error
from cachectl.core.temps import no_world_writes

if TYPE_CHECKING:
    from cachectl.context import Context

# name -> (module under cachectl.cli, attribute, short help). The short help is the
# command's own (its first help sentence); tests/test_cli_startup.py holds the two equal.
COMMANDS: dict[str, tuple[str, str, str]] = {
    "advise": (
        "usage_cmds",
        "advise",
        "Choose bucket values from the sizes services really called with: the least padding"
        " waste for N buckets (an exact dynamic program), or the fewest buckets within a"
        " waste bound.",
    ),
    "bundle": (
        "bundle_cmds",
        "bundle_group",
        "Ship a namespace as one verified file (images, clusters without bucket access).",
    ),
    "cache": ("cache_cmds", "cache_group", "Register caches (a root URL plus a policy)."),
    "db": ("db_cmds", "db_group", "Index schema migrations (Alembic, shipped with cachectl)."),
    "doctor": (
        "service_cmds",
        "doctor",
        "Explain why this process would miss its warmed cache (exit 1 on any error).",
    ),
    "env": (
        "env_cmds",
        "env",
        "Print the variables a service needs to hit this environment's namespace.",
    ),
    "exec": (
        "env_cmds",
        "exec_",
        "Run COMMAND with the environment `cachectl env` prints (for services that cannot"
        " call activate()).",
    ),
    "fingerprint": (
        "env_cmds",
        "fingerprint",
        "Show this machine's environment: everything in JAX's cache key but the program.",
    ),
    "gc": (
        "lifecycle_cmds",
        "gc_cmd",
        "Evict entries until the cache fits its max_size (and env_max_size).",
    ),
    "key": ("bundle_cmds", "key_group", "Signing keys: the trust root of signed caches."),
    "ls": (
        "inventory_cmds",
        "ls",
        "List a cache's environments, or one environment's entries.",
    ),
    "misses": (
        "usage_cmds",
        "misses",
        "Every program signature services missed, each with the nearest warmed bucket and"
        " the fields that differ (exit 1 when something missed).",
    ),
    "path": (
        "env_cmds",
        "path",
        "Print the managed namespace for this environment (created if missing).",
    ),
    "prune": (
        "lifecycle_cmds",
        "prune_cmd",
        "Delete entries and namespaces the selectors name (AND).",
    ),
    "pull": (
        "service_cmds",
        "pull",
        "Copy this environment's verified entries to DIR (then point JAX at DIR).",
    ),
    "push": (
        "service_cmds",
        "push",
        "Upload entries a local run wrote in DIR to the shared namespace (writers only).",
    ),
    "serve": (
        "server_cmds",
        "serve",
        "Run the cachectl server (FastAPI on uvicorn) over the index.",
    ),
    "stats": (
        "inventory_cmds",
        "stats",
        "Totals per cache and per environment with the hit rate over the last 24h; with"
        " --since, hits and misses from services per environment and function.",
    ),
    "sync": ("sync_cmds", "sync_cmd", "Reconcile storage and index."),
    "token": (
        "server_cmds",
        "token_group",
        "Bearer tokens for the server: reader, writer or admin, optionally scoped to caches.",
    ),
    "verify": (
        "lifecycle_cmds",
        "verify_cmd",
        "Check every indexed entry: exists, sha256 matches, decompresses.",
    ),
    "warm": (
        "warm_cmds",
        "warm_cmd",
        "Compile every function x shape bucket of MANIFEST into this environment's namespace.",
    ),
    "warm-check": (
        "warm_cmds",
        "warm_check_cmd",
        "Prove coverage: in a fresh process, activate the cache read-only and load every bucket.",
    ),
    "warm-run": (
        "warm_run_cmds",
        "warm_run_cmd",
        "Run COMMAND with writes on into this environment's namespace, then index what it"
        " compiled.",
    ),
}


# The top-level help's sections: every command of COMMANDS in one (tests/test_cli_startup.py).
GROUPS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("Set up", ("cache", "db", "key", "fingerprint", "path", "env", "exec")),
    ("Warm", ("warm", "warm-check", "warm-run")),
    ("Inspect", ("ls", "stats", "misses", "advise", "doctor")),
    ("Lifecycle", ("prune", "gc", "verify", "sync")),
    ("Ship", ("bundle", "push", "pull")),
    ("Serve", ("serve", "token")),
)


def _log_level(verbose: int) -> int:
    return (logging.WARNING, logging.INFO, logging.DEBUG)[min(verbose, 2)]


def _global_option_seen(ctx: click.Context, param: click.Parameter, value: Any) -> None:
    """A global option given after the command: it lands in the root's params, as if given first."""
    if not value or ctx.resilient_parsing:
        return
    root = ctx.find_root()
    if param.name == "_global_wide":
        _wide(ctx, param, value)
    elif param.name == "_global_verbose":
        root.params["verbose"] = (root.params.get("verbose") or 0) + value
        if root.meta.get("cachectl.configured_logging"):  # the root's basicConfig took
            logging.getLogger().setLevel(_log_level(root.params["verbose"]))
    else:
        root.params[str(param.name).removeprefix("_global_")] = value


# The root's options a command accepts after its name too (cachectl warm m.yaml -v), where
# it has no option of that name itself: (opts, click.Option keywords).
_GLOBAL_OPTIONS: tuple[tuple[tuple[str, ...], dict[str, Any]], ...] = (
    (("--db", "_global_db"), {"metavar": "URL"}),
    (("--cache", "_global_cache_name"), {"metavar": "NAME"}),
    (("-v", "--verbose", "_global_verbose"), {"count": True}),
    (("--wide", "_global_wide"), {"is_flag": True}),
)


def _wide(ctx: click.Context, param: click.Parameter, value: bool) -> None:
    want_wide(ctx, param, value)


def accept_global_options(cmd: click.Command) -> None:
    """Give ``cmd`` (and every command under it) the global options it does not define itself."""
    if getattr(cmd, "_cachectl_globals", False):
        return
    taken = {opt for p in cmd.params for opt in (*p.opts, *p.secondary_opts)}
    for decls, extra in _GLOBAL_OPTIONS:
        opts = [d for d in decls if d.startswith("-")]
        if taken.isdisjoint(opts):
            cmd.params.append(
                click.Option(
                    decls,
                    expose_value=False,
                    hidden=True,
                    callback=_global_option_seen,
                    **extra,
                )
            )
    cmd._cachectl_globals = True  # type: ignore[attr-defined]
    if isinstance(cmd, click.Group):
        group_resolve = cmd.resolve_command

        def resolve(
            ctx: click.Context, args: list[str]
        ) -> tuple[str | None, click.Command | None, list[str]]:
            _refuse_unknown(cmd, ctx, args)
            return group_resolve(ctx, args)

        cmd.resolve_command = resolve  # type: ignore[method-assign]
        for sub in cmd.commands.values():
            accept_global_options(sub)


def _refuse_unknown(group: click.Group, ctx: click.Context, args: list[str]) -> None:
    """A mistyped command is bad input in one line, naming the command it was likely meant."""
    name = click.utils.make_str(args[0])
    if name.startswith("-") or ctx.resilient_parsing or group.get_command(ctx, name):
        return  # an option: click says what is wrong with it
    raise BadInput(_no_such_command(name, group.list_commands(ctx), ctx.command_path))


class _LazyContext:
    """``ctx.obj``: the command's :class:`cachectl.context.Context`, built on first use.

    Built after every option is parsed (those after the command included), and never
    for ``CMD --help`` or a command that needs none.
    """

    def __init__(self, root: click.Context) -> None:
        self._root = root
        self._context: Context | None = None

    def _get(self) -> Context:
        if self._context is None:
            from cachectl.context import Context  # SQLAlchemy and the stores: not for --help

            params = self._root.params
            self._context = Context(load_settings(db=params["db"], cache=params["cache_name"]))
        return self._context

    def __getattr__(self, name: str) -> Any:
        return getattr(self._get(), name)

    def close(self) -> None:
        if self._context is not None:
            self._context.close()


class CachectlGroup(click.Group):
    """Loads commands from ``COMMANDS`` on demand; turns library errors into one line on
    stderr and the contract's exit code (130 on Ctrl-C)."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted({*self.commands, *COMMANDS})

    def make_context(
        self,
        info_name: str | None,
        args: list[str],
        parent: click.Context | None = None,
        **extra: Any,
    ) -> click.Context:
        """A command's context; --wide is this command's alone (CliRunner runs many in one process)."""
        want_wide(value=False)
        return super().make_context(info_name, args, parent, **extra)

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        cmd = self.commands.get(cmd_name)
        if cmd is None and cmd_name in COMMANDS:
            module, attribute, _ = COMMANDS[cmd_name]
            cmd = getattr(importlib.import_module(f"cachectl.cli.{module}"), attribute)
            accept_global_options(cmd)
            self.add_command(cmd, cmd_name)
        return cmd

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        """The commands in GROUPS' sections, each with its whole short help (wrapped, never cut
        with "..."), from ``COMMANDS`` for a command not loaded yet."""
        shown = [n for n in self.list_commands(ctx) if not self._command(n).hidden]
        sections = [(title, [n for n in names if n in shown]) for title, names in GROUPS]
        grouped = {n for _, names in sections for n in names}
        sections.append(("Other", [n for n in shown if n not in grouped]))
        width = max(len(n) for n in shown)  # one column for every section
        for title, names in sections:
            if names:
                with formatter.section(f"{title} commands"):
                    formatter.write_dl([(n.ljust(width), self._short_help(n)) for n in names])

    def _command(self, name: str) -> click.Command:
        return self.commands.get(name) or click.Command(name, help=COMMANDS[name][2])

    def _short_help(self, name: str) -> str:
        cmd = self.commands.get(name)
        if cmd is None:
            return COMMANDS[name][2]
        return cmd.get_short_help_str(10**6)

    def resolve_command(
        self, ctx: click.Context, args: list[str]
    ) -> tuple[str | None, click.Command | None, list[str]]:
        _refuse_unknown(self, ctx, args)
        return super().resolve_command(ctx, args)

    def invoke(self, ctx: click.Context) -> Any:
        try:
            try:
                return super().invoke(ctx)
            except OSError as exc:  # a read-only or full disk: one line, not a traceback
                raise from_os_error(exc) from exc
        except CachectlError as exc:
            # The one place a library error becomes an exit code (cachectl.core.errors.ERRORS).
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
    subcommand_metavar="COMMAND [ARGS...]",  # no help line ends in "...": that marks a cut
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
@click.option(
    "--wide",
    is_flag=True,
    expose_value=False,
    callback=_wide,
    help="Tables with whole digests, keys and paths, as wide as their widest row (else they "
    "fit the terminal, or COLUMNS in a pipe; a pipe with no COLUMNS gets them whole).",
)
@click.version_option(__version__, prog_name="cachectl", message="%(prog)s %(version)s")
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
    no_world_writes()  # whatever the umask, nothing a command creates is world-writable
    ctx.meta["cachectl.configured_logging"] = not logging.root.handlers
    logging.basicConfig(level=_log_level(verbose), format="%(levelname)s %(name)s: %(message)s")
    ctx.obj = _LazyContext(ctx)
    ctx.call_on_close(ctx.obj.close)


def _no_such_command(name: str, names: list[str], where: str = "cachectl") -> str:
    import difflib

    close = difflib.get_close_matches(name, names, n=1, cutoff=0.6)
    hint = f"did you mean {close[0]}?" if close else f"`{where} --help` lists the commands"
    scope = "" if where == "cachectl" else f" in {where}"
    return f"no command {name!r}{scope}: {hint}"


@cli.command("help", hidden=False)
@click.argument("names", nargs=-1, metavar="[COMMAND]...")
@click.pass_context
def help_cmd(ctx: click.Context, names: tuple[str, ...]) -> None:
    """Show the help of COMMAND (`cachectl help bundle create`), or of cachectl."""
    root = ctx.find_root()
    target: click.Command = root.command
    sub = root
    for name in names:
        group = target if isinstance(target, click.Group) else None
        found = group.get_command(sub, name) if group is not None else None
        if group is None or found is None:
            where = sub.command_path
            raise BadInput(_no_such_command(name, group.list_commands(sub) if group else [], where))
        if isinstance(group, CachectlGroup):
            accept_global_options(found)
        target = found
        sub = click.Context(found, info_name=name, parent=sub)
    click.echo(target.get_help(sub))


def main() -> None:
    cli.main(prog_name="cachectl")
