"""`cachectl verify`: every indexed entry exists, matches its checksum and decompresses.

One recursive listing of the root's paths (no stat per local file: only
unknown files get one, for --min-age), then every indexed entry is read, hashed
and its header checked (a bounded decompression): through ``Store.reader``
(on local disk each namespace directory is opened once, files relative to
it), on threads for object stores and for big local files
(``store.read_workers``). Files in a namespace the index does not know are "unknown
writer" findings. With --quarantine, unknown, corrupt and mismatched files
move to ``<root>/.quarantine/<UTC timestamp>/<namespace>/<file>`` (outside
every namespace, so JAX never reads them) and their index rows go; with
--repair (implied by --quarantine) JAX's sidecars are fixed: an ``-atime``
without its ``-cache`` is deleted, a ``-cache`` without its ``-atime`` in a
namespace where JAX's own eviction runs (a ``.lockfile`` exists) gets a
fresh one, and rows of missing files are dropped. Any finding means exit 1.

Stored executables (``<key>-aot``) are checked like entries: size and sha256
against the index, and their header (``aot.read_header``: magic, format,
payload checksum; the key and entry sha256 it names must be its entry's).
A bad one is quarantined and its entry's executable columns cleared (the
entry stays); an indexed one that is gone has its columns cleared (repair);
an ``-aot`` without its ``-cache`` is an orphan (quarantined); one the index
does not know is an unknown writer. A quarantined entry takes its ``-aot``
into quarantine with it.

Files a writer killed mid-write left (``.tmp-*`` beside their target, a bundle install's
``.staging/bundle-*`` directory) are ``stale-temp`` findings once their writer is gone
(``lifecycle/sweep.py``: its host and pid are in the name, else 24 h untouched); repair removes
them. A live writer's are no finding.
"""

from __future__ import annotations

import hashlib
import itertools
import operator
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from cachectl.context import Context
from cachectl.core import temps
from cachectl.core.errors import BadInput
from cachectl.core.fingerprint import current_environment
from cachectl.core.units import format_duration
from cachectl.index import CacheInfo
from cachectl.index.lifecycle_queries import (
    WARM_HEARTBEAT_WINDOW,
    delete_entry_rows,
    entry_digests,
    environments,
    executable_digests,
    service_written_entries,
    warms_in_progress,
)
from cachectl.index.models import utcnow
from cachectl.lifecycle import lease as leases
from cachectl.lifecycle import sweep
from cachectl.lifecycle.deep import load_all
from cachectl.lifecycle.lease import Lease
from cachectl.lifecycle.sync import _group_by_namespace, check_entry_bytes
from cachectl.storage import executables as aot
from cachectl.storage.entries import (
    AOT_SUFFIX,
    ATIME_SUFFIX,
    CACHE_SUFFIX,
    CorruptEntry,
    Kind,
    classify,
    entry_file_matcher,
    parse_aot_filename,
    sha256,
)
from cachectl.storage.namespace import QUARANTINE_DIR, read_env_json
from cachectl.storage.store import NotRegularFile, Store, ordered_map, read_workers
from cachectl.trust.permissions import check_writer

# Kinds of finding, and what --quarantine / --repair does about each.
MISSING = "missing"  # index row, no file: row dropped (repair)
CORRUPT = "corrupt"  # does not decompress / header insane: quarantined
MISMATCH = "mismatch"  # decompresses, but size or sha256 differ from the index: quarantined
UNKNOWN = "unknown-writer"  # a file in a namespace the index does not know: quarantined
ORPHAN_ATIME = "orphan-atime"  # -atime without -cache: deleted (repair)
MISSING_ATIME = "missing-atime"  # -cache without -atime where JAX eviction is on: written (repair)
BAD_ENV = "bad-env-json"  # env.json unreadable or for another environment: reported
UNINDEXED_NAMESPACE = "unindexed-namespace"  # a whole namespace the index lacks: `cachectl sync`
MISSING_NAMESPACE = "missing-namespace"  # an indexed namespace with no files: `cachectl sync`
ORPHAN_AOT = "orphan-aot"  # -aot without its -cache: quarantined
XLA_SUBCACHE = "xla-subcache"  # an XLA sub-cache directory: keys become path-dependent; reported
STRAY = "stray-file"  # a file in the root outside every namespace: reported
SERVICE_WRITE = "service-write"  # a service wrote an entry although the cache denies service writes
NOT_LOADABLE = "not-loadable"  # --deep: the header is fine but JAX cannot load the executable
# A dead writer's .tmp-* file or bundle staging directory (lifecycle/sweep.py): deleted (repair).
# One whose writer may still be writing is not a finding.
STALE_TEMP = "stale-temp"

