"""`cachectl bundle create`: a namespace as one zstd tar stream, entries in raw blocks, every file hashed."""

from __future__ import annotations

import hashlib
import json
import os
import tarfile
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from cachectl.bundle.format import (
    FILES,
    FORMAT,
    INLINE_MAX,
    META,
    SIGNATURE,
    BundleEntry,
    BundleInfo,
    Outcome,
    member_header,
    ran_here,
    sign_entries,
    write_all,
)
from cachectl.context import Context
from cachectl.core.errors import BadInput, NotFound, OperationFailed
from cachectl.index import CacheInfo, EnvironmentInfo
from cachectl.manifest import LoadedManifest, as_loaded
from cachectl.storage.entries import CACHE_SUFFIX, ENV_FILE, EXECUTABLE_SUFFIX
from cachectl.trust import signing

# --------------------------------------------------------------------------- create


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _resolve_env(ctx: Context, cache: CacheInfo, env: str | None) -> EnvironmentInfo:
    if env:
        return ctx.index.find_environment(cache.name, env)
    here = ctx.environment(registers=False)  # read only: nothing is recorded
    try:
        return ctx.index.get_environment(cache.name, here.digest)
    except NotFound:
        raise NotFound(
            f"cache {cache.name!r} has no namespace for this machine's environment "
            f"{here.digest[:16]}: warm it first, or pass --env DIGEST (see `cachectl ls`)"
        ) from None


def _signer(signed: dict[str, Any] | None) -> str | None:
    return signing.key_id(str(signed["key"])) if signed and signed.get("key") else None


# JAX writes entries zstd- or zlib-compressed already (docs/jax-facts.md, fact 10): compressing them again costs
# most of a bundle's time and saves nothing. They go into the zstd stream as raw blocks: a standard
# zstd frame (magic, descriptor, a 128 KiB window) whose blocks hold the bytes as they are, which every
# zstd decoder reads, so bundles stay cachectl-bundle/1 for older versions. Metadata and stored
# executables go through the compressor.
_RAW_FRAME = b"\x28\xb5\x2f\xfd\x00\x38"  # magic; no size, checksum or dictionary; window 2^17
_RAW_BLOCK = 128 << 10  # the largest block a 128 KiB window allows
_LAST_EMPTY_BLOCK = b"\x01\x00\x00"
_READ_AHEAD = 3  # read tasks ahead of the writer: more holds fresh pages (bench/fleet.py)
_BATCH_BYTES = 1 << 20  # files read by one task, up to this many bytes or _BATCH_FILES files:
_BATCH_FILES = 64  # a task per 8 KiB file cost more in handing over than in reading it
_FLUSH = 1 << 20  # bytes the writer gathers for one writev


def _block_header(size: int) -> bytes:
    return (size << 3).to_bytes(3, "little")  # not the last block, type raw


class _BundleWriter:
    """The bundle's tar stream, written as zstd frames straight to a file descriptor: members given
    ``raw`` in raw-block frames, the rest compressed at ``level``."""

    def __init__(self, fd: int, level: int) -> None:
        import zstandard

        self._fd = fd
        self._cctx = zstandard.ZstdCompressor(level=level)
        self._cobj: Any = None
        self._raw = False
        self._offset = 0  # bytes of tar stream so far, for the end-of-archive padding
        self._out: list[bytes | memoryview] = []  # written in one writev once _FLUSH bytes wait
        self._waiting = 0

    def _emit(self, bufs: list[bytes | memoryview]) -> None:
        self._out += bufs
        self._waiting += sum(len(b) for b in bufs)
        if self._waiting >= _FLUSH:
            self.flush()

    def flush(self) -> None:
        write_all(self._fd, self._out)
        self._out, self._waiting = [], 0

    def _end_frame(self) -> None:
        if self._cobj is not None:
            self._emit([self._cobj.flush()])
            self._cobj = None
        if self._raw:
            self._emit([_LAST_EMPTY_BLOCK])
            self._raw = False

    def _write(self, parts: list[bytes], raw: bool) -> None:
        self._offset += sum(len(p) for p in parts)
        if raw:
            if not self._raw:
                self._end_frame()
                bufs: list[bytes | memoryview] = [_RAW_FRAME]
                self._raw = True
            else:
                bufs = []
            for part in parts:
                view = memoryview(part)
                for i in range(0, len(view), _RAW_BLOCK):
                    block = view[i : i + _RAW_BLOCK]
                    bufs += [_block_header(len(block)), block]
            self._emit(bufs)
            return
        if self._cobj is None:
            self._end_frame()
            self._cobj = self._cctx.compressobj()
        out = b"".join(self._cobj.compress(p) for p in parts)
        if out:
            self._emit([out])

    def member(self, name: str, data: bytes, mtime: int, *, raw: bool = False) -> None:
        parts = [
            member_header(name, len(data), mtime),
            data,
            b"\0" * (-len(data) % tarfile.BLOCKSIZE),
        ]
        if raw and len(data) < _RAW_BLOCK // 2:  # one raw block, not three: a copy is cheaper
            parts = [b"".join(parts)]
        self._write(parts, raw)

    def close(self) -> None:
        """The end-of-archive blocks, padded to a whole tar record as tarfile does; the last frame."""
        end = 2 * tarfile.BLOCKSIZE
        self._write([b"\0" * (end + (-(self._offset + end) % tarfile.RECORDSIZE))], False)
        self._end_frame()
        self.flush()


