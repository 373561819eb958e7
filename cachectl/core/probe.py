"""This machine's environment, read by a short child process so this one never opens a backend.

A TPU is held by one process at a time, from JAX's first backend use until that process
exits; a second process that asks for it fails ("The TPU is already in use by process N").
A command that starts JAX children (warm-check, warm-run, its replay, verify --deep) must
therefore leave the backend alone: it asks a child, which reads the environment exactly as
``current_environment()`` would there, prints it and exits before the next child starts.
Where this process already opened a backend (a library caller that ran JAX), it is read here.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from cachectl.core import jax_seam
from cachectl.core.errors import OperationFailed
from cachectl.core.fingerprint import Environment, current_environment

# Backends one process at a time may hold: no two JAX processes share one of them.
ONE_PROCESS_BACKENDS = ("tpu",)
# Opening a TPU took 6 to 15 s where it was measured; a probe stuck this long is killed.
PROBE_TIMEOUT_S = 300.0
_MARK = "cachectl-environment "
_TAIL_LINES = 3


def environment_in_child(timeout_s: float = PROBE_TIMEOUT_S) -> Environment:
    """The environment a JAX child of this process will see (see module)."""
    if jax_seam.backends_opened():
        return current_environment()
    command = [sys.executable, "-c", "from cachectl.core.probe import main; main()"]
    try:
        proc = subprocess.run(
            command, capture_output=True, text=True, timeout=timeout_s, env=dict(os.environ)
        )
    except subprocess.TimeoutExpired:
        raise OperationFailed(
            f"reading this machine's JAX environment took over {timeout_s:g}s in a child "
            "process: is another process holding the accelerator?"
        ) from None
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith(_MARK):
            return Environment.from_dict(json.loads(line[len(_MARK) :]))
    tail = (proc.stderr or proc.stdout or "").strip().splitlines()[-_TAIL_LINES:]
    raise OperationFailed(
        f"could not read this machine's JAX environment in a child process (exit "
        f"{proc.returncode}): {' | '.join(tail) or 'no output'}; is another process holding "
        "the accelerator?"
    )


def main() -> None:
    """The child: one line with the environment, then exit (which releases the backend)."""
    print(_MARK + json.dumps(current_environment().to_dict(), sort_keys=True), flush=True)
