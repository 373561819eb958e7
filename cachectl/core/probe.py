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
import re
import stat
import subprocess
import sys
import threading
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from cachectl.core import jax_seam
from cachectl.core.config import state_dir
from cachectl.core.cpu_isa import host_cpu_isa
from cachectl.core.errors import CachectlError, OperationFailed
from cachectl.core.fingerprint import ADDED_FIELDS, Environment, check_versions, current_environment
from cachectl.core.temps import atomic_write

# Backends one process at a time may hold: no two JAX processes share one of them.
ONE_PROCESS_BACKENDS = ("tpu",)
# Opening a TPU took 6 to 15 s where it was measured; a probe stuck this long is killed.
PROBE_TIMEOUT_S = 300.0
_MARK = "cachectl-environment "
_TAIL_LINES = 3
# The child prints one line of about 1 KB; more than this is an error, never the parent's memory.
PROBE_OUTPUT_LIMIT = 1 << 20
_STDERR_TAIL = 1 << 16  # stderr's last bytes kept for the error message


# Where every cachectl child that imports JAX or cachectl starts: not the user's working
# directory, whose ``json.py`` would shadow the standard library's (with ``-P``: isolated()).
ISOLATED_CWD = "/"


def isolated(code: str) -> list[str]:
    """The command of a Python child running ``code`` isolated from the working directory: with
    ``-P`` nothing unsafe is put before the standard library on its path; run it in
    ``ISOLATED_CWD``. The probe, ``verify --deep`` and ``warm-check``'s children start so."""
    return [sys.executable, "-P", "-c", code]


def environment_in_child(timeout_s: float = PROBE_TIMEOUT_S) -> Environment:
    """The environment a JAX child of this process will see (see module).

    The child runs isolated from the working directory (``-P``, started in ``/``): a
    ``json.py`` there is never imported. Its output is read bounded: a child that prints more
    than ``PROBE_OUTPUT_LIMIT`` bytes is an error, not memory."""
    if jax_seam.backends_opened():
        return current_environment()
    command = isolated("from cachectl.core.probe import main; main()")
    returncode, stdout, stderr = _run_bounded(command, timeout_s)
    for line in reversed(stdout.splitlines()):
        if line.startswith(_MARK.encode()):
            return Environment.from_dict(json.loads(line[len(_MARK) :]))
    text = (stderr or stdout).decode(errors="replace").strip()
    tail = text.splitlines()[-_TAIL_LINES:]
    raise OperationFailed(
        f"could not read this machine's JAX environment in a child process (exit "
        f"{returncode}): {' | '.join(tail) or 'no output'}; is another process holding "
        "the accelerator?"
    )


def _run_bounded(command: list[str], timeout_s: float) -> tuple[int, bytes, bytes]:
    """Run the probe child in ``/``; (exit code, stdout, stderr's tail), each read bounded."""
    proc = subprocess.Popen(
        command,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        cwd=ISOLATED_CWD,
        env=dict(os.environ),
    )
    out, err = bytearray(), bytearray()
    too_much = threading.Event()

    def read_out() -> None:
        assert proc.stdout is not None
        while chunk := os.read(proc.stdout.fileno(), 1 << 16):
            out.extend(chunk)
            if len(out) > PROBE_OUTPUT_LIMIT:
                too_much.set()
                with contextlib.suppress(OSError):
                    proc.kill()
                return

    def read_err() -> None:
        assert proc.stderr is not None
        while chunk := os.read(proc.stderr.fileno(), 1 << 16):
            err.extend(chunk)
            if len(err) > 2 * _STDERR_TAIL:
                del err[:-_STDERR_TAIL]

    readers = [threading.Thread(target=f, daemon=True) for f in (read_out, read_err)]
    for reader in readers:
        reader.start()
    try:
        returncode = proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        raise OperationFailed(
            f"reading this machine's JAX environment took over {timeout_s:g}s in a child "
            "process: is another process holding the accelerator?"
        ) from None
    finally:
        for reader in readers:
            reader.join(timeout=5.0)  # a grandchild that keeps a pipe open is not waited for
        for pipe in (proc.stdout, proc.stderr):
            if pipe is not None:
                pipe.close()
    if too_much.is_set():
        raise OperationFailed(
            "the child process that reads this machine's JAX environment printed more than "
            f"{PROBE_OUTPUT_LIMIT // (1 << 20)} MiB: remove what prints on its start "
            "(a sitecustomize, usercustomize or .pth file on its path)"
        )
    return returncode, bytes(out), bytes(err)


