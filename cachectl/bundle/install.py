"""`cachectl bundle install`: verified into a staging directory (each member by extract.py), then
renamed into place and indexed."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, NamedTuple, Protocol, cast

from cachectl.bundle.extract import extract
from cachectl.bundle.format import (
    BUNDLE_EXPANSION,
    META,
    ORIGIN,
    STAGING_DIR,
    BadBundle,
    BundleEntry,
    InstallResult,
    bundle_entries,
    content_signature,
    entries_signed,
    field_defaults,
    frozen_from,
    open_bundle,
    read_meta,
    room,
)
from cachectl.context import Context
from cachectl.core import temps
from cachectl.core.bulk_pass import bulk_pass
from cachectl.core.errors import BadInput, EnvironmentMismatch, NotFound
from cachectl.core.fingerprint import Environment
from cachectl.core.units import format_size
from cachectl.index import CacheInfo, EnvironmentInfo, NewEntry
from cachectl.lifecycle import sweep
from cachectl.storage import ingest, ingest_rules
from cachectl.storage.entries import (
    CACHE_SUFFIX,
    ENV_FILE,
    EXECUTABLE_SUFFIX,
    MAX_KEY_LENGTH,
    all_keys,
    is_key,
    parse_entry_filename,
)
from cachectl.trust import signing
from cachectl.trust.permissions import check_writer

# --------------------------------------------------------------------------- install


def environment_diff(here: Environment, bundled: dict[str, Any]) -> list[str]:
    """'field: X here, Y in the bundle' for every differing fingerprint field."""
    mine = here.to_dict()
    return [
        f"{k}: {mine.get(k)!r} here, {bundled.get(k)!r} in the bundle"
        for k in sorted(set(mine) | set(bundled))
        if mine.get(k) != bundled.get(k)
    ]


def staging_dir(store: Any, ns: str) -> Path:
    """Where files are verified before anything is visible: beside the namespace on local disk
    (so a rename moves them into place), else a local temporary directory. Its name carries this
    process's tag (``temps``): the staging directories of installs that died are removed first."""
    if store.is_local:
        root = Path(store.url_for(STAGING_DIR))
        root.mkdir(parents=True, exist_ok=True, mode=0o700)
        sweep.sweep_staging(store)
        return Path(tempfile.mkdtemp(prefix=temps.prefix(temps.STAGING_PREFIX), dir=root))
    sweep.sweep_dir(tempfile.gettempdir(), temps.LOCAL_STAGING_PREFIX)
    return Path(tempfile.mkdtemp(prefix=temps.prefix(temps.LOCAL_STAGING_PREFIX)))


_KEY_HASH = 65  # "-" and the 64 hex digits that end a JAX key (is_key)


def _check_declared(
    path: Path,
    cache: CacheInfo,
    expected: dict[str, tuple[int, str]],
    entries: list[BundleEntry],
    size: int | None = None,
) -> dict[str, str]:
    """Before anything is staged: every listed entry within the cache's max entry size, and the
    files' total within BUNDLE_EXPANSION times the bundle's size. Returns the module of each
    listed entry by file name (found once: staging and indexing look them up)."""
    # ``entries`` hold JAX keys (``_check_meta``): the module is what stands before "-<hash>",
    # as parse_key reads it, without a parse and an EntryName per entry. A content list may
    # name other entry files: parsed.
    modules = {e.key + CACHE_SUFFIX: e.key[:-_KEY_HASH] for e in entries}
    for name in expected:
        if (
            name.endswith(CACHE_SUFFIX)
            and name not in modules
            and (entry := parse_entry_filename(name)) is not None
        ):
            modules[name] = entry.module
    if cache.max_entry_size is not None:  # else no entry is too large: no call per entry
        for name in modules:
            try:
                ingest_rules.check_size(cache, name[: -len(CACHE_SUFFIX)], expected[name][0])
            except ingest_rules.Refused as exc:
                raise BadBundle(f"{path}: {exc.message}: nothing installed") from None
    declared = sum(n for n, _ in expected.values())
    own = path.stat().st_size if size is None else size
    if declared > room(path, size):
        raise BadBundle(
            f"{path}: its content list declares {format_size(declared)} of files in a "
            f"{format_size(own)} bundle (more than {BUNDLE_EXPANSION} times its size: a "
            "decompression bomb?): nothing installed"
        )
    return modules


