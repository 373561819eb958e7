"""``check``: coverage proven the way a service sees it.

A fresh process calls ``activate(readonly=True)`` and compiles every bucket; each
must be a hit. Another fresh process, which never lowers (as a service), loads every
stored executable and calls it once on zeros: a crash there costs that child only, the
bucket it was calling is named, and a new child goes on with the rest. An executable
that raised or crashed is marked unusable in the index, and ``cachectl.serving``
serves its bucket through ``jax.jit``.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from cachectl.context import Context
from cachectl.core.config import distributed_requested
from cachectl.core.errors import BadInput, CachectlError, EnvironmentMismatch, OperationFailed
from cachectl.core.fingerprint import Environment, current_environment
from cachectl.core.probe import ISOLATED_CWD, isolated
from cachectl.core.records import Proof, utcnow
from cachectl.dispatch import Serving, namespace_reader
from cachectl.dispatch.loading import Verified
from cachectl.dispatch.served_function import NoDummyInput
from cachectl.dispatch.siblings import closest_environment_hint
from cachectl.manifest import check_imports, expand, load_manifest, select_shard
from cachectl.service.activate import activate
from cachectl.warm import padding_check
from cachectl.warm.canary import EQUAL, compare, fresh_outputs, random_inputs
from cachectl.warm.compiling import compile_bucket, error_text
from cachectl.warm.job import join
from cachectl.warm.plan import build_calls, environment_json, environment_mismatch, target_problems
from cachectl.warm.reports import (
    CALL_CRASHED,
    CALL_FAILED,
    CALL_OK,
    CALL_RAISED,
    CALL_SKIPPED,
    FAILED,
    HIT,
    MISS,
    CheckBucket,
    CheckReport,
)

_TAIL_LINES = 5

# --------------------------------------------------------------------------- coverage check


def check(
    ctx: Context,
    manifest_path: str | Path,
    *,
    cache: str | None = None,
    shard: tuple[int, int] | None = None,
    paths: Sequence[str] = (),
    timeout: float | None = None,
    canary: bool = False,
    padding: dict[str, float | None] | None = None,
    distributed: bool | None = None,
) -> CheckReport:
    """Load every bucket in a fresh, read-only activated process: hit or miss, and coverage.

    With ``canary``, each stored executable that runs is also called on seeded random inputs
    and compared with a fresh compile of the same function here (cachectl.warm.canary). The
    result is recorded on the namespace's index row (a :class:`Proof`) unless a shard was checked.
    With ``padding`` (``{"rtol": ..., "atol": ...}``, None for a dtype's default), each bucket's
    stored executable is also run on inputs padded to it from raw sizes below it and compared
    with jax.jit at the raw shape (cachectl.warm.padding_check).

    A fresh process is the only honest test: this one may hold executables in
    memory, and a service starts from nothing but ``activate()``. This process never
    opens JAX's backend (an accelerator held here would refuse the children): the
    child reads the environment, checks the manifest's target and imports its modules.

    Inside a ``jax.distributed`` job (``distributed``, by default when
    ``JAX_COORDINATOR_ADDRESS`` is set; every process runs the check) each child joins the job
    first (warm/job.py ``join``), as a service initializes before ``activate()``: the
    job's namespace, its global devices and meshes are checked from every process. Process 0
    alone records the verdicts and the proof.
    """
    manifest = load_manifest(manifest_path, import_paths=paths)  # a bad one: all problems
    cache_info = ctx.cache(cache or manifest.cache or ctx.settings.cache)
    if shard is not None:
        select_shard(expand(manifest), *shard)  # a bad shard is bad input before any child
    request = {
        "manifest": str(Path(manifest_path).resolve()),
        "manifest_shown": str(manifest_path),  # as the user wrote it, for messages
        "paths": [str(Path(p).resolve()) for p in paths],
        "shard": list(shard) if shard else None,
        "cache": cache_info.name,
        "db": ctx.settings.db,
        "canary": canary,
        "padding": padding,
        "distributed": distributed_requested(distributed),
        "cwd": os.getcwd(),  # the child starts in ISOLATED_CWD, then works from here
    }
    with tempfile.TemporaryDirectory(prefix="cachectl-check-") as tmp:
        out = Path(tmp) / "result.json"
        request["out"] = str(out)
        proc = subprocess.run(
            isolated("from cachectl.warm import check_main; check_main()"),
            input=json.dumps(request),
            text=True,
            capture_output=True,
            timeout=timeout,
            cwd=ISOLATED_CWD,
            env=dict(os.environ),
        )
        if not out.exists():
            tail = (proc.stderr or proc.stdout or "").strip().splitlines()[-5:]
            raise OperationFailed(
                f"the coverage check process failed (exit {proc.returncode}): " + " | ".join(tail)
            )
        data = json.loads(out.read_text())
    if "error" in data:
        errors: dict[int, type[CachectlError]] = {2: BadInput, 3: EnvironmentMismatch}
        raise errors.get(data.get("exit_code", 1), OperationFailed)(data["error"])
    environment = Environment.from_dict(data["environment"])
    todo = [(b["function"], json.dumps(b["bucket"], sort_keys=True)) for b in data["buckets"]]
    loaded, called, canaries, paddings = _call_executables(request, todo, timeout)
    buckets = [_with_call(b, loaded, called, canaries, canary) for b in data["buckets"]]
    verdicts: dict[str, str | None] = {}
    for where, (outcome, text) in called.items():
        key = loaded.get(where, (None, None, False))[0]
        if key is not None and outcome in (CALL_OK, *CALL_FAILED):
            verdicts[key] = _failure_text(outcome, text) if outcome in CALL_FAILED else None
    process = data.get("process") or [0, 1]
    if process[0] != 0:  # a job's process 0 records for the job
        verdicts = {}
    marked, mark_error = _record_verdicts(ctx, cache_info.name, environment.digest, verdicts)
    report = CheckReport(
        environment_json(environment),
        data["namespace"],
        cache_info.name,
        buckets,
        warning=data.get("warning"),
        closest=data.get("closest"),
        marked=marked,
        mark_error=mark_error,
        padding=None if padding is None else _padding_report(request, paddings, called, padding),
    )
    if shard is not None:
        return replace(report, proof_error="not recorded: a shard checks part of the manifest")
    if process[0] != 0:
        return replace(
            report, proof_error=f"recorded by process 0 of the job (this is process {process[0]})"
        )
    proof = replace(_proof(report, environment, canary), manifest=str(request["manifest"]))
    error = _record_proof(ctx, cache_info.name, proof)
    return replace(report, proof=None if error else proof, proof_error=error)


def _proof(report: CheckReport, environment: Environment, canary: bool) -> Proof:
    """What this check proved on this machine, as the index keeps it."""
    n = len(report.buckets)
    if not canary:
        result = "not run (--canary not given)"
    else:
        differs = sum(
            b.canary is not None and b.canary.startswith("differs") for b in report.buckets
        )
        equal = sum(b.canary == EQUAL for b in report.buckets)
        if equal == n:
            result = EQUAL
        elif differs:
            result = f"differs in {differs} of {n}"
        else:
            result = f"not run for {n - equal} of {n}"
    proved = {
        b.key
        for b in report.buckets
        if b.status == HIT and b.aot_call == CALL_OK and (not canary or b.canary == EQUAL)
    }
    return Proof(
        at=utcnow(),
        machine_digest=environment.digest,
        devices=f"{environment.device_kind} x{environment.device_count}",
        host=socket.gethostname(),
        buckets=n,
        hits=report.hits,
        executables_called=report.summary.aot_ran,
        canary=result,
        entries_proven=len(proved),
    )


def _padding_report(
    request: dict[str, Any],
    paddings: dict[tuple[str, str], list[Any]],
    called: dict[tuple[str, str], tuple[str, str | None]],
    options: dict[str, float | None],
) -> padding_check.PaddingReport:
    manifest = load_manifest(request["manifest"])
    buckets = expand(manifest)
    checked = select_shard(buckets, *request["shard"]) if request.get("shard") else None
    ran = {where for where, (outcome, _) in called.items() if outcome == CALL_OK}
    return padding_check.report(
        manifest, buckets, paddings, ran, options.get("rtol"), options.get("atol"), checked
    )


def _record_proof(ctx: Context, cache: str, proof: Proof) -> str | None:
    """Keep the proof on the namespace's index row; why not, when it could not."""
    try:
        env = ctx.index.find_environment(cache, proof.machine_digest)
        ctx.index.record_proof(env.id, proof)
    except CachectlError as exc:
        return f"not recorded: {exc.message}"
    return None


def _with_call(
    bucket: dict[str, Any],
    loaded: dict[tuple[str, str], tuple[str | None, str | None, bool]],
    called: dict[tuple[str, str], tuple[str, str | None]],
    canaries: dict[tuple[str, str], str],
    canary: bool,
) -> CheckBucket:
    """The coverage child's bucket with what loading and calling its executable did, and
    (with ``canary``) what the canary found."""
    where = (bucket["function"], json.dumps(bucket["bucket"], sort_keys=True))
    _, load_error, refused = loaded.get(where, (None, "not checked", False))
    if load_error is not None:
        verdict = "not run (no stored executable loaded)" if canary else None
        return CheckBucket(**bucket, aot=load_error, aot_refused=refused, canary=verdict)
    outcome, text = called.get(where, (CALL_SKIPPED, "not called"))
    if outcome == CALL_OK:
        aot = "loaded"
    elif outcome in CALL_FAILED:
        aot = _failure_text(outcome, text)
    else:
        aot = f"loaded; not called: {text}"
    verdict = None
    if canary:
        verdict = canaries.get(where) or "not run (the stored executable did not run on zeros)"
    return CheckBucket(**bucket, aot=aot, aot_call=outcome, canary=verdict)


def _failure_text(outcome: str, text: str | None) -> str:
    """Why an executable is unusable: what the index records and the report shows."""
    if outcome == CALL_CRASHED:
        return f"crashed when called on zeros ({text})"
    return f"raised when called on zeros: {text}"


def _record_verdicts(
    ctx: Context, cache: str, digest: str, verdicts: dict[str, str | None]
) -> tuple[int, str | None]:
    """Mark the executables that raised or crashed unusable, and clear those that ran."""
    if not verdicts:
        return 0, None
    try:
        env = ctx.index.find_environment(cache, digest)
        if env is None:
            return 0, "the index does not know this environment"
        return ctx.index.mark_executables(env.id, verdicts), None
    except CachectlError as exc:
        return 0, exc.message


def _exit_text(returncode: int) -> str:
    """'killed by SIGSEGV' or 'exit 3'."""
    if returncode < 0:
        try:
            return f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    return f"exit {returncode}"


def _call_executables(
    request: dict[str, Any], todo: list[tuple[str, str]], timeout: float | None
) -> tuple[
    dict[tuple[str, str], tuple[str | None, str | None, bool]],
    dict[tuple[str, str], tuple[str, str | None]],
    dict[tuple[str, str], str],
    dict[tuple[str, str], list[Any]],
]:
    """Load and call every bucket's stored executable in fresh child processes.

    Returns (function, bucket JSON) -> (key, None when loaded else why not, whether a stored
    executable was refused or failed to load), -> (call outcome, its error), -> the canary's
    verdict and -> the padding samples (when the request asks for them). A child that dies
    mid-call names that bucket (crashed) and a new
    child goes on after it; one that dies elsewhere leaves the rest not called.
    """
    loaded: dict[tuple[str, str], tuple[str | None, str | None, bool]] | None = None
    called: dict[tuple[str, str], tuple[str, str | None]] = {}
    canaries: dict[tuple[str, str], str] = {}
    paddings: dict[tuple[str, str], list[Any]] = {}
    remaining = list(todo)
    # In a job every process's child calls together: a child that died leaves the others' calls
    # without it, so a job's check has one calling child per process and names what it left.
    rounds = 1 if request.get("distributed") else len(todo) + 1
    with tempfile.TemporaryDirectory(prefix="cachectl-call-") as tmp:
        for round_ in range(rounds):
            if not remaining:
                break
            progress = Path(tmp) / f"progress-{round_}.jsonl"
            child = {**request, "todo": [list(w) for w in remaining], "progress": str(progress)}
            died: str | None = None  # how the child ended, when not well
            detail = ""  # and the tail of its output
            try:
                proc = subprocess.run(
                    isolated("from cachectl.warm import call_main; call_main()"),
                    input=json.dumps(child),
                    text=True,
                    capture_output=True,
                    timeout=timeout,
                    cwd=ISOLATED_CWD,
                    env=dict(os.environ),
                )
                if proc.returncode != 0:
                    died = _exit_text(proc.returncode)
                    tail = (proc.stderr or proc.stdout or "").strip().splitlines()[-_TAIL_LINES:]
                    detail = ": " + " | ".join(tail) if tail else ""
            except subprocess.TimeoutExpired:
                died = f"did not return within {timeout:g}s"
            started: tuple[str, str] | None = None
            lines = progress.read_text().splitlines() if progress.exists() else []
            for line in lines:
                item = json.loads(line)
                if "loaded" in item and loaded is None:
                    loaded = {
                        (f, b): (key, error, bool(refused))
                        for f, b, key, error, refused in item["loaded"]
                    }
                elif "start" in item:
                    started = (item["start"][0], item["start"][1])
                elif "done" in item:
                    called[(item["done"][0], item["done"][1])] = (
                        item["outcome"],
                        item.get("error"),
                    )
                    started = None
                elif "canary" in item:
                    canaries[(item["canary"][0], item["canary"][1])] = item["result"]
                elif "padding" in item:
                    paddings[(item["padding"][0], item["padding"][1])] = item["result"]
                elif "fatal" in item:
                    died, detail = "failed", ": " + item["fatal"]
            if started is not None:
                # It died (or hung) calling this bucket: a crash of that executable.
                called[started] = (CALL_CRASHED, died or "the process ended")
            elif died is not None:
                why = f"the calling process failed ({died}{detail})"
                for where in remaining:
                    called.setdefault(where, (CALL_SKIPPED, why))
                if loaded is None:
                    loaded = {w: (None, why, False) for w in todo}
                break
            remaining = [w for w in remaining if w not in called]
        for where in remaining:  # a job's one round ended early
            called.setdefault(where, (CALL_SKIPPED, "the job's calling process ended before it"))
    return loaded or {}, called, canaries, paddings


def call_main() -> None:
    """Entry point of a fresh calling process: load every executable as cachectl.serving does,
    then call the requested ones on zeros, one progress line before and after each call."""
    request = json.loads(sys.stdin.read())
    os.chdir(request["cwd"])  # started isolated (probe.isolated); the user's paths from here
    with open(request["progress"], "a", buffering=1) as progress:

        def say(**item: Any) -> None:
            progress.write(json.dumps(item) + "\n")  # line-buffered: on disk before the call

        try:
            _join_job(request)
            rt = _serving_for(request)
        except Exception as exc:  # noqa: BLE001 - reported by the parent
            say(fatal=error_text(exc))
            return
        stored = rt.stored()
        say(loaded=[[f, b, *found] for (f, b), found in stored.items()])
        for function, bucket in request["todo"]:
            key, error, _ = stored.get((function, bucket), (None, "not checked", False))
            if error is not None:
                continue
            say(start=[function, bucket])
            try:
                rt.call_stored(function, bucket)
                say(done=[function, bucket], outcome=CALL_OK)
            except NoDummyInput as exc:
                say(done=[function, bucket], outcome=CALL_SKIPPED, error=str(exc))
                continue
            except Exception as exc:  # noqa: BLE001 - that executable raised
                say(done=[function, bucket], outcome=CALL_RAISED, error=error_text(exc))
                continue
            if request.get("canary"):
                say(canary=[function, bucket], result=_canary(rt, request, function, bucket))
            if request.get("padding") is not None:
                result = padding_check.check_bucket(rt, request, function, bucket)
                say(padding=[function, bucket], result=result)


def _canary(rt: Serving, request: dict[str, Any], function: str, bucket: str) -> str:
    """The canary's verdict on one bucket (cachectl.warm.canary): equal, differs, or not run."""
    buckets = expand(rt.manifest)
    position, which = next(
        (i, b)
        for i, b in enumerate(buckets)
        if b.function == function and json.dumps(dict(b.values), sort_keys=True) == bucket
    )
    spec = rt[function].spec
    try:
        args, kwargs = random_inputs(spec, which, request["paths"], position)
        served = rt.stored_outputs(function, bucket, args)
    except Exception as exc:  # noqa: BLE001 - said in the report; the check fails on it
        return f"not run (the stored executable on random inputs: {error_text(exc)})"
    try:
        # Inputs of its own, equal to the stored call's (same seed): that call may have donated
        # (deleted) its arguments' buffers, as a train step does with its state.
        args, kwargs = random_inputs(spec, which, request["paths"], position)
        fresh = fresh_outputs(spec, request["paths"], args, kwargs)
    except Exception as exc:  # noqa: BLE001
        return f"not run (jax.jit here: {error_text(exc)})"
    return compare(served, fresh)


def _serving_for(request: dict[str, Any]) -> Serving:
    """A read-only service of the manifest, every executable loaded; warm-check's earlier
    verdicts ignored (each is judged again)."""
    manifest = load_manifest(request["manifest"])
    paths = request["paths"]
    activation = activate(request["cache"], db=request["db"], readonly=True, telemetry=False)
    if not activation.active:
        raise OperationFailed(activation.warning or "activate() did not activate the cache")
    check_imports(manifest, paths)
    warnings: list[str] = []
    read, names, indexed = namespace_reader(activation, request["db"], warnings)
    if indexed is not None:
        indexed = Verified(
            {k: v._replace(unusable=None) for k, v in indexed.items()}, indexed.refusal
        )
    return Serving(
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


def _join_job(request: dict[str, Any]) -> list[int]:
    """Join the jax.distributed job first, as its services do (before activate()); this
    process's [index, count]."""
    if not request.get("distributed"):
        return [0, 1]
    me = join()
    return [me.index, me.count]


def check_main() -> None:
    """Entry point of the fresh check process: request JSON on stdin, result JSON to a file."""
    request = json.loads(sys.stdin.read())
    os.chdir(request["cwd"])  # started isolated (probe.isolated); the user's paths from here
    out = Path(request["out"])
    try:
        process = _join_job(request)
        result = {**_check_in_this_process(request), "process": process}
    except (BadInput, EnvironmentMismatch) as exc:
        result = {"error": exc.message, "exit_code": exc.exit_code}
    except Exception as exc:  # noqa: BLE001 - reported by the parent
        result = {"error": error_text(exc), "exit_code": 1}
    out.write_text(json.dumps(result))


def _check_in_this_process(request: dict[str, Any]) -> dict[str, Any]:
    manifest = load_manifest(request["manifest"])
    paths = request["paths"]
    buckets = expand(manifest)
    if request.get("shard"):
        buckets = select_shard(buckets, *request["shard"])
    environment = current_environment()
    problems = target_problems(manifest, environment)
    if problems:
        raise environment_mismatch(request.get("manifest_shown", request["manifest"]), problems)
    activation = activate(request["cache"], db=request["db"], readonly=True, telemetry=False)
    if not activation.active:
        raise OperationFailed(activation.warning or "activate() did not activate the cache")
    check_imports(manifest, paths)  # after activate(), as cachectl.serving imports them
    jitted, calls = build_calls(manifest, buckets, paths)
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
            results.append({**base, "status": FAILED, "error": error_text(exc)})
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
    # Nothing hit: where another mode of this machine (x64, the CPU instruction set, XLA flags)
    # was warmed, say so, as serving does; "run warm" is not the first fix then.
    closest = None
    if results and not any(r["status"] == HIT for r in results):
        closest = closest_environment_hint(activation, environment, who="warm-check")
    return {
        "namespace": activation.path,
        "warning": activation.warning,
        "closest": closest,
        "buckets": results,
        "environment": environment.to_dict(),
    }