def main() -> None:
    """The child: one line with the environment, then exit (which releases the backend)."""
    print(_MARK + json.dumps(current_environment().to_dict(), sort_keys=True), flush=True)


# -- the remembered environment (exec) ------------------------------------------------------

MEMO_VERSION = 2  # 2: environments name x64 and the CPU instruction set
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
MEMO_MAX_BYTES = 1 << 16  # a remembered file is about 1 KB; a bigger one is damage
_MEMO_NAME = re.compile(r"[0-9a-f]{64}\.json")  # the only names pruning ever removes
_MAX_DEVICES = 1 << 20
_MAX_TEXT = 4096
BOOT_ID = Path("/proc/sys/kernel/random/boot_id")


@dataclass(frozen=True)
class ProbedEnvironment:
    """The environment for a service, and whether it was remembered rather than read now."""

    environment: Environment
    remembered: bool
    memo: Path | None  # the file that holds it; None where nothing can be remembered
    warning: str | None = None  # why a remembered file was ignored or forgotten


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
    lines.append(f"version {sys.version}")  # the probe child runs in /, never from the cwd
    lines.append(f"cpu {host_cpu_isa()}")  # a CPU environment names what XLA:CPU compiles for
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


class Untrusted(Exception):
    """The memo directory or a file in it is not this user's alone: nothing in it is used."""


def _owner_only(st: os.stat_result, what: str, path: Path) -> None:
    if st.st_uid != os.geteuid():
        raise Untrusted(f"{what} {path} belongs to uid {st.st_uid}, not {os.geteuid()}")
    if st.st_mode & 0o022:
        raise Untrusted(
            f"{what} {path} is writable by others (mode {stat.S_IMODE(st.st_mode):o}); "
            f"run chmod go-w {path}"
        )


def _private_memo_dir(create: bool) -> Path | None:
    """The memo directory, checked: a real directory (not a symlink) that this user owns and
    no one else may write. None where it does not exist (and ``create`` is false); raises
    Untrusted otherwise. Created 0700 (its parent too, where missing), whatever the umask."""
    directory = memo_dir()
    if create:
        try:
            os.makedirs(directory.parent, mode=0o700, exist_ok=True)
            os.mkdir(directory, 0o700)
            os.chmod(directory, 0o700)
        except FileExistsError:
            pass
    try:
        st = os.lstat(directory)
    except FileNotFoundError:
        return None
    if not stat.S_ISDIR(st.st_mode):
        raise Untrusted(f"{directory} is not a directory (a symlink?)")
    _owner_only(st, "directory", directory)
    return directory


def strict_environment(data: object) -> Environment:
    """A remembered environment, checked field by field; ValueError names the first bad one."""
    if not isinstance(data, dict):
        raise ValueError("not an object")
    names = {f.name for f in fields(Environment)}
    if not names - ADDED_FIELDS.keys() <= set(data) <= names:
        raise ValueError(f"fields differ: {sorted(set(data) ^ names)}")
    data = {**ADDED_FIELDS, **data}  # recorded before these fields: their defaults
    for name in names:
        value = data[name]
        if name in ("device_count", "process_count"):
            ok = type(value) is int and 1 <= value <= _MAX_DEVICES
        elif name in ("include_metadata_in_key", "enable_x64"):
            ok = type(value) is bool
        elif name == "xla_flags":
            ok = isinstance(value, list) and all(
                isinstance(f, str) and f.isprintable() and len(f) <= _MAX_TEXT for f in value
            )
        elif name == "compression":
            ok = value in ("zstandard", "zlib")
        elif name == "platform_version":
            # libtpu's spans lines ("PJRT C API\nTFRT TPU v5 lite\nBuilt on ..."), read on a
            # v5e: refusing line breaks here forgot every remembered TPU environment.
            ok = isinstance(value, str) and len(value) <= _MAX_TEXT
            ok = ok and value.replace("\n", "").isprintable()
        else:
            ok = isinstance(value, str) and value.isprintable() and len(value) <= _MAX_TEXT
            ok = ok and (bool(value) or name in ("enable_xla_caches", "cpu_isa"))
        if not ok:
            raise ValueError(f"field {name} is {value!r:.60}")
    environment = Environment.from_dict(data)
    check_versions(environment)
    return environment