@dataclass(frozen=True)
class _Read:
    data: bytes
    sha256: str


def _batches(files: list[tuple[str, int, str]]) -> Iterator[tuple[list[str], bool]]:
    """The files in read tasks, each with whether all of its files are small (INLINE_MAX)."""
    batch: list[str] = []
    nbytes, small = 0, True
    for name, size, _ in files:
        if batch and (nbytes + size > _BATCH_BYTES or len(batch) >= _BATCH_FILES):
            yield batch, small
            batch, nbytes, small = [], 0, True
        batch.append(name)
        nbytes += size
        small = small and size <= INLINE_MAX
    if batch:
        yield batch, small


def _read_verified(
    store: Any, ns: str, files: list[tuple[str, int, str]]
) -> Iterator[_Read | None]:
    """Each file's bytes and sha256 (None when storage lacks it), in order, read and hashed in
    threads ahead of the caller (hashlib and file reads release the GIL) so hashing overlaps writing;
    small files in batches, so handing work to a thread costs less than the work."""
    with store.dir_reader(ns) as read_in_ns:

        def read(names: list[str]) -> list[_Read | None]:
            out: list[_Read | None] = []
            for name in names:
                try:
                    data = read_in_ns(name)
                except FileNotFoundError:
                    out.append(None)
                    continue
                out.append(_Read(data, hashlib.sha256(data).hexdigest()))
            return out

        with ThreadPoolExecutor(max_workers=2, thread_name_prefix="cachectl-bundle") as pool:
            pending: list[Outcome[list[_Read | None]]] = []
            try:
                for batch, small in _batches(files):
                    # small files read here: see INLINE_MAX
                    pending.append(ran_here(read, batch) if small else pool.submit(read, batch))
                    if len(pending) >= _READ_AHEAD:
                        yield from pending.pop(0).result()
                while pending:
                    yield from pending.pop(0).result()
            finally:
                for f in pending:
                    f.cancel()


@dataclass(frozen=True)
class _Plan:
    """What a bundle holds, known before any byte of it is written."""

    cache: CacheInfo
    info: EnvironmentInfo
    env_json: bytes
    files: list[tuple[str, int, str]]  # (name, size, sha256), env.json first
    entries: list[BundleEntry]
    meta: dict[str, Any]
    signed: dict[str, Any] | None
    created_at: datetime


def create(
    ctx: Context,
    output: str | os.PathLike[str],
    *,
    cache: CacheInfo | None = None,
    env: str | None = None,
    manifest: str | LoadedManifest | None = None,
    sign_key: str | None = None,
    level: int = 3,
    dry_run: bool = False,
) -> BundleInfo:
    """Write one namespace (this machine's, or ``env``'s) as a bundle file at ``output``.

    With ``manifest`` the manifest's ``cache:`` picks the cache (else the global one) and the
    namespace is this machine's. Every file is checked against the index's sha256 first.
    """
    started = time.monotonic()
    if manifest is not None and env is not None:
        raise BadInput("give --manifest or --env, not both")
    if cache is None and manifest is not None:
        m = as_loaded(manifest).manifest
        cache = ctx.cache(m.cache or None)
    cache = cache or ctx.cache()
    out = Path(output).expanduser().absolute()
    if not out.parent.is_dir():
        raise BadInput(f"-o {out}: {out.parent} is not a directory")
    if out.is_dir():
        raise BadInput(f"-o {out} is a directory: give a file name such as cache.tar.zst")
    key = signing.signing_key(sign_key)
    plan = _plan(ctx, cache, _resolve_env(ctx, cache, env), key)
    if not dry_run:
        _write_bundle(ctx.store(cache), plan, out, level)
    return BundleInfo(
        str(out),
        plan.meta["environment"],
        plan.info.digest,
        plan.info.namespace,
        cache.name,
        plan.meta["created_at"],
        plan.entries,
        len(plan.files),
        sum(s for _, s, _ in plan.files),
        0 if dry_run else out.stat().st_size,
        _signer(plan.signed),
        time.monotonic() - started,
        dry_run,
    )


