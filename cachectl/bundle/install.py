"""`cachectl bundle install`: verified into a staging directory, then renamed into place and indexed."""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import tarfile
import tempfile
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import IO, Any

from cachectl import ingest, signing
from cachectl.bundle.format import (
    _CHUNK,
    FILES,
    META,
    ORIGIN,
    STAGING_DIR,
    BadBundle,
    InstallResult,
    _entries,
    _meta,
    _open,
    _write_all,
)
from cachectl.context import Context
from cachectl.entries import (
    AOT_SUFFIX,
    CACHE_SUFFIX,
    ENV_FILE,
    MAX_KEY_LENGTH,
    is_key,
    parse_entry_filename,
)
from cachectl.errors import BadInput, EnvironmentMismatch, NotFound
from cachectl.fingerprint import Environment
from cachectl.index import CacheInfo, NewEntry
from cachectl.permissions import check_writer

# --------------------------------------------------------------------------- install


def environment_diff(here: Environment, bundled: dict[str, Any]) -> list[str]:
    """'field: X here, Y in the bundle' for every differing fingerprint field."""
    mine = here.to_dict()
    return [
        f"{k}: {mine.get(k)!r} here, {bundled.get(k)!r} in the bundle"
        for k in sorted(set(mine) | set(bundled))
        if mine.get(k) != bundled.get(k)
    ]


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
_IN_FLIGHT_MAX = (
    4 << 20
)  # bytes read but not yet written: more costs fresh pages (64 MiB: 596 vs 362 ms)


def _write_hashed(dest: Path, data: bytes) -> tuple[int, str]:
    """Write ``data`` to a new file and return its size and sha256 (in a worker: both release the GIL).
    Each 64 KiB piece is hashed right after it is written, while it is still in the CPU's cache."""
    digest = hashlib.sha256()
    view = memoryview(data)
    fd = os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        for i in range(0, len(view), _PIECE):
            piece = view[i : i + _PIECE]
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


def _extract(
    path: Path,
    tar: tarfile.TarFile,
    first: tarfile.TarInfo | None,
    expected: dict[str, tuple[int, str]],
    staging: Path,
) -> None:
    """Every member into ``staging``, each checked against the content list; BadBundle at the first
    that is not listed, repeated, not a file, or whose size or sha256 differ. Decompressing runs here
    while worker threads hash and write the members read before."""
    seen: set[str] = set()
    pending: list[tuple[str, tuple[int, str], Future[tuple[int, str]]]] = []
    in_flight = 0

    def settle() -> int:
        name, want, done = pending.pop(0)
        if done.result() != want:
            raise BadBundle(
                f"{path}: {name} does not match its sha256 in the content list "
                "(tampered or damaged): nothing installed"
            )
        return want[0]

    member = first
    with ThreadPoolExecutor(max_workers=_WORKERS, thread_name_prefix="cachectl-bundle") as pool:
        while member is not None:
            if not member.name.startswith(FILES):
                raise BadBundle(f"{path}: unexpected member {member.name!r}: nothing installed")
            name = member.name[len(FILES) :]
            if name not in expected or "/" in name or name in (".", ".."):
                raise BadBundle(
                    f"{path}: {member.name} is not in the bundle's content list: nothing installed"
                )
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
        raise BadBundle(
            f"{path}: {len(missing)} file(s) of the content list are missing ({missing[0]}, ...): "
            "nothing installed"
        )


def _check_meta(
    path: Path, meta: dict[str, Any], expected: dict[str, tuple[int, str]]
) -> Environment:
    try:
        env = Environment.from_dict(meta["environment"])
    except (ValueError, TypeError, KeyError) as exc:
        raise BadBundle(f"{path}: bad environment in {META} ({exc})") from exc
    if env.digest != meta["digest"] or meta["content"].get("environment") != env.digest:
        raise BadBundle(
            f"{path}: the environment's digest does not match its fields: nothing installed"
        )
    if env.namespace != meta["namespace"]:
        raise BadBundle(f"{path}: namespace {meta['namespace']!r} is not the environment's")
    if ENV_FILE not in expected:
        raise BadBundle(f"{path}: the content list has no {ENV_FILE}")
    try:
        entries = _entries(meta)
    except (TypeError, AttributeError) as exc:
        raise BadBundle(f"{path}: bad entry list in {META} ({exc}): nothing installed") from None
    for e in entries:
        # Before anything is written (an environment row, a staged file): a key JAX cannot have
        # made was an AssertionError after the environment was created.
        if not is_key(e.key):
            raise BadBundle(
                f"{path}: entry {str(e.key)[:80]!r} is not a JAX cache key (<module>-<64 hex "
                f"digits>, at most {MAX_KEY_LENGTH} bytes): nothing installed"
            )
        if expected.get(e.key + CACHE_SUFFIX) != (e.size, e.sha256):
            raise BadBundle(f"{path}: entry {e.key} disagrees with the content list")
        if e.aot_sha256 and expected.get(e.key + AOT_SUFFIX) != (e.aot_size, e.aot_sha256):
            raise BadBundle(f"{path}: the executable of {e.key} disagrees with the content list")
    return env