QUARANTINE, DROP_ROW, DELETE_ATIME, WRITE_ATIME = (
    "quarantine",
    "drop-row",
    "delete-atime",
    "write-atime",
)
DELETE_TEMP = "delete-temp"  # a stale-temp file or directory is removed (repair), re-checked first
CLEAR_AOT = "clear-executable"  # an indexed -aot is gone: its entry's executable columns are cleared (repair)
# An unknown file younger than this may be a writer's between its storage
# write and its index row: reported, not quarantined (verify --min-age).
RECENT_GRACE = WARM_HEARTBEAT_WINDOW


@dataclass(frozen=True, slots=True)
class Finding:
    kind: str
    namespace: str
    path: str  # relative to the cache root
    detail: str
    action: str = ""  # what execution does about it ("" = nothing)
    environment_id: int | None = None
    key: str | None = None


@dataclass
class VerifyPlan:
    cache: str
    root: str
    entries_checked: int = 0
    executables_checked: int = 0
    bytes_read: int = 0
    files_listed: int = 0
    namespaces: int = 0
    findings: list[Finding] = field(default_factory=list)
    quarantine_dir: str | None = None

    __json_extra__ = ("counts",)

    @property
    def counts(self) -> dict[str, int]:
        return dict(Counter(f.kind for f in self.findings))


@dataclass(frozen=True)
class VerifyResult:
    plan: VerifyPlan
    quarantined: int
    atimes_deleted: int
    atimes_written: int
    rows_dropped: int
    dry_run: bool
    duration_s: float
    executables_cleared: int = 0
    temps_removed: int = 0

    __json_extra__ = ("ok",)

    @property
    def ok(self) -> bool:
        return not self.plan.findings


Check = tuple[str | None, str, int]  # (kind or None, detail, bytes read)


def _verdict(
    data: bytes, size: int, digest: str, corrupt: str | None, problems: list[str]
) -> Check:
    """The finding for one file's bytes: header problems first, then size and sha256 against the index."""
    if len(data) != size:
        problems.append(f"{len(data)} bytes, index says {size}")
    if sha256(data) != digest:
        problems.append("sha256 differs from the index")
    if corrupt:
        return CORRUPT, "; ".join([corrupt, *problems]), len(data)
    if problems:
        return MISMATCH, "; ".join(problems), len(data)
    return None, "", len(data)


def _check_entry(read: Callable[[str], bytes], path: str, size: int, digest: str) -> Check:
    """The finding for one indexed entry file (``read``: a reader of ``path``)."""
    try:
        data = read(path)
    except NotRegularFile:
        return CORRUPT, "not a regular file (a symlink, or reached through one): never read", 0
    except FileNotFoundError:
        return MISSING, "file is gone", 0
    try:
        check_entry_bytes(data)
    except CorruptEntry as exc:
        return _verdict(data, size, digest, str(exc), [])
    if len(data) == size and hashlib.sha256(data).hexdigest() == digest:
        return None, "", size  # most files: no lists, no second hash
    return _verdict(data, size, digest, None, [])


def _entry_checks(
    store: Store, checks: list[tuple[str, str, int, str, int, str]], workers: int
) -> Iterator[Check]:
    """``_check_entry`` of each check, in order: a namespace's entries read by name through one
    directory reader (``Store.dir_reader``: its descriptor found once, not a path parsed per file)."""
    for ns, run in itertools.groupby(checks, key=operator.itemgetter(0)):
        with store.dir_reader(ns) as read:

            def check(
                c: tuple[str, str, int, str, int, str], read: Callable[[str], bytes] = read
            ) -> Check:
                return _check_entry(read, f"{c[1]}{CACHE_SUFFIX}", c[2], c[3])

            yield from ordered_map(check, list(run), workers)


