"""Warm by running: the user's own command compiles, with writes on, into the namespace.

Libraries jit private closures no manifest can name (Keras's ``predict_step`` inside
``model.predict``, NumPyro's ``_fori_collect_loop`` inside ``MCMC.run``). The only way to
warm those is to run what calls them. The command runs with activate()'s JAX settings plus
warm's (``WARM_EXTRA_CONFIG``: every program written, whatever its compile time, which a
service never writes below JAX's one-second minimum), as environment variables, so any
process it starts (a Python script, a shell pipeline) writes into this environment's
namespace. Afterwards every entry the command's own processes wrote passes ingest's rules and
is indexed under a warm-runs row, as a manifest warm's are; a refused one is removed. Run it
again and the command hits what the first run wrote: ``written`` is then 0.

"The command's own" is what its Python processes report: the exec hook (COUNTS_VAR) in each
one appends the key of every entry JAX writes there, as it is written (JAX's write log, the one
``warm`` reads with ``CAPTURE.writes``), and the sha256 of the bytes it handed JAX's file cache:
JAX logs a write and then writes nothing where a file is at the key already, so a file is
claimed only when its sha256 is one its processes handed JAX. A listing of the namespace cannot say who wrote a file:
another process writes into a shared namespace meanwhile (a deploy job, another pod of a
sharded warm) and indexes its own. JAX logs a write before it writes the file, so a process
killed afterwards has already reported it. A file new to the namespace that no process reported
(another writer's, or one from a process without the hook: not Python, or Python run with
``-I`` or ``-S``) is never claimed, because a wrong attribution cannot be told from a right one
afterwards; those nothing indexed by the end of the run are reported
(``unclaimed``) and left as they are, for ``verify`` to name as ``unknown-writer``. Where no
process of the command reported at all and files appeared, the run fails (``unseen``): what
the command wrote went unseen, and a warm that indexed nothing must not pass.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from cachectl.context import Context
from cachectl.core.errors import BadInput
from cachectl.index import warm_runs
from cachectl.service.activate import env_vars_for
from cachectl.service.exec_hook import COUNTS_VAR, PUT, SHA256, WRITES_VAR, child_variables
from cachectl.storage import ingest, ingest_rules
from cachectl.storage.entries import CACHE_SUFFIX, EntryName, Kind, classify, parse_key
from cachectl.storage.jax_storage import child_env
from cachectl.trust.permissions import check_writer
from cachectl.warm.compiling import warm_jax_config


@dataclass(frozen=True)
class RunEntry:
    """One program the command's run left in the namespace."""

    key: str
    module: str
    bytes: int
    compile_ms: int | None
    # "written" (checked and indexed), "refused" (removed: error says why) or "foreign" (the
    # bytes at the key are not the ones the command handed JAX: another writer's, left there)
    status: str
    error: str | None = None


@dataclass(frozen=True)
class RunWarmReport:
    cache: str
    namespace: str
    command: list[str]
    exit_code: int
    entries: list[RunEntry]
    seconds: float
    run_id: int | None = None
    known_before: int = 0  # entries the namespace held before the run
    environment: dict[str, Any] = field(default_factory=dict)
    # JAX's own counts in the command's processes: compile requests, hits, and the programs it
    # compiled but would not write because they use host callbacks.
    requests: int = 0
    hits: int = 0
    host_callbacks: list[str] = field(default_factory=list)
    # Entry files new to the namespace that no process of the command reported writing and
    # nothing had indexed when the run ended: not claimed (see module), verify's unknown-writer.
    unclaimed: list[str] = field(default_factory=list)
    processes: int = 0  # the command's processes that imported JAX and reported to the hook

    @property
    def unseen(self) -> bool:
        """Files appeared unclaimed and no process of the command reported at all (not Python,
        or Python without the hook: ``-I``, ``-S``): what the command wrote went unseen, and is
        not indexed."""
        return bool(self.unclaimed) and self.processes == 0

    @property
    def written(self) -> int:
        return sum(e.status == "written" for e in self.entries)

    @property
    def nothing_written(self) -> bool:
        """The command compiled programs (its requests missed) and none could be written."""
        return self.written == 0 and (self.requests > self.hits or bool(self.host_callbacks))

    @property
    def ok(self) -> bool:
        return (
            self.exit_code == 0
            and all(e.status == "written" for e in self.entries)
            and not self.nothing_written
            and not self.unseen
        )


def run_digest(command: Sequence[str]) -> str:
    """A warm-runs row's digest of the command it ran (a manifest's row has the manifest's)."""
    return hashlib.sha256(json.dumps(["run", list(command)]).encode()).hexdigest()


def entry_names(store: Any, ns_rel: str) -> set[str]:
    """The JAX entry file names directly in a namespace (what a run may have added). The listing
    is not kept: JAX writes there next, through its own client."""
    names = set()
    for info in store.list(ns_rel):
        rel = info.path[len(ns_rel) + 1 :] if info.path.startswith(ns_rel + "/") else info.path
        if "/" not in rel and classify(rel) is Kind.ENTRY:
            names.add(rel)
    store.forget_listings(ns_rel)
    return names


