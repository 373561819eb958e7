"""Signature telemetry and bucket advice: hit-path cost of signature capture, advise on 1,000,000 sizes.

    python -m bench --only signatures [--quick]

Hit path: a warm process writes K distinct programs; then fresh processes trace,
lower and compile each of them (every compile a persistent-cache hit), with the
full collector (hit/miss counters and signature capture) installed for every other
program, parity flipped per repetition, so adjacent with/without compiles share the
process and the machine's load. The capture's own cost is also timed alone: JAX's
guarded lowering log call with real avals and shardings, with and without the tap.
Advise: the exact dynamic program over 1,000,000 observed sizes, timed in-process.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path
from typing import Any

SECTION = "## Signatures and bucket advice"

PROGRAMS = """
import jax, jax.numpy as jnp
x = jnp.ones((64,)); w = jnp.ones((64, 64))
fns = [jax.jit(lambda v, m, c=float(i): jnp.tanh(m @ v) * c + c) for i in range({k})]
"""

WARM = (
    """
import json, jax, cachectl
a = cachectl.activate(root={root!r}, readonly=False, telemetry=False)
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
"""
    + PROGRAMS
    + """
for f in fns:
    f(x, w).block_until_ready()
print(json.dumps({{"path": a.path}}))
"""
)

HIT_PATH = (
    """
import time, json, cachectl
from cachectl import telemetry
a = cachectl.activate(root={root!r}, readonly=True, telemetry=False)
"""
    + PROGRAMS
    + """
collector = telemetry.Collector(cache="bench", environment_digest=a.digest, sink=None)  # no flusher thread
order = []
for i, f in enumerate(fns):
    on = (i + {parity}) % 2 == 0
    if on:
        collector.install()
    t = time.perf_counter(); f.lower(x, w).compile(); dt = time.perf_counter() - t
    if on:
        collector.uninstall(flush=False)
    order.append((on, dt))
s = collector.stats()
sigs = sum(v.hits for v in collector.take().signatures.values())
print(json.dumps({{"order": order, "hits": s.hits, "requests": s.requests, "signature_hits": sigs}}))
"""
)


def _py(code: str, env: dict[str, str], timeout: float = 600) -> dict[str, Any]:
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        stdin=subprocess.DEVNULL,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"benchmark process failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _med(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def bench_hit_path(tmp: Path, reps: int, k: int) -> dict[str, Any]:
    env = {key: v for key, v in os.environ.items() if not key.startswith(("CACHECTL_", "JAX_"))}
    for var in ("XDG_DATA_HOME", "XDG_CACHE_HOME", "XDG_CONFIG_HOME"):
        (tmp / var.lower()).mkdir(exist_ok=True)
        env[var] = str(tmp / var.lower())
    root = str(tmp / "cache")
    _py(WARM.format(k=k, root=root), env)
    without: list[float] = []
    with_: list[float] = []
    pairs: list[float] = []
    diffs: list[float] = []
    hits = requests = sig_hits = 0
    for rep in range(reps):
        out = _py(HIT_PATH.format(k=k, root=root, parity=rep % 2), env)
        order = out["order"]
        for on, dt in order:
            (with_ if on else without).append(dt)
        for (a_on, a), (_b_on, b) in zip(order[::2], order[1::2], strict=False):
            pairs.append(a / b if a_on else b / a)
            diffs.append(a - b if a_on else b - a)
        hits += out["hits"]
        requests += out["requests"]
        sig_hits += out["signature_hits"]
    return {
        "programs": k,
        "reps": reps,
        "compiles_with": len(with_),
        "compiles_without": len(without),
        "without_ms_median": round(_med(without) * 1e3, 3),
        "with_ms_median": round(_med(with_) * 1e3, 3),
        "paired_ratio_median": round(_med(pairs), 4),
        "paired_diff_us_median": round(_med(diffs) * 1e6, 1),
        "hits_requests": [hits, requests],
        "signature_hits": sig_hits,
    }


def bench_capture(n: int) -> dict[str, Any]:
    """JAX's guarded lowering log call (what pxla does per lowering), with and without the tap."""
    import logging

    import jax
    import jax.numpy as jnp
    from jax import core

    from cachectl import telemetry
    from cachectl.core import jax_seam

    logger = jax_seam.pxla_logger()
    avals = [
        core.ShapedArray((64, 64), jnp.float32),
        core.ShapedArray((64,), jnp.float32),
        core.ShapedArray((), jnp.float32, weak_type=True),
    ]
    shardings = [jax_seam.single_device_sharding(jax.devices()[0]), None, None]

    def one() -> None:  # exactly the shape of pxla's call
        if logger.isEnabledFor(logging.DEBUG):
            logger.log(
                logging.DEBUG,
                "Compiling %s with global shapes and types %s. Argument mapping: %s.",
                "jit(f)",
                avals,
                shardings,
            )

    def timed() -> float:
        best = float("inf")
        for _ in range(5):
            t = time.perf_counter()
            for _ in range(n):
                one()
            best = min(best, (time.perf_counter() - t) / n)
        return best

    without = timed()
    collector = telemetry.Collector(
        cache="b", environment_digest="0" * 64, sink=telemetry.MemorySink(), interval_s=3600
    )
    collector.install()
    try:
        with_ = timed()
    finally:
        collector.uninstall(flush=False)
    return {"calls": n, "without_us": round(without * 1e6, 3), "with_us": round(with_ * 1e6, 3)}