def _check_executable(
    read: Callable[[str], bytes], path: str, key: str, size: int, digest: str, entry_sha: str
) -> Check:
    """The finding for one indexed stored executable."""
    try:
        data = read(path)
    except FileNotFoundError:
        return MISSING, "stored executable indexed, but no file in storage", 0
    problems = []
    corrupt = None
    try:
        header = aot.read_header(data)
        if header.key != key:
            corrupt = f"stored executable header names key {header.key[:40]}…, not its file's"
        elif header.entry_sha256 != entry_sha:
            problems.append(
                "made for other entry bytes (its entry_sha256 is not the indexed entry's)"
            )
    except CorruptEntry as exc:
        corrupt = str(exc)
    return _verdict(data, size, digest, corrupt, problems)


def is_executable(f: Finding) -> bool:
    """Whether a finding is about a stored executable (``-aot``), not a JAX entry."""
    return f.path.endswith(AOT_SUFFIX)


def plan_verify(
    ctx: Context,
    cache: CacheInfo,
    *,
    env_prefix: str | None = None,
    quarantine: bool = False,
    repair: bool = False,
    now: datetime | None = None,
    lease: Lease | None = None,
    workers: int | None = None,
    min_age: timedelta = RECENT_GRACE,
    store: Store | None = None,
) -> VerifyPlan:
    """Check storage against the index; findings carry the action execution would take."""
    now = now or utcnow()
    repair = repair or quarantine
    store = store or ctx.store(cache)
    store.check_reachable()
    plan = VerifyPlan(cache.name, store.url)
    if quarantine:
        plan.quarantine_dir = f"{QUARANTINE_DIR}/{now:%Y%m%dT%H%M%SZ}"
    envs = {e.namespace: e for e in environments(ctx.sql_index, cache.name)}
    if env_prefix:
        target = ctx.index.find_environment(cache.name, env_prefix)
        envs = {ns: e for ns, e in envs.items() if e.id == target.id}
        scope = target.namespace
    else:
        scope = ""
    # Paths only (on local disk no stat per file): the times of the few files that need one (unknown
    # writers, for --min-age) are read after the walk.
    listing = store.list_paths(scope)  # paths stay relative to the root
    plan.files_listed = len(listing)
    groups, strays = _group_by_namespace(listing, listing)
    # In-progress files: debris when their writer is gone (sweep.find_debris), else no finding.
    temp_paths: dict[str, str] = {}  # path -> namespace
    for path in strays:
        if path.rsplit("/", 1)[-1].startswith(temps.TEMP_PREFIX):
            temp_paths[path] = ""
        elif not path.startswith(
            (QUARANTINE_DIR + "/", temps.STAGING_DIR + "/")
        ) and not path.endswith(".lock"):
            plan.findings.append(
                Finding(
                    STRAY,
                    "",
                    path,
                    "a file outside every namespace: not a cachectl "
                    "entry; remove it if nothing of yours needs it",
                )
            )
    warming = warms_in_progress(ctx.sql_index, [e.id for e in envs.values()], now=now)
    checks: list[
        tuple[str, str, int, str, int, str]
    ] = []  # (namespace, key, size, sha, env id, path)
    aot_checks: list[tuple[str, str, int, str, int, str]] = []  # (+ the entry's indexed sha256)
    atime_needed: dict[str, list[tuple[str, str]]] = {}
    # Files the index does not know: (namespace, path, warm in progress, action, env id, key).
    unknowns: list[tuple[str, str, bool, str, int, str | None]] = []

    def act(action: str) -> str:
        return action if (quarantine if action == QUARANTINE else repair) else ""

    is_entry = entry_file_matcher()
    for ns in sorted(set(groups) | set(envs)):
        files = groups.get(ns, [])
        env = envs.get(ns)
        if env is None:
            plan.findings.append(
                Finding(
                    UNINDEXED_NAMESPACE,
                    ns,
                    ns,
                    f"{len(files)} file(s) in a namespace the index does not know: "
                    "run `cachectl sync` to adopt it",
                )
            )
            continue
        plan.namespaces += 1
        if not files:
            if env.entries:
                plan.findings.append(
                    Finding(
                        MISSING_NAMESPACE,
                        ns,
                        ns,
                        f"indexed with {env.entries} entries but no files in storage: "
                        "run `cachectl sync`",
                        environment_id=env.id,
                    )
                )
            continue
        indexed = entry_digests(ctx.sql_index, env.id)
        indexed_aot = executable_digests(ctx.sql_index, env.id)
        names = dict(files)  # path in the namespace -> path in the root
        # once per file: the loops below all need it (an entry's name in one regex match)
        kinds = {rel: Kind.ENTRY if is_entry(rel) else classify(rel) for rel in names}
        has_lockfile = any(kind is Kind.LOCKFILE for kind in kinds.values())
        subcaches = sorted(
            {rel.split("/", 1)[0] for rel, kind in kinds.items() if kind is Kind.XLA_SUBCACHE}
        )
        for sub in subcaches:
            plan.findings.append(
                Finding(
                    XLA_SUBCACHE,
                    ns,
                    f"{ns}/{sub}",
                    "an XLA sub-cache directory: a writer ran without jax_persistent_cache_enable_xla_caches=none, "
                    "so its keys depend on this path; activate() and warm set none: find that writer, then remove "
                    "the directory",
                    environment_id=env.id,
                )
            )
        if cache.effective_service_writes == "deny":
            for key, created in service_written_entries(ctx.sql_index, env.id):
                plan.findings.append(
                    Finding(
                        SERVICE_WRITE,
                        ns,
                        f"{ns}/{key}{CACHE_SUFFIX}",
                        f"written by a service at {created:%Y-%m-%d %H:%M} UTC, after the last warm, while the cache "
                        "denies service writes (read-only is advisory: a process that lowers "
                        "min_compile_time_secs writes anyway)",
                        environment_id=env.id,
                        key=key,
                    )
                )
        entry_keys: set[str] = set()
        aot_keys: set[str] = set()
        # In listing order (the findings are sorted at the end); most files are indexed entries,
        # which take the first branch and one lookup.
        for rel, path in names.items():
            kind = kinds[rel]
            if kind is Kind.ENTRY:
                key = rel[: -len(CACHE_SUFFIX)]  # classify() matched the name: no second parse
                entry_keys.add(key)
                row = indexed.get(key)
                if row is not None:
                    checks.append((ns, key, row[0], row[1], env.id, path))
                else:
                    unknowns.append((ns, path, env.id in warming, act(QUARANTINE), env.id, key))
            elif kind is Kind.AOT:
                parsed = parse_aot_filename(rel)
                assert parsed is not None
                aot_keys.add(parsed.key)
                if f"{parsed.key}{CACHE_SUFFIX}" not in names:
                    plan.findings.append(
                        Finding(
                            ORPHAN_AOT,
                            ns,
                            path,
                            "stored executable without its -cache entry (unusable)",
                            act(QUARANTINE),
                            env.id,
                            parsed.key,
                        )
                    )
                elif parsed.key in indexed_aot:
                    size, digest, entry_sha = indexed_aot[parsed.key]
                    aot_checks.append((ns, parsed.key, size, digest, env.id, entry_sha))
                else:
                    unknowns.append(
                        (ns, path, env.id in warming, act(QUARANTINE), env.id, parsed.key)
                    )
            elif kind is Kind.ATIME:
                key = rel[: -len(ATIME_SUFFIX)]
                if f"{key}{CACHE_SUFFIX}" not in names:
                    plan.findings.append(
                        Finding(
                            ORPHAN_ATIME,
                            ns,
                            path,
                            "-atime without its -cache",
                            act(DELETE_ATIME),
                            env.id,
                            key,
                        )
                    )
            elif kind is Kind.ENV:
                try:
                    found = read_env_json(store, ns)
                    if found.digest != env.digest:
                        plan.findings.append(
                            Finding(
                                BAD_ENV,
                                ns,
                                path,
                                f"describes environment {found.digest[:16]}, index says {env.digest[:16]}",
                            )
                        )
                except (BadInput, FileNotFoundError) as exc:
                    plan.findings.append(Finding(BAD_ENV, ns, path, str(exc)))
            elif kind is Kind.OTHER:
                unknowns.append((ns, path, env.id in warming, act(QUARANTINE), env.id, None))
            elif kind is Kind.TEMP:
                temp_paths[path] = ns
        for key in sorted(set(indexed) - entry_keys):
            plan.findings.append(
                Finding(
                    MISSING,
                    ns,
                    f"{ns}/{key}{CACHE_SUFFIX}",
                    "indexed, but no file in storage",
                    act(DROP_ROW),
                    env.id,
                    key,
                )
            )
        for key in sorted(set(indexed_aot) - aot_keys):
            if key in entry_keys:  # else the entry's own missing finding drops the whole row
                plan.findings.append(
                    Finding(
                        MISSING,
                        ns,
                        f"{ns}/{key}{AOT_SUFFIX}",
                        "stored executable indexed, but no file in storage",
                        act(CLEAR_AOT),
                        env.id,
                        key,
                    )
                )
        if has_lockfile:
            atime_needed[ns] = [
                (key, f"{ns}/{key}{CACHE_SUFFIX}")
                for key in sorted(entry_keys)
                if f"{key}{ATIME_SUFFIX}" not in names
            ]

    for d in sweep.find_debris(store, list(temp_paths), staging=not scope):
        plan.findings.append(
            Finding(
                STALE_TEMP,
                temp_paths.get(d.path, ""),
                d.path,
                f"an unfinished {'bundle install staging directory' if d.directory else 'write'}: "
                f"{d.why}; --repair (or --quarantine) removes it",
                act(DELETE_TEMP),
            )
        )
    # --min-age spares a young unknown file from quarantine: only those need a time.
    infos = store.infos([u[1] for u in unknowns if u[3] and not u[2]], within=scope)
    for ns, path, warm, action, env_id, file_key in unknowns:
        info = infos.get(path)
        plan.findings.append(
            _unknown(
                ns, path, info.mtime if info else None, now, min_age, warm, action, env_id, file_key
            )
        )
    bad: set[str] = set()
    workers = workers or read_workers(store, [c[2] for c in checks] + [c[2] for c in aot_checks])
    with store.reader() as read:

        def check_aot(c: tuple[str, str, int, str, int, str]) -> Check:
            return _check_executable(read, f"{c[0]}/{c[1]}{AOT_SUFFIX}", c[1], c[2], c[3], c[5])

        entry_results = _entry_checks(store, checks, workers)
        for (ns, key, _size, _sha, env_id, _path), (fault, detail, nread) in zip(
            checks, entry_results, strict=True
        ):
            if fault is None:  # a good file: counted here, without a call per file
                plan.bytes_read += nread
                if lease is not None:
                    lease.check()
                continue
            finding = _finding(
                plan, lease, ns, key, env_id, CACHE_SUFFIX, fault, detail, nread, act(DROP_ROW), act
            )
            if finding:
                bad.add(finding.path)
        plan.entries_checked += len(checks)
        aot_results = ordered_map(check_aot, aot_checks, workers)
        for (ns, key, _size, _sha, env_id, _esha), (fault, detail, nread) in zip(
            aot_checks, aot_results, strict=True
        ):
            plan.executables_checked += 1
            _finding(
                plan, lease, ns, key, env_id, AOT_SUFFIX, fault, detail, nread, act(CLEAR_AOT), act
            )
    unknown = {f.path for f in plan.findings if f.kind == UNKNOWN}
    for ns, items in atime_needed.items():
        for key, path in items:
            if path not in bad and path not in unknown:
                plan.findings.append(
                    Finding(
                        MISSING_ATIME,
                        ns,
                        f"{ns}/{key}{ATIME_SUFFIX}",
                        "-cache without -atime while JAX eviction is on (.lockfile): "
                        "JAX's size limit fails on it",
                        act(WRITE_ATIME),
                        envs[ns].id,
                        key,
                    )
                )
    plan.findings.sort(key=lambda f: (f.namespace, f.path, f.kind))
    return plan


