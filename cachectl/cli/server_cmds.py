"""`cachectl serve` and `cachectl token`: run the HTTP server, manage its bearer tokens."""

from __future__ import annotations

import contextlib
import os
import sys
from typing import TYPE_CHECKING, Any

import click

from cachectl.cli.render import emit, json_option, stdout, table, when
from cachectl.core.config import SERVER_HOST, SERVER_PORT, TOKEN_ROLES
from cachectl.core.errors import BadInput, OperationFailed

if TYPE_CHECKING:
    from cachectl.context import Context
    from cachectl.trust import tokens

# cachectl.operations (the index, SQLAlchemy) and the server are imported by the command bodies
# when they run, never at import: `cachectl token create --help` builds its options from
# cachectl.core.config alone.

KEEP_ALIVE_S = 75
MAX_WORKERS = 64


@click.command("serve")
@click.option("--host", default=SERVER_HOST, show_default=True, help="Address to listen on.")
@click.option(
    "--port",
    default=SERVER_PORT,
    show_default=True,
    type=click.IntRange(0, 65535),
    help="TCP port.",
)
@click.option(
    "--uds",
    metavar="PATH",
    help="Listen on a unix socket at PATH (created 0660 less the umask, removed on exit) instead "
    "of --host/--port: for nginx or a load balancer on the same host.",
)
@click.option(
    "--db",
    "serve_db",
    metavar="URL",
    help="Index database (default: the global --db / CACHECTL_DB).",
)
@click.option(
    "--maintenance-interval",
    metavar="DUR",
    help="Enforce each cache's policy (retention, keep_versions, max_size) every DUR, e.g. 1h; "
    "off by default. [env: CACHECTL_SERVER_MAINTENANCE_INTERVAL]",
)
@click.option(
    "--telemetry-retention",
    metavar="DUR",
    help="Delete telemetry rows older than DUR at each maintenance tick (default 30d; 'off' keeps "
    "them). [env: CACHECTL_SERVER_TELEMETRY_RETENTION]",
)
@click.option(
    "--public-metrics",
    is_flag=True,
    default=None,
    help="Serve /metrics without a token. [env: CACHECTL_SERVER_METRICS_PUBLIC]",
)
@click.option(
    "--public-dashboard",
    is_flag=True,
    default=None,
    help="Serve the dashboard at / read-only without a token. [env: CACHECTL_SERVER_DASHBOARD_PUBLIC]",
)
@click.option(
    "--workers",
    default="1",
    show_default=True,
    metavar="N",
    help=f"Server processes on one port (1 to {MAX_WORKERS}); one that dies is replaced.",
)
@click.option(
    "--accel-redirect",
    metavar="PREFIX",
    help="Behind nginx: answer downloads of local-disk bytes with an X-Accel-Redirect to this "
    "internal location, e.g. /_cachectl_files/ (see --print-nginx-config). "
    "[env: CACHECTL_SERVER_ACCEL_REDIRECT]",
)
@click.option(
    "--print-nginx-config",
    is_flag=True,
    help="Print an nginx.conf that serves this cache's local-disk bytes with --accel-redirect "
    "(default prefix /_cachectl_files/), then exit.",
)
@click.option(
    "--nginx-listen",
    default="127.0.0.1:8080",
    show_default=True,
    metavar="ADDR:PORT",
    help="Where the printed nginx configuration listens (or unix:PATH, a unix socket).",
)
@click.option(
    "--nginx-user",
    metavar="USER",
    help="The user the printed configuration runs nginx's workers as: one that may read the "
    "cache roots.",
)
@click.option(
    "--log-level",
    type=click.Choice(["debug", "info", "warning", "error"]),
    default="info",
    show_default=True,
)
@click.pass_obj
def serve(
    ctx: Context,
    host: str,
    port: int,
    uds: str | None,
    serve_db: str | None,
    maintenance_interval: str | None,
    telemetry_retention: str | None,
    public_metrics: bool | None,
    public_dashboard: bool | None,
    workers: str,
    accel_redirect: str | None,
    print_nginx_config: bool,
    nginx_listen: str,
    nginx_user: str | None,
    log_level: str,
) -> None:
    """Run the cachectl server (FastAPI on uvicorn) over the index.

    Stateless: run several replicas over one PostgreSQL index behind a load
    balancer. Tokens come from `cachectl token create` on the same index.

    \b
    API:       /api/v1/... (Bearer token), spec at /openapi.json
    Health:    /healthz (alive), /readyz (index and storage reachable)
    Metrics:   /metrics (unscoped reader token, or --public-metrics)
    Dashboard: / (sign in at /login with a reader token: a session, never the
               token, in an HttpOnly cookie; or --public-dashboard for a
               read-only view)
    """
    import logging

    count = _workers(workers)
    if uds is not None:
        _only_uds(click.get_current_context())
    try:
        import uvicorn

        import cachectl_server.accel as accel
        from cachectl_server.app import listening_on
        from cachectl_server.config import load_server_settings
    except ImportError as exc:
        raise BadInput(
            f"the server needs its extra: pip install 'cachectl-jax[server]' ({exc.name} is missing)"
        ) from exc
    settings = load_server_settings(
        db=serve_db or ctx.settings.db,
        host=host,
        flags={
            "maintenance_interval_s": maintenance_interval or None,
            "telemetry_retention_s": telemetry_retention,
            "metrics_public": public_metrics,
            "dashboard_public": public_dashboard,
            "accel_redirect": accel_redirect,
        },
    )
    if print_nginx_config:
        from cachectl.index import open_index

        index = open_index(settings.db)
        try:
            caches = index.list_caches()
        finally:
            index.close()
        click.echo(
            accel.nginx_config(
                accel.local_roots(caches),
                upstream=f"unix:{uds}" if uds else f"{host}:{port}",
                listen=nginx_listen,
                prefix=settings.accel_redirect or accel.DEFAULT_PREFIX,
                user=nginx_user,
            ),
            nl=False,
        )
        return
    level = getattr(logging, log_level.upper())
    logging.basicConfig(
        level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s", force=True
    )
    # uvicorn's own access log prints query strings: ours (route templates only) replaces it.
    # Keep idle connections longer than load balancers do (60 s is common): a client must never
    # send on a connection the server is closing at that moment. Request heads are bounded in
    # size, count and time (http_edge: uvicorn's own protocol bounds none of them).
    common: dict[str, Any] = {
        "host": host,
        "port": port,
        "log_level": log_level,
        "access_log": False,
        "log_config": None,
        "server_header": False,
        "timeout_keep_alive": KEEP_ALIVE_S,
    }
    announce = _announcer(settings, uds)
    if uds is None:
        _run(uvicorn, settings, count, log_level, common, announce)
        return
    with listening_on(uds) as listener:
        common["fd"] = listener.fileno()  # uvicorn listens on it, one process or N workers
        _run(uvicorn, settings, count, log_level, common, announce)


