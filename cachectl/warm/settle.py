"""One bucket's outcome settled: what JAX did becomes a status; the stored bytes are indexed.

The written file itself is read back from storage: its size and sha256 are what
the index records, so the index describes bytes that exist. Split from ``run`` so
that module drives the run and this one judges each bucket.
"""

from __future__ import annotations

import json
import logging
import shutil
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, NamedTuple

from cachectl.context import Context
from cachectl.core import jax_seam
from cachectl.core.errors import EntryConflict
from cachectl.core.units import format_size
from cachectl.index import NewEntry
from cachectl.manifest import Bucket, resolve_callable
from cachectl.service.node_upload import upload
from cachectl.storage import executables, ingest, ingest_rules
from cachectl.storage.entries import (
    CACHE_SUFFIX,
    EXECUTABLE_SUFFIX,
    CorruptEntry,
    EntryName,
    parse_key,
    read_header,
    sha256,
)
from cachectl.warm.compiling import Outcome
from cachectl.warm.plan import WarmPlan
from cachectl.warm.reports import CACHED, COMPILED, FAILED, TOO_LARGE, BucketResult
from cachectl.warm.server_held import ServerEntries

log = logging.getLogger(__name__)

# key -> (size, sha256) of what the index holds (or a trusted list signed).
Known = dict[str, tuple[int, str]]


@dataclass(frozen=True)
class RunScope:
    """What every bucket of one warm run settles into: its namespace, index rows and run id.

    ``indexed`` and ``stored_aot`` are the run's own dicts: settling a bucket adds what it wrote.
    ``stored_aot`` None means executables are off.
    """

    ctx: Context
    plan: WarmPlan
    store: Any
    ns_rel: str
    env_id: int
    run_id: int
    indexed: Known
    stored_aot: Known | None
    # Per function: what its stored executables are bound to (executables.FunctionBinding).
    bindings: dict[str, executables.FunctionBinding]
    # Server mode without the root here: the server's rows say what is stored (service/node_upload.py),
    # and the server's entries are read into the node tier for JAX (warm/server_held.py).
    via_server: bool = False
    server: ServerEntries | None = None


class _Published(NamedTuple):
    """What publishing one bucket's executable did."""

    aot_bytes: int | None
    aot_error: str | None
    # (size, sha256) of the executable written now; None when none was written.
    aot_file: tuple[int, str] | None
    # The bucket failed: the server refused its upload (``aot_error`` says why).
    failed: bool = False
    # (size, sha256) of the entry the row names: the server's where it held the key with other
    # bytes (the executable is bound to those); None: the row's own.
    entry: tuple[int, str] | None = None


def settle(
    scope: RunScope, bucket: Bucket, outcome: Outcome | None, error: str | None
) -> BucketResult:
    """Turn what JAX did into a status; read the stored bytes; index them; enforce max entry size.

    With executables on (``stored_aot`` not None), a bucket is ``cached`` only
    when its JAX entry and its stored executable are both there already.
    """
    failed = _failed(bucket, outcome, error)
    if failed is not None:
        return failed
    assert outcome is not None and outcome.key is not None
    rel = f"{scope.ns_rel}/{outcome.key}{CACHE_SUFFIX}"
    if outcome.lookup == "miss" and not outcome.written:
        reason = outcome.skip_reason or "see the warning JAX printed"
        if jax_seam.is_host_callbacks_text(outcome.skip_reason):
            reason = jax_seam.host_callbacks_cause([_module(outcome.key)])
        broken = _broken_entry(scope.store, rel)
        if broken:  # JAX never rewrites an existing file: a broken one would stay for ever
            reason = f"{broken}; removed it, rerun warm"
        return _result(
            bucket, outcome, FAILED, error=f"compiled but JAX did not write it: {reason}"
        )
    if outcome.lookup == "hit":
        return _settle_hit(scope, bucket, outcome, rel)
    return _settle_written(scope, bucket, outcome, rel)