def install(
    ctx: Context,
    path: str | os.PathLike[str],
    *,
    cache: CacheInfo | None = None,
    dry_run: bool = False,
) -> InstallResult:
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
            raise EnvironmentMismatch(
                f"bundle {p.name} was made for another environment: " + "; ".join(diff)
            )
        signer = None
        if signed is not None:
            if signed.get("content") != meta["content"]:
                raise signing.Untrusted(
                    f"bundle {p.name}: its signature covers another content list: nothing installed"
                )
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
            return _commit(
                ctx, cache, store, env, meta, signed, staging, p, signer, started, dry_run
            )
        finally:
            shutil.rmtree(staging, ignore_errors=True)
            if store.is_local:
                with contextlib.suppress(
                    OSError
                ):  # only when empty: another install may be staging
                    os.rmdir(Path(store.url_for(STAGING_DIR)))


def _commit(
    ctx: Context,
    cache: CacheInfo,
    store: Any,
    env: Environment,
    meta: dict[str, Any],
    signed: dict[str, Any] | None,
    staging: Path,
    path: Path,
    signer: str | None,
    started: float,
    dry_run: bool,
) -> InstallResult:
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
    new_aot = [
        e for e in entries if e.aot_sha256 and e.key not in conflicts and e.key not in present_aot
    ]
    already = len(entries) - len(new) - len(conflicts)
    # The sizes staging verified (each file against the content list, the list against the rows).
    nbytes = sum(e.size for e in new) + sum(int(e.aot_size or 0) for e in new_aot)
    notes: list[str] = []
    if dry_run:
        return InstallResult(
            str(path),
            cache.name,
            env.digest,
            ns,
            store.url_for(ns),
            len(entries),
            sum(1 for e in entries if e.aot_sha256),
            len(new),
            already,
            conflicts,
            nbytes,
            signer,
            time.monotonic() - started,
            True,
            notes,
        )
    # Every file was verified against the content list (size, sha256 computed here) while staging.
    info = ctx.index.ensure_environment(cache.name, env)
    new_keys, by_aot = {e.key for e in new}, {e.key for e in new_aot}
    objects = []
    for e in entries:
        if e.key in conflicts or (e.key not in new_keys and e.key not in by_aot):
            continue
        parsed = parse_entry_filename(e.key + CACHE_SUFFIX)
        assert parsed is not None
        row = NewEntry(
            key=e.key,
            module=parsed.module,
            size=e.size,
            sha256=e.sha256,
            origin=ORIGIN,
            compile_time_ms=e.compile_time_ms,
            function=e.function,
            bucket=e.bucket,
            aot_size=e.aot_size if e.key in by_aot else None,
            aot_sha256=e.aot_sha256 if e.key in by_aot else None,
        )
        objects.append(
            ingest.NewObject(
                row,
                staging / (e.key + CACHE_SUFFIX) if e.key in new_keys else None,
                staging / (e.key + AOT_SUFFIX) if e.key in by_aot else None,
            )
        )
    published = ingest.publish(ctx.index, cache, env, info.id, store, objects, staging=staging)
    if published.failed:  # indexed what was written; the first failure is the command's
        raise next(iter(published.failed.values()))[1]
    if signed is not None and hasattr(ctx.index, "set_content_signature"):
        # The bundle's signed list is the namespace's when the namespace now holds exactly it.
        if signing.namespace_content(ctx.index, info) == meta["content"]:
            ctx.index.set_content_signature(info.id, signed)
        else:
            notes.append(
                "the namespace holds more than the bundle: its signed content list was not replaced"
            )
    duration = time.monotonic() - started
    ctx.index.audit(
        "bundle-install",
        cache=cache.name,
        entries=len(new),
        nbytes=nbytes,
        duration_ms=int(duration * 1000),
        details={
            "environment": env.digest,
            "bundle": str(path),
            "conflicts": len(conflicts),
            "signed_by": signer,
        },
    )
    return InstallResult(
        str(path),
        cache.name,
        env.digest,
        ns,
        store.url_for(ns),
        len(entries),
        sum(1 for e in entries if e.aot_sha256),
        len(new),
        already,
        conflicts,
        nbytes,
        signer,
        duration,
        False,
        notes,
    )
