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
whose header checks out and whose entry is shared, and records them
(cachectl/service/mirror_push.py).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import NamedTuple, TypeVar

from cachectl.context import Context
from cachectl.core.config import MIRROR_WORKERS as DEFAULT_WORKERS
from cachectl.core.errors import BadInput, NotFound
from cachectl.core.fingerprint import Environment
from cachectl.index import CacheInfo
from cachectl.index.protocol import IndexBackend
from cachectl.service.node_source import RemoteNamespace, remote_namespace
from cachectl.storage.entries import (
    CACHE_SUFFIX,
    ENV_FILE,
    EXECUTABLE_SUFFIX,
    SIGNATURE_FILE,
    Kind,
    classify,
    parse_aot_filename,
    parse_entry_filename,
    sha256,
)
from cachectl.storage.store import NotRegularFile, Store
from cachectl.trust.gate import matches
from cachectl.trust.signing import Coverage, coverage

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


def parallel(
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


def error(exc: Exception) -> str:
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


def file_key(name: str) -> tuple[Kind, str] | None:
    """(Kind.ENTRY or Kind.AOT, key) of an entry's or a stored executable's file name, else None."""
    kind = classify(name)
    if kind is Kind.ENTRY:
        parsed = parse_entry_filename(name)
    elif kind is Kind.AOT:
        parsed = parse_aot_filename(name)
    else:
        return None
    assert parsed is not None
    return kind, parsed.key


@dataclass(frozen=True)
class _Indexed:
    """What a pull may copy: {key: (size, sha256)} of the indexed entries and of their stored
    executables, less every file a trusted key did not sign (each one in ``unsigned``)."""

    entries: dict[str, tuple[int, str]]
    executables: dict[str, tuple[int, str]]
    unsigned: list[EntryProblem]
    covered: Coverage | None  # None: the cache trusts no keys


def _indexed(index: IndexBackend, cache: CacheInfo, env: Environment) -> _Indexed:
    """The index's entries of ``env`` (and their executables); with trusted keys, only what a
    trusted key signed: each unsigned file is refused alone."""
    try:
        info = index.find_environment(cache.name, env.digest)
    except NotFound as exc:
        raise NotFound(
            f"environment {env.digest[:16]} is not in cache {cache.name!r}, so there is nothing "
            "verified to pull: warm it here first, or run `cachectl doctor` to see why it differs"
        ) from exc
    expected = index.entry_keys(info.id)
    expected_aot = {k: v for k, v in index.aot_keys(info.id).items() if k in expected}
    covered = coverage(index, cache, info)
    if covered is None:
        return _Indexed(expected, expected_aot, [], None)
    unsigned: list[EntryProblem] = []
    signed: list[dict[str, tuple[int, str]]] = []
    for suffix, wanted, prefix in (
        (CACHE_SUFFIX, expected, ""),
        (EXECUTABLE_SUFFIX, expected_aot, AOT_REASON),
    ):
        kept = {k: v for k, v in wanted.items() if covered.covers(k + suffix, *v)}
        unsigned += [
            EntryProblem(k, prefix + covered.reason()) for k in sorted(wanted) if k not in kept
        ]
        signed.append(kept)
    entries, executables = signed
    executables = {k: v for k, v in executables.items() if k in entries}
    return _Indexed(entries, executables, unsigned, covered)


def _mirror_dir(
    dest: str | os.PathLike[str], env: Environment, covered: Coverage | None, dry_run: bool
) -> Path:
    """The mirror directory, made with the signed list beside the copies (a service verifies it
    with the key, no index); a dry run makes nothing but still refuses another environment's."""
    directory = Path(dest).expanduser().absolute()
    if dry_run:
        existing = read_mirror_env(directory) if directory.is_dir() else None
        if existing is not None and existing.digest != env.digest:
            raise BadInput(
                f"mirror {directory} holds environment {existing.digest[:16]}, not this one "
                f"({env.digest[:16]}): pull into another directory"
            )
        return directory
    directory = prepare_mirror_dir(directory, env)
    if covered is not None and covered.document is not None:
        signature = json.dumps(covered.document, indent=1, sort_keys=True).encode()
        _atomic_write(directory / SIGNATURE_FILE, signature)
    return directory


class _Listing(NamedTuple):
    """The namespace's entries and stored executables in storage: {key: size}."""

    entries: dict[str, int]
    executables: dict[str, int]


def _list_namespace(store: Store | RemoteNamespace, ns: str) -> _Listing:
    listing = _Listing({}, {})
    for f in store.list(ns):
        found = file_key(f.path[len(ns) :].lstrip("/") if f.path.startswith(ns) else f.path)
        if found is not None:
            kind, key = found
            (listing.entries if kind is Kind.ENTRY else listing.executables)[key] = f.size
    return listing


def _not_indexed(indexed: _Indexed, listing: _Listing) -> list[EntryProblem]:
    """The unsigned files, then every listed file the index does not know (an unsigned one is
    refused once, as unsigned)."""
    seen = {(p.key, p.reason.startswith(AOT_REASON)) for p in indexed.unsigned}
    refused = list(indexed.unsigned)
    refused += [
        EntryProblem(k, NOT_INDEXED)
        for k in sorted(set(listing.entries) - set(indexed.entries))
        if (k, False) not in seen
    ]
    refused += [
        EntryProblem(k, AOT_REASON + NOT_INDEXED)
        for k in sorted(set(listing.executables) - set(indexed.executables))
        if (k, True) not in seen
    ]
    return refused


@dataclass
class _Copies:
    """What the copy stage did, tallied as the reads come back."""

    entries: int = 0
    executables: int = 0
    nbytes: int = 0
    refused: list[EntryProblem] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)  # deleted between listing and reading
    failed: list[EntryProblem] = field(default_factory=list)


