"""Bundles: one file holding a namespace, for images and clusters without bucket credentials.

``cachectl bundle create`` writes a zstd-compressed tar stream:

1. ``bundle.json``: format, the environment (fields and digest), the cache it came
   from, the index rows (function, bucket, sizes, sha256, compile times) and the
   content list (every file with its size and sha256, signing.content_list);
2. ``signature.json`` when made with a signing key: the content list signed;
3. ``files/env.json``, ``files/<key>-cache``, ``files/<key>-aot``.

Entries are compressed by JAX already, so they are stored in raw zstd blocks (no second
compression); the rest is compressed at ``--level``. Any zstd decoder reads the stream.

``cachectl bundle install`` checks the environment against this machine (exit 3
with the differing fields), the signature when the target cache trusts keys,
then extracts into a staging directory verifying every size and sha256 against
the list (a file not listed, a missing one or a changed byte refuses the whole
bundle, exit 2), and only then moves the files into the namespace (a fresh
local namespace is one directory rename) and indexes them (origin ``bundle``).
A refused bundle leaves nothing behind.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tarfile
import tempfile
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import IO, Any

from cachectl import ingest, signing
from cachectl.context import Context
from cachectl.entries import AOT_SUFFIX, CACHE_SUFFIX, ENV_FILE, parse_entry_filename
from cachectl.errors import BadInput, EnvironmentMismatch, NotFound, OperationFailed
from cachectl.fingerprint import Environment
from cachectl.index import CacheInfo, EnvironmentInfo, NewEntry
from cachectl.manifest import load_manifest
from cachectl.permissions import check_writer

FORMAT = "cachectl-bundle/1"
META = "bundle.json"
SIGNATURE = "signature.json"
FILES = "files/"
ORIGIN = "bundle"
STAGING_DIR = ".staging"
_CHUNK = 1 << 20


class BadBundle(BadInput):
    """A bundle that is not one, or whose files do not match its content list."""


@dataclass(frozen=True)
class BundleEntry:
    key: str
    function: str | None
    bucket: dict[str, Any] | None
    size: int
    sha256: str
    compile_time_ms: int | None
    aot_size: int | None
    aot_sha256: str | None


@dataclass(frozen=True)
class BundleInfo:
    """What `bundle create` wrote and `bundle ls` shows."""

    path: str
    environment: dict[str, Any]
    digest: str
    namespace: str
    source_cache: str | None
    created_at: str
    entries: list[BundleEntry]
    files: int
    content_bytes: int
    bundle_bytes: int
    signed_by: str | None
    duration_s: float = 0.0
    dry_run: bool = False


@dataclass(frozen=True)
class InstallResult:
    path: str
    cache: str
    digest: str
    namespace: str
    dest: str
    entries: int
    executables: int
    installed: int
    already_present: int
    conflicts: list[str]
    bytes: int
    signed_by: str | None
    duration_s: float
    dry_run: bool
    notes: list[str] = field(default_factory=list)


# --------------------------------------------------------------------------- create


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _resolve_env(ctx: Context, cache: CacheInfo, env: str | None) -> EnvironmentInfo:
    if env:
        return ctx.index.find_environment(cache.name, env)
    here = ctx.environment()
    try:
        return ctx.index.get_environment(cache.name, here.digest)
    except NotFound:
        raise NotFound(f"cache {cache.name!r} has no namespace for this machine's environment "
                       f"{here.digest[:16]}: warm it first, or pass --env DIGEST (see `cachectl ls`)") from None


def _signer(signed: dict[str, Any] | None) -> str | None:
    return signing.key_id(str(signed["key"])) if signed and signed.get("key") else None


def _tarinfo(name: str, size: int, mtime: float) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.size, info.mtime, info.mode = size, int(mtime), 0o644
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    return info


# JAX writes entries zstd- or zlib-compressed already (DESIGN.md §1): compressing them again costs
# most of a bundle's time and saves nothing. They go into the zstd stream as raw blocks: a standard
# zstd frame (magic, descriptor, a 128 KiB window) whose blocks hold the bytes as they are, which every
# zstd decoder reads, so bundles stay cachectl-bundle/1 for older versions. Metadata and stored
# executables go through the compressor.
_RAW_FRAME = b"\x28\xb5\x2f\xfd\x00\x38"  # magic; no size, checksum or dictionary; window 2^17
_RAW_BLOCK = 128 << 10  # the largest block a 128 KiB window allows
_LAST_EMPTY_BLOCK = b"\x01\x00\x00"
_READ_AHEAD = 3  # files read and hashed ahead of the writer: more holds fresh pages (8: 265 vs 220 ms)


def _block_header(size: int) -> bytes:
    return (size << 3).to_bytes(3, "little")  # not the last block, type raw


def _write_all(fd: int, bufs: list[bytes | memoryview]) -> None:
    """os.writev until everything is written (a write may be short)."""
    while bufs:
        n = os.writev(fd, bufs[:1024])
        while bufs and n >= len(bufs[0]):
            n -= len(bufs[0])
            bufs.pop(0)
        if n:
            bufs[0] = memoryview(bufs[0])[n:]


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

    def _end_frame(self) -> None:
        if self._cobj is not None:
            _write_all(self._fd, [self._cobj.flush()])
            self._cobj = None
        if self._raw:
            _write_all(self._fd, [_LAST_EMPTY_BLOCK])
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
                    block = view[i:i + _RAW_BLOCK]
                    bufs += [_block_header(len(block)), block]
            _write_all(self._fd, bufs)
            return
        if self._cobj is None:
            self._end_frame()
            self._cobj = self._cctx.compressobj()
        out = b"".join(self._cobj.compress(p) for p in parts)
        if out:
            _write_all(self._fd, [out])

    def member(self, info: tarfile.TarInfo, data: bytes, *, raw: bool = False) -> None:
        header = info.tobuf(tarfile.PAX_FORMAT, "utf-8", "surrogateescape")
        self._write([header, data, b"\0" * (-len(data) % tarfile.BLOCKSIZE)], raw)

    def close(self) -> None:
        """The end-of-archive blocks, padded to a whole tar record as tarfile does; the last frame."""
        end = 2 * tarfile.BLOCKSIZE
        self._write([b"\0" * (end + (-(self._offset + end) % tarfile.RECORDSIZE))], False)
        self._end_frame()


@dataclass(frozen=True)
class _Read:
    data: bytes
    sha256: str


def _read_verified(store: Any, ns: str, files: list[tuple[str, int, str]]) -> Iterator[_Read | None]:
    """Each file's bytes and sha256 (None when storage lacks it), in order, read and hashed in
    threads ahead of the caller (hashlib and file reads release the GIL) so hashing overlaps writing."""
    def read(name: str) -> _Read | None:
        try:
            data = store.read_bytes(f"{ns}/{name}")
        except FileNotFoundError:
            return None
        return _Read(data, hashlib.sha256(data).hexdigest())

    with ThreadPoolExecutor(max_workers=2, thread_name_prefix="cachectl-bundle") as pool:
        pending: list[Future[_Read | None]] = []
        try:
            for name, _, _ in files:
                pending.append(pool.submit(read, name))
                if len(pending) >= _READ_AHEAD:
                    yield pending.pop(0).result()
            while pending:
                yield pending.pop(0).result()
        finally:
            for f in pending:
                f.cancel()


def create(ctx: Context, output: str | os.PathLike[str], *, cache: CacheInfo | None = None,
           env: str | None = None, manifest: str | None = None, sign_key: str | None = None,
           level: int = 3, dry_run: bool = False) -> BundleInfo:
    """Write one namespace (this machine's, or ``env``'s) as a bundle file at ``output``.

    With ``manifest`` the manifest's ``cache:`` picks the cache (else the global one) and the
    namespace is this machine's. Every file is checked against the index's sha256 first.
    """
    started = time.monotonic()
    if manifest is not None and env is not None:
        raise BadInput("give --manifest or --env, not both")
    if cache is None and manifest is not None:
        m = load_manifest(manifest)
        cache = ctx.cache(getattr(m, "cache", None) or None)
    cache = cache or ctx.cache()
    out = Path(output).expanduser().absolute()
    if not out.parent.is_dir():
        raise BadInput(f"-o {out}: {out.parent} is not a directory")
    if out.is_dir():
        raise BadInput(f"-o {out} is a directory: give a file name such as cache.tar.zst")
    key = signing.signing_key(sign_key)
    info = _resolve_env(ctx, cache, env)
    store = ctx.store(cache)
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
            files.append((e.key + AOT_SUFFIX, int(e.aot_size or 0), e.aot_sha256))
        entries.append(BundleEntry(e.key, e.function, e.bucket, e.size, e.sha256, e.compile_time_ms,
                                   e.aot_size, e.aot_sha256))
    content = signing.content_list(info.digest, files)
    created_at = datetime.now(UTC)
    meta = {"format": FORMAT, "created_at": created_at.isoformat(), "cache": cache.name,
            "environment": info.environment.to_dict(), "digest": info.digest, "namespace": ns,
            "entries": [e.__dict__ for e in entries], "content": content}
    content_bytes = sum(s for _, s, _ in files)
    signed = signing.sign(key, content) if key else None
    if signed is None and hasattr(ctx.index, "content_signature"):
        # No key here: carry the namespace's own signature when it covers exactly this content.
        existing = ctx.index.content_signature(info.id)
        if existing and existing.get("content") == content:
            signed = existing
    if dry_run:
        return BundleInfo(str(out), meta["environment"], info.digest, ns, cache.name, meta["created_at"],
                          entries, len(files), content_bytes, 0, _signer(signed),
                          time.monotonic() - started, True)

    tmp = out.with_name(f".{out.name}.tmp-{uuid.uuid4().hex[:8]}")
    mtime = created_at.timestamp()
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            writer = _BundleWriter(fd, level)
            blob = json.dumps(meta, indent=1, sort_keys=True).encode()
            writer.member(_tarinfo(META, len(blob), mtime), blob)
            if signed:
                sig = json.dumps(signed, indent=1, sort_keys=True).encode()
                writer.member(_tarinfo(SIGNATURE, len(sig), mtime), sig)
            writer.member(_tarinfo(FILES + ENV_FILE, len(env_json), mtime), env_json)
            for (name, size, sha), data in zip(files[1:], _read_verified(store, ns, files[1:]), strict=True):
                if data is None:
                    raise OperationFailed(f"{store.url_for(ns + '/' + name)} is in the index but not in "
                                          "storage: run `cachectl sync`, then bundle again")
                if len(data.data) != size or data.sha256 != sha:
                    raise OperationFailed(f"{store.url_for(ns + '/' + name)} differs from the index "
                                          "(sha256): run `cachectl verify`; nothing was bundled")
                writer.member(_tarinfo(FILES + name, size, mtime), data.data, raw=name.endswith(CACHE_SUFFIX))
            writer.close()
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, out)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return BundleInfo(str(out), meta["environment"], info.digest, ns, cache.name, meta["created_at"], entries,
                      len(files), content_bytes, out.stat().st_size, _signer(signed),
                      time.monotonic() - started, False)


# --------------------------------------------------------------------------- reading


@contextmanager
def _open(path: Path) -> Iterator[tarfile.TarFile]:
    import zstandard

    try:
        fh: IO[bytes] = open(path, "rb")  # noqa: SIM115 - closed by the with below
    except OSError as exc:
        raise BadInput(f"bundle {path}: {exc.strerror or exc}") from exc
    with fh:
        magic = fh.read(4)
        fh.seek(0)
        if magic != b"\x28\xb5\x2f\xfd":
            raise BadBundle(f"{path} is not a cachectl bundle (not zstd-compressed)")
        reader = zstandard.ZstdDecompressor().stream_reader(fh, read_across_frames=True)
        try:
            with tarfile.open(fileobj=reader, mode="r|") as tar:
                yield tar
        except (tarfile.TarError, zstandard.ZstdError, EOFError) as exc:
            raise BadBundle(f"{path}: damaged bundle ({exc})") from exc


def _read_json(tar: tarfile.TarFile, member: tarfile.TarInfo, path: Path) -> dict[str, Any]:
    fh = tar.extractfile(member)
    if fh is None or member.size > 256 << 20:
        raise BadBundle(f"{path}: {member.name} is not a regular file")
    try:
        data = json.loads(fh.read())
    except ValueError as exc:
        raise BadBundle(f"{path}: {member.name} is not JSON ({exc})") from exc
    if not isinstance(data, dict):
        raise BadBundle(f"{path}: {member.name} is not a JSON object")
    return data


def _meta(path: Path, tar: tarfile.TarFile) -> tuple[dict[str, Any], dict[str, Any] | None, tarfile.TarInfo | None]:
    """bundle.json, signature.json (or None), and the first file member (or None)."""
    first = tar.next()
    if first is None or first.name != META:
        raise BadBundle(f"{path} is not a cachectl bundle: its first member is not {META}")
    meta = _read_json(tar, first, path)
    if meta.get("format") != FORMAT:
        raise BadBundle(f"{path}: unknown bundle format {meta.get('format')!r} (this cachectl reads {FORMAT})")
    for field_name in ("environment", "digest", "namespace", "entries", "content"):
        if field_name not in meta:
            raise BadBundle(f"{path}: {META} lacks {field_name!r}")
    member = tar.next()
    signed = None
    if member is not None and member.name == SIGNATURE:
        signed = _read_json(tar, member, path)
        member = tar.next()
    return meta, signed, member


def _entries(meta: dict[str, Any]) -> list[BundleEntry]:
    names = {f.name for f in BundleEntry.__dataclass_fields__.values()}
    return [BundleEntry(**{k: v for k, v in e.items() if k in names}) for e in meta["entries"]]


def describe(path: str | os.PathLike[str]) -> BundleInfo:
    """`bundle ls`: what a bundle holds (reads only its first members)."""
    p = Path(path).expanduser().absolute()
    with _open(p) as tar:
        meta, signed, _ = _meta(p, tar)
    files = signing.files_of(meta["content"])
    return BundleInfo(str(p), meta["environment"], meta["digest"], meta["namespace"], meta.get("cache"),
                      meta.get("created_at", ""), _entries(meta), len(files), sum(s for s, _ in files.values()),
                      p.stat().st_size, signing.key_id(signed["key"]) if signed and signed.get("key") else None)


# --------------------------------------------------------------------------- install


def environment_diff(here: Environment, bundled: dict[str, Any]) -> list[str]:
    """'field: X here, Y in the bundle' for every differing fingerprint field."""
    mine = here.to_dict()
    return [f"{k}: {mine.get(k)!r} here, {bundled.get(k)!r} in the bundle"
            for k in sorted(set(mine) | set(bundled)) if mine.get(k) != bundled.get(k)]


def _staging_dir(store: Any, ns: str) -> Path:
    """Where files are verified before anything is visible: beside the namespace on local disk
    (so a rename moves them into place), else a local temporary directory."""
    if store.is_local:
        root = Path(store.url_for(STAGING_DIR))
        root.mkdir(parents=True, exist_ok=True, mode=0o700)
        return Path(tempfile.mkdtemp(prefix="bundle-", dir=root))
    return Path(tempfile.mkdtemp(prefix="cachectl-bundle-"))


_WORKERS = 2  # threads hashing and writing members while the main thread decompresses
_PIECE = 64 << 10
_IN_MEMORY_MAX = 16 << 20  # members up to this size are hashed and written in a worker thread
_IN_FLIGHT_MAX = 4 << 20  # bytes read but not yet written: more costs fresh pages (64 MiB: 596 vs 362 ms)


def _write_hashed(dest: Path, data: bytes) -> tuple[int, str]:
    """Write ``data`` to a new file and return its size and sha256 (in a worker: both release the GIL).
    Each 64 KiB piece is hashed right after it is written, while it is still in the CPU's cache."""
    digest = hashlib.sha256()
    view = memoryview(data)
    fd = os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        for i in range(0, len(view), _PIECE):
            piece = view[i:i + _PIECE]
            _write_all(fd, [piece])
            digest.update(piece)
    finally:
        os.close(fd)
    return len(data), digest.hexdigest()


