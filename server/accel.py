"""nginx in front of `cachectl serve`: cachectl authorizes each download, nginx sends the bytes.

With ``accel_redirect`` set (``cachectl serve --accel-redirect /_cachectl_files/``), a GET of an
entry or stored executable on local disk that every check passes is answered with no body and an
``X-Accel-Redirect`` to ``<prefix><cache>/<path in the cache>``; nginx's internal location for that
cache (``nginx_config``: ``internal``, ``alias`` to the cache's root, ``disable_symlinks on``)
then sends the file with its own ``sendfile``, ranges and HEAD included. The internal location
cannot be asked for directly (nginx answers 404), so nothing reaches the bytes without cachectl's
token check. Objects in GCS or S3 are not redirected: cachectl reads and sends them as before.
The headers cachectl computed (the recorded sha256, its ETag, Cache-Control) are copied onto
nginx's answer from the upstream's (``$upstream_http_*``).

The recipe is tested against real nginx (tests/test_server_nginx.py) and measured against nginx
alone in bench/nginx.py (BENCHMARKS.md, "Server against nginx").
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from urllib.parse import quote

from cachectl.index import CacheInfo
from cachectl.storage.store import Store

ACCEL_HEADER = "x-accel-redirect"
DEFAULT_PREFIX = "/_cachectl_files/"


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
) -> str:
    """An nginx configuration for the recipe: ``listen`` proxies to cachectl at ``upstream``, and
    one internal location per local cache sends its files. ``standalone``: a whole nginx.conf whose
    files (pid, temporary bodies) live under nginx's prefix (``nginx -p DIR -c FILE``); otherwise
    only the ``upstream`` and ``server`` blocks, for an ``include`` in an existing http block.
    nginx's workers must be able to read every cache root: ``user`` names whom they run as (nginx
    started by root otherwise runs them as ``nobody``)."""
    locations = []
    for name, root in roots:
        locations.append(
            f"""
        location {_quoted(prefix + quote(name, safe="") + "/")} {{
            internal;
            alias {_quoted(root.rstrip("/") + "/")};
            disable_symlinks on;
            etag off;
            types {{ }}
            default_type application/octet-stream;
            add_header Cache-Control $upstream_http_cache_control;
            add_header ETag $upstream_http_etag;
            add_header X-Cachectl-Sha256 $upstream_http_x_cachectl_sha256;
        }}"""
        )
    body = f"""
    upstream cachectl {{
        server {upstream};
        keepalive 32;
    }}

    server {{
        listen {listen};
        # Uploads go to cachectl as they arrive; it bounds and checks them itself.
        client_max_body_size 0;
        proxy_request_buffering off;
        proxy_http_version 1.1;
        proxy_set_header Connection "";
        proxy_set_header Host $http_host;
        proxy_set_header X-Forwarded-For $proxy_add_x_forwarded_for;
        proxy_set_header X-Forwarded-Proto $scheme;

        location / {{
            proxy_pass http://cachectl;
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
