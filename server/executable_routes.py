"""Stored executables over HTTP: PUT (writers), GET (streamed) and HEAD of an entry's ``<key>-aot``.

The sibling of server/entry_routes.py: ``/caches/{cache}/environments/{digest}/entries/{key}/aot``.
An executable belongs to an indexed entry and is recorded on that entry's row
(cachectl/storage/executables.py). An upload is checked before anything is stored: the key,
the environment, the same size limits as entries (413) and the cache's quota
counting entry and executable as one unit, then the bytes are an intact
artifact (``aot.read_header``: magic, format, payload checksum) made for
this key and this entry's recorded bytes (422). The server computes the
sha256 it records from the bytes it received.
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from cachectl.index import EnvironmentInfo
from cachectl.storage import ingest
from cachectl.storage.entries import EXECUTABLE_SUFFIX

from . import responses as out
from .api import CacheName, Digest
from .auth import route
from .entry_routes import (
    BYTES_BODY,
    ByteRoute,
    Key,
    OctetStream,
    download,
    download_responses,
    head,
    upload,
    upload_responses,
)

router = APIRouter(prefix="/api/v1")
ROUTE = "/caches/{cache}/environments/{digest}/entries/{key}/aot"


def executable_path(env: EnvironmentInfo, key: str) -> str:
    return f"{env.namespace}/{key}{EXECUTABLE_SUFFIX}"


@route(
    router,
    "PUT",
    ROUTE,
    role="writer",
    summary="Upload an entry's stored executable (the <key>-aot bytes warm made)",
    openapi_extra=BYTES_BODY,
    response_model=out.EntryOut,
    responses=upload_responses("stored", "replaced", "not a stored executable of this entry"),
)
async def put_executable(
    request: Request, cache: CacheName, digest: Digest, key: Key
) -> JSONResponse:
    return await upload(
        request,
        cache,
        digest,
        key,
        ingest.ingest_executable,
        lambda state, limit: {},
        lambda outcome: 200 if outcome == "replaced" else 201,
    )


EXECUTABLE = ByteRoute(
    executable_path,
    True,
    "no stored executable for entry {key} in environment {env} of cache {cache!r}",
)


@route(
    router,
    "GET",
    ROUTE,
    role="reader",
    summary="Download an entry's stored executable (streamed)",
    response_class=OctetStream,
    responses=download_responses("the -aot bytes"),
)
async def get_executable(request: Request, cache: CacheName, digest: Digest, key: Key) -> Response:
    return await download(request, cache, digest, key, EXECUTABLE)


@route(
    router,
    "HEAD",
    ROUTE,
    role="reader",
    summary="A stored executable's size and sha256, without its bytes",
    response_class=OctetStream,
    responses=download_responses("the -aot file's size and recorded sha256, no bytes"),
)
async def head_executable(request: Request, cache: CacheName, digest: Digest, key: Key) -> Response:
    return await head(request, cache, digest, key, EXECUTABLE)
