"""The dashboard at ``/``: server-rendered HTML with inline SVG charts; no JavaScript, no CDN.

Auth: a reader token, sent as ``Authorization: Bearer``, or a session from
the form at ``/login`` (posted from this server's own page: Origin checked)
kept in an HttpOnly, SameSite=Strict cookie, Secure unless the server is on
loopback. The cookie holds a session (cachectl.trust.tokens.issue_session), never
the token; reader and writer tokens sign in, admin tokens are refused there. The token is never put in a URL,
so it never reaches access logs or browser history.
A token scoped to caches sees only those caches. With
``dashboard_public`` the page is served read-only without a token.
"""

from __future__ import annotations

import html
import ipaddress
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any
from urllib.parse import parse_qs, urlsplit

from fastapi import APIRouter, Depends, HTTPException, Request
from fastapi.responses import HTMLResponse, RedirectResponse, Response
from fastapi.templating import Jinja2Templates
from starlette.concurrency import run_in_threadpool

from cachectl.core.units import format_size
from cachectl.index import server_queries as sq
from cachectl.index.usage import served_rate
from cachectl.trust.tokens import InvalidToken, TokenInfo, authenticate, issue_session
from cachectl.usage import inventory

from .auth import COOKIE_NAME, identify, route
from .deps import StateDep, state_of

if TYPE_CHECKING:
    from .config import ServerSettings

router = APIRouter(include_in_schema=True)
templates = Jinja2Templates(directory=str(Path(__file__).parent / "templates"))
templates.env.filters["size"] = format_size
templates.env.filters["when"] = lambda v: v.strftime("%Y-%m-%d %H:%M") if v else "-"
templates.env.filters["pct"] = lambda v: "-" if v is None else f"{v * 100:.1f}%"
MAX_LOGIN_BODY = 4096
# What the sign-in page says when it is the answer (server/templates/login.html).
PAGE_TEXT = {
    400: "an admin token: the dashboard takes reader or writer tokens",
    401: "no token, or one not accepted: the sign-in form",
    403: "refused: a token that may not read, or a form posted from another site",
    413: "the form is too large",
}


def pages(*codes: int) -> dict[int | str, dict[str, Any]]:
    """``responses=`` for answers that are the sign-in page (HTML) with a refusal status."""
    html_page = {"text/html": {"schema": {"type": "string"}}}
    return {code: {"description": PAGE_TEXT[code], "content": html_page} for code in codes}


# -- SVG charts ---------------------------------------------------------------------


