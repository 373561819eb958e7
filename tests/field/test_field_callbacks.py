"""The field suite, round three: diffrax with its defaults (explained), an optax train loop served.

diffrax's default ``throw=True`` compiles equinox's runtime checks as host callbacks, which JAX
never writes to its persistent cache: warm fails those buckets naming the cause and the way out
(``EQX_ON_ERROR=nan``; tests/field/test_field_services.py serves the same solve with it), serving
falls back to jax.jit with the same words and the same outputs, ``cachectl stats`` names the
function with host callbacks and ``misses`` counts what JAX itself counted. An optax AdamW loop with clipping donates params and
optimizer state to each step: served from stored executables over five steps, each step's
outputs fed to the next, its losses equal plain jit's. ``warm -> verify`` is clean for both.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import textwrap
from pathlib import Path
from typing import Any

import pytest
from support.field_cases import DIFFRAX_DEFAULTS, OPTAX_DONATION
from support.infra import run_cachectl, run_py

from cachectl.core import jax_seam

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

PROBE = """
import json, sys
counts = dict(requests=0, hits=0, compiles=0)
def _event(event, **kw):
    if event == "/jax/compilation_cache/compile_requests_use_cache":
        counts["requests"] += 1
    elif event == "/jax/compilation_cache/cache_hits":
        counts["hits"] += 1
def _duration(event, duration, **kw):
    if event == "/jax/core/compile/backend_compile_duration":
        counts["compiles"] += 1
import jax
jax.monitoring.register_event_listener(_event)
jax.monitoring.register_event_duration_secs_listener(_duration)
sys.path.insert(0, {dir!r})
import numpy as np
import cachectl
rt = cachectl.serving({manifest!r})
import case
"""

DIFFRAX_SERVICE = (
    PROBE
    + """
served, expected = [], []
for name, args, padded in case.calls():
    served.append(np.asarray(rt[name](*args))[: len(args[0])])
    expected.append(np.asarray(jax.jit(getattr(case, name))(*padded))[: len(args[0])])
report = rt.report().to_dict()["functions"]["solve"]
print(json.dumps(dict(counts=counts, report=report,
    close=all(np.allclose(s, e, rtol=1e-5, atol=1e-6) for s, e in zip(served, expected)))))
"""
)

OPTAX_SERVICE = (
    PROBE
    + """
step = rt["train_step"]
params, opt_state = case.host_state()
before = dict(counts)
served = []
for x, y in case.batches():
    params, opt_state, value = step(params, opt_state, x, y)  # outputs donated to the next step
    served.append(float(value))
during = dict(counts)
plain = jax.jit(case.train_step, **case.JIT)
params, opt_state = case.host_state()
expected = []
for x, y in case.batches():
    n = 4 if len(x) <= 4 else 16
    params, opt_state, value = plain(params, opt_state, case._pad(x, n), case._pad(y, n))
    expected.append(float(value))
report = rt.report().to_dict()["functions"]["train_step"]
print(json.dumps(dict(before=before, during=during, served=served, expected=expected,
                      report=report)))
