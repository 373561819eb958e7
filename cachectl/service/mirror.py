"""A verified local mirror of one namespace: `cachectl pull` and `cachectl push`.

JAX reading every entry from an object store costs a round trip per program,
and the cache is trusted: whoever can write it can run code in every process
that reads it (docs/jax-facts.md, fact 7). ``pull`` copies this environment's entries
to a local directory, but only entries the index knows whose sha256 matches
the index; anything else found in the bucket is reported, never copied.
Managed keys are path-independent (fact 1), so the mirror hits exactly what
warm wrote. ``push`` uploads what a local run wrote back to the shared
namespace, for writers only, and records it in the index.

A mirror directory holds the JAX files directly (JAX is pointed at it) plus the
``env.json`` of the environment it mirrors, so push knows where entries belong.

Stored executables (``<key>-aot``, cachectl/storage/executables.py) travel with their entries:
pull copies each indexed one whose entry is in the mirror, after checking its
sha256 against the index (an ``-aot`` the index does not know, or one whose
bytes changed, is refused like an entry); push uploads a run's executables
whose header checks out and whose entry is shared, and records them.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

from cachectl.context import Context
from cachectl.core.config import MIRROR_WORKERS as DEFAULT_WORKERS
from cachectl.core.errors import BadInput, NotFound
from cachectl.core.fingerprint import Environment
from cachectl.index import CacheInfo, NewEntry
from cachectl.index.protocol import IndexBackend
from cachectl.storage import ingest
from cachectl.storage.entries import (
    AOT_SUFFIX,
    CACHE_SUFFIX,
    ENV_FILE,
    SIGNATURE_FILE,
    Kind,
    classify,
    parse_aot_filename,
    parse_entry_filename,
    sha256,
)
from cachectl.storage.store import NotRegularFile, Store
from cachectl.trust.permissions import check_writer
from cachectl.trust.signing import coverage

FILE_MODE = 0o644
DIR_MODE = 0o755

T = TypeVar("T")


@dataclass(frozen=True)
class EntryProblem:
    """One entry that was not copied, and why (in words a person can act on)."""

    key: str
    reason: str


@dataclass(frozen=True)
class PullResult:
    cache: str
    environment: str
    namespace: str
    source: str
    dest: str
    indexed: int
    copied: int
    present: int
    bytes_copied: int
    refused: list[EntryProblem] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    failed: list[EntryProblem] = field(default_factory=list)
    duration_s: float = 0.0
    dry_run: bool = False
    storage_listed: bool = True
    # Stored executables (``-aot``): indexed ones, copied now, already in the mirror.
    # Their bytes are in ``bytes_copied``; refused ones are in ``refused``, reason "stored executable: ...".
    executables_indexed: int = 0
    executables_copied: int = 0
    executables_present: int = 0

    __json_extra__ = ("ok",)

    @property
    def ok(self) -> bool:
        """No entry was refused or failed to copy (missing ones are the index's business)."""
        return not self.refused and not self.failed


@dataclass(frozen=True)
class PushResult:
    cache: str
    environment: str
    namespace: str
    source: str
    dest: str
    uploaded: int
    bytes_uploaded: int
    already_shared: int
    conflicts: list[EntryProblem] = field(default_factory=list)
    refused: list[EntryProblem] = field(default_factory=list)
    failed: list[EntryProblem] = field(default_factory=list)
    duration_s: float = 0.0
    dry_run: bool = False
    executables_uploaded: int = 0  # their bytes are in bytes_uploaded
    # (file name, size, sha256) of every file this push wrote: what its signer signs.
    written: tuple[tuple[str, int, str], ...] = field(default=(), metadata={"json": False})

    __json_extra__ = ("ok",)

    @property
    def ok(self) -> bool:
        return not self.refused and not self.failed


def _parallel(
    fn: Callable[[str], T], items: Iterable[str], workers: int
) -> list[tuple[str, T | Exception]]:
    """Run ``fn`` over items in a thread pool; exceptions come back as values."""
    items = list(items)

    def guarded(item: str) -> tuple[str, T | Exception]:
        try:
            return item, fn(item)
        except Exception as exc:  # noqa: BLE001 - reported per entry
            return item, exc

    if len(items) <= 1 or workers <= 1:
        return [guarded(i) for i in items]
    with ThreadPoolExecutor(
        max_workers=min(workers, len(items)), thread_name_prefix="cachectl-mirror"
    ) as pool:
        return list(pool.map(guarded, items))


def _atomic_write(path: Path, data: bytes) -> None:
    """Readers of the mirror (JAX) see a whole entry or none: the Store's atomic write."""
    Store(str(path.parent)).write_bytes(path.name, data, mode=FILE_MODE)


def _error(exc: Exception) -> str:
    return f"{type(exc).__name__}: {exc}".splitlines()[0][:300]


def read_mirror_env(directory: Path) -> Environment | None:
    """The environment a mirror directory says it holds, or None if it has no env.json."""
    path = directory / ENV_FILE
    try:
        data = json.loads(path.read_text())
        if not isinstance(data, dict):
            raise ValueError(f"a JSON {type(data).__name__}, not an object")
        return Environment.from_dict(data)
    except FileNotFoundError:
        return None
    except (OSError, ValueError, TypeError, KeyError, AttributeError) as exc:
        raise BadInput(f"corrupt {path}: {exc}; remove it or use another directory") from exc


def prepare_mirror_dir(dest: str | os.PathLike[str], env: Environment) -> Path:
    """Create the mirror directory for ``env``; refuse one that mirrors another environment."""
    directory = Path(dest).expanduser().absolute()
    if directory.exists() and not directory.is_dir():
        raise BadInput(f"mirror {directory} exists and is not a directory: give a directory path")
    existing = read_mirror_env(directory) if directory.exists() else None
    if existing is not None and existing.digest != env.digest:
        raise BadInput(
            f"mirror {directory} holds environment {existing.digest[:16]}, not this one ({env.digest[:16]}): "
            "pull into another directory (one per environment)"
        )
    if (
        existing is None
        and directory.is_dir()
        and any(classify(p.name) is Kind.ENTRY for p in directory.iterdir() if p.is_file())
    ):
        raise BadInput(
            f"mirror {directory} already holds JAX entries but no {ENV_FILE}, so nobody knows their "
            "environment: pull into an empty directory"
        )
    directory.mkdir(parents=True, exist_ok=True, mode=DIR_MODE)
    if existing is None:
        _atomic_write(directory / ENV_FILE, env.env_json().encode())
    return directory


class _Tampered(Exception):
    """An object whose bytes no longer match the sha256 the index recorded."""


AOT_REASON = "stored executable: "
NOT_INDEXED = (
    "in storage but not in the index: not copied (run `cachectl verify` or "
    "`cachectl sync` if it is legitimate)"
)


def _local_state(
    directory: Path,
    expected: dict[str, tuple[int, str]],
    verify_existing: bool,
    suffix: str = CACHE_SUFFIX,
) -> tuple[int, list[str]]:
    """(files already in the mirror, keys to fetch): a size check, or a re-hash if asked."""
    present = 0
    todo: list[str] = []
    for key in sorted(expected):
        size, digest = expected[key]
        local = directory / (key + suffix)
        try:
            st = local.stat()
        except FileNotFoundError:
            todo.append(key)
            continue
        if st.st_size == size and (not verify_existing or sha256(local.read_bytes()) == digest):
            present += 1
        else:
            todo.append(key)
    return present, todo


def pull_namespace(
    index: IndexBackend,
    cache: CacheInfo,
    env: Environment,
    dest: str | os.PathLike[str],
    *,
    workers: int = DEFAULT_WORKERS,
    dry_run: bool = False,
    verify_existing: bool = False,
    store: Store | Callable[[], Store] | None = None,
    skip_storage_if_complete: bool = False,
) -> PullResult:
    """Copy ``env``'s verified entries from ``cache`` to ``dest`` (the library behind pull).

    ``skip_storage_if_complete`` (what activate(mirror=) uses): when the mirror
    already holds every indexed entry, storage is not contacted at all, so a
    restart reads only local disk and never even loads the object-store client.
    An index with no entries for ``env`` is not complete: storage is listed, so
    objects the index has not recorded yet (not synced) are reported as refused
    instead of the service silently compiling everything.
    `cachectl pull` always lists storage, to report objects the index lacks.
    """
    started = time.monotonic()
    ns = env.namespace
    try:
        info = index.find_environment(cache.name, env.digest)
    except NotFound as exc:
        raise NotFound(
            f"environment {env.digest[:16]} is not in cache {cache.name!r}, so there is nothing "
            "verified to pull: warm it here first, or run `cachectl doctor` to see why it differs"
        ) from exc
    expected = index.entry_keys(info.id)
    expected_aot = {k: v for k, v in index.aot_keys(info.id).items() if k in expected}
    # With trusted keys: only what a trusted key signed; each unsigned file is refused alone.
    unsigned: list[EntryProblem] = []
    covered = coverage(index, cache, info)
    if covered is not None:
        for suffix, wanted, prefix in (
            (CACHE_SUFFIX, expected, ""),
            (AOT_SUFFIX, expected_aot, AOT_REASON),
        ):
            for key in sorted(wanted):
                if not covered.covers(key + suffix, *wanted[key]):
                    unsigned.append(EntryProblem(key, prefix + covered.reason()))
                    del wanted[key]
        expected_aot = {k: v for k, v in expected_aot.items() if k in expected}

    directory = Path(dest).expanduser().absolute()
    if not dry_run:
        directory = prepare_mirror_dir(directory, env)
        if covered is not None and covered.document is not None:
            # The signed list beside the copies: a service verifies it with the key, no index.
            signature = json.dumps(covered.document, indent=1, sort_keys=True).encode()
            _atomic_write(directory / SIGNATURE_FILE, signature)
    else:
        existing = read_mirror_env(directory) if directory.is_dir() else None
        if existing is not None and existing.digest != env.digest:
            raise BadInput(
                f"mirror {directory} holds environment {existing.digest[:16]}, not this one "
                f"({env.digest[:16]}): pull into another directory"
            )
    present, todo = _local_state(directory, expected, verify_existing)
    aot_present, aot_todo = _local_state(directory, expected_aot, verify_existing, AOT_SUFFIX)
    if skip_storage_if_complete and expected and not todo and not aot_todo:
        return PullResult(
            cache=cache.name,
            environment=env.digest,
            namespace=ns,
            source=f"{cache.root_url.rstrip('/')}/{ns}",
            dest=str(directory),
            indexed=len(expected),
            copied=0,
            present=present,
            bytes_copied=0,
            duration_s=time.monotonic() - started,
            dry_run=dry_run,
            storage_listed=False,
            executables_indexed=len(expected_aot),
            executables_present=aot_present,
        )

    if store is None:
        store = Store(cache.root_url, cache.storage_options)
    elif not isinstance(store, Store):
        store = store()
    source = store.url_for(ns)
    listed: dict[str, int] = {}
    listed_aot: dict[str, int] = {}
    for f in store.list(ns):
        name = f.path[len(ns) :].lstrip("/") if f.path.startswith(ns) else f.path
        kind = classify(name)
        if kind is Kind.ENTRY:
            parsed = parse_entry_filename(name)
            assert parsed is not None
            listed[parsed.key] = f.size
        elif kind is Kind.AOT:
            parsed = parse_aot_filename(name)
            assert parsed is not None
            listed_aot[parsed.key] = f.size
    unknown = NOT_INDEXED
    refused = list(unsigned)
    seen = {(p.key, p.reason.startswith(AOT_REASON)) for p in unsigned}
    refused += [
        EntryProblem(k, unknown)
        for k in sorted(set(listed) - set(expected))
        if (k, False) not in seen
    ]
    refused += [
        EntryProblem(k, AOT_REASON + unknown)
        for k in sorted(set(listed_aot) - set(expected_aot))
        if (k, True) not in seen
    ]
    missing = sorted(set(expected) - set(listed))
    todo = [k for k in todo if k in listed]
    aot_todo = [k for k in aot_todo if k in listed_aot]

    copied = nbytes = aot_copied = 0
    failed: list[EntryProblem] = []
    if dry_run:
        copied = len(todo)
        aot_copied = len(aot_todo)
        nbytes = sum(expected[k][0] for k in todo) + sum(expected_aot[k][0] for k in aot_todo)
    else:
        fs_store = store

        def fetcher(suffix: str, want_of: dict[str, tuple[int, str]]) -> Callable[[str], int]:
            def fetch(key: str) -> int:
                data = fs_store.read_bytes(f"{ns}/{key}{suffix}")
                got = sha256(data)
                want = want_of[key][1]
                if got != want:
                    raise _Tampered(
                        f"sha256 {got[:16]}… in storage, {want[:16]}… in the index: not copied "
                        "(the object changed after it was recorded; run `cachectl verify`)"
                    )
                _atomic_write(directory / (key + suffix), data)
                return len(data)

            return fetch

        in_mirror = {k for k in expected if k not in todo}
        for key, outcome in _parallel(fetcher(CACHE_SUFFIX, expected), todo, workers):
            if isinstance(outcome, _Tampered):
                refused.append(EntryProblem(key, str(outcome)))
            elif isinstance(outcome, NotRegularFile):
                refused.append(
                    EntryProblem(
                        key, "not a regular file in storage (a symlink?): never read or copied"
                    )
                )
            elif isinstance(outcome, FileNotFoundError):
                missing.append(key)  # deleted between listing and reading
            elif isinstance(outcome, Exception):
                failed.append(EntryProblem(key, _error(outcome)))
            else:
                copied += 1
                nbytes += outcome
                in_mirror.add(key)
        # An executable is only of use beside its entry: copy those whose entry is in the mirror.
        aot_todo = [k for k in aot_todo if k in in_mirror]
        for key, outcome in _parallel(fetcher(AOT_SUFFIX, expected_aot), aot_todo, workers):
            if isinstance(outcome, _Tampered):
                refused.append(EntryProblem(key, AOT_REASON + str(outcome)))
            elif isinstance(outcome, FileNotFoundError):
                continue  # deleted between listing and reading: the next pull (or sync) settles it
            elif isinstance(outcome, Exception):
                failed.append(EntryProblem(key, AOT_REASON + _error(outcome)))
            else:
                aot_copied += 1
                nbytes += outcome
    return PullResult(
        cache=cache.name,
        environment=env.digest,
        namespace=ns,
        source=source,
        dest=str(directory),
        indexed=len(expected),
        copied=copied,
        present=present,
        bytes_copied=nbytes,
        refused=sorted(refused, key=lambda p: p.key),
        missing=sorted(missing),
        failed=failed,
        duration_s=time.monotonic() - started,
        dry_run=dry_run,
        executables_indexed=len(expected_aot),
        executables_copied=aot_copied,
        executables_present=aot_present,
    )


def pull(
    ctx: Context,
    dest: str | os.PathLike[str],
    *,
    cache: CacheInfo | None = None,
    env: Environment | None = None,
    workers: int = DEFAULT_WORKERS,
    dry_run: bool = False,
    verify_existing: bool = False,
) -> PullResult:
    """`cachectl pull --to DIR`: this environment's verified entries, copied locally."""
    cache = cache or ctx.cache()
    env = env or ctx.environment()
    return pull_namespace(
        ctx.index,
        cache,
        env,
        dest,
        workers=workers,
        dry_run=dry_run,
        verify_existing=verify_existing,
        store=ctx.store(cache),
    )


def push(
    ctx: Context,
    src: str | os.PathLike[str],
    *,
    cache: CacheInfo | None = None,
    workers: int = DEFAULT_WORKERS,
    dry_run: bool = False,
) -> PushResult:
    """`cachectl push --from DIR`: upload entries a local run wrote, and index them (origin "push").

    Only writers may push (exit 4 otherwise). Entries already shared are
    skipped; a key the index holds with other bytes is a conflict and is left
    alone; bytes that are not a JAX entry are refused.
    """
    started = time.monotonic()
    cache = cache or ctx.cache()
    directory = Path(src).expanduser().absolute()
    if not directory.is_dir():
        raise BadInput(
            f"--from {directory} is not a directory: give the mirror directory a run wrote to"
        )
    env = read_mirror_env(directory)
    if env is None:
        raise BadInput(
            f"{directory} has no {ENV_FILE}, so the environment of its entries is unknown: "
            "push only directories made by `cachectl pull` or `cachectl.activate(mirror=...)`"
        )
    if not dry_run:
        check_writer(cache, "push to")
    store = ctx.store(cache)
    ns = env.namespace
    if dry_run:
        try:
            env_id = ctx.index.find_environment(cache.name, env.digest).id
            expected, expected_aot = ctx.index.entry_keys(env_id), ctx.index.aot_keys(env_id)
        except NotFound:
            expected, expected_aot = {}, {}
    else:
        info = ctx.index.ensure_environment(cache.name, env)
        expected, expected_aot = ctx.index.entry_keys(info.id), ctx.index.aot_keys(info.id)

    local: list[str] = []
    local_aot: list[str] = []
    for path in sorted(directory.iterdir()):
        if not path.is_file():
            continue
        kind = classify(path.name)
        if kind is Kind.ENTRY:
            parsed = parse_entry_filename(path.name)
            assert parsed is not None
            local.append(parsed.key)
        elif kind is Kind.AOT:
            parsed = parse_aot_filename(path.name)
            assert parsed is not None
            local_aot.append(parsed.key)

    already = 0
    conflicts: list[EntryProblem] = []
    refused: list[EntryProblem] = []
    failed: list[EntryProblem] = []
    candidates: list[ingest.NewObject] = []
    shared: dict[str, tuple[int, str]] = {}  # entries the namespace holds with these bytes
    for key in local:
        try:
            data = (directory / (key + CACHE_SUFFIX)).read_bytes()
        except OSError as exc:
            failed.append(EntryProblem(key, _error(exc)))
            continue
        if key in expected:
            if expected[key][1] == sha256(data):
                already += 1
                shared[key] = expected[key]
            else:
                conflicts.append(
                    EntryProblem(
                        key, "the shared namespace holds other bytes for this key: kept theirs"
                    )
                )
            continue
        parsed = parse_entry_filename(key + CACHE_SUFFIX)
        assert parsed is not None
        try:
            candidates.append(
                ingest.NewObject(ingest.check_new(cache, parsed, data, origin="push"), data)
            )
        except ingest.Refused as exc:
            refused.append(EntryProblem(key, f"{exc.message}: not uploaded"))
    local_sha = {o.row.key: o.row.sha256 for o in candidates}
    local_sha.update({k: v[1] for k, v in shared.items()})
    aot_candidates = _executables_to_push(
        directory, local_aot, local_sha, expected_aot, conflicts, refused, failed
    )

    uploaded = nbytes = aot_uploaded = 0
    written: list[tuple[str, int, str]] = []
    if dry_run:
        uploaded = len(candidates)
        aot_uploaded = len(aot_candidates)
        nbytes = sum(o.row.size for o in candidates) + sum(len(d) for d in aot_candidates.values())
    elif candidates or aot_candidates:

        def with_executable(row: NewEntry, entry: bytes | Path | None) -> ingest.NewObject:
            data = aot_candidates.get(row.key)
            if data is not None:
                row = dataclasses.replace(row, aot_size=len(data), aot_sha256=sha256(data))
            return ingest.NewObject(row, entry, data)

        objects = [with_executable(o.row, o.entry) for o in candidates]
        for key in sorted(
            set(aot_candidates) & set(shared)
        ):  # an executable beside an entry already shared
            parsed = parse_entry_filename(key + CACHE_SUFFIX)
            assert parsed is not None
            objects.append(
                with_executable(
                    NewEntry(
                        key=key,
                        module=parsed.module,
                        size=shared[key][0],
                        sha256=shared[key][1],
                        origin="push",
                    ),
                    None,
                )
            )
        published = ingest.publish(
            ctx.index,
            cache,
            env,
            info.id,
            store,
            objects,
            parallel=lambda fn, keys: _parallel(fn, keys, workers),
        )
        for key, (what, error) in published.failed.items():
            failed.append(
                EntryProblem(key, (AOT_REASON if what == "executable" else "") + _error(error))
            )
        for row in published.rows:
            if row.key not in shared:
                uploaded += 1
                nbytes += row.size
                written.append((row.key + CACHE_SUFFIX, row.size, row.sha256))
            if row.aot_size is not None and row.aot_sha256 is not None:
                aot_uploaded += 1
                nbytes += row.aot_size
                written.append((row.key + AOT_SUFFIX, row.aot_size, row.aot_sha256))
    duration = time.monotonic() - started
    if not dry_run:
        ctx.index.audit(
            "push",
            cache=cache.name,
            entries=uploaded,
            nbytes=nbytes,
            duration_ms=int(duration * 1000),
            details={
                "environment": env.digest,
                "source": str(directory),
                "already_shared": already,
                "conflicts": len(conflicts),
                "refused": len(refused),
                "failed": len(failed),
                "executables_uploaded": aot_uploaded,
            },
        )
    return PushResult(
        cache=cache.name,
        environment=env.digest,
        namespace=ns,
        source=str(directory),
        dest=store.url_for(ns),
        uploaded=uploaded,
        bytes_uploaded=nbytes,
        already_shared=already,
        conflicts=conflicts,
        refused=refused,
        failed=failed,
        duration_s=duration,
        dry_run=dry_run,
        executables_uploaded=aot_uploaded,
        written=tuple(written),
    )


def _executables_to_push(
    directory: Path,
    keys: list[str],
    entry_sha: dict[str, str],
    shared_aot: dict[str, tuple[int, str]],
    conflicts: list[EntryProblem],
    refused: list[EntryProblem],
    failed: list[EntryProblem],
) -> dict[str, bytes]:
    """The local ``-aot`` files worth uploading: intact, made for the entry bytes being shared,
    not shared already. Problems are appended to the lists given."""
    out: dict[str, bytes] = {}
    for key in keys:
        if key not in entry_sha:
            continue  # its entry is not shared (refused, conflicting, failed or absent): neither is it
        try:
            data = (directory / (key + AOT_SUFFIX)).read_bytes()
        except OSError as exc:
            failed.append(EntryProblem(key, AOT_REASON + _error(exc)))
            continue
        if key in shared_aot:
            if shared_aot[key][1] != sha256(data):
                conflicts.append(
                    EntryProblem(
                        key,
                        AOT_REASON + "the shared namespace holds another one for "
                        "this key: kept theirs",
                    )
                )
            continue
        try:
            ingest.check_executable(key, data, entry_sha[key])
        except ingest.Refused as exc:
            refused.append(EntryProblem(key, AOT_REASON + f"{exc.message}: not uploaded"))
            continue
        out[key] = data
    return out