def _stream_hashed(src: IO[bytes], dest: Path) -> tuple[int, str]:
    digest = hashlib.sha256()
    n = 0
    with open(dest, "wb") as dst:
        while chunk := src.read(_CHUNK):
            digest.update(chunk)
            dst.write(chunk)
            n += len(chunk)
    return n, digest.hexdigest()


def _extract(path: Path, tar: tarfile.TarFile, first: tarfile.TarInfo | None,
             expected: dict[str, tuple[int, str]], staging: Path) -> None:
    """Every member into ``staging``, each checked against the content list; BadBundle at the first
    that is not listed, repeated, not a file, or whose size or sha256 differ. Decompressing runs here
    while worker threads hash and write the members read before."""
    seen: set[str] = set()
    pending: list[tuple[str, tuple[int, str], Future[tuple[int, str]]]] = []
    in_flight = 0

    def settle() -> int:
        name, want, done = pending.pop(0)
        if done.result() != want:
            raise BadBundle(f"{path}: {name} does not match its sha256 in the content list "
                            "(tampered or damaged): nothing installed")
        return want[0]

    member = first
    with ThreadPoolExecutor(max_workers=_WORKERS, thread_name_prefix="cachectl-bundle") as pool:
        while member is not None:
            if not member.name.startswith(FILES):
                raise BadBundle(f"{path}: unexpected member {member.name!r}: nothing installed")
            name = member.name[len(FILES):]
            if name not in expected or "/" in name or name in (".", ".."):
                raise BadBundle(f"{path}: {member.name} is not in the bundle's content list: nothing installed")
            if name in seen:
                raise BadBundle(f"{path}: {member.name} appears twice: nothing installed")
            if not member.isfile():
                raise BadBundle(f"{path}: {member.name} is not a regular file: nothing installed")
            src = tar.extractfile(member)
            assert src is not None
            if member.size <= _IN_MEMORY_MAX:
                done = pool.submit(_write_hashed, staging / name, src.read())
            else:
                done = Future()
                done.set_result(_stream_hashed(src, staging / name))
            pending.append((member.name, expected[name], done))
            in_flight += member.size
            while in_flight > _IN_FLIGHT_MAX:
                in_flight -= settle()
            seen.add(name)
            member = tar.next()
        while pending:
            settle()
    missing = sorted(set(expected) - seen)
    if missing:
        raise BadBundle(f"{path}: {len(missing)} file(s) of the content list are missing ({missing[0]}, ...): "
                        "nothing installed")