def _finding(
    plan: VerifyPlan,
    lease: Lease | None,
    ns: str,
    key: str,
    env_id: int,
    suffix: str,
    kind: str | None,
    detail: str,
    nread: int,
    if_missing: str,
    act: Callable[[str], str],
) -> Finding | None:
    """Count one checked file into the plan; the finding it adds, if any (a missing file's
    action is ``if_missing``; anything else wrong is quarantined)."""
    plan.bytes_read += nread
    if lease is not None:
        lease.check()
    if kind is None:
        return None
    finding = Finding(
        kind,
        ns,
        f"{ns}/{key}{suffix}",
        detail,
        if_missing if kind == MISSING else act(QUARANTINE),
        env_id,
        key,
    )
    plan.findings.append(finding)
    return finding


def _unknown(
    ns: str,
    path: str,
    mtime: datetime | None,
    now: datetime,
    min_age: timedelta,
    warming: bool,
    action: str,
    env_id: int,
    key: str | None,
) -> Finding:
    detail = "not in the index (unknown writer; `cachectl sync` adopts entries services wrote)"
    if warming:
        return Finding(
            UNKNOWN, ns, path, detail + "; warm in progress: not quarantined", "", env_id, key
        )
    if action and mtime is not None and now - mtime < min_age:
        return Finding(
            UNKNOWN,
            ns,
            path,
            detail + f"; younger than --min-age {format_duration(min_age)}: not quarantined",
            "",
            env_id,
            key,
        )
    return Finding(UNKNOWN, ns, path, detail, action, env_id, key)


