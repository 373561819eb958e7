"""``check``: coverage proven the way a service sees it.

A fresh process calls ``activate(readonly=True)`` and compiles every bucket; each
must be a hit, and each stored executable must load.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import cachectl
from cachectl.context import Context
from cachectl.dispatch import Serving, _namespace_reader
from cachectl.errors import BadInput, OperationFailed
from cachectl.manifest import Manifest, check_imports, expand, load_manifest, select_shard
from cachectl.warm.compiling import _error_text, compile_bucket
from cachectl.warm.plan import _build_calls, _environment_json, _mismatch, plan_warm
from cachectl.warm.reports import FAILED, HIT, MISS, CheckBucket, CheckReport

# --------------------------------------------------------------------------- coverage check


def check(
    ctx: Context,
    manifest_path: str | Path,
    *,
    cache: str | None = None,
    shard: tuple[int, int] | None = None,
    paths: Sequence[str] = (),
    timeout: float | None = None,
) -> CheckReport:
    """Load every bucket in a fresh, read-only activated process: hit or miss, and coverage.

    A fresh process is the only honest test: this one may hold executables in
    memory, and a service starts from nothing but ``activate()``.
    """
    plan = plan_warm(ctx, manifest_path, cache=cache, shard=shard, paths=paths, writer_check=False)
    if plan.target_problems:
        raise _mismatch(plan)
    request = {
        "manifest": str(Path(plan.manifest_path).resolve()),
        "paths": [str(Path(p).resolve()) for p in paths],
        "shard": list(shard) if shard else None,
        "cache": plan.cache.name,
        "db": ctx.settings.db,
    }
    with tempfile.TemporaryDirectory(prefix="cachectl-check-") as tmp:
        out = Path(tmp) / "result.json"
        request["out"] = str(out)
        proc = subprocess.run(
            [sys.executable, "-c", "from cachectl.warm import _check_main; _check_main()"],
            input=json.dumps(request),
            text=True,
            capture_output=True,
            timeout=timeout,
            cwd=os.getcwd(),
            env=dict(os.environ),
        )
        if not out.exists():
            tail = (proc.stderr or proc.stdout or "").strip().splitlines()[-5:]
            raise OperationFailed(
                f"the coverage check process failed (exit {proc.returncode}): " + " | ".join(tail)
            )
        data = json.loads(out.read_text())
    if "error" in data:
        raise (
            BadInput(data["error"])
            if data.get("exit_code") == 2
            else OperationFailed(data["error"])
        )
    buckets = [CheckBucket(**b) for b in data["buckets"]]
    return CheckReport(
        _environment_json(plan.environment),
        data["namespace"],
        plan.cache.name,
        buckets,
        warning=data.get("warning"),
    )


def _check_main() -> None:
    """Entry point of the fresh check process: request JSON on stdin, result JSON to a file."""
    request = json.loads(sys.stdin.read())
    out = Path(request["out"])
    try:
        result = _check_in_this_process(request)
    except BadInput as exc:
        result = {"error": exc.message, "exit_code": 2}
    except Exception as exc:  # noqa: BLE001 - reported by the parent
        result = {"error": _error_text(exc), "exit_code": 1}
    out.write_text(json.dumps(result))


def _check_in_this_process(request: dict[str, Any]) -> dict[str, Any]:
    manifest = load_manifest(request["manifest"])
    paths = request["paths"]
    check_imports(manifest, paths)
    buckets = expand(manifest)
    if request.get("shard"):
        buckets = select_shard(buckets, *request["shard"])
    activation = cachectl.activate(
        request["cache"], db=request["db"], readonly=True, telemetry=False
    )
    if not activation.active:
        raise OperationFailed(activation.warning or "activate() did not activate the cache")
    jitted, calls = _build_calls(manifest, buckets, paths)
    results: list[dict[str, Any]] = []
    for position, bucket in enumerate(buckets):
        base = {"function": bucket.function, "bucket": dict(bucket.values)}
        call = calls[position]
        if isinstance(call, str):
            results.append({**base, "status": FAILED, "error": call})
            continue
        try:
            outcome = compile_bucket(jitted[bucket.function], *call)
        except Exception as exc:  # noqa: BLE001
            results.append({**base, "status": FAILED, "error": _error_text(exc)})
            continue
        status = HIT if outcome.lookup == "hit" else MISS
        error = None if outcome.lookup else "JAX did not consult the persistent cache"
        results.append(
            {
                **base,
                "status": status,
                "key": outcome.key,
                "seconds": outcome.seconds,
                "error": error,
            }
        )
    loaded = _executables_in_this_process(manifest, activation, request["db"], paths)
    for result in results:
        result["aot"] = loaded.get(
            (result["function"], json.dumps(result["bucket"], sort_keys=True)), "not checked"
        )
        if result["aot"] is None:
            result["aot"] = "loaded"
    return {"namespace": activation.path, "warning": activation.warning, "buckets": results}


def _executables_in_this_process(
    manifest: Manifest, activation: Any, db: str | None, paths: Sequence[str]
) -> dict[tuple[str, str], str | None]:
    """Load every bucket's stored executable as cachectl.serving would (same checks)."""
    warnings: list[str] = []
    read, names, indexed = _namespace_reader(activation, db, warnings)
    rt = Serving(
        manifest,
        namespace=activation.path,
        read=read,
        names=names,
        indexed=indexed,
        paths=paths,
        overflow="error",
        preload=True,
        workers=None,
        on_load=None,
        warnings=[],
    )
    return rt.executables()
