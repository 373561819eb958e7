"""Telemetry against JAX's own log: `stats` counts what JAX itself says it hit and missed.

The example manifest is warmed once; each service is a fresh process under plain
``cachectl.activate()`` that turns on JAX's own explanations (``jax_explain_cache_misses``,
``jax_log_compiles``) and records, in the same process, every persistent-cache hit and miss
line JAX's compiler logger emits. Then `cachectl stats` must agree with that log:

- hit: JAX logged a hit;
- miss: JAX logged a miss, whether it then wrote the program or not (too fast to compile, or a
  read-only service): a manifest function's miss is always a miss;
- not cacheable: JAX-internal staging programs (the eager ``jit_stage``,
  ``jit_convert_element_type``, ``jit_broadcast_in_dim`` this service makes);
- loads: executables cachectl.serving loads, which JAX never looks up, counted apart.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from support.infra import run_py  # noqa: E402

from cachectl.cli import cli

REPO = Path(__file__).resolve().parent.parent
EXAMPLE = REPO / "examples" / "manifest.yaml"
MANIFEST_FUNCTIONS = {"jit_prefill", "jit_decode_step"}
# What this service applies eagerly: jnp.asarray(numpy), astype, jnp.zeros.
STAGING = {"jit_stage", "jit_convert_element_type", "jit_broadcast_in_dim"}

JAX_LOG = """
import json, logging, sys
sys.path.insert(0, {repo!r})
jax_log = []
class Keep(logging.Handler):
    def emit(self, record):
        msg = str(record.msg)
        if msg.startswith("Persistent compilation cache hit for"):
            jax_log.append(["hit", str(record.args[0])])
        elif msg.startswith("PERSISTENT COMPILATION CACHE MISS for"):
            jax_log.append(["miss", str(record.args[0])])
        elif msg.startswith("Not writing persistent cache entry for"):
            jax_log.append(["not written", str(record.args[0])])
logging.getLogger("jax._src.compiler").addHandler(Keep())
import jax
jax.config.update("jax_explain_cache_misses", True)
jax.config.update("jax_log_compiles", True)
"""

SERVICE = (
    JAX_LOG
    + """
import numpy as np, jax.numpy as jnp
import cachectl
cachectl.activate()
from examples import lm
prefill = jax.jit(lm.prefill)
decode = jax.jit(lm.decode_step, static_argnames=["sampling"], donate_argnums=[1])
specs = lm.param_specs()
params = jax.tree.map(lambda s: np.ones(s.shape, s.dtype) * 0.01, specs)
prefill(params, np.zeros((1, 32), np.int32))[0].block_until_ready()       # a bucket
prefill(params, np.zeros((4, 64), np.int32))[0].block_until_ready()       # a bucket
prefill(params, np.zeros((2, 32), np.int32))[0].block_until_ready()       # batch 2: no bucket
prefill(params, np.zeros((1, 48), np.int32))[0].block_until_ready()       # seq 48: no bucket
kv = np.zeros(lm.kv_cache_shape(1), jnp.bfloat16)
decode(params, kv, np.zeros((1, 1), np.int32), np.int32(3), np.zeros(2, np.uint32),
       sampling="greedy")[0].block_until_ready()                          # a bucket
kv = np.zeros(lm.kv_cache_shape(2), jnp.bfloat16)
decode(params, kv, np.zeros((2, 1), np.int32), np.int32(3), np.zeros(2, np.uint32),
       sampling="greedy")[0].block_until_ready()                          # batch 2: no bucket
x = jnp.asarray(np.ones((3, 5), np.float32))                              # jit_stage
x.astype(jnp.int32).block_until_ready()                                   # convert_element_type
jnp.zeros((7,)).block_until_ready()                                       # broadcast_in_dim
print(json.dumps(jax_log))
"""
)

SERVING = (
    JAX_LOG
    + """
import numpy as np
import cachectl
from examples import lm
rt = cachectl.serving({manifest!r})
prefill = rt["prefill"]
params = jax.tree.map(lambda s: np.ones(s.shape, s.dtype) * 0.01, lm.param_specs())
for b, s in ((1, 20), (3, 50), (1, 32), (2, 100)):
    np.asarray(prefill(params, np.zeros((b, s), np.int32))[0])