def _still_bad(ctx: Context, store: Store, f: Finding) -> bool:
    """Re-read an indexed entry right before moving it: a write that finished since the
    check (or a row corrected meanwhile) is not moved away."""
    if (
        f.kind not in (CORRUPT, MISMATCH)
        or not f.key
        or f.environment_id is None
        or is_executable(f)
    ):
        return True
    row = ctx.index.get_entry(f.environment_id, f.key)
    if row is None:
        return True
    kind, _, _ = _check_entry(store.read_bytes, f.path, row.size, row.sha256)
    return kind is not None


def execute_verify(
    ctx: Context, cache: CacheInfo, plan: VerifyPlan, *, started: float, store: Store | None = None
) -> VerifyResult:
    """Move, delete, write and drop what the findings say; then audit."""
    store = store or ctx.store(cache)
    by_action: dict[str, list[Finding]] = defaultdict(list)
    for f in plan.findings:
        if f.action:
            by_action[f.action].append(f)
    moved: list[str] = []
    rows: dict[int, list[str]] = defaultdict(list)
    # entries whose executable columns go
    cleared: dict[int, dict[str, tuple[int, str] | None]] = defaultdict(dict)
    to_move = [f for f in by_action[QUARANTINE] if _still_bad(ctx, store, f)]
    moving = {f.path for f in to_move}
    for f in list(to_move):
        # A quarantined entry's executable is unusable without it: it goes along.
        aot_path = f"{f.namespace}/{f.key}{AOT_SUFFIX}"
        if (
            f.key
            and not is_executable(f)
            and f.kind in (CORRUPT, MISMATCH, UNKNOWN)
            and aot_path not in moving
        ):
            to_move.append(
                Finding(
                    f.kind,
                    f.namespace,
                    aot_path,
                    "with its entry",
                    QUARANTINE,
                    f.environment_id,
                    f.key,
                )
            )
            moving.add(aot_path)
    if to_move:
        assert plan.quarantine_dir is not None

        def move(f: Finding) -> str | None:
            try:
                store.move(f.path, f"{plan.quarantine_dir}/{f.path}")
                return f.path
            except FileNotFoundError:
                return None

        with ThreadPoolExecutor(max_workers=read_workers(store)) as pool:
            moved = [p for p in pool.map(move, to_move) if p]
        for f in to_move:
            if f.kind in (CORRUPT, MISMATCH) and f.environment_id is not None and f.key:
                if is_executable(f):
                    cleared[f.environment_id][f.key] = None
                else:
                    rows[f.environment_id].append(f.key)
        # A moved entry's -atime would be an orphan: remove it with the entry.
        store.delete(
            f"{f.namespace}/{f.key}{ATIME_SUFFIX}"
            for f in to_move
            if f.key and not is_executable(f)
        )
    for f in by_action[DROP_ROW]:
        if f.environment_id is not None and f.key:
            rows[f.environment_id].append(f.key)
    for f in by_action[CLEAR_AOT]:
        if f.environment_id is not None and f.key:
            cleared[f.environment_id][f.key] = None
    dropped = delete_entry_rows(ctx.sql_index, rows) if rows else 0
    aot_cleared = sum(ctx.index.set_executables(env_id, keys) for env_id, keys in cleared.items())
    temps_removed = sweep.remove(
        store,
        [
            sweep.Debris(f.path, f.detail, f.path.startswith(temps.STAGING_DIR + "/"))
            for f in by_action[DELETE_TEMP]
        ],
    )
    orphans = [f.path for f in by_action[DELETE_ATIME]]
    if orphans:
        store.delete(orphans)
    written = 0
    for f in by_action[WRITE_ATIME]:
        store.write_bytes(f.path, time.time_ns().to_bytes(8, "little"))
        written += 1
    duration = time.monotonic() - started
    ctx.index.audit(
        "verify",
        cache=cache.name,
        entries=plan.entries_checked,
        nbytes=plan.bytes_read,
        duration_ms=int(duration * 1000),
        details={
            "findings": plan.counts,
            "quarantined": len(moved),
            "quarantine_dir": plan.quarantine_dir,
            "moved": moved[:200],
            "atimes_deleted": len(orphans),
            "atimes_written": written,
            "rows_dropped": dropped,
            "executables_cleared": aot_cleared,
            "temps_removed": temps_removed,
        },
    )
    return VerifyResult(
        plan,
        len(moved),
        len(orphans),
        written,
        dropped,
        False,
        duration,
        aot_cleared,
        temps_removed,
    )