def _check_staged_env(path: Path, staging: Path, env: Environment) -> None:
    """The staged env.json describes the bundle's environment (checked before anything is visible)."""
    try:
        data = json.loads((staging / ENV_FILE).read_bytes())
        if not isinstance(data, dict):
            raise ValueError(f"a JSON {type(data).__name__}, not an object")
        staged = Environment.from_dict(data)
    except (ValueError, TypeError, KeyError, AttributeError) as exc:
        raise BadBundle(f"{path}: its {ENV_FILE} is corrupt ({exc}): nothing installed") from None
    recorded = data.get("digest")
    if staged.digest != env.digest or (recorded is not None and recorded != staged.digest):
        raise BadBundle(
            f"{path}: its {ENV_FILE} describes environment {str(recorded or staged.digest)[:16]}, "
            f"not the bundle's {env.digest[:16]}: nothing installed"
        )


def _check_meta(
    path: Path, meta: dict[str, Any], expected: dict[str, tuple[int, str]]
) -> tuple[Environment, list[BundleEntry]]:
    """The bundle's environment and entries, each consistent with its content list."""
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
        entries = bundle_entries(meta)
    except (TypeError, AttributeError) as exc:
        raise BadBundle(f"{path}: bad entry list in {META} ({exc}): nothing installed") from None
    # Before anything is written (an environment row, a staged file): a key JAX cannot have
    # made was an AssertionError after the environment was created. All at once; one by one
    # only to name the first that is not.
    keys_ok = all_keys([e.key for e in entries])
    for e in entries:
        if not keys_ok and not is_key(e.key):
            raise BadBundle(
                f"{path}: entry {str(e.key)[:80]!r} is not a JAX cache key (<module>-<64 hex "
                f"digits>, at most {MAX_KEY_LENGTH} bytes): nothing installed"
            )
        if expected.get(e.key + CACHE_SUFFIX) != (e.size, e.sha256):
            raise BadBundle(f"{path}: entry {e.key} disagrees with the content list")
        if e.aot_sha256 and expected.get(e.key + EXECUTABLE_SUFFIX) != (e.aot_size, e.aot_sha256):
            raise BadBundle(f"{path}: the executable of {e.key} disagrees with the content list")
    return env, entries


@dataclass(frozen=True)
class _Staged:
    """A bundle verified into ``staging``: what committing it needs."""

    cache: CacheInfo
    store: Any
    env: Environment
    entries: list[BundleEntry]
    modules: dict[str, str]  # the listed entries' modules by file name (_check_declared)
    signed: dict[str, Any] | None
    signer: str | None
    staging: Path
    path: Path
    started: float
    notes: list[str]


class _Delta(NamedTuple):
    """The bundle's entries against what the namespace's index rows hold already."""

    info: EnvironmentInfo | None
    conflicts: list[str]
    new: list[BundleEntry]
    new_aot: list[BundleEntry]
    nbytes: int


def install(
    ctx: Context,
    path: str | os.PathLike[str],
    *,
    cache: CacheInfo | None = None,
    dry_run: bool = False,
) -> InstallResult:
    """Verify a bundle completely, then move its files into place and index them. It runs as a
    bulk pass (``core/bulk_pass.py``): a bundle of many small entries keeps a few objects per
    entry alive until it is indexed, and with JAX loaded one full collection in the middle costs
    as much as the whole install of thousands of entries (BENCHMARKS.md, "OCI")."""
    with bulk_pass():
        return _install(ctx, path, cache=cache, dry_run=dry_run)


class Arriving(Protocol):
    """A bundle's bytes while they still arrive (a pull's download), read as they come."""

    size: int  # the bundle's size, by its manifest

    def read(self, n: int = -1) -> bytes: ...

    def peek(self, n: int = 0) -> bytes: ...

    def finish(self) -> None:
        """Wait for the last byte; raise if the whole (not only what was read) is not what
        was announced (its digest)."""


def install_arriving(
    ctx: Context,
    path: str | os.PathLike[str],
    source: Arriving,
    *,
    cache: CacheInfo | None = None,
    dry_run: bool = False,
) -> InstallResult:
    """``install`` of a bundle read while it arrives (a pull's download), named ``path`` in
    messages: every check as for a file, and nothing is published before ``source.finish()``
    verified the whole. Where the install refuses a bundle whose whole does not verify, the
    download's error is the one raised (the cause, not a symptom)."""
    with bulk_pass():
        try:
            return _install(ctx, path, cache=cache, dry_run=dry_run, source=source)
        except Exception:
            source.finish()  # raises the download's own error, if it has one
            raise