def _ticks(at: list[datetime]) -> list[tuple[int, str]]:
    if not at:
        return []
    step = max(1, -(-len(at) // 5))  # at most 5 labels, so they never overlap
    fmt = "%m-%d %H:%M" if len(at) < 2 or (at[-1] - at[0]).days < 3 else "%m-%d"
    return [(i, at[i].strftime(fmt)) for i in range(0, len(at), step)]


def bar_chart(
    title: str,
    at: list[datetime],
    series: list[tuple[str, str, list[int]]],
    *,
    width: int = 640,
    height: int = 200,
    fmt: Any = str,
) -> str:
    """Stacked bars, one per time bucket; ``series`` is (label, colour, values)."""
    pad_l, pad_b, pad_t = 70, 36, 24
    plot_w, plot_h = width - pad_l - 10, height - pad_b - pad_t
    totals = [sum(s[2][i] for s in series) for i in range(len(at))]
    top = max(totals, default=0) or 1
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" role="img" aria-label="{html.escape(title)}" '
        f'width="{width}" height="{height}" viewBox="0 0 {width} {height}" class="chart">',
        f'<text x="{pad_l}" y="16" class="chart-title">{html.escape(title)}</text>',
    ]
    for frac in (0, 0.5, 1) if at else ():
        y = pad_t + plot_h * (1 - frac)
        parts.append(
            f'<line x1="{pad_l}" x2="{width - 10}" y1="{y:.1f}" y2="{y:.1f}" class="grid"/>'
        )
        parts.append(
            f'<text x="{pad_l - 6}" y="{y + 4:.1f}" text-anchor="end" class="axis">'
            f"{html.escape(str(fmt(int(top * frac))))}</text>"
        )
    if not at:
        parts.append(
            f'<text x="{pad_l + plot_w / 2}" y="{pad_t + plot_h / 2}" text-anchor="middle" '
            'class="axis">no data yet</text>'
        )
    slot = plot_w / max(len(at), 1)
    bar = max(1.0, slot * 0.7)
    for i, _t in enumerate(at):
        x = pad_l + i * slot + (slot - bar) / 2
        base: float = pad_t + plot_h
        for label, colour, values in series:
            h = plot_h * values[i] / top
            base -= h
            parts.append(
                f'<rect x="{x:.1f}" y="{base:.1f}" width="{bar:.1f}" height="{h:.1f}" fill="{colour}">'
                f"<title>{html.escape(label)} {values[i]}</title></rect>"
            )
    for i, text in _ticks(at):
        x = pad_l + i * slot + slot / 2
        parts.append(
            f'<text x="{x:.1f}" y="{height - 18}" text-anchor="middle" class="axis">{html.escape(text)}</text>'
        )
    legend_x = pad_l
    for label, colour, _values in series:
        parts.append(
            f'<rect x="{legend_x}" y="{height - 12}" width="10" height="10" fill="{colour}"/>'
            f'<text x="{legend_x + 14}" y="{height - 3}" class="axis">{html.escape(label)}</text>'
        )
        legend_x += 90
    parts.append("</svg>")
    return "".join(parts)


# -- page data -------------------------------------------------------------------------


@dataclass(frozen=True)
class EnvRow:
    digest: str
    jax_version: str
    backend: str
    device: str
    entries: int
    bytes: int
    requests: int
    hits: int
    hit_rate: float | None  # served: hits and loads over those and the misses
    last_seen: datetime | None


@dataclass(frozen=True)
class CacheView:
    name: str
    root: str
    entries: int
    bytes: int
    max_size: int | None
    usage: float | None
    retention_seconds: int | None
    environments: list[EnvRow]
    hits_chart: str
    bytes_chart: str


def _cache_views(state: Any, token: TokenInfo | None) -> list[CacheView]:
    caches = [
        c for c in state.index.list_caches() if token is None or token.allows("reader", c.name)
    ]
    views = []
    for totals in inventory.cache_totals(state.ctx, caches):
        cache = totals.cache
        rates = sq.hit_rates(state.index, cache.name)
        rows = []
        for e in totals.per_environment:
            requests, hits, misses, loads = rates.get(e.id, (0, 0, 0, 0))
            seen = max(
                [t for t in (e.last_seen_at, e.last_access_at) if t is not None], default=None
            )
            rows.append(
                EnvRow(
                    e.digest[:16],
                    e.environment.jax_version,
                    e.environment.backend,
                    f"{e.environment.device_kind} x{e.environment.device_count}",
                    e.entries,
                    e.bytes,
                    requests,
                    hits,
                    served_rate(hits, misses, loads),
                    seen,
                )
            )
        points = sq.telemetry_series(state.index, cache.name)
        hits_chart = bar_chart(
            f"{cache.name}: compile requests per hour (7 days)",
            [p.at for p in points],
            [
                ("hits", "#2e7d32", [p.hits for p in points]),
                ("misses", "#c62828", [p.misses for p in points]),
            ],
        )
        growth = sq.bytes_series(state.index, cache.name)
        bytes_chart = bar_chart(
            f"{cache.name}: bytes held, by day the entries were written",
            [p.at for p in growth],
            [("bytes", "#1565c0", [p.total_bytes for p in growth])],
            fmt=format_size,
        )
        usage = totals.bytes / cache.max_size if cache.max_size else None
        views.append(
            CacheView(
                cache.name,
                cache.root_url,
                totals.entries,
                totals.bytes,
                cache.max_size,
                usage,
                cache.retention_seconds,
                rows,
                hits_chart,
                bytes_chart,
            )
        )
    return views


@dataclass(frozen=True)
class DashboardVisitor:
    """Who asks for the dashboard: a reader's token (None: public), or why the sign-in page
    answers instead (``refused``, a status, with ``message``)."""

    token: TokenInfo | None
    refused: int | None = None
    message: str | None = None


async def dashboard_visitor(request: Request) -> DashboardVisitor:
    """The dashboard's auth: a bearer token or the session cookie, a reader; anyone when public.
    A dependency that never raises: a refusal is the sign-in page, not a JSON error."""
    try:
        token = await identify(request, allow_cookie=True)
    except HTTPException:  # a stale cookie or bad header: ask again
        return DashboardVisitor(None, 401, "That token is not valid any more: sign in again.")
    if token is None and not state_of(request).settings.dashboard_public:
        return DashboardVisitor(None, 401)
    if token is not None and not token.allows("reader"):
        return DashboardVisitor(token, 403, "This token may not read caches.")
    return DashboardVisitor(token)


Visitor = Annotated[DashboardVisitor, Depends(dashboard_visitor)]


def _login_page(request: Request, status: int, message: str | None = None) -> HTMLResponse:
    return templates.TemplateResponse(
        request, "login.html", {"message": message}, status_code=status
    )


@route(
    router,
    "GET",
    "/",
    role="reader",
    scope="any",
    enforce=False,
    response_class=HTMLResponse,
    summary="Dashboard (reader token by header or /login cookie; public when configured)",
    responses=pages(401, 403),
)
async def dashboard(request: Request, state: StateDep, visitor: Visitor) -> Response:
    if visitor.refused is not None:
        return _login_page(request, visitor.refused, visitor.message)
    token = visitor.token
    views = await run_in_threadpool(_cache_views, state, token)
    return templates.TemplateResponse(
        request,
        "dashboard.html",
        {
            "caches": views,
            "token": token,
            "public": token is None,
            "generated": sq.utcnow(),
        },
    )


@route(
    router,
    "GET",
    "/login",
    role="public",
    response_class=HTMLResponse,
    summary="Dashboard sign-in form",
)
async def login_form(request: Request) -> Response:
    return _login_page(request, 200)


@route(
    router,
    "POST",
    "/login",
    role="public",
    response_class=RedirectResponse,
    status_code=303,
    summary="Sign in to the dashboard with a reader token (form field 'token')",
    responses={
        303: {"description": "signed in: the session cookie is set, on to the dashboard"},
        **pages(400, 401, 403, 413),
    },
    openapi_extra={
        "requestBody": {
            "content": {
                "application/x-www-form-urlencoded": {
                    "schema": {
                        "type": "object",
                        "properties": {"token": {"type": "string"}},
                        "required": ["token"],
                    }
                }
            }
        }
    },
)
async def login(request: Request, state: StateDep) -> Response:
    if not same_origin(request):
        return _login_page(
            request, 403, "Sign-in refused: the form was not posted from this server's own page."
        )
    body = b""
    async for chunk in request.stream():
        body += chunk
        if len(body) > MAX_LOGIN_BODY:
            return _login_page(request, 413, "Request too large.")
    try:
        fields = parse_qs(body.decode("utf-8"), max_num_fields=5)
    except (UnicodeDecodeError, ValueError):
        fields = {}
    token = (fields.get("token") or [""])[0].strip()
    try:
        info = await run_in_threadpool(authenticate, state.index, token)
    except InvalidToken:
        return _login_page(request, 401, "Token not accepted (unknown, expired or revoked).")
    if not info.allows("reader"):
        return _login_page(request, 403, "This token may not read caches.")
    if info.role == "admin":
        # An admin secret typed into a browser form is one XSS or shared machine away from
        # the whole index: the dashboard only ever needs a reader.
        return _login_page(
            request,
            400,
            "Admin tokens cannot sign in to the dashboard: use a reader token "
            "(cachectl token create --name dashboard --role reader).",
        )
    try:
        session = await run_in_threadpool(issue_session, state.index, token)
    except InvalidToken:
        return _login_page(request, 401, "Token not accepted (unknown, expired or revoked).")
    response = RedirectResponse("/", status_code=303)
    max_age = max(0, int((session.expires_at - sq.utcnow()).total_seconds()))
    response.set_cookie(
        COOKIE_NAME,
        session.value,
        httponly=True,
        samesite="strict",
        path="/",
        secure=secure_cookies(state.settings),
        max_age=max_age,
    )
    return response


@route(
    router,
    "POST",
    "/logout",
    role="public",
    response_class=RedirectResponse,
    status_code=303,
    summary="Forget the dashboard cookie",
    responses={303: {"description": "signed out: on to /login"}, **pages(403)},
)
async def logout(request: Request) -> Response:
    if not same_origin(request):
        return _login_page(
            request, 403, "Sign-out refused: not posted from this server's own page."
        )
    response = RedirectResponse("/login", status_code=303)
    response.delete_cookie(COOKIE_NAME, path="/")
    return response


def same_origin(request: Request) -> bool:
    """False for a form posted from another site (login CSRF): a browser names the page that
    posted in Origin (else Referer) and, in current browsers, Sec-Fetch-Site. Clients that send
    none of them (scripts) are not browsers and carry no ambient credentials."""
    if request.headers.get("sec-fetch-site", "same-origin").lower() not in ("same-origin", "none"):
        return False
    host = (request.headers.get("host") or "").strip().lower()
    origin = request.headers.get("origin")
    if origin is None:
        referer = request.headers.get("referer")
        if not referer:
            return True
        origin = referer
    if origin.strip().lower() == "null":
        return False
    netloc = urlsplit(origin.strip()).netloc.lower()
    return bool(host) and netloc == host


def secure_cookies(settings: ServerSettings) -> bool:
    """Secure unless the server listens on loopback only (plain http://127.0.0.1 in development);
    ``secure_cookies`` True or False forces it."""
    if settings.secure_cookies is not None:
        return bool(settings.secure_cookies)
    return not _is_loopback(settings.host)


def _is_loopback(host: str) -> bool:
    if host.strip().lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False