"""
)


def _needs(module: str) -> None:
    if importlib.util.find_spec(module) is None:
        pytest.skip(f"{module} is not installed: the field extra, pip install -e '.[field]'")


def _cachectl(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    path = os.pathsep.join(p for p in (str(cwd), os.environ.get("PYTHONPATH")) if p)
    return run_cachectl(cwd, *args, env={"PYTHONPATH": path})


def _setup(tmp_path: Path, module: str, manifest: str) -> None:
    (tmp_path / "case.py").write_text(textwrap.dedent(module))
    (tmp_path / "field.yaml").write_text(textwrap.dedent(manifest))


def _serve(tmp_path: Path, code: str) -> dict[str, Any]:
    proc = run_py(
        code.format(dir=str(tmp_path), manifest=str(tmp_path / "field.yaml")),
        timeout=600,
        check=True,
    )
    return dict(json.loads(proc.stdout.strip().splitlines()[-1]), stderr=proc.stderr)


def _verify_clean(tmp_path: Path) -> None:
    verified = _cachectl(tmp_path, "verify")
    assert verified.returncode == 0 and "no problems" in verified.stdout, (
        verified.stdout + verified.stderr
    )


def test_a_diffrax_solve_with_its_defaults_is_explained_and_answered_by_jit(
    tmp_path: Path,
) -> None:
    _needs("diffrax")
    if not jax_seam.never_writes_host_callbacks():
        pytest.skip("this JAX writes programs with host callbacks: nothing to explain")
    assert DIFFRAX_DEFAULTS.manifest is not None
    _setup(tmp_path, DIFFRAX_DEFAULTS.module, DIFFRAX_DEFAULTS.manifest)
    warm = _cachectl(tmp_path, "warm", "field.yaml", "--json")
    assert warm.returncode == 1, warm.stdout + warm.stderr
    for b in json.loads(warm.stdout)["buckets"]:
        assert b["status"] == "failed", b
        assert "uses host callbacks" in b["error"] and "EQX_ON_ERROR=nan" in b["error"], b
    _verify_clean(tmp_path)  # equinox's eager programs while tracing are indexed

    out = _serve(tmp_path, DIFFRAX_SERVICE)
    assert out["close"], out
    reason = out["report"]["fallback_reason"]
    assert "uses host callbacks" in reason and "EQX_ON_ERROR=nan" in reason, reason
    assert out["report"]["fallback"] == out["report"]["calls"] > 0, out["report"]
    jax_missed = out["counts"]["requests"] - out["counts"]["hits"]
    assert jax_missed > 0, out["counts"]

    stats = json.loads(_cachectl(tmp_path, "stats", "--since", "1h", "--json").stdout)
    # What JAX missed: misses, or not cacheable requests of a function named for host callbacks.
    fns = stats["functions"]
    assert sum(f["misses"] + f["host_callbacks"] for f in fns) == jax_missed, fns
    named = [f for f in fns if f["host_callbacks"]]
    assert named and all("EQX_ON_ERROR=nan" in f["cause"] for f in named), fns
    missed = json.loads(_cachectl(tmp_path, "misses", "--json").stdout)
    # misses counts as stats does: the programs with host callbacks are not cacheable, no miss
    callbacks = sum(missed["host_callback_functions"].values())
    assert missed["misses"] + callbacks == jax_missed and callbacks > 0, missed
    assert missed["misses"] == sum(f["misses"] for f in fns), (missed, fns)
    assert "EQX_ON_ERROR=nan" in missed["host_callbacks_cause"], missed


def test_an_optax_train_loop_with_donation_is_served(tmp_path: Path) -> None:
    _needs("optax")
    assert OPTAX_DONATION.manifest is not None
    _setup(tmp_path, OPTAX_DONATION.module, OPTAX_DONATION.manifest)
    warm = _cachectl(tmp_path, "warm", "field.yaml", "--json")
    assert warm.returncode == 0, warm.stdout + warm.stderr
    _verify_clean(tmp_path)

    out = _serve(tmp_path, OPTAX_SERVICE)
    assert out["during"]["compiles"] == out["before"]["compiles"], out  # five steps, no compile
    assert out["report"]["aot"] == out["report"]["calls"] == 5, out["report"]
    assert out["report"]["fallback"] == 0, out["report"]
    assert out["served"] == pytest.approx(out["expected"], rel=1e-5, abs=1e-6), out


TRANSFORMS = """
import numpy as np
import jax, jax.numpy as jnp

@jax.custom_jvp
def softclip(x):
    return jnp.tanh(x) * 3

softclip.defjvp(lambda p, t: (softclip(p[0]), (1 - jnp.tanh(p[0]) ** 2) * 3 * t[0]))

def _body(x, w):
    return softclip(x @ w)

def loss(x, w, branch):
    h = jax.checkpoint(_body)(x, w)  # remat
    h = jax.lax.switch(branch, [jnp.sin, jnp.cos, lambda v: v * v], h)
    return jnp.mean(h)

def grad_step(x, w, branch):
    return jax.value_and_grad(loss, argnums=1)(x, w, branch)

def host_norm(v):
    return np.asarray(np.linalg.norm(v), np.float32)

def logged(x, w, branch):  # the same step, with a host callback: never written by JAX
    value, grad = grad_step(x, w, branch)
    return value, grad, jax.pure_callback(host_norm, jax.ShapeDtypeStruct((), jnp.float32), grad)