def _copy(
    store: Store | RemoteNamespace,
    ns: str,
    directory: Path,
    indexed: _Indexed,
    todo: list[str],
    aot_todo: list[str],
    workers: int,
) -> _Copies:
    """Fetch the ``todo`` entries, then the ``aot_todo`` executables whose entry is in the mirror;
    each file is written only if its bytes have the sha256 the index recorded."""
    out = _Copies()

    def fetcher(suffix: str, want_of: dict[str, tuple[int, str]]) -> Callable[[str], int]:
        def fetch(key: str) -> int:
            data = store.read_bytes(f"{ns}/{key}{suffix}")
            want = want_of[key][1]
            if not matches(data, want):  # the gate's one comparison (trust/gate.py)
                got = sha256(data)
                raise _Tampered(
                    f"sha256 {got[:16]}… in storage, {want[:16]}… in the index: not copied "
                    "(the object changed after it was recorded; run `cachectl verify`)"
                )
            _atomic_write(directory / (key + suffix), data)
            return len(data)

        return fetch

    pending = set(todo)
    in_mirror = {k for k in indexed.entries if k not in pending}
    for key, outcome in parallel(fetcher(CACHE_SUFFIX, indexed.entries), todo, workers):
        if isinstance(outcome, _Tampered):
            out.refused.append(EntryProblem(key, str(outcome)))
        elif isinstance(outcome, NotRegularFile):
            out.refused.append(
                EntryProblem(
                    key, "not a regular file in storage (a symlink?): never read or copied"
                )
            )
        elif isinstance(outcome, FileNotFoundError):
            out.missing.append(key)
        elif isinstance(outcome, Exception):
            out.failed.append(EntryProblem(key, error(outcome)))
        else:
            out.entries += 1
            out.nbytes += outcome
            in_mirror.add(key)
    # An executable is only of use beside its entry: copy those whose entry is in the mirror.
    aot_todo = [k for k in aot_todo if k in in_mirror]
    for key, outcome in parallel(
        fetcher(EXECUTABLE_SUFFIX, indexed.executables), aot_todo, workers
    ):
        if isinstance(outcome, _Tampered):
            out.refused.append(EntryProblem(key, AOT_REASON + str(outcome)))
        elif isinstance(outcome, FileNotFoundError):
            continue  # deleted between listing and reading: the next pull (or sync) settles it
        elif isinstance(outcome, Exception):
            out.failed.append(EntryProblem(key, AOT_REASON + error(outcome)))
        else:
            out.executables += 1
            out.nbytes += outcome
    return out


def pull_namespace(
    index: IndexBackend,
    cache: CacheInfo,
    env: Environment,
    dest: str | os.PathLike[str],
    *,
    workers: int = DEFAULT_WORKERS,
    dry_run: bool = False,
    verify_existing: bool = False,
    store: Store | RemoteNamespace | Callable[[], Store] | None = None,
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
    indexed = _indexed(index, cache, env)
    directory = _mirror_dir(dest, env, indexed.covered, dry_run)
    present, todo = _local_state(directory, indexed.entries, verify_existing)
    aot_present, aot_todo = _local_state(
        directory, indexed.executables, verify_existing, EXECUTABLE_SUFFIX
    )
    result = partial(
        PullResult,
        cache=cache.name,
        environment=env.digest,
        namespace=ns,
        dest=str(directory),
        indexed=len(indexed.entries),
        present=present,
        dry_run=dry_run,
        executables_indexed=len(indexed.executables),
        executables_present=aot_present,
    )
    if skip_storage_if_complete and indexed.entries and not todo and not aot_todo:
        return result(
            source=f"{cache.root_url.rstrip('/')}/{ns}",
            copied=0,
            bytes_copied=0,
            duration_s=time.monotonic() - started,
            storage_listed=False,
        )

    if store is None:
        store = Store(cache.root_url, cache.storage_options)
    elif not isinstance(store, (Store, RemoteNamespace)):
        store = store()
    listing = _list_namespace(store, ns)
    todo = [k for k in todo if k in listing.entries]
    aot_todo = [k for k in aot_todo if k in listing.executables]
    if dry_run:
        nbytes = sum(indexed.entries[k][0] for k in todo)
        nbytes += sum(indexed.executables[k][0] for k in aot_todo)
        copies = _Copies(len(todo), len(aot_todo), nbytes)
    else:
        copies = _copy(store, ns, directory, indexed, todo, aot_todo, workers)
    refused = _not_indexed(indexed, listing) + copies.refused
    return result(
        source=store.url_for(ns),
        copied=copies.entries,
        bytes_copied=copies.nbytes,
        refused=sorted(refused, key=lambda p: p.key),
        missing=sorted([*(set(indexed.entries) - set(listing.entries)), *copies.missing]),
        failed=copies.failed,
        duration_s=time.monotonic() - started,
        executables_copied=copies.executables,
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
    env = env or ctx.environment(registers=False)  # read only: nothing is recorded
    # Server mode without the root here: the server's rows and entry routes, through the node tier.
    remote = remote_namespace(ctx.settings, ctx.index, cache.name, cache.root_url, env)
    return pull_namespace(
        ctx.index,
        cache,
        env,
        dest,
        workers=workers,
        dry_run=dry_run,
        verify_existing=verify_existing,
        store=remote or ctx.store(cache),
    )
