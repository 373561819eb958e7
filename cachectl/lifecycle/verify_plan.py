"""`cachectl verify`'s plan: storage checked against the index, each finding with its action.

One walk of the listing, a namespace at a time (``_Planner``), sorts every file into a finding
or a read; then every indexed file is read and checked (``lifecycle/checks.py``). The kinds of
finding and their actions are in ``lifecycle/verify_records.py``; ``lifecycle/verify.py``
describes the command as a whole.
"""

from __future__ import annotations

import functools
from collections import defaultdict
from collections.abc import Sequence
from datetime import datetime, timedelta
from typing import NamedTuple

from cachectl.context import Context
from cachectl.core import temps
from cachectl.core.errors import BadInput
from cachectl.core.units import format_duration
from cachectl.index import CacheInfo
from cachectl.index.lifecycle_queries import (
    EnvSummary,
    entry_digests,
    environments,
    executable_digests,
    service_written_entries,
    warms_in_progress,
)
from cachectl.index.models import utcnow
from cachectl.lifecycle import sweep
from cachectl.lifecycle.checks import (
    Check,
    EntryCheck,
    ExecutableCheck,
    check_executable,
    entry_checks,
)
from cachectl.lifecycle.lease import Lease
from cachectl.lifecycle.verify_records import (
    BAD_ENV,
    CLEAR_AOT,
    DELETE_ATIME,
    DELETE_TEMP,
    DROP_ROW,
    MISSING,
    MISSING_ATIME,
    MISSING_NAMESPACE,
    ORPHAN_AOT,
    ORPHAN_ATIME,
    QUARANTINE,
    RECORDS_DISAGREE,
    SERVICE_WRITE,
    STALE_TEMP,
    STRAY,
    UNINDEXED_NAMESPACE,
    UNKNOWN,
    WRITE_ATIME,
    XLA_SUBCACHE,
    VerifyFinding,
    VerifyOptions,
    VerifyPlan,
)
from cachectl.storage.entries import (
    ATIME_SUFFIX,
    CACHE_SUFFIX,
    EXECUTABLE_SUFFIX,
    Kind,
    classify,
    entry_file_matcher,
    keys_lacking_atime,
    parse_aot_filename,
)
from cachectl.storage.namespace import QUARANTINE_DIR, read_env_json
from cachectl.storage.store import Store, ordered_map, read_workers
from cachectl.trust import signing


class Unknown(NamedTuple):
    """A file in an indexed namespace that the index does not know."""

    namespace: str
    path: str
    warming: bool  # a warm of its environment is in progress
    action: str
    environment_id: int
    key: str | None


def _group_by_namespace(paths: Sequence[str]) -> tuple[dict[str, list[tuple[str, str]]], list[str]]:
    """Split a root listing into namespaces (jax-*/hw/digest16/...): (path in the namespace, path in
    the root); and stray files."""
    groups: dict[str, list[tuple[str, str]]] = defaultdict(list)
    strays: list[str] = []
    # The listing is sorted: a namespace's files come together, so a path that starts with the
    # current namespace's prefix (one C call) is sliced once; only the first path of each namespace,
    # and strays, are split at their first three slashes.
    prefix, cut = None, 0
    members: list[tuple[str, str]] = []
    for path in paths:
        if prefix is not None and path.startswith(prefix):
            members.append((path[cut:], path))
            continue
        parts = path.split("/", 3)
        if parts[0] == QUARANTINE_DIR:
            continue
        if len(parts) == 4 and parts[0].startswith("jax-"):
            ns = f"{parts[0]}/{parts[1]}/{parts[2]}"
            prefix, cut, members = f"{ns}/", len(ns) + 1, groups[ns]
            members.append((parts[3], path))
        else:
            strays.append(path)
    return groups, strays


class _Namespace(NamedTuple):
    """One indexed namespace with files, as its walk sees it."""

    namespace: str
    env: EnvSummary
    names: dict[str, str]  # path in the namespace -> path in the root
    kinds: dict[str, Kind]  # path in the namespace -> what the file is
    indexed: dict[str, tuple[int, str]]  # key -> (size, sha256) of its entry row
    indexed_aot: dict[str, tuple[int, str, str]]  # key -> (size, sha256, entry sha256)


