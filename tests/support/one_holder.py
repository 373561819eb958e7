"""The TPU's one-holder rule, for CPU: a sitecustomize that fails a second process's backend.

On a TPU, a second process that opens the chip fails with "The TPU is already in use by
process N". ``one_holder_env`` puts a sitecustomize on PYTHONPATH that takes an exclusive
lock on a file when a process first opens a JAX backend and fails as the TPU does while
another process holds it. With ``report`` the process writes the backends it opened
(``jax._src.xla_bridge._backends``, each time it grows) when it exits or execs; with
ONE_HOLDER_LOG set, every process that opened one appends its command line there.
"""

from __future__ import annotations

import os
import textwrap
from pathlib import Path

# Loaded in every process through PYTHONPATH: the TPU's one-holder rule, for CPU.
ONE_HOLDER_SITE = """
import fcntl, importlib.abc, importlib.util, os, sys

_LOCK = os.environ["ONE_HOLDER_LOCK"]
_held = []
_opened = set()  # every backend this process opened (JAX clears its table at exit)


def _take():
    if _held:
        return
    fd = os.open(_LOCK, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        raise RuntimeError(
            "Unable to initialize backend 'cpu': ABORTED: the accelerator is already in use "
            "by another process (test lock)"
        ) from None
    _held.append(fd)
    if os.environ.get("ONE_HOLDER_LOG"):  # every process that opened the "accelerator"
        with open(os.environ["ONE_HOLDER_LOG"], "a") as log:
            with open("/proc/self/cmdline") as own:
                log.write(own.read().replace("\\0", " ") + "\\n")


class _AfterBridge(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name != "jax._src.xla_bridge":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        original = spec.loader.exec_module

        def exec_module(module):
            original(module)
            backends = module.backends

            def guarded():
                if not module._backends:
                    _take()
                result = backends()
                _opened.update(module._backends)
                return result

            module.backends = guarded

        spec.loader.exec_module = exec_module
        return spec


sys.meta_path.insert(0, _AfterBridge())

if os.environ.get("REPORT_BACKENDS"):  # the cachectl parent: what it opened, at exit or exec
    import atexit, json

    def _report():
        bridge = sys.modules.get("jax._src.xla_bridge")
        with open(os.environ["REPORT_BACKENDS"], "w") as f:
            json.dump(sorted(_opened | set(getattr(bridge, "_backends", None) or {})), f)

    atexit.register(_report)
    _execvpe = os.execvpe

    def _execvpe_reporting(file, args, env):
        _report()
        env = {k: v for k, v in env.items() if k != "REPORT_BACKENDS"}
        _execvpe(file, args, env)

    os.execvpe = _execvpe_reporting
"""


def one_holder_env(tmp_path: Path, report: Path | None = None) -> dict[str, str]:
    site = tmp_path / "site"
    site.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text(textwrap.dedent(ONE_HOLDER_SITE))
    path = os.pathsep.join(p for p in (str(site), str(tmp_path), os.environ.get("PYTHONPATH")) if p)
    env = {"PYTHONPATH": path, "ONE_HOLDER_LOCK": str(tmp_path / "accelerator.lock")}
    if report is not None:
        env["REPORT_BACKENDS"] = str(report)
    return env
