"""Telemetry for services run by `cachectl exec`: started when the process imports JAX.

`cachectl exec` cannot call activate() inside someone else's program, so it
puts a sitecustomize on PYTHONPATH (cachectl/service/_exec_site) that installs this
import hook. When ``jax`` finishes importing, the collector starts as
activate() starts it, for the environment exec resolved (passed in
CACHECTL_EXEC_ENVIRONMENT, so no JAX backend is initialised early). The JAX
configuration itself came from exec's environment variables; JAX's cache then reads only the
entries activate() would verify (``_verify_jax_cache``).

Where exec used a remembered environment (cachectl.core.probe), it names the file in
CACHECTL_EXEC_REMEMBERED and its own pid (which the service keeps) in CACHECTL_EXEC_PID; the
first Python process of the service checks it: exec's own pid, or, behind a program that is
not Python (``sh -c``), the first Python process started below it. That process marks the
variable claimed for its own children (helpers with other devices are not checked). At its
first compile request, when its backend is open, the probe's ``watch_remembered`` compares
every field of the namespace with the process's own and forgets the file on any difference,
so the next exec reads the environment afresh.
"""

from __future__ import annotations

import contextlib
import importlib.abc
import importlib.util
import json
import os
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

SITE_DIR = str(Path(__file__).resolve().parent / "_exec_site")
ENABLE_VAR = "CACHECTL_EXEC_TELEMETRY"
ENVIRONMENT_VAR = "CACHECTL_EXEC_ENVIRONMENT"
REMEMBERED_VAR = "CACHECTL_EXEC_REMEMBERED"
# The pid exec hands over (execvpe keeps it): only that process checks the remembered
# environment, not the helpers it starts with other devices or platforms.
SERVICE_PID_VAR = "CACHECTL_EXEC_PID"
# What the checking process leaves in CACHECTL_EXEC_PID for its children.
CLAIMED = "claimed"
# Set by `cachectl warm-check --replay` and `warm-run`: a file each process appends its JAX cache
# counts to at exit (and the programs it would not write because of their host callbacks), and,
# under WRITES_VAR, as JAX writes each entry, a line naming its key (``WROTE``): what warm-run
# indexes.
COUNTS_VAR = "CACHECTL_EXEC_COUNTS"
WROTE = "wrote"
# Under WRITES_VAR, as JAX's file cache is handed each entry, a line with its key (``PUT``) and
# the sha256 of the bytes (``SHA256``): a file is the process's own only with that sha256 (JAX
# logs a write, then writes nothing where a file is already at the key).
PUT = "put"
SHA256 = "sha256"
# Set ("1") by `warm-run` only, whose command writes: the WROTE lines are asked for. A read-only
# replay's processes neither pay for the capture nor have JAX's cache loggers turned to DEBUG.
WRITES_VAR = "CACHECTL_EXEC_WRITES"
# Where exec pointed JAX's persistent cache (service/env.py): the directory the verifier guards.
JAX_CACHE_DIR_VAR = "JAX_COMPILATION_CACHE_DIR"


def child_variables(
    environment: dict[str, Any],
    existing_pythonpath: str | None,
    *,
    telemetry: bool = True,
    remembered: str | None = None,
) -> dict[str, str]:
    """What exec adds to the child's environment: telemetry, the remembered file's check."""
    path = SITE_DIR if not existing_pythonpath else SITE_DIR + os.pathsep + existing_pythonpath
    variables = {ENVIRONMENT_VAR: json.dumps(environment, sort_keys=True), "PYTHONPATH": path}
    if telemetry:
        variables[ENABLE_VAR] = "1"
    if remembered:
        variables[REMEMBERED_VAR] = remembered
        variables[SERVICE_PID_VAR] = str(os.getpid())
    return variables


class _AfterJaxImport(importlib.abc.MetaPathFinder):
    """Finds nothing itself: wraps JAX's own loader so telemetry starts once jax is imported."""

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        if name != "jax":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec("jax")
        loader = getattr(spec, "loader", None)
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        original = loader.exec_module

        def exec_module(module: Any) -> None:
            original(module)
            _start()

        loader.exec_module = exec_module
        return spec


def _claims_the_check() -> bool:
    """Whether this process checks the remembered environment (see module); its children won't."""
    if not os.environ.get(REMEMBERED_VAR):
        return False
    owner = os.environ.get(SERVICE_PID_VAR)
    os.environ[SERVICE_PID_VAR] = CLAIMED
    return owner != CLAIMED