def deep_findings(ctx: Context, cache: CacheInfo, plan: VerifyPlan, store: Store) -> list[Finding]:
    """Load every indexed entry of this machine's environment that passed the checks (--deep)."""

    env = current_environment()
    try:
        info = ctx.index.find_environment(cache.name, env.digest)
    except Exception:  # noqa: BLE001 - this machine's environment is not in this cache
        return []
    bad = {f.path for f in plan.findings}
    paths = [
        p
        for p in (
            f"{info.namespace}/{key}{CACHE_SUFFIX}"
            for key in sorted(entry_digests(ctx.sql_index, info.id))
        )
        if p not in bad
    ]
    return [
        Finding(
            NOT_LOADABLE,
            info.namespace,
            p.path,
            p.detail,
            environment_id=info.id,
            key=p.path.rsplit("/", 1)[-1][: -len(CACHE_SUFFIX)],
        )
        for p in load_all(store, paths)
    ]


def verify(
    ctx: Context,
    cache: CacheInfo,
    *,
    env_prefix: str | None = None,
    quarantine: bool = False,
    repair: bool = False,
    dry_run: bool = False,
    now: datetime | None = None,
    min_age: timedelta = RECENT_GRACE,
    deep: bool = False,
) -> VerifyResult:
    """Check; with quarantine/repair (and not a dry run) fix, under the cache's lifecycle lease.

    ``deep`` also loads every entry of this machine's environment in a subprocess
    (reported, never moved: another machine of this kind may load it)."""
    started = time.monotonic()
    store = ctx.store(cache)
    mutating = (quarantine or repair) and not dry_run
    if not mutating:
        plan = plan_verify(
            ctx,
            cache,
            env_prefix=env_prefix,
            quarantine=quarantine,
            repair=repair,
            now=now,
            min_age=min_age,
            store=store,
        )
        if deep:
            plan.findings.extend(deep_findings(ctx, cache, plan, store))
        if dry_run:
            return VerifyResult(plan, 0, 0, 0, 0, True, time.monotonic() - started)
        duration = time.monotonic() - started
        ctx.index.audit(
            "verify",
            cache=cache.name,
            entries=plan.entries_checked,
            nbytes=plan.bytes_read,
            duration_ms=int(duration * 1000),
            details={"findings": plan.counts},
        )
        return VerifyResult(plan, 0, 0, 0, 0, False, duration)
    check_writer(cache, "quarantine or repair")
    with leases.held(ctx.sql_index, cache.name, "verify") as lease:
        plan = plan_verify(
            ctx,
            cache,
            env_prefix=env_prefix,
            quarantine=quarantine,
            repair=repair,
            now=now,
            lease=lease,
            min_age=min_age,
            store=store,
        )
        if deep:
            plan.findings.extend(deep_findings(ctx, cache, plan, store))
        return execute_verify(ctx, cache, plan, started=started, store=store)
