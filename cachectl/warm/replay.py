"""Replay a warm-run: the same command, read-only, as a service; JAX's own hit counts.

``cachectl warm-run`` records the command it ran and its working directory with the run
(in the audit record, which also names the warm-runs row). A replay runs that command
again as ``cachectl exec --readonly`` would (activate()'s JAX settings, writes off), with
the exec sitecustomize on PYTHONPATH: every Python process of the command that imports JAX
counts JAX's cache-request and cache-hit events (``jax_seam.EVENT_REQUESTS``, ``EVENT_HITS``)
and appends them to a file at exit. Every request a hit: the warm covers the command.
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from sqlalchemy import select

from cachectl.context import Context
from cachectl.core.errors import BadInput, NotFound
from cachectl.index.models import AuditRecord, WarmRun
from cachectl.service.env import service_env
from cachectl.service.exec_hook import COUNTS_VAR, WROTE, child_variables
from cachectl.warm.by_running import run_digest


@dataclass(frozen=True)
class ReplayReport:
    cache: str
    namespace: str
    run_id: int
    command: list[str]
    cwd: str
    exit_code: int
    processes: int  # processes of the command that imported JAX and reported their counts
    requests: int  # compile requests that looked in the persistent cache
    hits: int
    seconds: float
    # Programs the command compiled that JAX would not write: they use host callbacks.
    host_callbacks: list[str] = field(default_factory=list)

    __json_extra__ = ("misses", "hit_rate", "ok")

    @property
    def misses(self) -> int:
        return self.requests - self.hits

    @property
    def hit_rate(self) -> float | None:
        return self.hits / self.requests if self.requests else None

    @property
    def ok(self) -> bool:
        """The command succeeded and every compile request it made was a hit."""
        return self.exit_code == 0 and self.requests > 0 and self.hits == self.requests


def recorded_run(ctx: Context, cache: str, run_id: int | None = None) -> tuple[int, list[str], str]:
    """(warm run id, command, working directory) of ``run_id``, or of the latest warm-run."""
    index: Any = ctx.index  # the SQL index, read as `cachectl misses` reads it
    with index.read_session() as s:
        records = s.scalars(
            select(AuditRecord)
            .where(AuditRecord.operation == "warm", AuditRecord.cache_name == cache)
            .order_by(AuditRecord.at.desc(), AuditRecord.id.desc())
        ).all()
        for r in records:
            details = r.details or {}
            if details.get("via") != "run" or not isinstance(details.get("warm_run"), int):
                continue
            if run_id is not None and details["warm_run"] != run_id:
                continue
            row = s.get(WarmRun, details["warm_run"])
            command, cwd = details.get("command"), details.get("cwd")
            if (
                row is None
                or not isinstance(command, list)
                or not isinstance(cwd, str)
                or run_digest(command) != row.manifest_digest
            ):
                raise BadInput(
                    f"warm run {details['warm_run']}'s command was not recorded whole "
                    "(a cachectl before replays): run cachectl warm-run again"
                )
            return details["warm_run"], [str(c) for c in command], cwd
    which = f"warm run {run_id}" if run_id is not None else "warm-run"
    raise NotFound(f"no {which} into cache {cache!r} to replay (cachectl warm-run -- CMD)")


def replay_warm_run(
    ctx: Context,
    run_id: int | None = None,
    *,
    cache: str | None = None,
    child_stdout: IO[str] | None = None,
) -> ReplayReport:
    """Run the recorded command again, read-only, and count JAX's cache hits in it (see module)."""
    info = ctx.cache(cache)
    run, command, cwd = recorded_run(ctx, info.name, run_id)
    if not Path(cwd).is_dir():
        raise BadInput(f"warm run {run}'s working directory is gone: {cwd}")
    env = ctx.environment_for_children  # the command's JAX needs the accelerator
    ns, _ = ctx.namespace(info, env)
    variables = service_env(ctx, readonly=True, environment=env).variables
    variables |= child_variables(env.to_dict(), os.environ.get("PYTHONPATH"))
    with tempfile.TemporaryDirectory(prefix="cachectl-replay-") as tmp:
        counts = Path(tmp) / "counts.jsonl"
        environ = {**os.environ, **variables, COUNTS_VAR: str(counts)}
        started = time.perf_counter()
        try:
            exit_code = subprocess.run(
                command, cwd=cwd, env=environ, stdout=child_stdout, check=False
            ).returncode
        except FileNotFoundError:
            raise BadInput(f"command not found: {command[0]}") from None
        seconds = time.perf_counter() - started
        lines: list[dict[str, Any]] = []
        if counts.is_file():
            lines = [json.loads(x) for x in counts.read_text().splitlines() if x.strip()]
            lines = [x for x in lines if WROTE not in x]  # a process's counts, not its writes
    return ReplayReport(
        cache=info.name,
        namespace=ns.url,
        run_id=run,
        command=command,
        cwd=cwd,
        exit_code=exit_code,
        processes=len(lines),
        requests=sum(int(x.get("requests", 0)) for x in lines),
        hits=sum(int(x.get("hits", 0)) for x in lines),
        seconds=seconds,
        host_callbacks=sorted({m for x in lines for m in x.get("host_callbacks", [])}),
    )
