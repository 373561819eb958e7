"""The cachectl app for ASGI servers other than `cachectl serve`'s uvicorn (bench/asgi.py starts them).

``app``: built at import over the index at ``CACHECTL_DB``, as `cachectl serve` builds it.

``CACHECTL_BENCH_NO_FAST_LANE=1``: the app without server/fast_lane.py, every request routed by
FastAPI (how the byte routes were served before it); ``python bench/asgi_app.py PORT`` serves it
under uvicorn configured as `cachectl serve` configures it.

``CACHECTL_BENCH_NO_ZERO_COPY=1`` (with ``python bench/asgi_app.py PORT``): uvicorn as `cachectl
serve` runs it, except that no request is offered server/zero_copy.py's ``sendfile``: a download is
read in its thread hop and written (up to 4 MiB) or streamed, as before that module.

``CACHECTL_BENCH_PATHSEND=1`` (a measurement only, not the product): the entry download, behind
the same route and auth, hands the server the open file by the ASGI ``http.response.pathsend``
extension (granian offers it) instead of reading the bytes. The file is opened as the product opens
it (the store's O_NOFOLLOW open, Content-Length from fstat) and sent as ``/proc/self/fd/N``, the
inode checked. granian opens that path *after* ``send`` has returned and signals nothing when it
has, so the descriptor is closed on a timer here (``GRACE_S``): a descriptor closed before granian
opened it, and reused meanwhile, would send another file. That is why the product does not take
this path (see BENCHMARKS.md, "ASGI servers").
"""

from __future__ import annotations

import asyncio
import os
from typing import Any

from fastapi import HTTPException, Request
from fastapi.responses import Response
from starlette.concurrency import run_in_threadpool

from cachectl_server import entry_routes, zero_copy
from cachectl_server.app import create_app, freeze_startup_heap
from cachectl_server.config import load_server_settings
from cachectl_server.deps import state_of
from cachectl_server.state import ServerState

PATHSEND = "http.response.pathsend"
GRACE_S = 5.0


def _open(
    state: ServerState, cache: str, digest: str, key: str, route: entry_routes.ByteRoute
) -> tuple[Any, int, str | None]:
    from cachectl.index import server_queries as sq

    info, env = state.where(cache, digest)
    recorded = sq.recorded_digest(state.index, env.id, key, executable=route.executable)
    try:
        fh = state.store(info).open(route.path_of(env, key), "rb")
    except FileNotFoundError:
        raise HTTPException(404, "no such entry") from None
    size = os.fstat(fh.fileno()).st_size
    return fh, size, recorded[1] if recorded and recorded[0] == size else None


class _PathBody(Response):
    def __init__(self, fh: Any, headers: dict[str, str]) -> None:
        super().__init__(None, media_type="application/octet-stream", headers=headers)
        self.fh = fh

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
            await send({"type": PATHSEND, "path": f"/proc/self/fd/{self.fh.fileno()}"})
        finally:
            asyncio.get_running_loop().call_later(GRACE_S, self.fh.close)


_product_download = entry_routes.download


async def _download(
    request: Request, cache: str, digest: str, key: str, route: entry_routes.ByteRoute
) -> Response:
    if PATHSEND not in request.scope.get("extensions", {}) or route.executable:
        return await _product_download(request, cache, digest, key, route)
    entry_routes.check_key(key)
    fh, size, sha = await run_in_threadpool(_open, state_of(request), cache, digest, key, route)
    return _PathBody(fh, entry_routes.byte_headers(size, sha))


if os.environ.get("CACHECTL_BENCH_NO_ZERO_COPY") == "1":
    zero_copy.offer = lambda cycle: None  # http_edge looks it up per request

PATHSEND_ON = os.environ.get("CACHECTL_BENCH_PATHSEND") == "1"
if PATHSEND_ON:
    entry_routes.download = (
        _download  # get_entry looks the name up when it runs: same route, same auth
    )

settings = load_server_settings(db=os.environ["CACHECTL_DB"])
# The pathsend download replaces the route's: the lane, which answers before the route, stays off.
app = create_app(
    settings,
    byte_fast_lane=not PATHSEND_ON and os.environ.get("CACHECTL_BENCH_NO_FAST_LANE") != "1",
)
freeze_startup_heap()

if __name__ == "__main__":
    import sys

    import uvicorn

    from cachectl_server.http_edge import bounded_http

    uvicorn.run(
        app,
        host="127.0.0.1",
        port=int(sys.argv[1]),
        http=bounded_http(settings),
        log_level="warning",
        access_log=False,
        log_config=None,
        server_header=False,
    )
