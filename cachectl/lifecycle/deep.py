"""`verify --deep`: load every entry's executable the way a JAX cache hit does, in a subprocess.

A header that decompresses says nothing about whether XLA can load the
executable (upstream segfaults loading some CPU executables in a new process,
jax issues 24982, 28908). Loading runs in a child process, so a crash costs the
child, not verify: the entry it was loading is reported and a new child goes on
with the rest. Only entries of this machine's own environment can be loaded.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from cachectl.core.probe import ISOLATED_CWD, isolated
from cachectl.storage.entries import CorruptEntry
from cachectl.storage.store import Store
from cachectl.trust.gate import deserialize_entry

# One load should take well under a second; a child stuck this long is killed.
DEFAULT_TIMEOUT_S = 600.0


@dataclass(frozen=True)
class DeepProblem:
    path: str
    detail: str


def load_all(
    store: Store, rows: Mapping[str, str], *, timeout_s: float = DEFAULT_TIMEOUT_S
) -> list[DeepProblem]:
    """Load each entry at ``rows``' paths (relative to the store) in child processes, each only
    when its bytes have the sha256 of its index row (the gate, trust/gate.py); report failures."""
    if not rows:
        return []
    problems: list[DeepProblem] = []
    paths = list(rows)
    with tempfile.TemporaryDirectory(prefix="cachectl-deep-") as tmp:
        files = []
        for n, path in enumerate(paths):
            local = Path(tmp) / f"{n}.entry"
            local.write_bytes(store.read_bytes(path))
            files.append([str(local), rows[path]])
        todo = list(range(len(paths)))
        while todo:
            done, failed, crashed_at, detail = _run_child([files[i] for i in todo], timeout_s)
            for j, message in failed.items():
                problems.append(DeepProblem(paths[todo[j]], message))
            if crashed_at is None:
                break
            problems.append(DeepProblem(paths[todo[crashed_at]], detail))
            todo = todo[crashed_at + 1 :]
            del done
    return problems


def _run_child(
    files: list[list[str]], timeout_s: float
) -> tuple[int, dict[int, str], int | None, str]:
    """(loaded, {index: error}, index being loaded when the child died or None, why it died)."""
    try:
        proc = subprocess.run(
            isolated("from cachectl.lifecycle.deep import _main; _main()"),
            input=json.dumps(files),
            cwd=ISOLATED_CWD,
            capture_output=True,
            text=True,
            timeout=timeout_s,
        )
        out, code = proc.stdout, proc.returncode
    except subprocess.TimeoutExpired as exc:
        raw = exc.stdout or ""
        out = raw.decode() if isinstance(raw, bytes) else raw
        code = None
    started: int | None = None
    loaded = 0
    failed: dict[int, str] = {}
    for line in out.splitlines():
        kind, _, rest = line.partition(" ")
        if kind == "start":
            started = int(rest)
        elif kind == "ok":
            loaded += 1
            started = None
        elif kind == "error":
            index, _, message = rest.partition(" ")
            failed[int(index)] = message
            started = None
    if code == 0 or started is None:
        return loaded, failed, None, ""
    why = (
        "the loading process hung"
        if code is None
        else (
            f"loading it killed the process (signal {-code})"
            if code < 0
            else f"the loading process exited {code}"
        )
    )
    return loaded, failed, started, why


def _main() -> None:
    """The child: load each file as JAX's own cache hit does, through the gate (its bytes must
    have their index row's sha256), one line of progress per file."""
    import jax

    files = json.loads(sys.stdin.read())
    every = jax.devices()[0].client.devices()
    for n, (path, sha256) in enumerate(files):
        print("start", n, flush=True)
        try:
            deserialize_entry(Path(path).read_bytes(), sha256, every)
        except CorruptEntry as exc:
            print("error", n, f"not an entry: {exc}".replace("\n", " "), flush=True)
            continue
        except Exception as exc:  # noqa: BLE001 - what JAX says is the finding
            text = f"JAX cannot load it: {type(exc).__name__}: {exc}".replace("\n", " ")[:400]
            print("error", n, text, flush=True)
            continue
        print("ok", n, flush=True)
