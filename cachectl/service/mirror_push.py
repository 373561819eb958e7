"""`cachectl push`: upload what a local run wrote into a mirror back to the shared namespace.

For writers only. Each local entry is either shared already (same bytes), a conflict (the
namespace holds other bytes for its key: theirs are kept), refused (not a JAX entry) or a
candidate, checked by cachectl/storage/ingest.py and published through it; a stored executable
goes with it when its header checks out and its entry is shared (cachectl/service/mirror.py says
what a mirror directory holds).
"""

from __future__ import annotations

import dataclasses
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

from cachectl.context import Context
from cachectl.core.config import MIRROR_WORKERS as DEFAULT_WORKERS
from cachectl.core.errors import BadInput, NotFound
from cachectl.core.fingerprint import Environment
from cachectl.index import CacheInfo, NewEntry
from cachectl.index.protocol import IndexBackend
from cachectl.service.mirror import (
    AOT_REASON,
    EntryProblem,
    error,
    file_key,
    parallel,
    read_mirror_env,
)
from cachectl.storage import ingest, ingest_rules
from cachectl.storage.entries import (
    CACHE_SUFFIX,
    ENV_FILE,
    EXECUTABLE_SUFFIX,
    Kind,
    parse_entry_filename,
    sha256,
)
from cachectl.trust.permissions import check_writer


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


def _push_source(src: str | os.PathLike[str]) -> tuple[Path, Environment]:
    """The mirror directory to push and the environment its env.json names."""
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
    return directory, env


class _Shared(NamedTuple):
    """What the shared namespace holds already: {key: (size, sha256)} of entries and executables.
    ``env_id`` is None only for a dry run whose environment the index does not know."""

    env_id: int | None
    entries: dict[str, tuple[int, str]]
    executables: dict[str, tuple[int, str]]


def _shared(index: IndexBackend, cache: CacheInfo, env: Environment, dry_run: bool) -> _Shared:
    """The namespace's indexed files; a real push makes the environment's row first."""
    if not dry_run:
        env_id = index.ensure_environment(cache.name, env).id
        return _Shared(env_id, index.entry_keys(env_id), index.aot_keys(env_id))
    try:
        env_id = index.find_environment(cache.name, env.digest).id
    except NotFound:
        return _Shared(None, {}, {})
    return _Shared(env_id, index.entry_keys(env_id), index.aot_keys(env_id))


def _local_keys(directory: Path) -> tuple[list[str], list[str]]:
    """(entry keys, stored executable keys) of the files in the mirror, in name order."""
    local: list[str] = []
    local_aot: list[str] = []
    for path in sorted(directory.iterdir()):
        found = file_key(path.name) if path.is_file() else None
        if found is not None:
            kind, key = found
            (local if kind is Kind.ENTRY else local_aot).append(key)
    return local, local_aot


@dataclass
class _Triage:
    """Where each local file stands against the shared namespace, filled as they are read."""

    already: int = 0
    shared: dict[str, tuple[int, str]] = field(default_factory=dict)  # held with these bytes
    candidates: list[ingest.NewObject] = field(default_factory=list)
    conflicts: list[EntryProblem] = field(default_factory=list)
    refused: list[EntryProblem] = field(default_factory=list)
    failed: list[EntryProblem] = field(default_factory=list)


def _triage(
    cache: CacheInfo, directory: Path, keys: list[str], shared: dict[str, tuple[int, str]]
) -> _Triage:
    """Sort the local entries into shared already, conflicts, refused and candidates to upload."""
    out = _Triage()
    for key in keys:
        try:
            data = (directory / (key + CACHE_SUFFIX)).read_bytes()
        except OSError as exc:
            out.failed.append(EntryProblem(key, error(exc)))
            continue
        if key in shared:
            if shared[key][1] == sha256(data):
                out.already += 1
                out.shared[key] = shared[key]
            else:
                out.conflicts.append(
                    EntryProblem(
                        key, "the shared namespace holds other bytes for this key: kept theirs"
                    )
                )
            continue
        parsed = parse_entry_filename(key + CACHE_SUFFIX)
        assert parsed is not None
        try:
            out.candidates.append(
                ingest.NewObject(ingest.check_new(cache, parsed, data, origin="push"), data)
            )
        except ingest_rules.Refused as exc:
            out.refused.append(EntryProblem(key, f"{exc.message}: not uploaded"))
    return out


