"""Manifest: what reading and validating a manifest costs a fresh process, now that it imports no JAX.

Two kinds of fresh process, alternating in one run, each timing from process start
until ``load_manifest(examples/manifest.yaml)`` has returned:

  (a) ``cachectl.manifest`` alone: what `cachectl warm --dry-run`, `advise` and bundle
      installs pay to read a manifest;
  (b) the same after ``import jax.numpy``: what every validation paid while the dtype
      validator resolved names through ``jax.numpy`` (before the manifest package).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import REPO, machine_line, stats, write_section

SECTION = "## Manifest"

# Run with the repository on PYTHONPATH; the clock starts before any import.
LOAD = r"""
import time
t0 = time.perf_counter()
import json
import sys
if {with_jax!r}:
    import jax.numpy
from cachectl.manifest import load_manifest
load_manifest({manifest!r})
print(json.dumps({{"seconds": time.perf_counter() - t0,
                  "jax_loaded": "jax" in sys.modules}}))
"""


def _once(with_jax: bool) -> dict[str, Any]:
    code = LOAD.format(manifest=str(REPO / "examples" / "manifest.yaml"), with_jax=with_jax)
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    ).stdout
    return json.loads(out.strip().splitlines()[-1])


def run(quick: bool = False) -> dict[str, Any]:
    rounds = 5 if quick else 15
    machine_text = machine_line()  # the load average at the start, before either side runs
    plain: list[float] = []
    with_jax: list[float] = []
    jax_loaded = False
    for _ in range(rounds):  # alternating: the machine's load hits both sides alike
        a = _once(False)
        jax_loaded = jax_loaded or a["jax_loaded"]
        plain.append(a["seconds"])
        with_jax.append(_once(True)["seconds"])
    return {
        "rounds": rounds,
        "plain": stats(plain),
        "with_jax": stats(with_jax),
        "jax_loaded_without_jax": jax_loaded,
        "machine": machine_text,
    }


def markdown(result: dict[str, Any], command: str = "python -m bench --only manifest") -> str:
    p, j = result["plain"], result["with_jax"]
    return (
        f"{SECTION}\n\n"
        f"`{command}`. {result['machine']}\n\n"
        "Fresh process until `load_manifest(examples/manifest.yaml)` returns (parse, schema, "
        "cross-field checks), the two sides alternating, "
        f"{result['rounds']} rounds each; median (min–max):\n\n"
        "| process | seconds |\n|---|---|\n"
        f"| `cachectl.manifest` alone (JAX loaded: {'yes' if result['jax_loaded_without_jax'] else 'no'}) | "
        f"{p['median']:.3f} ({p['min']:.3f}–{p['max']:.3f}) |\n"
        f"| after `import jax.numpy` (what the dtype check used to import) | "
        f"{j['median']:.3f} ({j['min']:.3f}–{j['max']:.3f}) |\n\n"
        f"Reading a manifest costs **{p['median'] / j['median']:.2f}x** what it did when validation "
        "imported JAX.\n"
    )


if __name__ == "__main__":
    quick = "--quick" in sys.argv
    res = run(quick)
    print(json.dumps(res, indent=2))
    if "--no-write" not in sys.argv:
        write_section(SECTION, markdown(res))