def _failed(bucket: Bucket, outcome: Outcome | None, error: str | None) -> BucketResult | None:
    """The bucket's failure before anything was stored: it raised, or JAX never consulted the
    persistent cache for it; None when it goes on to be settled."""
    if error is not None or outcome is None:
        return BucketResult(
            bucket.function,
            dict(bucket.values),
            status=FAILED,
            error=str(error or "no result"),
            traceback=getattr(error, "traceback", None),
        )
    if outcome.lookup is None or outcome.key is None:
        return _result(
            bucket,
            outcome,
            FAILED,
            key=None,
            error="JAX did not consult the persistent cache for this program",
        )
    return None


def settle_peer(bucket: Bucket, outcome: Outcome | None, error: str | None) -> BucketResult:
    """A bucket of a process JAX never writes from (a distributed job's process other than 0):
    the same judgement as :func:`settle` with nothing stored or indexed here. A miss is
    ``compiled`` with the entry JAX would have written (``outcome.entry``, for process 0 to
    store when its own key differs); a program with host callbacks fails as in process 0."""
    failed = _failed(bucket, outcome, error)
    if failed is not None:
        return failed
    assert outcome is not None
    if outcome.lookup == "hit":
        return _result(bucket, outcome, CACHED)
    if outcome.host_callbacks:
        cause = jax_seam.host_callbacks_cause([_module(outcome.key or "")])
        return _result(bucket, outcome, FAILED, error=f"compiled but JAX did not write it: {cause}")
    size = len(outcome.entry) if outcome.entry is not None else None
    return _result(bucket, outcome, COMPILED, bytes=size)


def _result(bucket: Bucket, outcome: Outcome, status: str, **fields: Any) -> BucketResult:
    """A settled bucket's result: its key (the outcome's unless given) and JAX's times."""
    fields.setdefault("key", outcome.key)
    return BucketResult(
        bucket.function,
        dict(bucket.values),
        status=status,
        compile_seconds=outcome.seconds,
        lower_seconds=outcome.lower_seconds,
        **fields,
    )


def _module(key: str) -> str:
    """The module name a key carries (the key itself when it is not JAX's format)."""
    parsed = parse_key(key)
    return parsed.module if parsed else key


def _settle_hit(scope: RunScope, bucket: Bucket, outcome: Outcome, rel: str) -> BucketResult:
    """JAX loaded the entry: index it as observed, and store its executable if it is new."""
    key = outcome.key or ""
    known = scope.indexed.get(key) or _indexed_now(scope, key)
    if known is None:  # a file no writer indexed: never this run's to claim (issue 62)
        return _result(
            bucket,
            outcome,
            FAILED,
            error=f"JAX loaded {rel}, which no writer indexed: not indexed; rerun warm to "
            "replace it",
        )
    size, digest = known
    try:  # JAX loaded what is on storage: it must be what the row says, or nothing is stored
        data = scope.store.read_bytes(rel)
    except FileNotFoundError:
        return _result(bucket, outcome, CACHED)
    if sha256(data) != digest:
        return _result(
            bucket,
            outcome,
            FAILED,
            error=f"JAX loaded {rel}, whose bytes differ from its index row (another writer "
            "rewrote it): nothing stored; `cachectl verify` names it",
        )
    # A hit belongs to this run too: lifecycle protects the newest run's entries.
    row = NewEntry(
        key=key,
        module=_module(key),
        function=bucket.function,
        bucket=dict(bucket.values),
        warm_run_id=scope.run_id,
        size=size,
        sha256=digest,
        origin="observed",
    )
    published = _publish(scope, row, bucket, outcome)
    if published.failed:
        return _result(bucket, outcome, FAILED, bytes=size, error=published.aot_error)
    # In server mode the server held the entry: nothing was compiled, whatever was stored.
    new_here = published.aot_file is not None and not scope.via_server
    return _result(
        bucket,
        outcome,
        COMPILED if new_here else CACHED,
        bytes=size,
        aot_bytes=published.aot_bytes,
        aot_error=published.aot_error,
        # JAX loaded the entry, this run did not write it: only a new executable is its own
        # (signed only beside an entry a trusted list already signed).
        written=_written(key, aot=published.aot_file),
    )


