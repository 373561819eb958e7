"""`cachectl warm` inside a multi-process JAX job (`jax.distributed`): TPU pod slices, GPU hosts.

Every process of the job runs the same command. Each one:

1. joins the job (``jax.distributed.initialize``: the coordinator from
   ``JAX_COORDINATOR_ADDRESS``, the count and rank from ``JAX_NUM_PROCESSES`` and
   ``JAX_PROCESS_ID``, else JAX's own cluster detection);
2. publishes what it would warm (manifest digest, environment digest, cache,
   buckets, target problems) in the job's key-value store and compares it with
   every other process: any difference, or a target mismatch anywhere, and every
   process refuses (exit 3) before compiling;
3. compiles every bucket (each process compiles its part of every program, as a
   multi-process service does). JAX writes the persistent cache from process 0
   only (DESIGN.md fact 6), so process 0 alone stores executables, records the
   entries (once) and the warm run; the others wait for its results and check
   that they looked up the same keys;
4. reports for itself (``process`` in the JSON: index, count, writer 0).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cachectl import jax_seam
from cachectl import warm as warm_mod
from cachectl.context import Context
from cachectl.entries import CACHE_SUFFIX, CorruptEntry, parse_key, read_header, sha256
from cachectl.errors import BadInput, CachectlError, EnvironmentMismatch
from cachectl.index import NewEntry
from cachectl.manifest import manifest_digest

WRITER = 0
TIMEOUT_MS = 30 * 60 * 1000
_PREFIX = "cachectl/warm"
_SEQUENCE = [0]  # one exchange namespace per collective warm of this process


@dataclass(frozen=True)
class ProcessInfo:
    index: int
    count: int
    writer: int = WRITER


@dataclass(frozen=True)
class DistributedWarmReport:
    """One process's view of a collective warm."""

    process: ProcessInfo
    report: Any  # cachectl.warm.WarmReport

    @property
    def ok(self) -> bool:
        return self.report.ok

    def to_json(self) -> dict[str, Any]:
        return {**self.report.to_json(), "process": {"index": self.process.index, "count": self.process.count,
                                                     "writer": self.process.writer}}


def requested(flag: bool | None) -> bool:
    """--distributed, --no-distributed, or auto: a coordinator address in the environment."""
    if flag is not None:
        return flag
    return bool(os.environ.get("JAX_COORDINATOR_ADDRESS", "").strip())


def _int_env(name: str) -> int | None:
    raw = os.environ.get(name, "").strip()
    if not raw:
        return None
    if not raw.isdigit():
        raise BadInput(f"{name} must be a whole number, got {raw!r}")
    return int(raw)


def join() -> ProcessInfo:
    """Initialize jax.distributed (once) and say which process this is."""
    import jax

    if jax_seam.distributed_client() is None:
        kwargs: dict[str, Any] = {}
        address = os.environ.get("JAX_COORDINATOR_ADDRESS", "").strip() or None
        count, rank = _int_env("JAX_NUM_PROCESSES"), _int_env("JAX_PROCESS_ID")
        if address:
            kwargs["coordinator_address"] = address
        if count is not None:
            kwargs["num_processes"] = count
        if rank is not None:
            kwargs["process_id"] = rank
        try:
            jax.distributed.initialize(**kwargs)
        except (RuntimeError, ValueError) as exc:
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise EnvironmentMismatch(
                f"--distributed: could not join the JAX job ({first}); set JAX_COORDINATOR_ADDRESS, "
                "JAX_NUM_PROCESSES and JAX_PROCESS_ID, or run where JAX detects the cluster") from exc
    return ProcessInfo(jax.process_index(), jax.process_count())


def _client() -> Any:
    return jax_seam.distributed_client()


def _exchange(tag: str, me: ProcessInfo, value: dict[str, Any]) -> list[dict[str, Any]]:
    """Publish ``value`` under ``tag`` and return every process's, in process order."""
    client = _client()
    base = f"{_PREFIX}/{_SEQUENCE[0]}/{tag}"
    client.key_value_set(f"{base}/{me.index}", json.dumps(value, sort_keys=True))
    views = [json.loads(client.blocking_key_value_get(f"{base}/{i}", TIMEOUT_MS)) for i in range(me.count)]
    # Nobody leaves (and, being process 0, takes the coordinator with it) before every process
    # has read every view: a refusal must reach all of them, not leave one waiting for a peer.
    client.wait_at_barrier(f"{base}/read", TIMEOUT_MS)
    failed = [(i, v["error"]) for i, v in enumerate(views) if v.get("error")]
    if failed:
        i, message = failed[0]
        raise (BadInput if i != me.index else CachectlError)(
            message if i == me.index else f"process {i} of {me.count} failed: {message}")
    return views