def _check_meta(path: Path, meta: dict[str, Any], expected: dict[str, tuple[int, str]]) -> Environment:
    try:
        env = Environment.from_dict(meta["environment"])
    except (ValueError, TypeError, KeyError) as exc:
        raise BadBundle(f"{path}: bad environment in {META} ({exc})") from exc
    if env.digest != meta["digest"] or meta["content"].get("environment") != env.digest:
        raise BadBundle(f"{path}: the environment's digest does not match its fields: nothing installed")
    if env.namespace != meta["namespace"]:
        raise BadBundle(f"{path}: namespace {meta['namespace']!r} is not the environment's")
    if ENV_FILE not in expected:
        raise BadBundle(f"{path}: the content list has no {ENV_FILE}")
    for e in _entries(meta):
        if expected.get(e.key + CACHE_SUFFIX) != (e.size, e.sha256):
            raise BadBundle(f"{path}: entry {e.key} disagrees with the content list")
        if e.aot_sha256 and expected.get(e.key + AOT_SUFFIX) != (e.aot_size, e.aot_sha256):
            raise BadBundle(f"{path}: the executable of {e.key} disagrees with the content list")
    return env


def install(ctx: Context, path: str | os.PathLike[str], *, cache: CacheInfo | None = None,
            dry_run: bool = False) -> InstallResult:
    """Verify a bundle completely, then move its files into place and index them."""
    started = time.monotonic()
    p = Path(path).expanduser().absolute()
    if not p.is_file():
        raise BadInput(f"bundle {p} is not a file")
    cache = cache or ctx.cache()
    with _open(p) as tar:
        meta, signed, first = _meta(p, tar)
        expected = signing.files_of(meta["content"])
        env = _check_meta(p, meta, expected)
        here = ctx.environment()
        if here.digest != env.digest:
            diff = environment_diff(here, meta["environment"])
            raise EnvironmentMismatch(f"bundle {p.name} was made for another environment: " + "; ".join(diff))
        signer = None
        if signed is not None:
            if signed.get("content") != meta["content"]:
                raise signing.Untrusted(f"bundle {p.name}: its signature covers another content list: nothing installed")
            signer = signing.key_id(str(signed.get("key", ""))) if signed.get("key") else None
        if signed is not None:  # a signature present must verify, trusted or not
            signing.verify(signed, [str(signed.get("key", ""))], f"bundle {p.name}")
        if cache.trusted_keys:
            signing.verify(signed, cache.trusted_keys, f"bundle {p.name}")
        if not dry_run:
            check_writer(cache, "install a bundle into")
        store = ctx.store(cache)
        ns = env.namespace
        staging = _staging_dir(store, ns)
        try:
            _extract(p, tar, first, expected, staging)
            return _commit(ctx, cache, store, env, meta, signed, staging, p, signer, started, dry_run)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
            if store.is_local:
                with contextlib.suppress(OSError):  # only when empty: another install may be staging
                    os.rmdir(Path(store.url_for(STAGING_DIR)))