def _settle_written(scope: RunScope, bucket: Bucket, outcome: Outcome, rel: str) -> BucketResult:
    """JAX wrote the entry: check it meets the rules, index it, store its executable."""
    key = outcome.key or ""
    store, cache = scope.store, scope.plan.cache
    try:
        data = store.read_bytes(rel)
    except FileNotFoundError:
        return _result(
            bucket, outcome, FAILED, error=f"JAX reported writing {rel} but it is not in the cache"
        )
    size = len(data)
    problem = _entry_problem(data)
    if problem is not None:
        store.delete([rel])
        return _result(
            bucket,
            outcome,
            FAILED,
            bytes=size,
            error=f"JAX wrote a broken entry ({problem}){_space_hint(store, scope.ns_rel)}; "
            "removed it: a rerun with space compiles it again",
        )
    if sha256(data) not in outcome.put_sha256s:  # JAX logs a write it skips at a taken key
        return _result(
            bucket,
            outcome,
            FAILED,
            bytes=size,
            error=f"the file at {rel} is not the one this warm wrote (another writer's bytes): "
            "not indexed; rerun warm to replace it",
        )
    try:  # the rules every new entry meets (ingest.py): max entry size, a JAX entry, its sha256
        row = ingest.check_new(
            cache,
            EntryName(key, _module(key)),
            data,
            origin="warm",
            compile_time_ms=int(round(outcome.seconds * 1000)),
            function=bucket.function,
            bucket=dict(bucket.values),
            warm_run_id=scope.run_id,
        )
    except ingest_rules.Refused as exc:
        store.delete([rel])
        limit = cache.max_entry_size
        if exc.rule == ingest_rules.TOO_LARGE and limit is not None:
            error = (
                f"entry is {format_size(size)}, above the max entry size of cache "
                f"{cache.name!r} ({format_size(limit)}): removed, not kept"
            )
            return _result(bucket, outcome, TOO_LARGE, bytes=size, error=error)
        error = f"JAX wrote an entry that is not kept ({exc.message}); removed it"
        return _result(bucket, outcome, FAILED, bytes=size, error=error)
    published = _publish(scope, row, bucket, outcome)
    if published.failed:
        return _result(bucket, outcome, FAILED, bytes=size, error=published.aot_error)
    entry = published.entry or (size, row.sha256)
    scope.indexed[key] = entry
    return _result(
        bucket,
        outcome,
        COMPILED,
        bytes=entry[0],
        aot_bytes=published.aot_bytes,
        aot_error=published.aot_error,
        # the server's entry, where it held the key, is not this run's file
        written=_written(key, None if published.entry else entry, published.aot_file),
    )


def _written(
    key: str, entry: tuple[int, str] | None = None, aot: tuple[int, str] | None = None
) -> tuple[tuple[str, int, str], ...]:
    """(name, size, sha256) of the files a bucket wrote: what its signer signs."""
    files = [(key + CACHE_SUFFIX, *entry)] if entry is not None else []
    if aot is not None:
        files.append((key + EXECUTABLE_SUFFIX, *aot))
    return tuple(files)


def _entry_problem(data: bytes) -> str | None:
    """Why bytes JAX wrote are not an entry (a full disk leaves 0-byte or truncated files)."""
    if not data:
        return "0 bytes"
    try:
        read_header(data)
    except CorruptEntry as exc:
        return f"{len(data)} bytes, {exc}"
    return None


def _broken_entry(store: Any, rel: str) -> str | None:
    """A broken file in the way of this key is removed; returns what was wrong with it."""
    try:
        data = store.read_bytes(rel)
    except (FileNotFoundError, OSError):
        return None
    problem = _entry_problem(data)
    if problem is not None:
        store.delete([rel])
        return f"a broken entry was in its place ({problem})"
    return None


def _space_hint(store: Any, ns_rel: str) -> str:
    """', no space left on DIR' when the local disk is (nearly) full."""
    if not getattr(store, "is_local", False):
        return ""
    try:
        path = store.url_for(ns_rel).removeprefix("file://")
        free = shutil.disk_usage(path).free
    except OSError:
        return ""
    return f", no space left on {path} ({free} bytes free)" if free < (1 << 20) else ""


