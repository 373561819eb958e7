"""This machine's environment, read by a short child process so this one never opens a backend.

A TPU is held by one process at a time, from JAX's first backend use until that process
exits; a second process that asks for it fails ("The TPU is already in use by process N").
A command that starts JAX children (warm-check, warm-run, its replay, verify --deep) must
therefore leave the backend alone: it asks a child, which reads the environment exactly as
``current_environment()`` would there, prints it and exits before the next child starts.
Where this process already opened a backend (a library caller that ran JAX), it is read here.

`cachectl exec` starts a service, and a second open of the chip doubled its start on a TPU
(about 10 s each). So exec remembers what the child read, in one small file per machine
state (``remembered_environment``): the key hashes everything the reading depends on that
can change without a reboot (the boot, the interpreter, the packages installed on sys.path
and where jax, jaxlib and libtpu are imported from, the variables JAX, XLA and the device
runtimes read, the accelerator device nodes). The service exec started checks the remembered
runtime against its own once its backend is open (``watch_remembered``, started by
cachectl.service.exec_hook) and forgets it on any difference.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cachectl.core import jax_seam
from cachectl.core.config import state_dir
from cachectl.core.errors import CachectlError, OperationFailed
from cachectl.core.fingerprint import Environment, check_versions, current_environment
from cachectl.core.temps import atomic_write

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


# -- the remembered environment (exec) ------------------------------------------------------

MEMO_VERSION = 1
# Variables the environment's reading depends on: JAX's config, XLA's and the device runtimes'
# settings, the interpreter's path and library search.
MEMO_VARIABLE_PREFIXES = (
    "JAX_", "XLA_", "TPU_", "LIBTPU", "CLOUD_TPU", "MEGASCALE", "PJRT_", "TF_", "CUDA_",
    "NVIDIA_", "NCCL_", "ROCR_", "HIP_", "GPU_", "PYTHON", "LD_",
)  # fmt: skip
# Device nodes of the accelerators JAX runs on: recreated (new ctime) when a driver reloads.
MEMO_DEVICE_NODES = ("accel", "nvidia", "vfio", "kfd", "dri")
# The packages whose files decide the versions and the runtime read.
MEMO_PACKAGES = ("jax", "jaxlib", "libtpu", "jax_plugins", "zstandard")
# Names an install leaves in a directory on sys.path.
INSTALL_MARKERS = (".dist-info", ".egg-info", ".egg-link", ".pth", ".egg")
MEMO_KEEP = 16  # files kept in the memo directory; older ones are removed
BOOT_ID = Path("/proc/sys/kernel/random/boot_id")
# Runtime fields a service compares with its own: the rest come from variables in the key.
RUNTIME_FIELDS = (
    "jax_version", "jaxlib_version", "backend", "platform_version", "device_kind",
    "device_count", "topology",
)  # fmt: skip


@dataclass(frozen=True)
class ProbedEnvironment:
    """The environment for a service, and whether it was remembered rather than read now."""

    environment: Environment
    remembered: bool
    memo: Path | None  # the file that holds it; None where nothing can be remembered


def _stat_line(path: str) -> str:
    try:
        st = os.stat(path)
    except OSError:
        return f"{path} -"
    return f"{path} {st.st_mode:o} {st.st_rdev} {st.st_mtime_ns} {st.st_ctime_ns}"


def _installed(directory: str) -> list[str]:
    """What an install or uninstall changes in a directory on sys.path (not its bytecode)."""
    try:
        names = os.listdir(directory)
    except OSError:
        return ["-"]
    return sorted(n for n in names if n.endswith(INSTALL_MARKERS))


def memo_key() -> str | None:
    """What the environment's reading depends on, hashed; None where it cannot be known."""
    try:
        boot = BOOT_ID.read_text().strip()
    except OSError:
        return None
    lines = [f"memo {MEMO_VERSION}", f"boot {boot}", f"python {os.path.realpath(sys.executable)}"]
    lines.append(f"version {sys.version}")
    lines.append(f"cwd {os.getcwd()}")  # the probe child imports from its working directory
    lines += [
        f"env {k}={v}"
        for k, v in sorted(os.environ.items())
        if k.startswith(MEMO_VARIABLE_PREFIXES)
    ]
    for entry in sys.path[1:]:
        lines.append(f"path {entry} " + " ".join(_installed(entry)))
    for name in MEMO_PACKAGES:
        try:
            spec = importlib.util.find_spec(name)
        except (ImportError, ValueError):
            spec = None
        for location in list(getattr(spec, "submodule_search_locations", None) or []):
            lines.append("package " + _stat_line(location))
            lines.append("package " + _stat_line(os.path.join(location, "version.py")))
    with contextlib.suppress(OSError):
        for name in sorted(os.listdir("/dev")):
            if name.startswith(MEMO_DEVICE_NODES):
                lines.append("device " + _stat_line(os.path.join("/dev", name)))
                if os.path.isdir(os.path.join("/dev", name)):
                    for child in sorted(os.listdir(os.path.join("/dev", name))):
                        lines.append("device " + _stat_line(os.path.join("/dev", name, child)))
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()