def _token_command(db: str) -> str:
    """The command that makes a reader token on the server's index: ``--db`` only where a plain
    command would open another index (its password never printed)."""
    from cachectl.core.config import load_settings

    command = "cachectl token create --name NAME --role reader"
    if db == load_settings().db:
        return command
    from cachectl.index.db import safe_url

    return f"{command} --db '{safe_url(db)}'"


def serve_banner(settings: Any, base: str | None, uds: str | None = None) -> list[str]:
    """What `cachectl serve` prints once it listens: where the API and the dashboard are, and
    how to get the token the dashboard's sign-in asks for. ``base``: http://HOST:PORT."""
    if base is None:  # a unix socket: a proxy in front gives it its URL
        where = f"unix socket {uds} (curl --unix-socket {uds} http://localhost/healthz)"
        lines = [f"cachectl server listening on {where}"]
        lines.append(f"clients on this host: CACHECTL_SERVER=unix://{os.path.abspath(uds or '')}")
        lines.append("dashboard: / through the proxy in front of the socket")
    else:
        lines = [f"cachectl server listening on {base} (API {base}/api/v1)"]
        lines.append(
            f"dashboard: {base}/ (read-only, public)"
            if settings.dashboard_public
            else f"dashboard: {base}/ (sign in at {base}/login with a reader token)"
        )
    lines.append(f"a reader token: {_token_command(settings.db)}")
    return lines


def _announcer(settings: Any, uds: str | None) -> Any:
    """A callback for uvicorn's bound sockets: prints the banner with the port really bound."""

    def announce(host: str | None, port: int | None) -> None:
        base = None
        if uds is None and port is not None:
            shown = host or "0.0.0.0"
            base = f"http://[{shown}]:{port}" if ":" in shown else f"http://{shown}:{port}"
        click.echo("\n".join(serve_banner(settings, base, uds)))
        sys.stdout.flush()

    return announce