def read_private(path: Path, limit: int = MEMO_MAX_BYTES) -> bytes:
    """A state file's bytes, read bounded, without following a symlink and without waiting
    on a FIFO; only a regular file this user owns that no one else can write. Raises
    FileNotFoundError where it is missing, ValueError or Untrusted where it is damaged or
    foreign, OSError where it cannot be opened."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    with os.fdopen(fd, "rb") as fh:
        st = os.fstat(fh.fileno())
        if not stat.S_ISREG(st.st_mode):
            raise ValueError("not a regular file")
        _owner_only(st, "file", path)
        raw = fh.read(limit + 1)
    if len(raw) > limit:
        raise ValueError(f"over {limit} bytes")
    return raw


def _read_memo(path: Path, key: str) -> tuple[Environment | None, str | None]:
    """(the remembered environment or None, why it was forgotten). A missing file is no
    reason; a damaged one (not a regular file, a symlink, too big, not JSON, a bad field) is
    removed, and so is a file another uid planted."""
    try:
        data = json.loads(read_private(path))
        if not isinstance(data, dict) or set(data) != {"key", "environment"}:
            raise ValueError("not a remembered environment")
        if data["key"] != key:
            raise ValueError("remembered for another state of this machine")
        return strict_environment(data["environment"]), None
    except FileNotFoundError:
        return None, None
    except OSError as exc:  # a symlink (ELOOP), no permission
        forget(path)
        return None, f"cannot read it ({exc.strerror or exc})"
    except (ValueError, Untrusted, CachectlError) as exc:
        forget(path)
        reason = exc.message if isinstance(exc, CachectlError) else str(exc)
        return None, reason[:200]


def _write_memo(path: Path, key: str, environment: Environment) -> None:
    """Best effort, atomic, owner-only: a memo that cannot be written only costs the next exec
    a child. Pruning removes only older memo files (their names), never another file."""
    data = json.dumps({"key": key, "environment": environment.to_dict()}, sort_keys=True)
    with contextlib.suppress(OSError):
        atomic_write(str(path), 0o600, lambda fh: fh.write(data.encode()))
        kept: list[tuple[int, str]] = []
        with os.scandir(path.parent) as names:
            for entry in names:
                if _MEMO_NAME.fullmatch(entry.name) and entry.is_file(follow_symlinks=False):
                    kept.append((entry.stat(follow_symlinks=False).st_mtime_ns, entry.name))
        for _, name in sorted(kept, reverse=True)[MEMO_KEEP:]:
            forget(path.parent / name)


def remembered_environment(fresh: bool = False) -> ProbedEnvironment:
    """The environment for a service `cachectl exec` starts: remembered where this machine's
    state is unchanged since a child last read it, read by a child otherwise (see module).

    Nothing about the remembered file stops a start: a directory that is not this user's
    alone is ignored with a warning, a damaged file is forgotten with one."""
    if jax_seam.backends_opened():
        return ProbedEnvironment(current_environment(), remembered=False, memo=None)
    warning = None
    try:
        key = memo_key()
        directory = _private_memo_dir(create=True) if key else None
    except Untrusted as exc:
        key, directory = None, None
        warning = f"cachectl: remembered environments ignored: {exc}"
    except OSError as exc:  # a removed working directory, a read-only state directory
        key, directory = None, None
        warning = f"cachectl: cannot remember environments here ({exc.strerror or exc})"
    if key is None or directory is None:
        return ProbedEnvironment(environment_in_child(), False, None, warning)
    path = directory / f"{key}.json"
    environment, reason = (None, None) if fresh else _read_memo(path, key)
    if environment is not None:
        return ProbedEnvironment(environment, remembered=True, memo=path)
    if reason:
        warning = f"cachectl: the remembered environment {path} is forgotten: {reason}"
    environment = environment_in_child()
    _write_memo(path, key, environment)
    return ProbedEnvironment(environment, remembered=False, memo=path, warning=warning)


def forget(path: str | Path) -> None:
    with contextlib.suppress(OSError):
        Path(path).unlink(missing_ok=True)


def runtime_differences(remembered: Environment, actual: Environment) -> list[str]:
    """The fields in which a remembered environment is not this process's: every field that
    goes into the namespace, the runtime's and those the variables decide alike."""
    a, b = remembered.to_dict(), actual.to_dict()
    return [f"{name} {a[name]} -> {b[name]}" for name in sorted(a) if a[name] != b[name]]


def watch_remembered(path: str, remembered: dict[str, Any]) -> None:
    """In a service exec started: at its first compile request (its backend is open then),
    forget a remembered environment that is not this process's, and say so."""
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