def _agreement(plan: Any) -> dict[str, Any]:
    return {"manifest_digest": manifest_digest(plan.manifest_path), "environment": plan.environment.digest,
            "cache": plan.cache.name, "root": plan.cache.root_url,
            "buckets": [[b.function, sorted(b.values.items())] for b in plan.buckets],
            "target_problems": list(plan.target_problems), "fields": plan.environment.to_dict()}


def check_agreement(me: ProcessInfo, views: Sequence[dict[str, Any]]) -> None:
    """Refuse (exit 3) unless every process warms the same manifest into the same target."""
    target = [(i, v["target_problems"]) for i, v in enumerate(views) if v["target_problems"]]
    if target:
        i, problems = target[0]
        raise EnvironmentMismatch(f"process {i} of {me.count} does not match the manifest's target "
                                  f"({'; '.join(problems)}): no process compiled anything")
    labels = {"manifest_digest": "manifest digest", "environment": "environment", "cache": "cache",
              "root": "cache root", "buckets": "buckets"}
    for field, label in labels.items():
        values = [json.dumps(v[field], sort_keys=True) for v in views]
        if len(set(values)) > 1:
            odd = next(i for i, v in enumerate(values) if v != values[0])
            shown = str(views[odd][field])[:16] if field != "buckets" else f"{len(views[odd][field])} bucket(s)"
            first = str(views[0][field])[:16] if field != "buckets" else f"{len(views[0][field])} bucket(s)"
            if field == "environment":
                a, b = views[0]["fields"], views[odd]["fields"]
                diff = [f"{k}: {a.get(k)!r} vs {b.get(k)!r}" for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]
                shown += f" ({'; '.join(diff)})"
            raise EnvironmentMismatch(f"the processes of this JAX job differ in {label}: process 0 has "
                                      f"{first}, process {odd} has {shown}: no process compiled anything")


def warm(ctx: Context, manifest_path: str | Path, *, cache: str | None = None, jobs: int | None = None,
         shard: tuple[int, int] | None = None, paths: Sequence[str] = (), fail_fast: bool = False,
         dry_run: bool = False, executables: bool = True, progress: Any = None) -> DistributedWarmReport:
    """The collective warm: every process of the job calls this with the same arguments."""
    me = join()
    _SEQUENCE[0] += 1
    started = time.perf_counter()
    try:
        plan = warm_mod.plan_warm(ctx, manifest_path, cache=cache, shard=shard, paths=paths,
                                  writer_check=not dry_run and me.index == WRITER)
    except CachectlError as exc:
        _publish_error("plan", me, exc)  # the others must not wait for this process
        raise
    check_agreement(me, _exchange("plan", me, _agreement(plan)))
    if dry_run or me.index == WRITER:
        # Process 0 is a normal warm: JAX writes from it, so it stores, records and reports.
        try:
            report = warm_mod.warm(ctx, manifest_path, cache=cache, jobs=jobs, shard=shard, paths=paths,
                                   fail_fast=fail_fast, dry_run=dry_run, executables=executables,
                                   progress=progress)
        except BaseException as exc:
            if not dry_run:
                _publish_error("result", me, exc)
            raise
        if not dry_run:
            _exchange("result", me, {"buckets": [{"key": b.key, "status": b.status, "bytes": b.bytes,
                                                  "aot_bytes": b.aot_bytes, "error": b.error}
                                                 for b in report.buckets], "run_id": report.run_id})
            stored = _store_peer_entries(ctx, plan, me, report.run_id)
            _exchange("done", me, {"stored": stored})
        return DistributedWarmReport(me, report)
    return DistributedWarmReport(me, _follow(ctx, plan, me, started))


def _store_peer_entries(ctx: Context, plan: Any, me: ProcessInfo, run_id: int | None) -> int:
    """Process 0 writes and records the entries other processes compiled under keys of their own.

    JAX's key hashes the topology fingerprint, which on some backends (CPU) differs per
    process: then process 1's programs have other keys than process 0's, JAX would never
    write them, and process 1 of a service would always miss. Each such entry is sent
    here through the job's key-value store and stored once.
    """

    views = _exchange("peer", me, {"entries": []})
    client = _client()
    store = ctx.store(plan.cache)
    ns = plan.environment.namespace
    env_info = ctx.index.ensure_environment(plan.cache.name, plan.environment)
    known = ctx.index.entry_keys(env_info.id)
    rows = []
    for rank, view in enumerate(views):
        for item in view["entries"]:
            key = item["key"]
            if key in known:
                continue
            data = client.blocking_key_value_get_bytes(f"{_PREFIX}/{_SEQUENCE[0]}/blob/{rank}/{item['position']}",
                                                       TIMEOUT_MS)
            if sha256(data) != item["sha256"] or parse_key(key) is None:
                continue
            try:
                header = read_header(data)
            except CorruptEntry:
                continue
            store.write_bytes(f"{ns}/{key}{CACHE_SUFFIX}", data)
            bucket = plan.buckets[item["position"]]
            parsed = parse_key(key)
            rows.append(NewEntry(key=key, module=parsed.module, size=len(data), sha256=item["sha256"],
                                 origin="warm", compile_time_ms=int(round(item["seconds"] * 1000))
                                 if item.get("seconds") is not None else header.compile_seconds * 1000,
                                 function=bucket.function, bucket=dict(bucket.values), warm_run_id=run_id))
            known[key] = (len(data), item["sha256"])
    if rows:
        ctx.index.upsert_entries(env_info.id, rows)
    return len(rows)