_CHECKS: list[bool] = []


def install() -> None:
    _CHECKS[:] = [_claims_the_check()]
    if "jax" in sys.modules:
        _start()
    elif not any(isinstance(f, _AfterJaxImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterJaxImport())


_WRITES = contextlib.ExitStack()  # the write capture, open until the process exits


def _count_cache_events(path: str) -> None:
    """JAX's own persistent-cache events in this process, one JSON line appended at exit; under
    WRITES_VAR also one line per entry JAX writes, appended as it is written (``{"pid", "wrote":
    key}``), so a process that dies before its exit handlers has still said which files it wrote."""
    import atexit

    import jax

    from cachectl.core.jax_seam import (
        EVENT_HITS,
        EVENT_REQUESTS,
        compiler_logger,
        host_callbacks_module,
        record_puts,
    )

    counts = {"pid": os.getpid(), "requests": 0, "hits": 0}
    # Programs JAX compiled and would not write because of their host callbacks: warm-run and
    # warm-check --replay name them as the cause of what missed.
    host_callbacks: list[str] = []

    def on_event(event: str, **_: Any) -> None:
        if event == EVENT_REQUESTS:
            counts["requests"] += 1
        elif event == EVENT_HITS:
            counts["hits"] += 1

    def write() -> None:
        with open(path, "a", encoding="utf-8") as f:
            f.write(json.dumps({**counts, "host_callbacks": sorted(set(host_callbacks))}) + "\n")

    def wrote(key: str) -> None:
        with contextlib.suppress(Exception), open(path, "a", encoding="utf-8") as f:
            f.write(json.dumps({"pid": os.getpid(), WROTE: key}) + "\n")  # one append: atomic

    def put(key: str, sha256: str) -> None:
        with contextlib.suppress(Exception), open(path, "a", encoding="utf-8") as f:
            f.write(json.dumps({"pid": os.getpid(), PUT: key, SHA256: sha256}) + "\n")

    logger = compiler_logger()
    passed_on = logger.log

    def log(level: int, msg: Any, *args: Any, **kwargs: Any) -> None:
        module = host_callbacks_module(msg, args)
        if module is not None:
            host_callbacks.append(module)
        passed_on(level, msg, *args, **kwargs)

    logger.log = log  # type: ignore[method-assign]  # read, then passed on unchanged
    jax.monitoring.register_event_listener(on_event)
    atexit.register(write)
    if os.environ.get(WRITES_VAR) == "1":
        from cachectl.core.jaxlog import CAPTURE

        _WRITES.enter_context(CAPTURE.writes(on_write=wrote))
        record_puts(put)


def _service_side() -> ModuleType | None:
    """service/activate.py, imported once JAX is: the verifier and telemetry; None if it fails."""
    try:
        from cachectl.service import activate

        return activate
    except Exception:  # noqa: BLE001 - never break the service
        return None


def _verify_jax_cache(service: ModuleType | None) -> None:
    """JAX's cache in a process exec started reads only verified entries, as activate()'s does;
    where the verifier cannot be installed, JAX's cache is off (fail closed)."""
    path = os.environ.get(JAX_CACHE_DIR_VAR)
    if not path or ENVIRONMENT_VAR not in os.environ:
        return
    try:
        if service is None:
            raise ImportError("cachectl.service.activate")
        service.verify_exec_cache(path, json.loads(os.environ[ENVIRONMENT_VAR]))
    except Exception:  # noqa: BLE001 - never break the service: compile in memory instead
        import jax

        jax.config.update("jax_enable_compilation_cache", False)


def _start() -> None:
    service = _service_side()
    _verify_jax_cache(service)
    counts = os.environ.get(COUNTS_VAR)
    if counts:
        with contextlib.suppress(Exception):  # never break the service
            _count_cache_events(counts)
    remembered = os.environ.get(REMEMBERED_VAR)
    if remembered and _CHECKS == [True]:
        with contextlib.suppress(Exception):  # never break the service
            from cachectl.core.probe import watch_remembered

            watch_remembered(remembered, json.loads(os.environ[ENVIRONMENT_VAR]))
    if os.environ.get(ENABLE_VAR) != "1" or service is None:
        return
    with contextlib.suppress(Exception):  # telemetry never breaks the service
        service.start_exec_telemetry(json.loads(os.environ[ENVIRONMENT_VAR]))