def warm_by_running(
    ctx: Context,
    command: Sequence[str],
    *,
    cache: str | None = None,
    child_stdout: IO[str] | None = None,
) -> RunWarmReport:
    """Run ``command`` against this environment's namespace; index what it wrote (see module)."""
    if not command:
        raise BadInput(
            "give the command to run after --, e.g. cachectl warm-run -- python warmup.py"
        )
    cache_info = ctx.cache(cache)
    check_writer(cache_info, "warm")
    env = ctx.environment_for_children  # the command's JAX needs the accelerator
    ns, info = ctx.namespace(cache_info, env)
    assert info is not None
    store = ctx.store(cache_info)
    before = entry_names(store, ns.relpath)
    config = warm_jax_config(ns.url, env)
    environ = {
        **os.environ,
        **env_vars_for(config),
        **child_env(cache_info.root_url, cache_info.storage_options),
        **child_variables(env.to_dict(), os.environ.get("PYTHONPATH"), telemetry=False),
        "CACHECTL_CACHE": cache_info.name,
    }
    digest = run_digest(list(command))
    run = ctx.index.start_warm_run(info.id, manifest_digest=digest, manifest_path=None, buckets=0)
    started = time.perf_counter()
    status = warm_runs.INTERRUPTED
    entries: list[RunEntry] = []
    exit_code = 127
    counted: list[dict[str, Any]] = []  # the hook's lines: each process's counts, each write
    unclaimed: list[str] = []
    processes = 0
    try:
        with tempfile.TemporaryDirectory(prefix="cachectl-warm-run-") as tmp:
            counts = Path(tmp) / "counts.jsonl"
            try:
                exit_code = subprocess.run(
                    list(command),
                    env={**environ, COUNTS_VAR: str(counts), WRITES_VAR: "1"},
                    stdout=child_stdout,
                    check=False,
                ).returncode
            except FileNotFoundError:
                raise BadInput(f"command not found: {command[0]}") from None
            if counts.is_file():
                counted = [json.loads(x) for x in counts.read_text().splitlines() if x.strip()]
        new = entry_names(store, ns.relpath) - before
        produced: dict[str, set[str]] = {}  # key -> the sha256s its processes handed JAX
        for x in counted:
            if PUT in x:
                produced.setdefault(str(x[PUT]), set()).add(str(x.get(SHA256)))
        ours = {k + CACHE_SUFFIX for k in produced} & new
        entries = index_entries(
            ctx, cache_info, env, info.id, store, ns.relpath, sorted(ours), run.id, produced
        )
        indexed = ctx.index.entry_keys(info.id)
        unclaimed = sorted(n for n in new - ours if n[: -len(CACHE_SUFFIX)] not in indexed)
        written_now = sum(e.status == "written" for e in entries)
        requests = sum(int(x.get("requests", 0)) for x in counted)
        hits = sum(int(x.get("hits", 0)) for x in counted)
        processes = len({x.get("pid") for x in counted})
        status = (
            warm_runs.SUCCEEDED
            if exit_code == 0
            and all(e.status == "written" for e in entries)
            and (written_now or requests <= hits)
            and (processes or not unclaimed)  # RunWarmReport.unseen
            else warm_runs.FAILED
        )
    finally:
        written = sum(e.status == "written" for e in entries)
        ctx.index.finish_warm_run(
            run.id, status, compiled=written, cached=0, failed=len(entries) - written
        )
    seconds = time.perf_counter() - started
    ctx.index.audit(
        "warm",
        cache=cache_info.name,
        entries=sum(e.status == "written" for e in entries),
        nbytes=sum(e.bytes for e in entries if e.status == "written"),
        duration_ms=int(seconds * 1000),
        details={
            "command": list(command),  # whole, with cwd: warm-check --replay runs it again
            "cwd": os.getcwd(),
            "namespace": ns.relpath,
            "warm_run": run.id,
            "exit_code": exit_code,
            "via": "run",
        },
    )
    return RunWarmReport(
        cache_info.name,
        ns.url,
        list(command),
        exit_code,
        entries,
        seconds,
        run_id=run.id,
        known_before=len(before),
        environment=env.to_dict(),
        requests=sum(int(x.get("requests", 0)) for x in counted),
        hits=sum(int(x.get("hits", 0)) for x in counted),
        host_callbacks=sorted({m for x in counted for m in x.get("host_callbacks", [])}),
        unclaimed=unclaimed,
        processes=processes,
    )


def index_entries(
    ctx: Context,
    cache: Any,
    env: Any,
    env_id: int,
    store: Any,
    ns_rel: str,
    names: Sequence[str],
    run_id: int,
    produced: dict[str, set[str]],
) -> list[RunEntry]:
    """Check the named entry files of the namespace (what this run's own processes wrote) with
    ingest's rules, index the good ones in one batch and remove the rest (a bad file left there
    would be read by every service); one gone meanwhile is passed over. A file whose sha256 is
    none of those its key's processes handed JAX (``produced``) is another writer's: refused,
    left for ``verify``, never indexed."""
    out: list[RunEntry] = []
    objects = []
    for name in names:
        key = name[: -len(CACHE_SUFFIX)]
        parsed = parse_key(key)
        module = parsed.module if parsed else key
        rel = f"{ns_rel}/{name}"
        try:
            data = store.read_bytes(rel)
        except FileNotFoundError:
            continue  # removed again by the command itself
        if hashlib.sha256(data).hexdigest() not in produced.get(key, ()):
            why = "the file at this key is not what the command wrote (another writer's bytes)"
            out.append(RunEntry(key, module, len(data), None, "foreign", why + ": not indexed"))
            continue
        try:
            row = ingest.check_new(
                cache,
                EntryName(key, module),
                data,
                origin="warm",
                function=module.removeprefix("jit_"),
                warm_run_id=run_id,
            )
        except ingest_rules.Refused as exc:
            store.delete([rel])
            out.append(RunEntry(key, module, len(data), None, "refused", exc.message))
            continue
        objects.append(ingest.NewObject(row, in_storage=True))
        out.append(RunEntry(key, module, len(data), row.compile_time_ms, "written"))
    if objects:
        published = ingest.publish(
            ctx.index, cache, env, env_id, store, objects, quota=False, namespace_ready=True
        )
        for key, (_, problem) in published.failed.items():  # in_storage: nothing is written
            print(f"cachectl: {key}: {problem}", file=sys.stderr)
    return out