def _run(
    uvicorn: Any,
    settings: Any,
    count: int,
    log_level: str,
    common: dict[str, Any],
    announce: Any,
) -> None:
    """uvicorn with one app object, or N workers that each build their own."""
    import os

    from cachectl_server.app import create_app, freeze_startup_heap
    from cachectl_server.config import WORKER_LOG_LEVEL_ENV, WORKER_SETTINGS_ENV, settings_to_env
    from cachectl_server.http_edge import bounded_http

    if count == 1:
        app = create_app(settings)
        freeze_startup_heap()

        class Announcing(uvicorn.Server):
            """uvicorn's server, which says where it listens once its sockets are bound."""

            def _log_started_message(self, listeners: Any) -> None:
                super()._log_started_message(listeners)
                bound = listeners[0].getsockname() if listeners else None
                port = bound[1] if isinstance(bound, tuple) else None
                announce(common["host"], port)

        server = Announcing(uvicorn.Config(app, http=bounded_http(settings), **common))
        with contextlib.suppress(KeyboardInterrupt):  # as uvicorn.run: Ctrl-C ends it quietly
            server.run()
        if not server.started:  # stopped before it listened (uvicorn says why in the log)
            raise OperationFailed("the server stopped before it listened: see the log above")
        return
    if common["port"]:  # the parent binds the workers' socket later: the port as given
        announce(common["host"], common["port"])
    # Several processes on one socket: uvicorn starts each as a fresh interpreter that builds its
    # own app (server/app.py worker_app) and replaces one that dies.
    os.environ[WORKER_SETTINGS_ENV] = settings_to_env(settings)
    os.environ[WORKER_LOG_LEVEL_ENV] = log_level.upper()
    uvicorn.run(
        "cachectl_server.app:worker_app",
        factory=True,
        workers=count,
        http="cachectl_server.http_edge:WorkerHttpTools",
        **common,
    )


def _only_uds(click_ctx: click.Context) -> None:
    """--uds replaces --host/--port: both given is a mistake to name, not to guess at."""
    for name in ("host", "port"):
        if click_ctx.get_parameter_source(name) not in (
            click.core.ParameterSource.DEFAULT,
            click.core.ParameterSource.DEFAULT_MAP,
            None,
        ):
            raise BadInput(f"--uds listens on a unix socket: drop --{name} (it is for TCP)")


def _workers(text: str) -> int:
    """--workers as a count, or a one-line refusal."""
    try:
        count = int(text)
    except ValueError:
        count = 0
    if not 1 <= count <= MAX_WORKERS:
        raise BadInput(
            f"--workers must be a whole number from 1 to {MAX_WORKERS}, not {text!r} "
            "(about one per core serves best)"
        )
    return count


def _print_tokens(items: list[tokens.TokenInfo]) -> None:
    rows = [
        (
            t.name,
            t.role,
            ",".join(t.caches) if t.caches is not None else "all",
            when(t.created_at),
            when(t.expires_at),
            when(t.last_used_at),
            "revoked" if t.revoked_at else ("active" if t.active else "expired"),
        )
        for t in items
    ]
    stdout.print(
        table(None, ["name", "role", "caches", "created", "expires", "last used", "status"], rows)
    )


@click.group("token")
def token_group() -> None:
    """Bearer tokens for the server: reader, writer or admin, optionally scoped to caches."""


@token_group.command("create")
@click.option(
    "--name",
    required=True,
    help="A unique name (shown in logs and 403 messages, never the secret).",
)
@click.option(
    "--role",
    required=True,
    type=click.Choice(TOKEN_ROLES),
    help="reader: list, stats, resolve, download, telemetry; writer: also upload and register "
    "entries and warm runs; admin: also prune, gc, verify, policy and tokens.",
)
@click.option(
    "--cache",
    "caches",
    multiple=True,
    metavar="NAME",
    help="Limit the token to this cache (repeatable).",
)
@click.option("--expires", metavar="DUR", help="Expire after DUR, e.g. 90d (default: never).")
@json_option
@click.pass_obj
def token_create(
    ctx: Context, name: str, role: str, caches: tuple[str, ...], expires: str | None, as_json: bool
) -> None:
    """Create a token; the secret is printed once, alone on the last line (only its hash is stored)."""
    from cachectl.operations import operations

    created = operations(ctx).create_token(name, role, list(caches) or None, expires)

    def human(c: tokens.CreatedToken) -> None:
        scope = ", ".join(c.info.caches) if c.info.caches else "all caches"
        until = f", expires {when(c.info.expires_at)} UTC" if c.info.expires_at else ""
        click.echo(f"created {c.info.role} token {c.info.name!r} for {scope}{until}")
        click.echo("store it now: it is not shown again")
        click.echo(c.token)

    emit(created, as_json, human)


@token_group.command("list")
@json_option
@click.pass_obj
def token_list(ctx: Context, as_json: bool) -> None:
    """List tokens (names, roles, scopes, expiry; never secrets)."""
    from cachectl.operations import operations

    items = operations(ctx).list_tokens()
    emit(items, as_json, _print_tokens)


@token_group.command("revoke")
@click.argument("name")
@json_option
@click.pass_obj
def token_revoke(ctx: Context, name: str, as_json: bool) -> None:
    """Revoke a token by name; the server refuses it from the next request on."""
    from cachectl.operations import operations

    info = operations(ctx).revoke_token(name)
    emit(info, as_json, lambda t: stdout.print(f"revoked token {t.name!r}"))


def register(cli: Any) -> None:
    cli.add_command(serve)
    cli.add_command(token_group)