report = rt.report().to_dict()
print(json.dumps({{"log": jax_log, "loaded": {{n: f["loaded"] for n, f in report["functions"].items()}},
                  "calls": sum(f["calls"] for f in report["functions"].values())}}))
"""
)


@pytest.fixture(scope="module")
def warmed(tmp_path_factory) -> dict[str, str]:
    home = tmp_path_factory.mktemp("truth-home")
    env = {
        "XDG_DATA_HOME": str(home / "data"),
        "XDG_CACHE_HOME": str(home / "cache"),
        "XDG_CONFIG_HOME": str(home / "config"),
        "CACHECTL_TELEMETRY_INTERVAL": "3600",
    }
    code = f"""
        import sys
        from cachectl.cli import main
        sys.argv = ["cachectl", "warm", {str(EXAMPLE)!r}, "--json"]
        main()
    """
    proc = run_py(code, env, check=True, timeout=600)
    assert json.loads(proc.stdout)["summary"]["failed"] == 0
    return env


def _counts(log: list[list[str]]) -> dict[str, dict[str, int]]:
    """{module: {hits, misses, not_cacheable}} as JAX's own log says."""
    out: dict[str, dict[str, int]] = {}
    for kind, module in log:
        if kind == "not written":
            continue
        c = out.setdefault(module, {"hits": 0, "misses": 0, "not_cacheable": 0})
        if module in STAGING:
            c["not_cacheable"] += 1
        else:
            c["hits" if kind == "hit" else "misses"] += 1
    return out


def _stats(warmed: dict[str, str], monkeypatch, *args: str) -> Any:
    for k, v in warmed.items():
        monkeypatch.setenv(k, v)
    result = CliRunner().invoke(cli, ["stats", *args])
    assert result.exit_code == 0, result.output
    return result.stdout


def _fresh(warmed: dict[str, str], monkeypatch) -> None:
    """Start each service's telemetry from nothing (the warm fixture is shared)."""
    import sqlite3

    db = Path(warmed["XDG_DATA_HOME"]) / "cachectl" / "index.db"
    with sqlite3.connect(db) as conn:
        conn.execute("DELETE FROM telemetry")
        conn.execute("DELETE FROM serving_telemetry")
        conn.execute("DELETE FROM signatures")


@pytest.mark.timeout(900)
@pytest.mark.parametrize("readonly", ["1", None], ids=["read-only", "default"])
def test_stats_count_what_jax_logged(warmed, monkeypatch, readonly: str | None) -> None:
    _fresh(warmed, monkeypatch)
    proc = run_py(
        SERVICE.format(repo=str(REPO)),
        {**warmed, "CACHECTL_READONLY": readonly},
        check=True,
        timeout=600,
    )
    log = json.loads(proc.stdout.strip().splitlines()[-1])
    jax_counts = _counts(log)
    assert set(jax_counts) == MANIFEST_FUNCTIONS | STAGING, jax_counts  # nothing else compiled
    assert jax_counts["jit_prefill"] == {"hits": 2, "misses": 2, "not_cacheable": 0}, jax_counts
    assert jax_counts["jit_decode_step"] == {"hits": 1, "misses": 1, "not_cacheable": 0}
    if readonly:  # JAX wrote none of the misses: they are misses all the same
        assert {m for kind, m in log if kind == "not written"} >= MANIFEST_FUNCTIONS

    usage = json.loads(_stats(warmed, monkeypatch, "--since", "1h", "--json"))
    by_fn = {
        r["function"]: {"hits": r["hits"], "misses": r["misses"], "not_cacheable": r["uncacheable"]}
        for r in usage["functions"]
    }
    assert by_fn == jax_counts
    (env,) = usage["environments"]
    hits = sum(c["hits"] for c in jax_counts.values())
    misses = sum(c["misses"] for c in jax_counts.values())
    staging = sum(c["not_cacheable"] for c in jax_counts.values())
    assert (env["hits"], env["misses"], env["uncacheable"]) == (hits, misses, staging)
    assert env["requests"] == len([k for k, _m in log if k != "not written"])
    assert env["hit_rate"] == pytest.approx(hits / (hits + misses))
    assert env["loads"] == 0
    prefill = next(r for r in usage["functions"] if r["function"] == "jit_prefill")
    assert prefill["name"] == "prefill" and prefill["hit_rate"] == pytest.approx(0.5)

    # Plain `stats`: the default window's hit rate, in the text and per cache and environment.
    plain = json.loads(_stats(warmed, monkeypatch, "--json"))
    (cache,) = plain
    assert cache["hit_rate"] == pytest.approx(hits / (hits + misses))
    (tenv,) = cache["telemetry"]["environments"]
    assert tenv["hit_rate"] == pytest.approx(hits / (hits + misses))
    text = _stats(warmed, monkeypatch)
    rate = f"{hits / (hits + misses):.1%}"
    assert (
        f"hit rate {rate} over the last 24h ({hits} hits, {misses} misses; {staging} not cacheable"
        in text
    )