def function_bindings(plan: WarmPlan) -> dict[str, executables.FunctionBinding]:
    """Per function: what each of its stored executables is bound to (its entry as it shapes a
    bucket's program, its source file), computed once for the run."""
    out: dict[str, executables.FunctionBinding] = {}
    for spec in plan.manifest.functions:
        try:
            fn = resolve_callable(spec.fn, plan.search_paths)
        except Exception:  # noqa: BLE001 - the bucket reports the import error itself
            fn = None
        out[spec.name] = executables.FunctionBinding.of(spec, fn)
    return out


def _bound_here(scope: RunScope, key: str, bucket: Bucket) -> bool:
    """Whether the stored executable at ``key`` is one serving would use for ``bucket``: its
    header bound to this function's entry, this bucket and its source. One stored for another
    version of the entry (or before per-bucket binding, for an entry since changed) is not:
    warm stores it again, so that it never reports an executable serving refuses."""
    binding = scope.bindings.get(bucket.function)
    if binding is None:
        return True
    try:
        header = executables.read_header(
            scope.store.read_bytes(f"{scope.ns_rel}/{key}{EXECUTABLE_SUFFIX}")
        )
    except (FileNotFoundError, OSError, CorruptEntry):
        return False
    values = dict(bucket.values)
    return (
        header.function == bucket.function
        and json.dumps(header.bucket, sort_keys=True) == json.dumps(values, sort_keys=True)
        and binding.refusal(header, values) is None
    )


def _publish(scope: RunScope, row: NewEntry, bucket: Bucket, outcome: Outcome) -> _Published:
    """Index the entry JAX wrote, with ``<key>-aot`` written beside it unless the same one is
    there, through ingest.publish. In server mode both go to the server first (an upload it
    refuses fails the bucket), and the executable is made for the server's entry bytes."""
    key, stored, store = row.key, scope.stored_aot, scope.store
    data: bytes | None = None
    error: str | None = None
    rebound: tuple[int, str] | None = None
    if scope.via_server:
        held = _server_entry(scope, row)
        if isinstance(held, str):
            return _Published(None, held, None, failed=True)
        if held is not None:
            row, rebound = replace(row, size=held[0], sha256=held[1]), held
    known = stored.get(key) if stored is not None else None
    if stored is None:
        pass
    elif known is not None and (
        outcome.stored or (not scope.via_server and _bound_here(scope, key, bucket))
    ):
        row = replace(row, aot_size=known[0], aot_sha256=known[1])  # stored: present() just looked
    elif outcome.payload is None:
        error = outcome.aot_error or "no executable to store"
    else:
        binding = scope.bindings.get(bucket.function)
        data = executables.pack(
            outcome.payload,
            key=key,
            entry_sha256=row.sha256,
            function=bucket.function,
            bucket=dict(bucket.values),
            spec_digest=binding.spec_digest if binding else None,
            source_digest=binding.source_digest if binding else None,
            custom_calls=outcome.custom_calls,
            platform_version=scope.plan.environment.platform_version,
            binding_digest=binding.digest(dict(bucket.values)) if binding else None,
            depends_on=binding.depends_on() if binding else None,
        )
        row = replace(row, aot_size=len(data), aot_sha256=sha256(data))
    plan = scope.plan
    if scope.via_server and data is not None:
        client = scope.ctx.index.client  # type: ignore[attr-defined]  # the http driver's
        failed_upload = upload(client, plan.cache.name, plan.environment.digest, key, None, data)
        if failed_upload is not None:
            return _Published(None, f"the executable: {failed_upload}", None, failed=True)
    published = ingest.publish(
        scope.ctx.index,
        plan.cache,
        plan.environment,
        scope.env_id,
        store,
        [ingest.NewObject(row, executable=data, in_storage=True)],
        quota=False,
        namespace_ready=True,
    )
    failure = published.failed.get(key)
    if failure is not None:
        return _Published(None, f"could not store the executable: {failure[1]}", None)
    if data is None:
        return _Published(row.aot_size, error, None, entry=rebound)
    assert stored is not None  # an executable is packed only with executables on
    stored[key] = (len(data), row.aot_sha256 or "")
    return _Published(row.aot_size, error, (len(data), row.aot_sha256 or ""), entry=rebound)


