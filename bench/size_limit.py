"""Writes under a size limit: JAX's own LRU vs a managed cache with out-of-band gc.

JAX's ``jax_compilation_cache_max_size`` makes every put glob the directory and
read every ``-atime`` file (docs/jax-facts.md, fact 2). A managed cache runs with
``max_size=-1`` (a put is one file write) and lets ``cachectl gc`` enforce the
limit from the index, off the service's path. This measures, at several resident
entry counts, JAX's real ``LRUCache.put`` (the class JAX itself uses) with eviction
on and off, and the gc run that replaces the eviction: planning from the index
and evicting 1% of the entries.

Run: ``python bench/size_limit.py [--quick]``; ``run(quick)`` for the suite.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import machine, machine_line, stats, write_section

SECTION = "## Writes under a size limit"
ENTRY_BYTES = 4096


def _populate(path: Path, n: int, payload: bytes) -> None:
    """N resident entries the way JAX leaves them with eviction on: -cache plus -atime."""
    path.mkdir(parents=True, exist_ok=True)
    now = time.time_ns()
    for i in range(n):
        key = f"jit_f-{i:064x}"
        (path / f"{key}-cache").write_bytes(payload)
        (path / f"{key}-atime").write_bytes((now - i).to_bytes(8, "little"))


def _put_latency(path: Path, max_size: int, puts: int, payload: bytes) -> list[float]:
    from jax._src.lru_cache import LRUCache

    cache = LRUCache(str(path), max_size=max_size)
    samples = []
    for j in range(puts):
        key = f"jit_new-{j:064x}"
        t0 = time.perf_counter()
        cache.put(key, payload)
        samples.append((time.perf_counter() - t0) * 1000)
    return samples


def _gc_run(work: Path, n: int, payload: bytes) -> dict[str, float]:
    """cachectl gc over N indexed entries, evicting about 1%: plan and execute times."""
    from cachectl.context import Context
    from cachectl.core.config import load_settings
    from cachectl.core.fingerprint import current_environment
    from cachectl.index import NewEntry
    from cachectl.lifecycle import gc as gc_mod
    from cachectl.storage.entries import sha256

    os.environ["XDG_DATA_HOME"] = str(work / "data")
    os.environ["XDG_CACHE_HOME"] = str(work / "cache")
    ctx = Context(load_settings(db=f"sqlite:///{work}/index.db"))
    cache = ctx.index.add_cache(
        "bench", str(work / "managed"), max_size=(n - n // 100) * len(payload)
    )
    env = current_environment()
    ns, info = ctx.namespace(cache, env)
    directory = Path(ns.url)
    digest = sha256(payload)
    rows = []
    for i in range(n):
        key = f"jit_f-{i:064x}"
        (directory / f"{key}-cache").write_bytes(payload)
        rows.append(
            NewEntry(key=key, module="jit_f", size=len(payload), sha256=digest, origin="observed")
        )
    assert info is not None
    ctx.index.upsert_entries(info.id, rows)
    cache = ctx.index.get_cache("bench")
    t0 = time.perf_counter()
    result = gc_mod.gc(ctx, cache, policy="lru")
    total = time.perf_counter() - t0
    evicted = len(result.plan.deletion.entries)
    ctx.close()
    return {
        "plan_s": result.planning_s,
        "execute_s": total - result.planning_s,
        "evicted": float(evicted),
    }


def run(quick: bool = False) -> dict[str, Any]:
    sizes = [1000, 10_000] if quick else [1000, 10_000, 30_000]
    puts = 10 if quick else 20
    payload = os.urandom(ENTRY_BYTES)
    rows = []
    for n in sizes:
        with tempfile.TemporaryDirectory(prefix="cachectl-bench-") as tmp:
            work = Path(tmp)
            _populate(work / "lru", n, payload)
            # A limit that never evicts: we time the bookkeeping, not the deletes.
            lru = _put_latency(
                work / "lru", max_size=10 * (n + puts) * ENTRY_BYTES, puts=puts, payload=payload
            )
            _populate(work / "plain", n, payload)
            plain = _put_latency(work / "plain", max_size=-1, puts=puts, payload=payload)
            gc = _gc_run(work / "gc", n, payload)
        lru_s, plain_s = stats(lru), stats(plain)
        rows.append(
            {
                "entries": n,
                "jax_lru_put_ms": lru_s,
                "managed_put_ms": plain_s,
                "ratio": lru_s["median"] / plain_s["median"],
                "gc": gc,
            }
        )
    return {
        "machine": machine(),
        "quick": quick,
        "puts": puts,
        "entry_bytes": ENTRY_BYTES,
        "rows": rows,
    }


def markdown(result: dict[str, Any]) -> str:
    lines = [
        SECTION,
        "",
        "JAX's own size limit (`jax_compilation_cache_max_size` set: every put globs the directory and reads "
        "every `-atime` file) vs a managed cache (`max_size=-1`, one file write per put) whose limit "
        "`cachectl gc` enforces from the index, off the service's path. Puts go through JAX's own "
        f"`LRUCache` class; {result['puts']} puts of {result['entry_bytes']} B per size, on local disk.",
        "",
        f"Produced by `python bench/size_limit.py{' --quick' if result['quick'] else ''}`. "
        + machine_line(result["machine"]),
        "",
        "| resident entries | JAX LRU put, median ms (min–max) | managed put, median ms (min–max) | ratio | "
        "gc plan s | gc execute s | evicted |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        a, b, g = r["jax_lru_put_ms"], r["managed_put_ms"], r["gc"]
        lines.append(
            f"| {r['entries']:,} | {a['median']:.2f} ({a['min']:.2f}–{a['max']:.2f}) | "
            f"{b['median']:.3f} ({b['min']:.3f}–{b['max']:.3f}) | **{r['ratio']:.0f}x** | "
            f"{g['plan_s']:.3f} | {g['execute_s']:.3f} | {int(g['evicted'])} |"
        )
    lines += [
        "",
        "The managed put stays flat as the cache grows; JAX's grows with the entry count. "
        "gc runs once per schedule (cron or the server), not once per write.",
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args(argv)
    result = run(quick=args.quick)
    print(json.dumps(result, indent=2))
    if not args.no_write:
        write_section(SECTION, markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