def _install(
    ctx: Context,
    path: str | os.PathLike[str],
    *,
    cache: CacheInfo | None,
    dry_run: bool,
    source: Arriving | None = None,
) -> InstallResult:
    started = time.monotonic()
    p = Path(path).expanduser().absolute()
    if source is None and not p.is_file():
        raise BadInput(f"bundle {p} is not a file")
    size = None if source is None else source.size
    cache = cache or ctx.cache()
    with open_bundle(p, cast("IO[bytes] | None", source)) as tar:
        meta, signed, first = read_meta(p, tar, size)
        expected = signing.files_of(meta["content"])
        env, entries = _check_meta(p, meta, expected)
        here = ctx.environment()
        if here.digest != env.digest:
            diff = environment_diff(here, meta["environment"])
            raise EnvironmentMismatch(
                f"bundle {p.name} was made for another environment: " + "; ".join(diff)
            )
        signer = _check_signature(p, cache, meta, signed)
        metadata_signed = signed is None or entries_signed(signed, meta, f"bundle {p.name}")
        if not dry_run:
            check_writer(cache, "install a bundle into")
        modules = _check_declared(p, cache, expected, entries, size)
        store = ctx.store(cache)
        staging = staging_dir(store, env.namespace)
        try:
            header_ms = extract(p, tar, first, expected, staging, modules)
            _check_staged_env(p, staging, env)
            if source is not None:
                source.finish()  # the whole bundle verified before anything is visible
            notes = []
            if not metadata_signed:
                # What the signature does not cover is not written: the header's compile time
                # (read here), no function or bucket.
                entries = [
                    dataclasses.replace(
                        e, function=None, bucket=None, compile_time_ms=header_ms.get(e.key)
                    )
                    for e in entries
                ]
                notes.append(
                    "its signature does not cover the entries' function, bucket and compile time "
                    "(signed by an older cachectl, or a namespace's signature carried over): "
                    "installed without them"
                )
            staged = _Staged(
                cache, store, env, entries, modules, signed, signer, staging, p, started, notes
            )
            return _commit(ctx, staged, dry_run)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
            if store.is_local:
                with contextlib.suppress(
                    OSError
                ):  # only when empty: another install may be staging
                    os.rmdir(Path(store.url_for(STAGING_DIR)))


def _check_signature(
    path: Path, cache: CacheInfo, meta: dict[str, Any], signed: dict[str, Any] | None
) -> str | None:
    """A signature present must cover this content list and verify; a cache that trusts keys
    needs one by a trusted key. Returns the signer's key id."""
    signer = None
    if signed is not None:
        if signed.get("content") != meta["content"]:
            raise signing.Untrusted(
                f"bundle {path.name}: its signature covers another content list: nothing installed"
            )
        signer = signing.key_id(str(signed.get("key", ""))) if signed.get("key") else None
    if signed is not None:  # a signature present must verify, trusted or not
        signing.verify(signed, [str(signed.get("key", ""))], f"bundle {path.name}")
    if cache.trusted_keys:
        signing.verify(signed, cache.trusted_keys, f"bundle {path.name}")
    return signer


def _delta(ctx: Context, staged: _Staged) -> _Delta:
    """Which entries are new, which conflict, which bring a new executable, and their bytes."""
    entries = staged.entries
    info: EnvironmentInfo | None
    try:
        info = ctx.index.get_environment(staged.cache.name, staged.env.digest)
    except NotFound:
        info = None
    # The bundle's keys' rows only, not the namespace's (BENCHMARKS.md, "Planning").
    held = ctx.index.held_entries(info.id, [e.key for e in entries]) if info is not None else {}
    clash = {e.key for e in entries if e.key in held and held[e.key].sha256 != e.sha256}
    new = [e for e in entries if e.key not in held]
    new_aot = [
        e
        for e in entries
        if e.aot_sha256
        and e.key not in clash
        and ((h := held.get(e.key)) is None or h.aot_sha256 is None)
    ]
    # The sizes staging verified (each file against the content list, the list against the rows).
    nbytes = sum(e.size for e in new) + sum(int(e.aot_size or 0) for e in new_aot)
    return _Delta(info, sorted(clash), new, new_aot, nbytes)


