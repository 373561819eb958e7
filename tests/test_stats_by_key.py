"""`cachectl stats` attributes a service's calls to manifest functions by the keys warm recorded.

Two manifest functions can compile under one jit name (two modules' `generate`, haiku's
`jit_apply_fn`): the name JAX logs is the same, the programs and keys are not. The index
records each entry's key with its manifest function, and the signatures record the key each
call looked up, so `stats` gives each manifest function its own row, as `ls` does, and keeps
what no manifest function's key explains under the jit name alone.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from support.infra import run_cachectl, run_py

pytestmark = [pytest.mark.timeout(600)]

GEN_A = "def generate(x):\n    return x * 2\n"
GEN_B = "def generate(x):\n    return x + 1\n"

MANIFEST = """
version: 1
functions:
  - name: gen_a
    fn: gen_a:generate
    args: [{shape: [n], dtype: float32}]
    buckets: {n: [4]}
  - name: gen_b
    fn: gen_b:generate
    args: [{shape: [n], dtype: float32}]
    buckets: {n: [4]}
"""

SERVICE = """
import sys
sys.path.insert(0, {dir!r})
import numpy as np
import cachectl
cachectl.activate()
import jax
import gen_a, gen_b
jax.jit(gen_a.generate)(np.ones(4, np.float32)).block_until_ready()  # gen_a's bucket: a hit
jax.jit(gen_b.generate)(np.ones(4, np.float32)).block_until_ready()  # gen_b's bucket: a hit
jax.jit(gen_b.generate)(np.ones(8, np.float32)).block_until_ready()  # no bucket: a miss
jax.jit(gen_a.generate)(np.ones(4, np.float32) * 3).block_until_ready()  # jit's own cache
"""


def test_stats_gives_two_functions_under_one_jit_name_their_own_rows(tmp_path: Path) -> None:
    (tmp_path / "gen_a.py").write_text(GEN_A)
    (tmp_path / "gen_b.py").write_text(GEN_B)
    (tmp_path / "manifest.yaml").write_text(MANIFEST)
    env = {"PYTHONPATH": str(tmp_path)}
    warm = run_cachectl(tmp_path, "warm", "manifest.yaml", "--jobs", "1", "--json", env=env)
    assert warm.returncode == 0, warm.stdout + warm.stderr
    run_py(SERVICE.format(dir=str(tmp_path)), cwd=tmp_path, check=True)

    out = run_cachectl(tmp_path, "stats", "--since", "1h", "--json")
    assert out.returncode == 0, out.stdout + out.stderr
    rows = {(f["name"], f["function"]): f for f in json.loads(out.stdout)["functions"]}
    counts = {k: (r["requests"], r["hits"], r["misses"]) for k, r in rows.items()}
    assert counts == {
        ("gen_a", "jit_generate"): (1, 1, 0),
        ("gen_b", "jit_generate"): (1, 1, 0),
        (None, "jit_generate"): (1, 0, 1),  # a program no manifest function's key explains
    }, counts
    assert rows[("gen_a", "jit_generate")]["saved_warm_seconds"] > 0
    (env_row,) = json.loads(out.stdout)["environments"]
    assert (env_row["requests"], env_row["hits"], env_row["misses"]) == (3, 2, 1), env_row
    listing = run_cachectl(tmp_path, "ls", "--env", env_row["environment"][:16], "--json")
    assert listing.returncode == 0, listing.stdout + listing.stderr
    in_ls = {(e["function"], e["module"]) for e in json.loads(listing.stdout)["entries"]}
    assert in_ls == {k for k in rows if k[0] is not None}, in_ls  # the names ls tells apart

    table = run_cachectl(tmp_path, "stats", "--since", "1h")
    assert table.returncode == 0, table.stdout + table.stderr
    text = table.stdout
    assert "gen_a (jit_generate)" in text and "gen_b (jit_generate)" in text, text
