"""Two key components JAX's cache key leaves out: the x64 mode and the CPU instruction set.

A stored executable warmed without ``jax_enable_x64`` refuses an x64 process ("different
enable_x64 mode"), and XLA:CPU code compiled where AVX-512 exists is an illegal instruction on
a host without it, while JAX's key is the same. Both are part of the environment, so each mode
and each CPU gets a namespace of its own. Real warms and services in fresh processes; the
"other CPU" is a mount namespace whose /proc/cpuinfo says so (what cachectl reads).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from support.infra import run_py
from support.serving import last_json

from cachectl.core.cpu_isa import describe, host_cpu_isa
from cachectl.core.fingerprint import Environment

FIXTURES = Path(__file__).parent / "fixtures"

MODULE = """
import jax.numpy as jnp

def double(x):
    return x * 2.0 + 1.0
"""

MANIFEST = """
version: 1
target: {backend: cpu}
functions:
  - fn: em_mod:double
    args: [{shape: [batch, 4], dtype: float32}]
    buckets: {batch: [2]}
"""

SERVICE = """
import json, sys
sys.path.insert(0, {dir!r})
import jax, numpy as np
import cachectl, em_mod
rt = cachectl.serving({manifest!r})
x = np.ones((2, 4), np.float32)
got = np.asarray(rt["double"](x)).tolist()
want = np.asarray(jax.jit(em_mod.double)(x)).tolist()
report = rt.report().to_dict()
print(json.dumps([got == want, report["functions"]["double"], report["warnings"],
                  bool(jax.config.jax_enable_x64)]))