def _commit(ctx: Context, staged: _Staged, dry_run: bool) -> InstallResult:
    """Publish the staged files that are new (entries, executables) and index them; audit it."""
    cache, env, delta = staged.cache, staged.env, _delta(ctx, staged)
    if dry_run:
        return _result(staged, delta, time.monotonic() - staged.started, True)
    # Every file was verified against the content list (size, sha256 computed here) and ingest's
    # rules while staging. The quota is checked before the environment's row is made: a refused
    # bundle leaves nothing in the index either.
    ingest.check_fits(
        ctx.index, cache, delta.info.id if delta.info is not None else None, delta.nbytes
    )
    info = ctx.index.ensure_environment(cache.name, env)
    objects = _objects(staged, delta)
    published = ingest.publish(
        ctx.index, cache, env, info.id, staged.store, objects, staging=staged.staging
    )
    if published.failed:  # indexed what was written; the first failure is the command's
        raise next(iter(published.failed.values()))[1]
    signed = staged.signed
    if signed is not None and hasattr(ctx.index, "set_content_signature"):
        # The bundle's signed list is the namespace's when the namespace now holds exactly it.
        if signing.namespace_content(ctx.index, info) == signed["content"]:
            ctx.index.set_content_signature(info.id, content_signature(signed))
        else:
            staged.notes.append(
                "the namespace holds more than the bundle: its signed content list was not replaced"
            )
    duration = time.monotonic() - staged.started
    ctx.index.audit(
        "bundle-install",
        cache=cache.name,
        entries=len(delta.new),
        nbytes=delta.nbytes,
        duration_ms=int(duration * 1000),
        details={
            "environment": env.digest,
            "bundle": str(staged.path),
            "conflicts": len(delta.conflicts),
            "signed_by": staged.signer,
        },
    )
    return _result(staged, delta, duration, False)


def _objects(staged: _Staged, delta: _Delta) -> list[ingest.NewObject]:
    """The staged files to publish: each new entry, and each new executable (beside its entry
    or one the namespace holds); never a conflicting key's."""
    new_keys, by_aot = {e.key for e in delta.new}, {e.key for e in delta.new_aot}
    conflicts = set(delta.conflicts)
    modules, into = staged.modules, f"{staged.staging}{os.sep}"
    objects = []
    for e in staged.entries:
        key = e.key
        if key in conflicts or (key not in new_keys and key not in by_aot):
            continue
        aot = key in by_aot
        # Built without the frozen dataclasses' __init__ (frozen_from): every field named,
        # the ones install does not know at their defaults.
        row = frozen_from(
            NewEntry,
            {
                **_ROW_DEFAULTS,
                "key": key,
                "module": modules[key + CACHE_SUFFIX],
                "size": e.size,
                "sha256": e.sha256,
                "origin": ORIGIN,
                "compile_time_ms": e.compile_time_ms,
                "function": e.function,
                "bucket": e.bucket,
                "aot_size": e.aot_size if aot else None,
                "aot_sha256": e.aot_sha256 if aot else None,
            },
        )
        # Paths as str: a Path per file cost more than the rest of its object (bench/oci.py).
        entry = f"{into}{key}{CACHE_SUFFIX}" if key in new_keys else None
        executable = f"{into}{key}{EXECUTABLE_SUFFIX}" if aot else None
        objects.append(
            frozen_from(
                ingest.NewObject,
                {**_OBJECT_DEFAULTS, "row": row, "entry": entry, "executable": executable},
            )
        )
    return objects


_ROW_DEFAULTS = field_defaults(NewEntry)
_OBJECT_DEFAULTS = field_defaults(ingest.NewObject)


def _result(staged: _Staged, delta: _Delta, duration: float, dry_run: bool) -> InstallResult:
    """What install reports, done or planned."""
    ns, entries = staged.env.namespace, staged.entries
    return InstallResult(
        str(staged.path),
        staged.cache.name,
        staged.env.digest,
        ns,
        staged.store.url_for(ns),
        len(entries),
        sum(1 for e in entries if e.aot_sha256),
        len(delta.new),
        len(entries) - len(delta.new) - len(delta.conflicts),
        delta.conflicts,
        delta.nbytes,
        staged.signer,
        duration,
        dry_run,
        staged.notes,
    )