def _entry_bytes(compiled: Any, seconds: float) -> bytes:
    """The JAX cache entry of a compiled program, exactly as JAX's own put would write it."""
    return jax_seam.entry_bytes(compiled, seconds)


def _publish_error(tag: str, me: ProcessInfo, exc: BaseException) -> None:
    text = getattr(exc, "message", None) or str(exc) or type(exc).__name__
    _client().key_value_set(f"{_PREFIX}/{_SEQUENCE[0]}/{tag}/{me.index}", json.dumps({"error": text}))


def _follow(ctx: Context, plan: Any, me: ProcessInfo, started: float) -> Any:
    """A process other than 0: compile every bucket as the job does, hand process 0 the entries
    only this process's key names, and report with process 0's results."""

    store = ctx.store(plan.cache)
    ns_url = store.url_for(plan.environment.namespace)
    config = warm_mod.warm_jax_config(ns_url, plan.environment)
    jitted, calls = warm_mod._build_calls(plan.manifest, plan.buckets, plan.search_paths)
    mine: dict[int, tuple[str | None, str | None, float, bytes | None, str | None]] = {}
    with warm_mod.jax_configured(config), warm_mod._CAPTURE.installed():
        for position, bucket in enumerate(plan.buckets):
            call = calls[position]
            if isinstance(call, str):
                mine[position] = (None, None, 0.0, None, call)
                continue
            try:
                fn = jitted[bucket.function]
                events, seconds, compiled = warm_mod._compile_once(fn, *call)
                if not any(e.kind in ("hit", "miss") for e in events):
                    warm_mod._clear_in_memory_executables()
                    events, seconds, compiled = warm_mod._compile_once(fn, *call)
                lookups = [e for e in events if e.kind in ("hit", "miss")]
                if not lookups:
                    mine[position] = (None, None, seconds, None, "JAX did not consult the persistent cache")
                    continue
                last = lookups[-1]
                data = _entry_bytes(compiled, seconds) if last.kind == "miss" else None
                mine[position] = (last.key, last.kind, seconds, data, None)
            except Exception as exc:  # noqa: BLE001 - reported per bucket, like warm
                mine[position] = (None, None, 0.0, None, warm_mod._error_text(exc))
    writer = _exchange("result", me, {"buckets": [], "run_id": None})[WRITER]
    theirs = {i: b for i, b in enumerate(writer["buckets"])}
    client = _client()
    offered = []
    for position, (key, _lookup, seconds, data, _error) in mine.items():
        other = theirs.get(position)
        if data is None or key is None or (other is not None and other["key"] == key):
            continue  # process 0 wrote this very key (or it was in the cache already)
        client.key_value_set_bytes(f"{_PREFIX}/{_SEQUENCE[0]}/blob/{me.index}/{position}", data)
        offered.append({"position": position, "key": key, "sha256": sha256(data), "seconds": seconds})
    _exchange("peer", me, {"entries": offered})
    _exchange("done", me, {"stored": 0})
    results = []
    for position, bucket in enumerate(plan.buckets):
        key, lookup, seconds, data, error = mine.get(position, (None, None, 0.0, None, "not attempted"))
        other = theirs.get(position) or {}
        if error is not None:
            status = warm_mod.FAILED
        elif other.get("status") == warm_mod.FAILED:
            status, error = warm_mod.FAILED, f"process {WRITER}: {other.get('error')}"
        else:
            status = warm_mod.CACHED if lookup == "hit" else warm_mod.COMPILED
        results.append(warm_mod.BucketResult(bucket.function, dict(bucket.values), status, key=key,
                                             compile_seconds=seconds if status == warm_mod.COMPILED else 0.0,
                                             bytes=len(data) if data is not None else other.get("bytes"),
                                             error=error))
    failed = sum(r.status == warm_mod.FAILED for r in results)
    compiled_n = sum(r.status == warm_mod.COMPILED for r in results)
    cached = sum(r.status == warm_mod.CACHED for r in results)
    compile_seconds = sum(r.compile_seconds or 0.0 for r in results)
    summary = warm_mod.WarmSummary(len(results), compiled_n, cached, failed, compile_seconds,
                                   time.perf_counter() - started)
    return warm_mod.WarmReport(warm_mod._environment_json(plan.environment), ns_url, summary, results,
                               cache=plan.cache.name, manifest=plan.manifest_path, run_id=writer["run_id"],
                               jobs=1, executor="thread")