def calls():
    rng = np.random.default_rng(4)
    w = (rng.standard_normal((8, 8)) / 3).astype(np.float32)
    out = []
    for rows, branch in ((3, 0), (6, 2)):
        x = rng.standard_normal((rows, 8)).astype(np.float32)
        n = 4 if rows <= 4 else 8
        px = np.concatenate([x, np.zeros((n - rows, 8), np.float32)])
        for name in ("grad_step", "logged"):
            out.append((name, (px, w, np.int32(branch)), (px, w, np.int32(branch))))
    return out
"""

TRANSFORMS_MANIFEST = """
version: 1
target: {backend: cpu}
functions:
  - fn: case:grad_step
    args:
      - {shape: [batch, 8], dtype: float32}
      - {shape: [8, 8], dtype: float32}
      - {shape: [], dtype: int32}
    buckets: {batch: [4, 8]}
  - fn: case:logged
    args:
      - {shape: [batch, 8], dtype: float32}
      - {shape: [8, 8], dtype: float32}
      - {shape: [], dtype: int32}
    buckets: {batch: [4, 8]}
"""

TRANSFORMS_SERVICE = (
    PROBE
    + """
flat = lambda tree: [np.asarray(leaf) for leaf in jax.tree_util.tree_leaves(tree)]
before, close, served_counts = dict(counts), [], {{}}
for name, args, padded in case.calls():
    served = rt[name](*args)
    mid = dict(counts)
    expected = jax.jit(getattr(case, name))(*padded)
    close.append(all(np.allclose(a, b, rtol=1e-5, atol=1e-6)
                     for a, b in zip(flat(served), flat(expected), strict=True)))
    served_counts[name] = served_counts.get(name, 0) + mid["compiles"] - before["compiles"]
    before = dict(counts)
report = rt.report().to_dict()["functions"]
print(json.dumps(dict(counts=counts, close=close, served_compiles=served_counts,
                      report={{n: (f["aot"], f["fallback"], f["fallback_reason"])
                              for n, f in report.items()}})))
"""
)


def test_remat_custom_jvp_switch_and_a_callback_are_served_or_explained(tmp_path: Path) -> None:
    """A gradient step through remat, a custom_jvp and lax.switch is stored and served with no
    compile; the same step with a pure_callback is a program JAX never writes: warm fails it with
    its cause, serving answers it through jit, equal to plain jit, and misses and stats count it
    as JAX does, not cacheable, never a miss."""
    if not jax_seam.never_writes_host_callbacks():
        pytest.skip("this JAX writes programs with host callbacks: nothing to explain")
    _setup(tmp_path, TRANSFORMS, TRANSFORMS_MANIFEST)
    warm = _cachectl(tmp_path, "warm", "field.yaml", "--json")
    assert warm.returncode == 1, warm.stdout + warm.stderr  # the callback's buckets fail
    by_fn: dict[str, set[str]] = {}
    for b in json.loads(warm.stdout)["buckets"]:
        by_fn.setdefault(b["function"], set()).add(b["status"])
        if b["function"] == "logged":
            assert "uses host callbacks" in b["error"], b
    assert by_fn == {"grad_step": {"compiled"}, "logged": {"failed"}}, by_fn
    _verify_clean(tmp_path)

    out = _serve(tmp_path, TRANSFORMS_SERVICE)
    assert all(out["close"]), out
    assert out["served_compiles"]["grad_step"] == 0, out  # stored executables, no compile
    aot, fallback, _ = out["report"]["grad_step"]
    assert (aot, fallback) == (2, 0), out["report"]
    aot, fallback, reason = out["report"]["logged"]
    assert (aot, fallback) == (0, 2) and "uses host callbacks" in reason, out["report"]

    stats = json.loads(_cachectl(tmp_path, "stats", "--since", "1h", "--json").stdout)
    missed = json.loads(_cachectl(tmp_path, "misses", "--since", "1h", "--json").stdout)
    callbacks = {f["function"]: f["host_callbacks"] for f in stats["functions"]}
    assert missed["host_callback_functions"] == {k: v for k, v in callbacks.items() if v}, (
        missed,
        stats["functions"],
    )
    assert missed["misses"] == sum(f["misses"] for f in stats["functions"]), (missed, stats)
    assert sum(missed["host_callback_functions"].values()) >= 2, missed