"""

AVX2_HOST = (
    "processor\t: 0\nflags\t\t: fpu sse2 ssse3 sse4_1 sse4_2 popcnt avx avx2 fma f16c bmi1 bmi2\n"
)


def _cachectl(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "cachectl", *args],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, **(env or {})},
    )


def _setup(tmp_path: Path) -> Path:
    (tmp_path / "em_mod.py").write_text(MODULE)
    manifest = tmp_path / "em.yaml"
    manifest.write_text(MANIFEST)
    return manifest


def _serve(tmp_path: Path, manifest: Path, env: dict[str, str]) -> list[Any]:
    code = SERVICE.format(dir=str(tmp_path), manifest=str(manifest))
    return last_json(run_py(code, env, check=True))


def test_cpu_isa_names_xla_levels_and_follows_the_cap() -> None:
    avx512 = AVX2_HOST.replace("bmi2", "bmi2 avx512f avx512bw avx512cd avx512dq avx512vl")
    assert describe("x86_64", AVX2_HOST).startswith("x86_64:AVX2:")
    assert describe("x86_64", avx512).startswith("x86_64:AVX512:")
    assert describe("x86_64", avx512) != describe("x86_64", AVX2_HOST)
    # Capped at AVX2, XLA turns AVX-512 off: that host compiles what the AVX2 host does.
    capped = describe("x86_64", avx512, ["--xla_cpu_max_isa=avx2"])
    assert capped == describe("x86_64", AVX2_HOST)
    assert describe("aarch64", "Features\t: fp asimd sve sve2\n").startswith("aarch64:SVE2:")
    assert describe("x86_64", None) == "x86_64:unknown"


def test_environments_recorded_before_these_fields_keep_their_digests() -> None:
    """A namespace's digest was computed without the new fields: read with their defaults, an
    old env.json (the v5e's, recorded on the chip) still names its own namespace."""
    recorded = json.loads((FIXTURES / "tpu-v5e-1x1-env.json").read_text())
    assert "enable_x64" not in recorded and "cpu_isa" not in recorded
    env = Environment.from_dict(recorded)
    assert (env.enable_x64, env.cpu_isa) == (False, "")
    assert env.digest == recorded["digest"]


def test_x64_and_x32_services_each_serve_their_own_warm(tmp_path: Path) -> None:
    manifest = _setup(tmp_path)
    warm = _cachectl("warm", str(manifest), "--json")
    assert warm.returncode == 0, warm.stderr
    assert json.loads(warm.stdout)["environment"]["enable_x64"] is False

    # An x64 service over an x32 warm: answered by jit (no raise), and told why.
    equal, counts, warnings, x64 = _serve(tmp_path, manifest, {"JAX_ENABLE_X64": "1"})
    assert x64 is True and equal is True
    assert (counts["aot"], counts["fallback"]) == (0, 1), counts
    said = [w for w in warnings if "x64" in w]
    assert said and "off when warmed" in said[0] and "JAX_ENABLE_X64=0" in said[0], warnings
    # warm-check in x64 over the x32 warm: a miss that names x64, not only "run warm".
    check = _cachectl("warm-check", str(manifest), env={"JAX_ENABLE_X64": "1"})
    assert check.returncode == 1, check.stderr
    assert "warm-check: this process's namespace holds no stored executable" in check.stdout
    assert "x64" in check.stdout and "JAX_ENABLE_X64=0" in check.stdout, check.stdout

    warm64 = _cachectl("warm", str(manifest), "--json", env={"JAX_ENABLE_X64": "1"})
    assert warm64.returncode == 0, warm64.stderr
    report = json.loads(warm64.stdout)
    assert report["environment"]["enable_x64"] is True
    assert report["summary"]["compiled"] == 1  # its own namespace: nothing of x32's counts
    human = _cachectl("warm", str(manifest), env={"JAX_ENABLE_X64": "1"})
    assert "; x64 on" in human.stdout, human.stdout  # warm says which mode it compiled in

    for env in ({"JAX_ENABLE_X64": "1"}, {}):
        equal, counts, warnings, _ = _serve(tmp_path, manifest, env)
        assert equal is True and (counts["aot"], counts["fallback"]) == (1, 0), (env, counts)


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("unshare"), reason="needs root")
def test_a_host_of_another_instruction_set_reads_another_namespace(tmp_path: Path) -> None:
    """Warmed on this host, then read on "another host" whose /proc/cpuinfo names AVX2 only:
    its namespace differs, so warm-check there misses (a compile, never an illegal instruction)."""
    if host_cpu_isa() == describe("x86_64", AVX2_HOST):
        pytest.skip("this host is the AVX2 host the test stands in for")
    manifest = _setup(tmp_path)
    here = json.loads(_cachectl("fingerprint", "--json").stdout)
    assert here["cpu_isa"] == host_cpu_isa()
    assert _cachectl("warm", str(manifest), "--json").returncode == 0
    assert (
        json.loads(_cachectl("warm-check", str(manifest), "--json").stdout)["summary"]["hits"] == 1
    )

    fake = tmp_path / "cpuinfo"
    fake.write_text(AVX2_HOST)
    other = subprocess.run(
        [
            "unshare",
            "-m",
            "sh",
            "-c",
            f"mount --bind {fake} /proc/cpuinfo && "
            f'"$0" -m cachectl fingerprint --json && "$0" -m cachectl warm-check {manifest} --json',
            sys.executable,
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    decoder = json.JSONDecoder()
    there, end = decoder.raw_decode(other.stdout)
    check, _ = decoder.raw_decode(other.stdout[end:].lstrip())
    assert there["cpu_isa"] == describe("x86_64", AVX2_HOST), there
    assert there["digest"] != here["digest"] and there["namespace"] != here["namespace"]
    assert check["namespace"].endswith(there["namespace"]), check
    assert check["summary"]["hits"] == 0, check["summary"]


def test_a_jax_version_skew_is_named_by_warm_check_and_serving(tmp_path: Path) -> None:
    """Warmed with another JAX (the index holds an environment of this backend and device kind,
    with entries, recorded with jax and jaxlib 0.9.2: what a warm with that JAX records), checked
    and served with this one: both name the versions and the fix, not only "run warm"."""
    from dataclasses import replace

    from cachectl.context import Context
    from cachectl.core.config import load_settings
    from cachectl.core.fingerprint import current_environment
    from cachectl.index import NewEntry

    manifest = _setup(tmp_path)
    here = current_environment()
    warmed = replace(here, jax_version="0.9.2", jaxlib_version="0.9.2")
    ctx = Context(load_settings())
    try:
        info = ctx.index.ensure_environment(ctx.cache().name, warmed)
        row = NewEntry(f"jit_double-{0:064x}", "jit_double", 10, "0" * 64, "warm")
        ctx.index.upsert_entries(info.id, [row])
    finally:
        ctx.close()
    named = f"jax {here.jax_version} vs 0.9.2 (here vs warmed)"
    check = _cachectl("warm-check", str(manifest))
    assert check.returncode == 1, check.stderr
    assert "warm-check: this process's namespace holds no stored executable" in check.stdout
    assert named in check.stdout and "install jax==0.9.2" in check.stdout, check.stdout
    assert f"jaxlib {here.jaxlib_version} vs 0.9.2" in check.stdout, check.stdout
    equal, counts, warnings, _ = _serve(tmp_path, manifest, {})
    assert equal is True and (counts["aot"], counts["fallback"]) == (0, 1), counts
    assert any(named in w and "install jax==0.9.2" in w for w in warnings), warnings