@pytest.mark.timeout(900)
def test_serving_loads_are_counted_apart(warmed, monkeypatch) -> None:
    _fresh(warmed, monkeypatch)
    proc = run_py(
        SERVING.format(repo=str(REPO), manifest=str(EXAMPLE)), warmed, check=True, timeout=600
    )
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["loaded"]["prefill"] >= 2 and out["calls"] == 4
    jax_counts = _counts(out["log"])
    usage = json.loads(_stats(warmed, monkeypatch, "--since", "1h", "--json"))
    (env,) = usage["environments"]
    assert env["loads"] == sum(out["loaded"].values())
    assert env["hits"] == sum(c["hits"] for c in jax_counts.values())
    assert env["misses"] == sum(c["misses"] for c in jax_counts.values())
    assert env["requests"] == sum(sum(c.values()) for c in jax_counts.values())
    prefill = next(r for r in usage["functions"] if r["function"] == "jit_prefill")
    assert prefill["loads"] == out["loaded"]["prefill"] and prefill["hits"] == jax_counts.get(
        "jit_prefill", {}
    ).get("hits", 0)
    # What the cache served counts the loads; JAX's hit rate alone would call it a cold cache.
    served = env["hits"] + env["loads"]
    assert env["served_rate"] == pytest.approx(served / (served + env["misses"]))
    assert env["served_rate"] > (env["hit_rate"] or 0.0)
    line = next(x for x in _stats(warmed, monkeypatch).splitlines() if "over the last 24h" in x)
    assert line.startswith(f"cache default: served from the cache {env['served_rate']:.1%}")
    assert f"({env['loads']} stored executables loaded, {env['hits']} hits" in line
    assert "hit rate" not in line


TIMED = """
import json, sys, time
sys.path.insert(0, {repo!r})
import numpy as np
import cachectl
cachectl.activate()
import jax
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
from examples import lm
prefill = jax.jit(lm.prefill)
params = jax.tree.map(lambda s: np.ones(s.shape, s.dtype) * 0.01, lm.param_specs())
jax.block_until_ready(jax.device_put(np.ones(2)))
started = time.perf_counter()
for b, s in ((1, 32), (4, 64), (1, 128), (4, 32)):
    prefill(params, np.zeros((b, s), np.int32))[0].block_until_ready()
print(json.dumps({{"seconds": time.perf_counter() - started}}))
"""


@pytest.mark.timeout(900)
def test_saved_is_what_a_warm_cache_saved_a_service(tmp_path, monkeypatch) -> None:
    """(a) a service that compiles its programs, (b) the same service hitting the entries (a)
    wrote: `stats` says the hits saved about (a) - (b), within 30%."""
    env = {
        "XDG_DATA_HOME": str(tmp_path / "data"),
        "XDG_CACHE_HOME": str(tmp_path / "cache"),
        "XDG_CONFIG_HOME": str(tmp_path / "config"),
        "CACHECTL_READONLY": "0",
    }
    code = TIMED.format(repo=str(REPO))
    cold = json.loads(run_py(code, env, check=True).stdout.strip().splitlines()[-1])["seconds"]
    hot = json.loads(run_py(code, env, check=True).stdout.strip().splitlines()[-1])["seconds"]
    usage = json.loads(_stats(env, monkeypatch, "--since", "1h", "--json"))
    prefill = next(r for r in usage["functions"] if r["function"] == "jit_prefill")
    assert prefill["hits"] == prefill["misses"] == 4 and prefill["writes"] == 4, prefill
    observed = cold - hot
    assert observed > 0.5, (cold, hot)
    estimate = prefill["saved_estimate_seconds"]
    assert abs(estimate - observed) <= 0.3 * observed, (estimate, observed, cold, hot)
    (env_row,) = usage["environments"]
    assert env_row["saved_estimate_seconds"] >= estimate
