"""Entry bytes over HTTP: PUT (writers), GET (streamed) and HEAD.

An upload is checked before anything is stored, in this order: the key is a
JAX key and nothing else (no '/', no '..', no leading dot), the environment
exists, the body fits the cache's max entry size (413, read no further; it is
streamed to a temporary file, never held in memory), the bytes decompress
into a JAX entry (422) in one streaming pass that stops at a bound tied to
that size (413), the key holds no other bytes already (409, unless an admin
says to overwrite: audited), and the quota is reserved in the index
atomically (413). Only then is it written, atomically; a full disk is 507.
Downloads serve only regular files inside the namespace (no symlinks).
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import re
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Annotated, Any

from fastapi import APIRouter, HTTPException, Path, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.concurrency import run_in_threadpool

from cachectl.entries import (
    AOT_SUFFIX,
    CACHE_SUFFIX,
    ENV_FILE,
    CorruptEntry,
    EntryName,
    EntryTooLarge,
    parse_key,
    scan_entry,
)
from cachectl.errors import EntryConflict, QuotaExceeded
from cachectl.index import CacheInfo, EntryInfo, EnvironmentInfo, NewEntry, warm_runs
from cachectl.index import server_queries as sq
from cachectl.namespace import ensure_namespace
from cachectl.store import Store
from cachectl.units import format_size

from . import schemas
from .api import CacheName, Digest, ok, state_of
from .auth import current_token, route
from .config import EXPANSION_RATIO
from .state import ServerState

router = APIRouter(prefix="/api/v1")

# <module>-<64 hex>: the module part as JAX sanitizes it (word characters, '.', '-'),
# never starting with a dot, so no key can name a path outside its namespace.
KEY_PATTERN = r"^[A-Za-z0-9_][A-Za-z0-9_.\-]{0,440}-[0-9a-f]{64}$"
_KEY_RE = re.compile(KEY_PATTERN)
Key = Annotated[str, Path(min_length=66, max_length=512, pattern=KEY_PATTERN,
                          description="A JAX cache key: <module>-<64 hex>, without the -cache suffix")]
SHA_HEADER = "x-cachectl-sha256"
# An admin replacing an entry that is stored with other bytes says so with this header.
OVERWRITE_HEADER = "x-cachectl-overwrite"
CHUNK = 1 << 20


def check_key(key: str) -> EntryName:
    parsed = parse_key(key) if _KEY_RE.match(key) else None
    if parsed is None:
        raise HTTPException(422, "bad entry key: use <module>-<64 hex digits> as JAX names it (no path)")
    return parsed


def entry_path(env: EnvironmentInfo, key: str) -> str:
    return f"{env.namespace}/{key}{CACHE_SUFFIX}"


def _resolve(state: ServerState, cache: str, digest: str) -> tuple[CacheInfo, EnvironmentInfo]:
    found = sq.locate(state.index, cache, digest)
    return found.cache, found.environment


def _too_large(what: str) -> HTTPException:
    return HTTPException(413, what)


def _disk_full(exc: OSError) -> HTTPException | None:
    """507 for a full disk or quota (ENOSPC, EDQUOT): the client may retry elsewhere or later."""
    if exc.errno in (errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC)):
        return HTTPException(507, "insufficient storage: the server's disk is full; nothing stored")
    return None


@dataclass
class Upload:
    """A request body streamed to a temporary file: its path, size and sha256."""

    path: str
    size: int
    sha256: str

    def discard(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)


async def _receive_body(request: Request, limit: int, what: str, directory: str | None) -> Upload:
    """Stream the body to a temporary file, hashing as it goes; 413 past ``limit`` (read no further)."""
    declared = request.headers.get("content-length")
    if declared is not None:
        try:
            length = int(declared)
        except ValueError:
            raise HTTPException(400, "bad Content-Length header") from None
        if length > limit:
            raise _too_large(f"entry of {format_size(length)} is above {what} ({format_size(limit)}): nothing stored")
    fd, path = tempfile.mkstemp(prefix="cachectl-upload-", dir=directory)
    upload = Upload(path, 0, "")
    digest = hashlib.sha256()
    try:
        with os.fdopen(fd, "wb") as fh:
            async for chunk in request.stream():
                upload.size += len(chunk)
                if upload.size > limit:
                    raise _too_large(f"entry is above {what} ({format_size(limit)}): nothing stored")
                digest.update(chunk)
                await run_in_threadpool(fh.write, chunk)
    except OSError as exc:
        upload.discard()
        full = _disk_full(exc)
        if full is not None:
            raise full from None
        raise
    except BaseException:
        upload.discard()
        raise
    upload.sha256 = digest.hexdigest()
    return upload


def expansion_limit(settings: Any, limit: int) -> int:
    """How far an upload may decompress: EXPANSION_RATIO times the size it may have on the wire
    (so a cache's max entry size bounds it too), never more than max_decompressed_bytes."""
    return min(settings.max_decompressed_bytes, max(limit, 1) * EXPANSION_RATIO)


def _store_entry(state: ServerState, info: CacheInfo, env: EnvironmentInfo, parsed: EntryName,
                 upload: Upload, claimed_sha: str | None, expand_to: int, *, replace: bool,
                 who: str) -> tuple[str, EntryInfo | None]:
    if claimed_sha is not None and claimed_sha.lower() != upload.sha256:
        raise HTTPException(422, f"body sha256 is {upload.sha256}, not the {SHA_HEADER} sent: corrupted in transit?")
    try:
        with open(upload.path, "rb") as fh:
            header = scan_entry(fh, expand_to)  # one streaming pass; nothing is decompressed again
    except EntryTooLarge:
        raise _too_large(f"entry expands to more than {format_size(expand_to)}: refused") from None
    except CorruptEntry as exc:
        raise HTTPException(422, f"not a JAX cache entry: {exc}") from None
    new = NewEntry(key=parsed.key, module=parsed.module, size=upload.size, sha256=upload.sha256, origin="upload",
                   compile_time_ms=header.compile_seconds * 1000)
    try:
        reservation = sq.reserve_entry(state.index, info.name, env.id, new, replace=replace)
    except QuotaExceeded as exc:
        raise _too_large(exc.message) from None
    except EntryConflict as exc:
        raise HTTPException(409, f"{exc.message}: send {OVERWRITE_HEADER}: true with an admin token") from None
    store = state.store(info)
    path = entry_path(env, parsed.key)
    try:
        if not store.exists(f"{env.namespace}/{ENV_FILE}"):
            # An environment recorded without its namespace (e.g. by a service that may not write):
            # storage must stay self-describing for sync and verify.
            ensure_namespace(store, env.environment, group=info.group)
        if reservation.outcome != "unchanged" or not _stored_size_is(store, path, upload.size):
            store.write_file(path, upload.path)
    except BaseException as exc:
        sq.release_entry(state.index, env.id, parsed.key, reservation)
        if isinstance(exc, OSError) and (full := _disk_full(exc)) is not None:
            raise full from None
        raise
    if reservation.outcome == "replaced" and reservation.previous is not None:
        state.index.audit("entry-overwrite", cache=info.name, entries=1, nbytes=upload.size, who=who,
                          details={"environment": env.digest, "key": parsed.key,
                                   "old_sha256": reservation.previous.sha256, "new_sha256": upload.sha256,
                                   "old_size": reservation.previous.size, "old_origin": reservation.previous.origin})
    return reservation.outcome, state.index.get_entry(env.id, parsed.key)


def _stored_size_is(store: Any, path: str, size: int) -> bool:
    try:
        return store.size(path) == size
    except FileNotFoundError:
        return False


def _wants_overwrite(request: Request) -> bool:
    return request.headers.get(OVERWRITE_HEADER, "").strip().lower() in ("1", "true", "yes")


def _may_overwrite(request: Request, cache: str) -> bool:
    """An existing entry is replaced only when an admin asks for it explicitly."""
    if not _wants_overwrite(request):
        return False
    token = current_token(request)
    if not token.allows("admin", cache):
        raise HTTPException(403, f"token {token.name!r} (role {token.role}) may not overwrite entries: "
                                 "it needs role admin")
    return True


@route(router, "PUT", "/caches/{cache}/environments/{digest}/entries/{key}", role="writer",
       summary="Upload one entry (raw bytes as JAX wrote them)",
       openapi_extra={"requestBody": {"required": True, "content": {
           "application/octet-stream": {"schema": {"type": "string", "format": "binary"}}}}},
       responses={201: {"description": "stored"}, 200: {"description": "already stored, or replaced"},
                  409: {"description": "stored with other bytes"},
                  413: {"description": "too large for the cache"}, 422: {"description": "not a JAX entry"},
                  507: {"description": "the server's disk is full"}})
async def put_entry(request: Request, cache: CacheName, digest: Digest, key: Key) -> JSONResponse:
    state = state_of(request)
    parsed = check_key(key)
    replace = _may_overwrite(request, cache)
    info, env = await run_in_threadpool(_resolve, state, cache, digest)
    limit, what = state.settings.max_upload_bytes, "the server's upload limit"
    if info.max_entry_size is not None and info.max_entry_size < limit:
        limit, what = info.max_entry_size, f"cache {cache!r}'s max entry size"
    upload: Upload | None = None
    try:
        upload = await _receive_body(request, limit, what, state.settings.upload_dir)
        outcome, entry = await run_in_threadpool(
            _store_entry, state, info, env, parsed, upload, request.headers.get(SHA_HEADER),
            expansion_limit(state.settings, limit), replace=replace, who=f"token {current_token(request).name}")
    except HTTPException as exc:
        state.metrics.uploads.labels(cache, str(exc.status_code)).inc()
        raise
    finally:
        if upload is not None:
            upload.discard()
    state.metrics.uploads.labels(cache, "stored").inc()
    state.metrics.upload_bytes.labels(cache).inc(upload.size)
    return ok(entry, 201 if outcome == "inserted" else 200)


def _located(state: ServerState, cache: str, digest: str, key: str) -> tuple[CacheInfo, EnvironmentInfo, int, str | None]:
    """The entry's cache, environment, size and recorded sha256; 404 when storage lacks it."""
    info, env = state.where(cache, digest)
    recorded = sq.recorded_digest(state.index, env.id, key)
    try:
        size = state.store(info).size(entry_path(env, key))
    except FileNotFoundError:
        raise HTTPException(404, f"no entry {key} in environment {env.digest[:16]} of cache {cache!r}") from None
    return info, env, size, recorded[1] if recorded and recorded[0] == size else None


def open_body(store: Store, path: str, size: int) -> bytes | Any:
    """The bytes of a file up to CHUNK (read in the same worker-thread hop as the open), else the
    open file to stream: a small download costs one thread hop instead of three."""
    fh = store.open(path, "rb")
    if size > CHUNK:
        return fh
    with fh:
        return fh.read()


def stream_file(body: bytes | Any, headers: dict[str, str]) -> Response:
    """What open_body gave as the response body: bytes at once, a file in CHUNK-sized reads (closed after)."""
    if isinstance(body, bytes):
        return Response(body, media_type="application/octet-stream", headers=headers)

    def chunks() -> Iterator[bytes]:
        with body:
            while block := body.read(CHUNK):
                yield block

    return StreamingResponse(chunks(), media_type="application/octet-stream", headers=headers)


def _headers(size: int, sha: str | None) -> dict[str, str]:
    headers = {"content-length": str(size), "cache-control": "private, max-age=0"}
    if sha:
        headers[SHA_HEADER] = sha
        headers["etag"] = f'"{sha}"'
    return headers


@route(router, "GET", "/caches/{cache}/environments/{digest}/entries/{key}", role="reader",
       summary="Download one entry (streamed)",
       responses={200: {"content": {"application/octet-stream": {}}, "description": "the entry's bytes"}})
async def get_entry(request: Request, cache: CacheName, digest: Digest, key: Key) -> Response:
    state = state_of(request)
    check_key(key)
    info, env, size, sha = await run_in_threadpool(_located, state, cache, digest, key)
    store = state.store(info)
    try:
        # Only a regular file inside the namespace: on local disk no symlink is followed (O_NOFOLLOW,
        # real paths compared), so a link planted in a namespace serves nothing.
        fh = await run_in_threadpool(open_body, store, entry_path(env, key), size)
    except FileNotFoundError:
        raise HTTPException(404, f"no entry {key} in environment {env.digest[:16]} of cache {cache!r}") from None
    state.metrics.download_bytes.labels(cache).inc(size)
    return stream_file(fh, _headers(size, sha))


@route(router, "HEAD", "/caches/{cache}/environments/{digest}/entries/{key}", role="reader",
       summary="An entry's size and sha256, without its bytes")
async def head_entry(request: Request, cache: CacheName, digest: Digest, key: Key) -> Response:
    state = state_of(request)
    check_key(key)
    _info, _env, size, sha = await run_in_threadpool(_located, state, cache, digest, key)
    return Response(status_code=200, headers=_headers(size, sha), media_type="application/octet-stream")


@route(router, "POST", "/caches/{cache}/environments/{digest}/entries", role="writer",
       summary="Record entries a writer stored itself (checked against storage)")
def register_entries(request: Request, cache: CacheName, digest: Digest,
                     body: schemas.EntryRegistration) -> JSONResponse:
    state = state_of(request)
    info, env = _resolve(state, cache, digest)
    store = state.store(info)
    replace = _may_overwrite(request, cache)
    new = []
    for e in body.entries:
        parsed = check_key(e.key)
        try:
            size = store.size(entry_path(env, e.key))
        except FileNotFoundError:
            raise HTTPException(422, f"entry {e.key} is not in storage at {env.namespace}: write it first") from None
        if size != e.size:
            raise HTTPException(422, f"entry {e.key} is {size} bytes in storage, not {e.size}")
        if info.max_entry_size is not None and e.size > info.max_entry_size:
            raise HTTPException(413, f"entry {e.key} ({e.size} bytes) is above cache {cache!r}'s max entry size "
                                     f"({info.max_entry_size} bytes)")
        stored_sha = _storage_sha256(store, entry_path(env, e.key))  # what is recorded: never the claim
        if stored_sha != e.sha256:
            raise HTTPException(422, f"entry {e.key} has sha256 {stored_sha} in storage, not the {e.sha256} sent")
        if (e.aot_size is None) != (e.aot_sha256 is None):
            raise HTTPException(422, f"entry {e.key}: give both aot_size and aot_sha256, or neither")
        aot_sha = None
        if e.aot_size is not None:
            aot_path = f"{env.namespace}/{e.key}{AOT_SUFFIX}"
            try:
                aot_size = store.size(aot_path)
            except FileNotFoundError:
                raise HTTPException(422, f"stored executable of {e.key} is not in storage: write it first") from None
            if aot_size != e.aot_size:
                raise HTTPException(422, f"stored executable of {e.key} is {aot_size} bytes in storage, "
                                         f"not {e.aot_size}")
            aot_sha = _storage_sha256(store, aot_path)
            if aot_sha != e.aot_sha256:
                raise HTTPException(422, f"stored executable of {e.key} has sha256 {aot_sha} in storage, "
                                         f"not the {e.aot_sha256} sent")
        new.append(NewEntry(key=e.key, module=parsed.module, size=e.size, sha256=stored_sha, origin=e.origin,
                            compile_time_ms=e.compile_time_ms, function=e.function, bucket=e.bucket,
                            warm_run_id=body.warm_run_id, aot_size=e.aot_size, aot_sha256=aot_sha))
    if body.warm_run_id is not None:
        run = warm_runs.get_run(state.index, body.warm_run_id)
        if run.environment_id != env.id:
            raise HTTPException(422, f"warm run {body.warm_run_id} belongs to another environment")
    known = state.index.entry_keys(env.id)
    changed = [n for n in new if n.key in known and known[n.key] != (n.size, n.sha256)]
    if changed and not replace:
        raise HTTPException(409, f"entry {changed[0].key} is already recorded with other bytes "
                                 f"(sha256 {known[changed[0].key][1][:16]}): entries are immutable; "
                                 f"an admin may replace it with {OVERWRITE_HEADER}: true")
    inserted, updated = state.index.upsert_entries(env.id, new)
    for n in changed:
        state.index.audit("entry-overwrite", cache=cache, entries=1, nbytes=n.size,
                          who=f"token {current_token(request).name}",
                          details={"environment": env.digest, "key": n.key, "old_sha256": known[n.key][1],
                                   "new_sha256": n.sha256, "old_size": known[n.key][0], "via": "register"})
    return ok({"inserted": inserted, "updated": updated})


def _storage_sha256(store: Any, path: str) -> str:
    digest = hashlib.sha256()
    with store.open(path, "rb") as fh:
        while block := fh.read(CHUNK):
            digest.update(block)
    return digest.hexdigest()
