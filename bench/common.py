"""What every benchmark shares: statistics, machine details, the BENCHMARKS.md writer."""

from __future__ import annotations

import functools
import os
import platform
import statistics
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
BENCHMARKS = REPO / "BENCHMARKS.md"


def compile_bytecode() -> str:
    """Write cachectl's bytecode before timing, as installing the package does.

    An editable install under PYTHONDONTWRITEBYTECODE (this machine's environment) never gets a
    .pyc, so every process would compile cachectl's modules from source (~18 ms) while JAX's
    come from its installed bytecode: an unequal comparison. What was done is reported."""
    import compileall

    package = REPO / "cachectl"
    ok = compileall.compile_dir(str(package), quiet=1)
    return "compiled (as installed)" if ok else "compile failed: modules compiled from source"


def tree_cpu(pid: int) -> float:
    """CPU seconds (user + system) of a process and every descendant alive now (a server's
    workers, granian's worker, nginx's).

    Found through each process's parent in /proc/PID/stat, which every Linux /proc has, rather
    than /proc/PID/task/*/children, which needs a kernel built with CONFIG_PROC_CHILDREN (one
    implementation for every bench; there were three).
    """
    tick = os.sysconf("SC_CLK_TCK")
    cpu: dict[int, float] = {}
    parent: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        cpu[int(entry)] = (int(fields[11]) + int(fields[12])) / tick
        parent[int(entry)] = int(fields[1])
    tree, grew = {pid}, True
    while grew:
        grew = False
        for child, ppid in parent.items():
            if ppid in tree and child not in tree:
                tree.add(child)
                grew = True
    return sum(cpu.get(p, 0.0) for p in tree)


def stats(values: list[float]) -> dict[str, float]:
    """Median and min-max: what we quote on shared, noisy machines."""
    return {
        "median": statistics.median(values),
        "min": min(values),
        "max": max(values),
        "n": len(values),
    }


@functools.cache
def _jax_here() -> tuple[str, str]:
    """JAX's version and backend, read in a child process: a TPU opened here would refuse every
    process a benchmark starts after it (cachectl.core.probe)."""
    try:
        from cachectl.core.probe import environment_in_child

        env = environment_in_child()
        return env.jax_version, env.backend
    except Exception:  # noqa: BLE001 - benchmarks report what they can
        return "?", "?"


def machine() -> dict[str, Any]:
    jax_version, backend = _jax_here()
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    return {
        "cores": os.cpu_count(),
        "python": platform.python_version(),
        "jax": jax_version,
        "backend": backend,
        "load_average": load,
    }


def machine_line(info: dict[str, Any] | None = None) -> str:
    m = info or machine()
    return (
        f"Machine: {m['cores']} cores (shared), Python {m['python']}, jax {m['jax']} ({m['backend']}), "
        f"load average {m['load_average']} at the start."
    )


def write_section(heading: str, text: str, path: Path = BENCHMARKS) -> None:
    """Replace (or append) one ``## heading`` section, leaving the others alone."""
    existing = path.read_text() if path.exists() else "# Benchmarks\n\n"
    lines = existing.splitlines(keepends=True)
    start = next((i for i, line in enumerate(lines) if line.strip() == heading), None)
    if start is None:
        body = existing.rstrip("\n") + "\n\n" + text
    else:
        end = next(
            (i for i in range(start + 1, len(lines)) if lines[i].startswith("## ")), len(lines)
        )
        tail = "".join(lines[end:])
        body = "".join(lines[:start]) + text + ("\n" + tail if tail else "")
    path.write_text(body)