def memo_dir() -> Path:
    return state_dir() / "environments"


def _read_memo(path: Path, key: str) -> Environment | None:
    """The remembered environment, or None for a missing, foreign or damaged file."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        if data.get("key") != key:
            return None
        environment = Environment.from_dict(data["environment"])
        check_versions(environment)
        return environment
    except (OSError, ValueError, KeyError, TypeError, AttributeError, CachectlError):
        return None


def _write_memo(path: Path, key: str, environment: Environment) -> None:
    """Best effort, atomic: a memo that cannot be written only costs the next exec a child."""
    data = json.dumps({"key": key, "environment": environment.to_dict()}, sort_keys=True)
    with contextlib.suppress(OSError):
        atomic_write(str(path), 0o644, lambda fh: fh.write(data.encode()))
        kept = sorted(path.parent.glob("*.json"), key=lambda p: p.stat().st_mtime, reverse=True)
        for old in kept[MEMO_KEEP:]:
            old.unlink(missing_ok=True)


def remembered_environment(fresh: bool = False) -> ProbedEnvironment:
    """The environment for a service `cachectl exec` starts: remembered where this machine's
    state is unchanged since a child last read it, read by a child otherwise (see module)."""
    if jax_seam.backends_opened():
        return ProbedEnvironment(current_environment(), remembered=False, memo=None)
    key = memo_key()
    if key is None:
        return ProbedEnvironment(environment_in_child(), remembered=False, memo=None)
    path = memo_dir() / f"{key}.json"
    environment = None if fresh else _read_memo(path, key)
    if environment is not None:
        return ProbedEnvironment(environment, remembered=True, memo=path)
    environment = environment_in_child()
    _write_memo(path, key, environment)
    return ProbedEnvironment(environment, remembered=False, memo=path)


def forget(path: str | Path) -> None:
    with contextlib.suppress(OSError):
        Path(path).unlink(missing_ok=True)


def runtime_differences(remembered: Environment, actual: Environment) -> list[str]:
    """The runtime fields in which a remembered environment is not this process's."""
    a, b = remembered.to_dict(), actual.to_dict()
    return [f"{name} {a[name]} -> {b[name]}" for name in RUNTIME_FIELDS if a[name] != b[name]]


def watch_remembered(path: str, remembered: dict[str, Any]) -> None:
    """In a service exec started: at its first compile request (its backend is open then),
    forget a remembered environment whose runtime is not this process's, and say so."""
    import jax

    checked: list[bool] = []

    def on_event(event: str, **_: Any) -> None:
        if event != jax_seam.EVENT_REQUESTS or checked:
            return
        checked.append(True)
        with contextlib.suppress(Exception):  # never break the service
            differences = runtime_differences(
                Environment.from_dict(remembered), current_environment()
            )
            if differences:
                forget(path)
                sys.stderr.write(
                    "cachectl: this process's JAX runtime is not the one `cachectl exec` "
                    f"remembered ({'; '.join(differences)}): its compiles go to the namespace "
                    "exec named; the remembered environment is forgotten, so the next "
                    "`cachectl exec` reads it afresh\n"
                )

    jax.monitoring.register_event_listener(on_event)