def _server_entry(scope: RunScope, row: NewEntry) -> tuple[int, str] | str | None:
    """Server mode: the entry this bucket's executable is bound to. None: the row's own (the
    server holds those bytes, or took them now); (size, sha256) of the server's entry where it
    holds the key with other bytes (a replica's compile of the same program), read into the node
    tier in place of this run's; a str: why the bucket fails (an upload the server refused)."""
    key = row.key
    held = scope.indexed.get(key)
    if held is None:  # the server lacks it: this run's entry goes up first
        client = scope.ctx.index.client  # type: ignore[attr-defined]  # the http driver's
        plan = scope.plan
        data = scope.store.read_bytes(f"{scope.ns_rel}/{key}{CACHE_SUFFIX}")
        if sha256(data) != row.sha256:  # the row's sha256 is one this run's put was handed
            return "the file at its key changed since this run's JAX wrote it: not uploaded"
        try:
            failed = upload(client, plan.cache.name, plan.environment.digest, key, data, None)
        except EntryConflict:  # a replica's upload of the same program landed meanwhile
            held = _indexed_now(scope, key)
            if held is None:
                return "the server refused the entry (it holds other bytes) but lists no row"
        else:
            return None if failed is None else f"the entry: {failed}"
    if held[1] == row.sha256:
        return None
    assert scope.server is not None  # set whenever via_server is
    _, why = scope.server.bring(key, held[1])
    if why is not None:
        return f"the server holds this program with other bytes, which could not be read: {why}"
    return held


def _indexed_now(scope: RunScope, key: str) -> tuple[int, str] | None:
    """(size, sha256) of ``key``'s row now: another writer may have indexed it since the run
    began."""
    held = scope.ctx.index.held_entries(scope.env_id, [key]).get(key)
    return None if held is None else (held.size, held.sha256)


def present_check(scope: RunScope, replace: bool = False) -> Callable[[str, Bucket], bool]:
    """Whether a bucket's key is fully warmed already: indexed, its entry (and stored executable,
    bound to this bucket: ``_bound_here``) on storage.

    Called from the compiling threads once a bucket is lowered; a yes means
    the bucket is ``cached`` without being compiled or loaded. A file at a key ``indexed`` does
    not hold is removed first (with ``replace``, a signed warm, whose ``indexed`` holds only
    signed entries; else one the index does not hold either: another writer's), so JAX compiles
    the bucket and writes it again instead of loading that file.
    """
    store, ns_rel, indexed, stored_aot = scope.store, scope.ns_rel, scope.indexed, scope.stored_aot

    def present(key: str, bucket: Bucket) -> bool:
        entry = f"{ns_rel}/{key}{CACHE_SUFFIX}"
        if scope.via_server:  # the server holds what it indexed: nothing to compile or send
            held = indexed.get(key)
            if held is None:
                held = _indexed_now(scope, key) if store.exists(entry) else None
                if held is None:  # this node's own file (an upload that failed): compiled again
                    if store.exists(entry):
                        log.warning("warm: %s is not on the server: removed, compiling it", entry)
                        store.delete([entry, f"{ns_rel}/{key}{EXECUTABLE_SUFFIX}"])
                    return False
            elif stored_aot is None or key in stored_aot:
                return True
            # No executable yet: JAX loads the server's entry (a hit, not a compile), and the
            # executable is made for it.
            assert scope.server is not None  # set whenever via_server is
            _, why = scope.server.bring(key, held[1])
            if why is not None:
                log.warning("warm: cannot read %s from the server (%s): compiling it", key, why)
            return False
        if key not in indexed:
            if store.exists(entry) and (replace or _indexed_now(scope, key) is None):
                why = "not signed" if replace else "not indexed (another writer's file)"
                log.warning("warm: %s is %s: removed, compiling it again", entry, why)
                store.delete([entry, f"{ns_rel}/{key}{EXECUTABLE_SUFFIX}"])
            return False
        if not store.exists(entry):
            return False
        return stored_aot is None or (key in stored_aot and _bound_here(scope, key, bucket))

    return present