def _unknown(
    u: Unknown, mtime: datetime | None, now: datetime, min_age: timedelta
) -> VerifyFinding:
    """The finding for a file the index does not know: quarantined unless a warm is in progress
    or it is younger than ``min_age``."""
    detail = "not in the index (unknown writer; `cachectl sync` adopts entries services wrote)"
    ns, path, env_id, key = u.namespace, u.path, u.environment_id, u.key
    if u.warming:
        return VerifyFinding(
            UNKNOWN, ns, path, detail + "; warm in progress: not quarantined", "", env_id, key
        )
    if u.action and mtime is not None and now - mtime < min_age:
        return VerifyFinding(
            UNKNOWN,
            ns,
            path,
            detail + f"; younger than --min-age {format_duration(min_age)}: not quarantined",
            "",
            env_id,
            key,
        )
    return VerifyFinding(UNKNOWN, ns, path, detail, u.action, env_id, key)


class _Planner:
    """One verify plan in the making: the walk of the listing, a namespace at a time, fills the
    read lists (``checks``, ``aot_checks``) and the files that need a second look; the reads and
    the last checks then add their findings."""

    def __init__(
        self,
        ctx: Context,
        cache: CacheInfo,
        options: VerifyOptions,
        store: Store,
        now: datetime,
        lease: Lease | None,
    ) -> None:
        self.ctx, self.cache, self.options, self.store = ctx, cache, options, store
        self.now, self.lease = now, lease
        self.plan = VerifyPlan(cache.name, store.url)
        if options.quarantine:
            self.plan.quarantine_dir = f"{QUARANTINE_DIR}/{now:%Y%m%dT%H%M%SZ}"
        self.envs: dict[str, EnvSummary] = {}
        self.warming: set[int] = set()
        self.checks: list[EntryCheck] = []
        self.aot_checks: list[ExecutableCheck] = []
        self.unknowns: list[Unknown] = []
        self.temp_paths: dict[str, str] = {}  # in-progress file -> its namespace ("" outside)
        self.atime_needed: dict[str, list[str]] = {}  # namespace -> keys of -cache without -atime

    def run(self, workers: int | None) -> VerifyPlan:
        scope = self._environments()
        # Paths only (on local disk no stat per file): the times of the few files that need one (unknown
        # writers, for --min-age) are read after the walk.
        listing = self.store.list_paths(scope)  # paths stay relative to the root
        self.plan.files_listed = len(listing)
        groups, strays = _group_by_namespace(listing)
        self._strays(strays)
        self.warming = set(
            warms_in_progress(self.ctx.index.sql, [e.id for e in self.envs.values()], now=self.now)
        )
        for ns in sorted(set(groups) | set(self.envs)):
            self._namespace(ns, groups.get(ns, []), self.envs.get(ns))
        self._debris(scope)
        self._unknowns(scope)
        bad = self._read(workers)
        self._missing_atimes(bad)
        self.plan.findings.sort(key=lambda f: (f.namespace, f.path, f.kind))
        return self.plan

    def _environments(self) -> str:
        """The indexed environments to check (``self.envs``); the listing's scope ("" = the root)."""
        envs = {e.namespace: e for e in environments(self.ctx.index.sql, self.cache.name)}
        prefix = self.options.env_prefix
        if not prefix:
            self.envs = envs
            return ""
        target = self.ctx.index.find_environment(self.cache.name, prefix)
        self.envs = {ns: e for ns, e in envs.items() if e.id == target.id}
        return target.namespace

    def _strays(self, strays: list[str]) -> None:
        """Files outside every namespace: in-progress ones are looked at with the debris
        (``sweep.find_debris``: a live writer's are no finding), the rest reported."""
        for path in strays:
            if path.rsplit("/", 1)[-1].startswith(temps.TEMP_PREFIX):
                self.temp_paths[path] = ""
            elif not path.startswith(
                (QUARANTINE_DIR + "/", temps.STAGING_DIR + "/")
            ) and not path.endswith(".lock"):
                self.plan.findings.append(
                    VerifyFinding(
                        STRAY,
                        "",
                        path,
                        "a file outside every namespace: not a cachectl "
                        "entry; remove it if nothing of yours needs it",
                    )
                )

    def _namespace(self, ns: str, files: list[tuple[str, str]], env: EnvSummary | None) -> None:
        if env is None:
            self.plan.findings.append(
                VerifyFinding(
                    UNINDEXED_NAMESPACE,
                    ns,
                    ns,
                    f"{len(files)} file(s) in a namespace the index does not know: "
                    "run `cachectl sync` to adopt it",
                )
            )
            return
        self.plan.namespaces += 1
        if not files:
            if env.entries:
                self.plan.findings.append(
                    VerifyFinding(
                        MISSING_NAMESPACE,
                        ns,
                        ns,
                        f"indexed with {env.entries} entries but no files in storage: "
                        "run `cachectl sync`",
                        environment_id=env.id,
                    )
                )
            return
        names = dict(files)
        is_entry = entry_file_matcher()
        # once per file: the loops below all need it (an entry's name in one regex match)
        kinds = {rel: Kind.ENTRY if is_entry(rel) else classify(rel) for rel in names}
        space = _Namespace(
            ns,
            env,
            names,
            kinds,
            entry_digests(self.ctx.index.sql, env.id),
            executable_digests(self.ctx.index.sql, env.id),
        )
        self._subcaches(space)
        if self.cache.effective_service_writes == "deny":
            self._service_writes(space)
        if self.cache.trusted_keys:
            self._disagreeing(space)
        entry_keys, aot_keys = self._files(space)
        self._missing(space, entry_keys, aot_keys)

    def _subcaches(self, space: _Namespace) -> None:
        ns = space.namespace
        for sub in sorted(
            {rel.split("/", 1)[0] for rel, kind in space.kinds.items() if kind is Kind.XLA_SUBCACHE}
        ):
            self.plan.findings.append(
                VerifyFinding(
                    XLA_SUBCACHE,
                    ns,
                    f"{ns}/{sub}",
                    "an XLA sub-cache directory: a writer ran without jax_persistent_cache_enable_xla_caches=none, "
                    "so its keys depend on this path; activate() and warm set none: find that writer, then remove "
                    "the directory",
                    environment_id=space.env.id,
                )
            )

    def _service_writes(self, space: _Namespace) -> None:
        ns = space.namespace
        for key, created in service_written_entries(self.ctx.index.sql, space.env.id):
            self.plan.findings.append(
                VerifyFinding(
                    SERVICE_WRITE,
                    ns,
                    f"{ns}/{key}{CACHE_SUFFIX}",
                    f"written by a service at {created:%Y-%m-%d %H:%M} UTC, after the last warm, while the cache "
                    "denies service writes (read-only is advisory: a process that lowers "
                    "min_compile_time_secs writes anyway)",
                    environment_id=space.env.id,
                    key=key,
                )
            )

    def _disagreeing(self, space: _Namespace) -> None:
        """Files the gate refuses although the index lists them: the cache trusts keys, and no
        list a trusted key signed names the index row's sha256 (trust/gate.py)."""
        ns = space.namespace
        try:
            info = self.ctx.index.get_environment(self.cache.name, space.env.digest)
            names = signing.unsigned_files(self.ctx.index, self.cache, info) or []
        except Exception as exc:  # noqa: BLE001 - an unreadable list: every file is refused
            names, why = [ns], f"the signed content list cannot be read ({exc})"
        else:
            why = (
                "the index row and the content list a trusted key signed disagree (or the list "
                "lacks it): every service refuses this file and compiles its program; re-sign "
                "with a trusted key (`cachectl warm --sign-key`)"
            )
        for name in sorted(names):
            path = name if name == ns else f"{ns}/{name}"
            key = name.removesuffix(CACHE_SUFFIX).removesuffix(EXECUTABLE_SUFFIX)
            self.plan.findings.append(
                VerifyFinding(RECORDS_DISAGREE, ns, path, why, environment_id=space.env.id, key=key)
            )

    def _files(self, space: _Namespace) -> tuple[set[str], set[str]]:
        """Each file of a namespace to its list or finding; the keys of its entries and executables.

        In listing order (the findings are sorted at the end); most files are indexed entries,
        which take the first branch and one lookup."""
        ns, env_id, indexed, kinds = space.namespace, space.env.id, space.indexed, space.kinds
        warm = env_id in self.warming
        quarantine = self.options.action(QUARANTINE)
        checks, unknowns = self.checks, self.unknowns
        entry_keys: set[str] = set()
        aot_keys: set[str] = set()
        for rel, path in space.names.items():
            kind = kinds[rel]
            if kind is Kind.ENTRY:
                key = rel[: -len(CACHE_SUFFIX)]  # classify() matched the name: no second parse
                entry_keys.add(key)
                row = indexed.get(key)
                if row is not None:
                    size, digest = row
                    checks.append(EntryCheck(ns, key, size, digest, env_id, path))
                else:
                    unknowns.append(Unknown(ns, path, warm, quarantine, env_id, key))
            elif kind is Kind.AOT:
                aot_keys.add(self._executable(space, rel, path, warm))
            else:
                self._other(space, rel, path, kind, warm)
        return entry_keys, aot_keys

    def _executable(self, space: _Namespace, rel: str, path: str, warm: bool) -> str:
        """A stored executable to check, an orphan or an unknown; its key."""
        parsed = parse_aot_filename(rel)
        assert parsed is not None
        ns, env_id, key = space.namespace, space.env.id, parsed.key
        if f"{key}{CACHE_SUFFIX}" not in space.names:
            self.plan.findings.append(
                VerifyFinding(
                    ORPHAN_AOT,
                    ns,
                    path,
                    "stored executable without its -cache entry (unusable)",
                    self.options.action(QUARANTINE),
                    env_id,
                    key,
                )
            )
        elif key in space.indexed_aot:
            size, digest, entry_sha = space.indexed_aot[key]
            self.aot_checks.append(ExecutableCheck(ns, key, size, digest, env_id, entry_sha))
        else:
            self.unknowns.append(
                Unknown(ns, path, warm, self.options.action(QUARANTINE), env_id, key)
            )
        return key

    def _other(self, space: _Namespace, rel: str, path: str, kind: Kind, warm: bool) -> None:
        """A file that is neither an entry nor an executable: sidecars, env.json, temporaries."""
        ns, env = space.namespace, space.env
        if kind is Kind.ATIME:
            key = rel[: -len(ATIME_SUFFIX)]
            if f"{key}{CACHE_SUFFIX}" not in space.names:
                self.plan.findings.append(
                    VerifyFinding(
                        ORPHAN_ATIME,
                        ns,
                        path,
                        "-atime without its -cache",
                        self.options.action(DELETE_ATIME),
                        env.id,
                        key,
                    )
                )
        elif kind is Kind.ENV:
            try:
                found = read_env_json(self.store, ns)
                if found.digest != env.digest:
                    self.plan.findings.append(
                        VerifyFinding(
                            BAD_ENV,
                            ns,
                            path,
                            f"describes environment {found.digest[:16]}, index says {env.digest[:16]}",
                        )
                    )
            except (BadInput, FileNotFoundError) as exc:
                self.plan.findings.append(VerifyFinding(BAD_ENV, ns, path, str(exc)))
        elif kind is Kind.OTHER:
            self.unknowns.append(
                Unknown(ns, path, warm, self.options.action(QUARANTINE), env.id, None)
            )
        elif kind is Kind.TEMP:
            self.temp_paths[path] = ns

    def _missing(self, space: _Namespace, entry_keys: set[str], aot_keys: set[str]) -> None:
        """Indexed files that are not in storage; entries whose -atime JAX's eviction needs."""
        ns, env_id = space.namespace, space.env.id
        for key in sorted(set(space.indexed) - entry_keys):
            self.plan.findings.append(
                VerifyFinding(
                    MISSING,
                    ns,
                    f"{ns}/{key}{CACHE_SUFFIX}",
                    "indexed, but no file in storage",
                    self.options.action(DROP_ROW),
                    env_id,
                    key,
                )
            )
        for key in sorted(set(space.indexed_aot) - aot_keys):
            if key in entry_keys:  # else the entry's own missing finding drops the whole row
                self.plan.findings.append(
                    VerifyFinding(
                        MISSING,
                        ns,
                        f"{ns}/{key}{EXECUTABLE_SUFFIX}",
                        "stored executable indexed, but no file in storage",
                        self.options.action(CLEAR_AOT),
                        env_id,
                        key,
                    )
                )
        lacking = keys_lacking_atime(space.kinds)
        if lacking is not None:
            self.atime_needed[ns] = lacking

    def _debris(self, scope: str) -> None:
        for d in sweep.find_debris(self.store, list(self.temp_paths), staging=not scope):
            self.plan.findings.append(
                VerifyFinding(
                    STALE_TEMP,
                    self.temp_paths.get(d.path, ""),
                    d.path,
                    f"an unfinished {'bundle install staging directory' if d.directory else 'write'}: "
                    f"{d.why}; --repair (or --quarantine) removes it",
                    self.options.action(DELETE_TEMP),
                )
            )

    def _unknowns(self, scope: str) -> None:
        # --min-age spares a young unknown file from quarantine: only those need a time.
        infos = self.store.infos(
            [u.path for u in self.unknowns if u.action and not u.warming], within=scope
        )
        for u in self.unknowns:
            info = infos.get(u.path)
            self.plan.findings.append(
                _unknown(u, info.mtime if info else None, self.now, self.options.min_age)
            )

    def _read(self, workers: int | None) -> set[str]:
        """Read and check every indexed file; the paths of the bad entries."""
        plan, lease, checks, aot_checks = self.plan, self.lease, self.checks, self.aot_checks
        bad: set[str] = set()
        sizes = [c.size for c in checks] + [c.size for c in aot_checks]
        workers = workers or read_workers(self.store, sizes)
        for entry, result in zip(checks, entry_checks(self.store, checks, workers), strict=True):
            if result.kind is None:  # a good file: counted here, without a call per file
                plan.bytes_read += result.nread
                if lease is not None:
                    lease.check()
                continue
            finding = self._checked(entry, CACHE_SUFFIX, result, DROP_ROW)
            if finding:
                bad.add(finding.path)
        plan.entries_checked += len(checks)
        with self.store.reader() as read:
            aot_results = ordered_map(
                functools.partial(check_executable, read), aot_checks, workers
            )
            for exe, result in zip(aot_checks, aot_results, strict=True):
                plan.executables_checked += 1
                self._checked(exe, EXECUTABLE_SUFFIX, result, CLEAR_AOT)
        return bad

    def _checked(
        self, c: EntryCheck | ExecutableCheck, suffix: str, result: Check, if_missing: str
    ) -> VerifyFinding | None:
        """Count one checked file into the plan; the finding it adds, if any (a missing file's
        action is ``if_missing``; anything else wrong is quarantined)."""
        self.plan.bytes_read += result.nread
        if self.lease is not None:
            self.lease.check()
        if result.kind is None:
            return None
        finding = VerifyFinding(
            result.kind,
            c.namespace,
            f"{c.namespace}/{c.key}{suffix}",
            result.detail,
            self.options.action(if_missing if result.kind == MISSING else QUARANTINE),
            c.environment_id,
            c.key,
        )
        self.plan.findings.append(finding)
        return finding

    def _missing_atimes(self, bad: set[str]) -> None:
        """-cache files without their -atime where JAX's eviction runs, less those going away."""
        unknown = {f.path for f in self.plan.findings if f.kind == UNKNOWN}
        for ns, keys in self.atime_needed.items():
            for key in keys:
                path = f"{ns}/{key}{CACHE_SUFFIX}"
                if path not in bad and path not in unknown:
                    self.plan.findings.append(
                        VerifyFinding(
                            MISSING_ATIME,
                            ns,
                            f"{ns}/{key}{ATIME_SUFFIX}",
                            "-cache without -atime while JAX eviction is on (.lockfile): "
                            "JAX's size limit fails on it",
                            self.options.action(WRITE_ATIME),
                            self.envs[ns].id,
                            key,
                        )
                    )


def plan_verify(
    ctx: Context,
    cache: CacheInfo,
    options: VerifyOptions = VerifyOptions(),  # noqa: B008 - frozen: one shared default is safe
    *,
    now: datetime | None = None,
    lease: Lease | None = None,
    workers: int | None = None,
    store: Store | None = None,
) -> VerifyPlan:
    """Check storage against the index; findings carry the action execution would take."""
    now = now or utcnow()
    store = store or ctx.store(cache)
    store.check_reachable()
    return _Planner(ctx, cache, options, store, now, lease).run(workers)