def _commit(ctx: Context, cache: CacheInfo, store: Any, env: Environment, meta: dict[str, Any],
            signed: dict[str, Any] | None, staging: Path, path: Path, signer: str | None, started: float,
            dry_run: bool) -> InstallResult:
    ns = env.namespace
    entries = _entries(meta)
    try:
        info = ctx.index.get_environment(cache.name, env.digest)
        present = ctx.index.entry_keys(info.id)
        present_aot = ctx.index.aot_keys(info.id)
    except NotFound:
        info, present, present_aot = None, {}, {}
    conflicts = sorted(e.key for e in entries if e.key in present and present[e.key][1] != e.sha256)
    new = [e for e in entries if e.key not in present]
    new_aot = [e for e in entries if e.aot_sha256 and e.key not in conflicts and e.key not in present_aot]
    already = len(entries) - len(new) - len(conflicts)
    # The sizes staging verified (each file against the content list, the list against the rows).
    nbytes = sum(e.size for e in new) + sum(int(e.aot_size or 0) for e in new_aot)
    notes: list[str] = []
    if dry_run:
        return InstallResult(str(path), cache.name, env.digest, ns, store.url_for(ns), len(entries),
                             sum(1 for e in entries if e.aot_sha256), len(new), already, conflicts, nbytes,
                             signer, time.monotonic() - started, True, notes)
    # Every file was verified against the content list (size, sha256 computed here) while staging.
    info = ctx.index.ensure_environment(cache.name, env)
    new_keys, by_aot = {e.key for e in new}, {e.key for e in new_aot}
    objects = []
    for e in entries:
        if e.key in conflicts or (e.key not in new_keys and e.key not in by_aot):
            continue
        parsed = parse_entry_filename(e.key + CACHE_SUFFIX)
        assert parsed is not None
        row = NewEntry(key=e.key, module=parsed.module, size=e.size, sha256=e.sha256, origin=ORIGIN,
                       compile_time_ms=e.compile_time_ms, function=e.function, bucket=e.bucket,
                       aot_size=e.aot_size if e.key in by_aot else None,
                       aot_sha256=e.aot_sha256 if e.key in by_aot else None)
        objects.append(ingest.NewObject(row, staging / (e.key + CACHE_SUFFIX) if e.key in new_keys else None,
                                        staging / (e.key + AOT_SUFFIX) if e.key in by_aot else None))
    published = ingest.publish(ctx.index, cache, env, info.id, store, objects, staging=staging)
    if published.failed:  # indexed what was written; the first failure is the command's
        raise next(iter(published.failed.values()))[1]
    if signed is not None and hasattr(ctx.index, "set_content_signature"):
        # The bundle's signed list is the namespace's when the namespace now holds exactly it.
        if signing.namespace_content(ctx.index, info) == meta["content"]:
            ctx.index.set_content_signature(info.id, signed)
        else:
            notes.append("the namespace holds more than the bundle: its signed content list was not replaced")
    duration = time.monotonic() - started
    ctx.index.audit("bundle-install", cache=cache.name, entries=len(new), nbytes=nbytes,
                    duration_ms=int(duration * 1000),
                    details={"environment": env.digest, "bundle": str(path), "conflicts": len(conflicts),
                             "signed_by": signer})
    return InstallResult(str(path), cache.name, env.digest, ns, store.url_for(ns), len(entries),
                         sum(1 for e in entries if e.aot_sha256), len(new), already, conflicts, nbytes, signer,
                         duration, False, notes)