def _executables_to_push(
    directory: Path,
    keys: list[str],
    shared_aot: dict[str, tuple[int, str]],
    triage: _Triage,
) -> dict[str, bytes]:
    """The local ``-aot`` files worth uploading: intact, made for the entry bytes being shared,
    not shared already. Problems go to ``triage``'s lists."""
    entry_sha = {o.row.key: o.row.sha256 for o in triage.candidates}
    entry_sha.update({k: v[1] for k, v in triage.shared.items()})
    out: dict[str, bytes] = {}
    for key in keys:
        if key not in entry_sha:
            continue  # its entry is not shared (refused, conflicting, failed or absent): neither is it
        try:
            data = (directory / (key + EXECUTABLE_SUFFIX)).read_bytes()
        except OSError as exc:
            triage.failed.append(EntryProblem(key, AOT_REASON + error(exc)))
            continue
        if key in shared_aot:
            if shared_aot[key][1] != sha256(data):
                triage.conflicts.append(
                    EntryProblem(
                        key,
                        AOT_REASON + "the shared namespace holds another one for "
                        "this key: kept theirs",
                    )
                )
            continue
        try:
            ingest_rules.check_executable(key, data, entry_sha[key])
        except ingest_rules.Refused as exc:
            triage.refused.append(EntryProblem(key, AOT_REASON + f"{exc.message}: not uploaded"))
            continue
        out[key] = data
    return out


def _objects(triage: _Triage, executables: dict[str, bytes]) -> list[ingest.NewObject]:
    """The batch to publish: each candidate entry with its executable, then each executable
    beside an entry already shared."""

    def with_executable(row: NewEntry, entry: ingest.Source | None) -> ingest.NewObject:
        data = executables.get(row.key)
        if data is not None:
            row = dataclasses.replace(row, aot_size=len(data), aot_sha256=sha256(data))
        return ingest.NewObject(row, entry, data)

    objects = [with_executable(o.row, o.entry) for o in triage.candidates]
    for key in sorted(set(executables) & set(triage.shared)):
        parsed = parse_entry_filename(key + CACHE_SUFFIX)
        assert parsed is not None
        size, digest = triage.shared[key]
        row = NewEntry(key=key, module=parsed.module, size=size, sha256=digest, origin="push")
        objects.append(with_executable(row, None))
    return objects


@dataclass(frozen=True)
class _Sent:
    """What a push uploaded (or, dry, would upload)."""

    entries: int = 0
    executables: int = 0
    nbytes: int = 0
    written: tuple[tuple[str, int, str], ...] = ()


def _sent(published: ingest.Published, triage: _Triage) -> _Sent:
    """Tally what was indexed; each failed write goes to ``triage.failed``."""
    for key, (what, failure) in published.failed.items():
        triage.failed.append(
            EntryProblem(key, (AOT_REASON if what == "executable" else "") + error(failure))
        )
    entries = executables = nbytes = 0
    written: list[tuple[str, int, str]] = []
    for row in published.rows:
        if row.key not in triage.shared:
            entries += 1
            nbytes += row.size
            written.append((row.key + CACHE_SUFFIX, row.size, row.sha256))
        if row.aot_size is not None and row.aot_sha256 is not None:
            executables += 1
            nbytes += row.aot_size
            written.append((row.key + EXECUTABLE_SUFFIX, row.aot_size, row.aot_sha256))
    return _Sent(entries, executables, nbytes, tuple(written))


def _audit(ctx: Context, result: PushResult) -> None:
    ctx.index.audit(
        "push",
        cache=result.cache,
        entries=result.uploaded,
        nbytes=result.bytes_uploaded,
        duration_ms=int(result.duration_s * 1000),
        details={
            "environment": result.environment,
            "source": result.source,
            "already_shared": result.already_shared,
            "conflicts": len(result.conflicts),
            "refused": len(result.refused),
            "failed": len(result.failed),
            "executables_uploaded": result.executables_uploaded,
        },
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
    directory, env = _push_source(src)
    if not dry_run:
        check_writer(cache, "push to")
    store = ctx.store(cache)
    shared = _shared(ctx.index, cache, env, dry_run)
    local, local_aot = _local_keys(directory)
    triage = _triage(cache, directory, local, shared.entries)
    executables = _executables_to_push(directory, local_aot, shared.executables, triage)

    sent = _Sent()
    if dry_run:
        nbytes = sum(o.row.size for o in triage.candidates)
        sent = _Sent(
            len(triage.candidates), len(executables), nbytes + sum(map(len, executables.values()))
        )
    elif triage.candidates or executables:
        assert shared.env_id is not None  # a real push made the environment's row
        published = ingest.publish(
            ctx.index,
            cache,
            env,
            shared.env_id,
            store,
            _objects(triage, executables),
            parallel=lambda fn, keys: parallel(fn, keys, workers),
        )
        sent = _sent(published, triage)
    result = PushResult(
        cache=cache.name,
        environment=env.digest,
        namespace=env.namespace,
        source=str(directory),
        dest=store.url_for(env.namespace),
        uploaded=sent.entries,
        bytes_uploaded=sent.nbytes,
        already_shared=triage.already,
        conflicts=triage.conflicts,
        refused=triage.refused,
        failed=triage.failed,
        duration_s=time.monotonic() - started,
        dry_run=dry_run,
        executables_uploaded=sent.executables,
        written=sent.written,
    )
    if not dry_run:
        _audit(ctx, result)
    return result