def bench_advise(n: int) -> list[dict[str, Any]]:
    import numpy as np

    from cachectl.usage.advise import optimal_buckets, score

    rng = np.random.default_rng(0)
    cases = {
        "uniform 1..4096": rng.integers(1, 4097, n),
        "long-tailed (Pareto) 1..8192": np.minimum(rng.pareto(1.2, n) * 64 + 1, 8192).astype(
            np.int64
        ),
        "bimodal 1..2048": np.concatenate(
            [rng.normal(128, 30, n // 2), rng.normal(1500, 200, n - n // 2)]
        )
        .clip(1, 2048)
        .astype(np.int64),
    }
    out = []
    for name, sizes in cases.items():
        for label, kwargs in (
            ("8 buckets", {"max_buckets": 8}),
            ("waste <= 5%", {"max_waste": 0.05}),
        ):
            t = time.perf_counter()
            buckets = optimal_buckets(sizes, **kwargs)
            dt = time.perf_counter() - t
            hist = dict(zip(*np.unique(sizes, return_counts=True), strict=True))
            out.append(
                {
                    "distribution": name,
                    "sizes": int(n),
                    "distinct": len(hist),
                    "mode": label,
                    "seconds": round(dt, 3),
                    "buckets": len(buckets),
                    "waste": round(score(buckets, hist).waste, 4),
                }
            )
    return out


def run(quick: bool = False) -> dict[str, Any]:
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="bench-signatures-") as d:
        load = " ".join(f"{x:.2f}" for x in os.getloadavg())
        hit = bench_hit_path(Path(d), reps=4 if quick else 8, k=80 if quick else 120)
    return {
        "quick": quick,
        "load": load,
        "hit_path": hit,
        "capture": bench_capture(20_000 if quick else 100_000),
        "advise": bench_advise(1_000_000),
        "seconds": round(time.monotonic() - started, 1),
    }


def markdown(r: dict[str, Any]) -> str:
    h, c = r["hit_path"], r["capture"]
    lines = [
        SECTION,
        "",
        f"`python -m bench --only signatures{' --quick' if r.get('quick') else ''}` ({r['seconds']:.0f} s; "
        f"load average {r.get('load', '?')} at the start). Hit path: {h['programs']} distinct "
        f"programs per process, each traced, lowered and compiled (a persistent-cache hit), the full "
        f"collector (counters and signature capture) installed for every other one; {h['reps']} processes, "
        f"{h['compiles_with']} compiles with, {h['compiles_without']} without.",
        "",
        "| measurement | without collector | with collector | ratio / difference |",
        "|---|---:|---:|---:|",
        f"| `.lower().compile()` of a cache hit, median ms | {h['without_ms_median']:.3f} | "
        f"{h['with_ms_median']:.3f} | {h['with_ms_median'] / h['without_ms_median']:.3f} |",
        f"| adjacent with/without pairs, median ratio | | | {h['paired_ratio_median']:.4f} |",
        f"| adjacent with/without pairs, median difference | | | {h['paired_diff_us_median']:+.1f} µs |",
        f"| signature capture alone: pxla's guarded lowering log call, µs | {c['without_us']:.3f} | "
        f"{c['with_us']:.3f} | +{c['with_us'] - c['without_us']:.2f} µs per lowering |",
        "",
        f"The collector saw {h['hits_requests'][0]} hits of {h['hits_requests'][1]} requests and recorded "
        f"{h['signature_hits']} of those hits against a signature.",
        "",
        "**`advise` on 1,000,000 observed sizes** (`cachectl.usage.advise.optimal_buckets`, raw sizes in, "
        "histogram and exact dynamic program included):",
        "",
        "| distribution | distinct sizes | mode | buckets | mean padding waste | seconds |",
        "|---|---:|---|---:|---:|---:|",
    ]
    for a in r["advise"]:
        lines.append(
            f"| {a['distribution']} | {a['distinct']} | {a['mode']} | {a['buckets']} | "
            f"{a['waste']:.1%} | {a['seconds']:.3f} |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    result = run(quick="--quick" in sys.argv)
    print(json.dumps(result, indent=2) if "--json" in sys.argv else markdown(result))
