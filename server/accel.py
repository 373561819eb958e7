"""nginx in front of `cachectl serve`: cachectl authorizes each download, nginx sends the bytes.

With ``accel_redirect`` set (``cachectl serve --accel-redirect /_cachectl_files/``), a GET of an
entry or stored executable on local disk that every check passes is answered with no body and an
``X-Accel-Redirect`` to ``<prefix><cache>/<path in the cache>``; nginx's internal location for that
cache (``nginx_config``: ``internal``, ``alias`` to the cache's root, ``disable_symlinks on``
below the root) then sends the file with its own ``sendfile``, ranges and HEAD included. The internal location
cannot be asked for directly (nginx answers 404), so nothing reaches the bytes without cachectl's
token check. Objects in GCS or S3 are not redirected: cachectl reads and sends them as before.
The headers cachectl computed (the recorded sha256, its ETag, Cache-Control) are copied onto
nginx's answer from the upstream's (``$upstream_http_*``).

Repeat downloads do not ask cachectl each time. An entry GET or HEAD on a local cache first asks
cachectl in an ``auth_request`` subrequest (a GET of the same path with the same token), whose
answer nginx keeps in its ``proxy_cache`` keyed on the Authorization header and the request URI;
then nginx sends the file that answer named from that cache's root, from the entry's own location
(``alias`` to the file, opened once, no symlink followed below the root). The answer is kept
only as long as cachectl says (``X-Accel-Expires: @<unix second>``,
server/fast_lane.py ``accel_expires``): until the first of the remembered token, environment and
recorded entry (server/state.py) would be asked for again, rounded down to nginx's whole
seconds; when that is under a whole second, cachectl forgets what it remembered and asks the
index again (fast_lane ``_nginx_would_not_keep``), so the next answer is kept for most of
``token_cache_s``. So a revoked token stops being served by nginx no later than by cachectl itself
(``token_cache_s``), and an entry whose file is deleted is a 404 at once. An entry rewritten
with other bytes is sent with the sha256 header of the kept answer for as long (a client that
checks it refuses them; cachectl sends the sha256 only while the recorded size matches). Only
an answer that names a file is kept; a refusal, a missing entry, an error or an answer without
a file (an object store) sends the request on to cachectl, which gives its own answer (JSON
401/403/404, or the bytes). Other methods (uploads) go to cachectl without the subrequest.
cachectl's /metrics count only what reaches it: a download nginx sends on a kept answer is in
nginx's logs only. The Authorization header is part of nginx's cache key, and nginx writes its
keys into the cache's files: the cache directory (``auth_cache``) must be readable by nginx's
user only (nginx makes it so).

Why an ``auth_request`` subrequest and not ``proxy_cache`` on the entry's location itself, which
would follow the kept answer's ``X-Accel-Redirect``: nginx does follow the redirect of an answer
it sends from its cache (ngx_http_upstream_cache_send calls ngx_http_upstream_process_headers),
but it never stores an answer whose redirect it followed, and following one from the cache
finalizes the request once too often (ngx_http_upstream_finalize_request finds no cleanup
handler yet, as the cache is read before one is set): nginx 1.22.1's worker died on signal 11
on such hits, the file sent at once.

The recipe is tested against real nginx (tests/test_server_nginx.py) and measured against nginx
alone in bench/nginx.py (BENCHMARKS.md, "Server against nginx").
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from urllib.parse import quote

from cachectl.index import CacheInfo
from cachectl.storage.store import Store

ACCEL_HEADER = "x-accel-redirect"
# How long nginx may keep a redirect as its answer (fast_lane.accel_expires).
ACCEL_EXPIRES = b"x-accel-expires"
DEFAULT_PREFIX = "/_cachectl_files/"
# Where nginx keeps cachectl's answers to its auth subrequests: under nginx's prefix for a whole
# printed nginx.conf, Debian's nginx cache directory for an include.
AUTH_CACHE_STANDALONE = "tmp/cachectl_auth"
AUTH_CACHE_INCLUDED = "/var/cache/nginx/cachectl_auth"
ENTRY_PATH = "/api/v1/caches/{cache}/environments/[^/]+/entries/[^/]+"
# Where an entry's location looks when no file was named: never a file.
NO_FILE = "/dev/null/cachectl-no-file"


def accel_uri(prefix: str, cache: str, rel: str) -> str:
    """The internal URI nginx sends ``rel`` (a path in ``cache``'s root) from."""
    return prefix + quote(cache, safe="") + "/" + quote(rel, safe="/")


def local_roots(caches: Sequence[CacheInfo]) -> list[tuple[str, str]]:
    """(cache name, root directory) of every cache on local disk: the ones nginx can send."""
    found = []
    for cache in caches:
        store = Store(cache.root_url, cache.storage_options)
        if store.kind == "file":
            found.append((cache.name, os.path.realpath(store.root)))
    return found


def _quoted(text: str) -> str:
    """A string as one nginx configuration token."""
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def nginx_config(
    roots: Sequence[tuple[str, str]],
    *,
    upstream: str,
    listen: str,
    prefix: str,
    standalone: bool = True,
    user: str | None = None,
    auth_cache: str | None = None,
) -> str:
    """An nginx configuration for the recipe: ``listen`` proxies to cachectl at ``upstream``, and
    one internal location per local cache sends its files. ``standalone``: a whole nginx.conf whose
    files (pid, temporary bodies) live under nginx's prefix (``nginx -p DIR -c FILE``); otherwise
    only the ``upstream`` and ``server`` blocks, for an ``include`` in an existing http block.
    nginx's workers must be able to read every cache root: ``user`` names whom they run as (nginx
    started by root otherwise runs them as ``nobody``). ``auth_cache``: where nginx keeps cachectl's
    answers (by default under its prefix, or Debian's cache directory for an include)."""
    if auth_cache is None:
        auth_cache = AUTH_CACHE_STANDALONE if standalone else AUTH_CACHE_INCLUDED
    # Repeated where a location sets headers of its own (nginx then inherits none of these).
    proxied = [
        "proxy_http_version 1.1;",
        'proxy_set_header Connection "";',
        "proxy_set_header Host $http_host;",
        "proxy_set_header X-Forwarded-For $proxy_add_x_forwarded_for;",
        "proxy_set_header X-Forwarded-Proto $scheme;",
    ]
    server_proxied, auth_proxied = ("\n" + " " * 8).join(proxied), ("\n" + " " * 12).join(proxied)
    locations = []
    for name, root in roots:
        headers = """etag off;
            types { }
            default_type application/octet-stream;"""
        root = root.rstrip("/")
        # Links are refused below the cache's root (where a writer could plant one), not above it:
        # the root is a real path already (local_roots), and each level checked costs an openat.
        no_links = f"disable_symlinks on {_quoted('from=' + root)};"
        locations.append(
            f"""
        location {_quoted(prefix + quote(name, safe="") + "/")} {{
            internal;
            alias {_quoted(root + "/")};
            {no_links}
            {headers}
            add_header Cache-Control $upstream_http_cache_control;
            add_header ETag $upstream_http_etag;
            add_header X-Cachectl-Sha256 $upstream_http_x_cachectl_sha256;
        }}

        # An entry of {name}: asked of cachectl once per token and path while its answer holds.
        location ~ {_quoted("^" + ENTRY_PATH.format(cache=re.escape(name)) + "$")} {{
            auth_request /_cachectl_auth;
            auth_request_set $cachectl_accel $upstream_http_x_accel_redirect;
            auth_request_set $cachectl_cc $upstream_http_cache_control;
            auth_request_set $cachectl_etag $upstream_http_etag;
            auth_request_set $cachectl_sha $upstream_http_x_cachectl_sha256;
            # The file the answer named, sent from here (no second lookup, no redirect). No file
            # named (404: gone, or no file named; 405: not a read) and refusals: cachectl answers.
            alias $cachectl_file;
            {no_links}
            log_not_found off;
            error_page 401 403 404 405 500 502 503 504 = @cachectl;
            {headers}
            add_header Cache-Control $cachectl_cc;
            add_header ETag $cachectl_etag;
            add_header X-Cachectl-Sha256 $cachectl_sha;
        }}"""
        )
    files = "\n".join(
        f"        {_quoted('~^' + re.escape(prefix + quote(name, safe='')) + '(/[^?%]+)$')} "
        f"{_quoted(root.rstrip('/') + '$1')};"
        for name, root in roots
    )
    body = f"""
    upstream cachectl {{
        server {upstream};
        keepalive 32;
    }}

    # cachectl's answers to the auth subrequests: kept only as long as its X-Accel-Expires says.
    proxy_cache_path {_quoted(auth_cache)} levels=1:2 keys_zone=cachectl_auth:10m max_size=256m
                     inactive=10m use_temp_path=off;

    # The file an answer named, in its cache's root. None: a path that is never a file
    # (/dev/null is not a directory), so the entry's location hands the request to cachectl.
    map $cachectl_accel $cachectl_file {{
{files}
        default {_quoted(NO_FILE)};
    }}

    # Not a read (an upload): no answer to keep, cachectl answers the request itself.
    map $request_method $cachectl_not_read {{
        GET "";
        HEAD "";
        default 1;
    }}

    server {{
        listen {listen};
        # Uploads go to cachectl as they arrive; it bounds and checks them itself.
        client_max_body_size 0;
        proxy_request_buffering off;
        {server_proxied}

        location / {{
            proxy_pass http://cachectl;
        }}

        location @cachectl {{
            proxy_pass http://cachectl;
        }}

        location @cachectl_no_file {{
            return 204;
        }}

        location = /_cachectl_auth {{
            internal;
            # Not a read: no file, cachectl answers the request itself.
            if ($cachectl_not_read) {{
                return 204;
            }}
            proxy_pass http://cachectl$request_uri;
            proxy_method GET;
            proxy_pass_request_body off;
            {auth_proxied}
            proxy_set_header Content-Length "";
            proxy_set_header Range "";
            proxy_set_header If-Range "";
            proxy_set_header If-None-Match "";
            proxy_set_header If-Modified-Since "";
            # A miss, or any answer but a file or a refusal: no file, and cachectl answers the
            # request itself (a refusal, 401 or 403, does the same through the entry's error_page).
            proxy_intercept_errors on;
            error_page 400 404 405 409 410 416 422 429 = @cachectl_no_file;
            proxy_cache cachectl_auth;
            proxy_cache_key "$http_authorization $request_uri";
            # Kept for as long as X-Accel-Expires says, and for no other reason.
            proxy_ignore_headers Cache-Control Expires Set-Cookie Vary X-Accel-Redirect
                                 X-Accel-Limit-Rate X-Accel-Buffering X-Accel-Charset;
            # The kept answers' files stay open between requests. nginx's cache reopens one that
            # was replaced (its node records the file's inode), and reads each answer's expiry
            # from the file on every request. The entries' own files are never kept open.
            open_file_cache max=1024 inactive=10m;
            open_file_cache_valid 1h;
        }}
{"".join(locations)}
    }}
"""
    if not standalone:
        return "# cachectl behind nginx: include this in nginx's http block\n" + body
    return f"""# cachectl behind nginx (cachectl serve --print-nginx-config): run with
#   mkdir -p DIR/tmp && nginx -p DIR -c THIS_FILE   (DIR: the pid file, nginx's temporary files)
daemon off;
{f"user {user};" if user else "# user: whoever may read the cache roots (nginx started by root: nobody)"}
worker_processes auto;
pid nginx.pid;
pcre_jit on;
error_log stderr warn;

events {{
    worker_connections 1024;
}}

http {{
    access_log off;
    sendfile on;
    tcp_nopush on;
    keepalive_requests 100000;
    client_body_temp_path tmp/client_body;
    proxy_temp_path tmp/proxy;
    fastcgi_temp_path tmp/fastcgi;
    uwsgi_temp_path tmp/uwsgi;
    scgi_temp_path tmp/scgi;
{body}}}
"""