def _plan(
    ctx: Context, cache: CacheInfo, info: EnvironmentInfo, key: signing.SigningKey | None
) -> _Plan:
    """The namespace's indexed files, the bundle's metadata and the signature it carries."""
    ns = info.namespace
    rows = ctx.index.list_entries(info.id)
    if not rows:
        raise BadInput(f"namespace {ns} of cache {cache.name!r} has no entries to bundle")
    env_json = info.environment.env_json().encode()
    files: list[tuple[str, int, str]] = [(ENV_FILE, len(env_json), _sha(env_json))]
    entries = []
    for e in rows:
        files.append((e.key + CACHE_SUFFIX, e.size, e.sha256))
        if e.aot_sha256:
            files.append((e.key + EXECUTABLE_SUFFIX, int(e.aot_size or 0), e.aot_sha256))
        entries.append(
            BundleEntry(
                e.key,
                e.function,
                e.bucket,
                e.size,
                e.sha256,
                e.compile_time_ms,
                e.aot_size,
                e.aot_sha256,
            )
        )
    content = signing.content_list(info.digest, files)
    created_at = datetime.now(UTC)
    meta: dict[str, Any] = {
        "format": FORMAT,
        "created_at": created_at.isoformat(),
        "cache": cache.name,
        "environment": info.environment.to_dict(),
        "digest": info.digest,
        "namespace": ns,
        "entries": [e.__dict__ for e in entries],
        "content": content,
    }
    signed = _signature(ctx, cache, info, key, files, meta)
    return _Plan(cache, info, env_json, files, entries, meta, signed, created_at)


def _signature(
    ctx: Context,
    cache: CacheInfo,
    info: EnvironmentInfo,
    key: signing.SigningKey | None,
    files: list[tuple[str, int, str]],
    meta: dict[str, Any],
) -> dict[str, Any] | None:
    """The content list signed with ``key`` (each entry of ``meta`` signed too), or the
    namespace's own signature when it covers exactly this content; refuses what no trusted
    list signed in a cache that trusts keys."""
    content = meta["content"]
    if key is not None and cache.trusted_keys:
        # A cache that trusts keys: a signer vouches only for what a trusted list already signed.
        carried = signing.carried_files(ctx.index, cache, info, key) or {}
        unsigned = [n for n, s, h in files if n != ENV_FILE and carried.get(n) != (s, h)]
        if unsigned:
            raise signing.Untrusted(
                f"namespace {info.namespace}: {len(unsigned)} indexed file(s) no trusted key "
                f"signed (first: {unsigned[0]}): refused, nothing written; bundle create signs "
                "only what a trusted signature already lists"
            )
    signed = signing.sign(key, content) if key else None
    if key is not None and signed is not None:
        sign_entries(key, meta, signed)
    if signed is None and hasattr(ctx.index, "content_signature"):
        # No key here: carry the namespace's own signature when it covers exactly this content.
        existing = ctx.index.content_signature(info.id)
        if existing and existing.get("content") == content:
            signed = existing
    return signed


def _write_bundle(store: Any, plan: _Plan, out: Path, level: int) -> None:
    """Write the bundle to a temporary file beside ``out``, each file checked against the
    index as it is read, then rename it into place (removed on any failure)."""
    tmp = out.with_name(f".{out.name}.tmp-{uuid.uuid4().hex[:8]}")
    mtime = int(plan.created_at.timestamp())
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            writer = _BundleWriter(fd, level)
            # Compact JSON: json's C encoder; an indent takes the pure-Python one (0.25 s at 2,000 entries).
            blob = json.dumps(plan.meta, sort_keys=True, separators=(",", ":")).encode()
            writer.member(META, blob, mtime)
            if plan.signed:
                sig = json.dumps(plan.signed, sort_keys=True, separators=(",", ":")).encode()
                writer.member(SIGNATURE, sig, mtime)
            writer.member(FILES + ENV_FILE, plan.env_json, mtime)
            _write_files(writer, store, plan.info.namespace, plan.files[1:], mtime)
            writer.close()
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, out)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _write_files(
    writer: _BundleWriter, store: Any, ns: str, files: list[tuple[str, int, str]], mtime: int
) -> None:
    """Each indexed file as a member, refused unless storage holds exactly what the index says."""
    for (name, size, sha), data in zip(files, _read_verified(store, ns, files), strict=True):
        if data is None:
            raise OperationFailed(
                f"{store.url_for(ns + '/' + name)} is in the index but not in "
                "storage: run `cachectl sync`, then bundle again"
            )
        if len(data.data) != size or data.sha256 != sha:
            raise OperationFailed(
                f"{store.url_for(ns + '/' + name)} differs from the index "
                "(sha256): run `cachectl verify`; nothing was bundled"
            )
        writer.member(FILES + name, data.data, mtime, raw=name.endswith(CACHE_SUFFIX))
