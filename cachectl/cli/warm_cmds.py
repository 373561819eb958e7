"""`cachectl warm` and `cachectl warm-check`: compile a manifest, then prove a service hits it."""

from __future__ import annotations

import contextlib
import os
import sys
from typing import TYPE_CHECKING, Any

import click

from cachectl.cli.oci_options import ca_file_option, insecure_option, print_push
from cachectl.cli.render import emit, stderr, stdout
from cachectl.cli.warm_render import (
    Progress,
    named,
    padding_failure,
    plain,
    print_check,
    print_replay,
    print_warm,
)
from cachectl.core.config import (
    DEFAULT_MAX_BUCKETS,
    DEFAULT_WARM_EXECUTOR,
    MAX_BUCKETS_ENV,
    SIGNING_KEY_ENV,
    WARM_EXECUTORS,
    default_jobs,
)
from cachectl.core.errors import BadInput, CachectlError, EnvironmentMismatch, OperationFailed
from cachectl.core.jax_seam import host_callbacks_cause

if TYPE_CHECKING:
    from cachectl.context import Context
    from cachectl.manifest import LoadedManifest
    from cachectl.warm import CheckReport, WarmReport

# The warm stack (JAX, pydantic, SQLAlchemy) is imported by the command bodies when they run,
# never at import: `cachectl warm --help` builds its options from cachectl.core.config alone
# (tests/test_cli_startup.py checks sys.modules).


def _verbosity() -> int:
    """The global ``-v`` count."""
    return int(click.get_current_context().find_root().params.get("verbose") or 0)


def _shard(text: str | None, shards: int | None = None) -> tuple[int, int] | None:
    if text is None and shards is None:
        return None  # the whole manifest: the warm stack stays unimported until needed
    from cachectl.warm.sharding import resolve_shard

    return resolve_shard(text, shards)


_CACHE_DEFAULT = "(default: the manifest's 'cache:', else the global --cache)"


def _cache_option(verb: str) -> Any:
    return click.option(
        "--cache", "cache_name", metavar="NAME", help=f"Cache to {verb} {_CACHE_DEFAULT}."
    )


_common = [
    click.argument("manifest", type=click.Path(dir_okay=False)),
    click.option(
        "--shard",
        metavar="I/N|auto",
        help="Only the I-th of N deterministic shares of the buckets; 'auto': I from "
        "JOB_COMPLETION_INDEX (a Kubernetes Indexed Job), N from --shards/CACHECTL_SHARDS.",
    ),
    click.option(
        "--shards",
        type=int,
        metavar="N",
        help="With --shard auto: the number of shards (else CACHECTL_SHARDS).",
    ),
    click.option(
        "--path",
        "paths",
        multiple=True,
        metavar="DIR",
        help="Add DIR to the import path (repeatable); the manifest's directory is always added.",
    ),
    click.option("--json", "as_json", is_flag=True, help="Print the report as JSON."),
    click.option(
        "--max-buckets",
        type=click.IntRange(min=1),
        metavar="N",
        expose_value=False,
        callback=lambda _ctx, _param, value: _set_max_buckets(value),
        help=f"Refuse a manifest whose axes multiply out to more than N buckets "
        f"(default {DEFAULT_MAX_BUCKETS}). [env: {MAX_BUCKETS_ENV}]",
    ),
]


def _set_max_buckets(value: int | None) -> int | None:
    # Through the environment: warm's worker processes load the manifest again.
    if value is not None:
        os.environ[MAX_BUCKETS_ENV] = str(value)
    return value


def _json_quiet(as_json: bool) -> contextlib.AbstractContextManager[Any]:
    """With --json, what the manifest's modules print on import (mujoco's "Failed to import
    warp") goes to stderr: stdout holds the report alone."""
    return contextlib.redirect_stdout(sys.stderr) if as_json else contextlib.nullcontext()


def _with_common(fn: Any) -> Any:
    for option in reversed(_common):
        fn = option(fn)
    return fn


def _with_common_options(fn: Any) -> Any:
    """The common options without the MANIFEST argument (warm-check's is optional)."""
    for option in reversed(_common[1:]):
        fn = option(fn)
    return fn


def _run_check(
    ctx: Context,
    manifest: str,
    cache_name: str | None,
    shard: str | None,
    paths: tuple[str, ...],
    as_json: bool,
    shards: int | None = None,
    canary: bool = False,
    padding: dict[str, float | None] | None = None,
    distributed: bool | None = None,
) -> None:
    from cachectl.warm import check

    with _json_quiet(as_json):
        report = check(
            ctx,
            manifest,
            cache=cache_name,
            shard=_shard(shard, shards),
            paths=paths,
            canary=canary,
            padding=padding,
            distributed=distributed,
        )
    emit(report, as_json, lambda r: print_check(r, manifest), failure=_check_failure)


def _check_failure(report: CheckReport) -> OperationFailed:
    """Exit 1: executables that raised, crashed or could not be called (by name), or buckets a
    service would compile."""
    problems = []
    if report.unusable:
        problems.append(
            f"{len(report.unusable)} stored executable(s) raised or crashed when called: "
            + ", ".join(named(b) for b in report.unusable)
        )
    if report.refused:
        problems.append(
            f"{len(report.refused)} stored executable(s) a service will not use: "
            + ", ".join(f"{named(b)} ({b.aot})" for b in report.refused)
        )
    if report.not_called:
        problems.append(
            f"{len(report.not_called)} stored executable(s) loaded but not called: "
            + ", ".join(f"{named(b)} ({b.aot})" for b in report.not_called)
        )
    if report.canary_failed:
        problems.append(
            f"canary: {len(report.canary_failed)} stored executable(s) did not give the outputs "
            "of a compile here: "
            + ", ".join(f"{named(b)} ({b.canary})" for b in report.canary_failed)
        )
    if report.padding is not None and report.padding.failed:
        problems.append(padding_failure(report.padding))
    if report.hits < len(report.buckets):
        problems.append(
            f"coverage {report.coverage:.1f}% is below 100%: "
            f"{len(report.buckets) - report.hits} bucket(s) would compile in a service"
        )
    return OperationFailed("; ".join(problems))


def _run_distributed(
    ctx: Context,
    manifest: str,
    cache_name: str | None,
    paths: tuple[str, ...],
    as_json: bool,
    jobs: int | None,
    fail_fast: bool,
    dry_run: bool,
    no_executables: bool,
    sign_key: str | None,
) -> None:
    """Every process of the job runs this; the signing-key check and the signing happen inside the
    collective warm, so a failure there reaches every process."""
    from cachectl.warm import distributed as dist
    from cachectl.warm import resign_written, signer_for

    signer: list[Any] = []

    def prepare(loaded: LoadedManifest) -> None:
        if not dry_run:
            signer.append(signer_for(ctx, loaded, cache_name, sign_key, paths))

    def finish(report: WarmReport) -> None:
        if signer and signer[0] is not None:
            resign_written(ctx, report, signer[0])

    result = dist.warm(
        ctx,
        manifest,
        cache=cache_name,
        jobs=jobs,
        paths=paths,
        fail_fast=fail_fast,
        dry_run=dry_run,
        executables=not no_executables,
        prepare=prepare,
        finish=finish,
    )
    me = result.process

    def human(r: Any) -> None:
        print_warm(r.report)
        stdout.print(
            f"process {me.index} of {me.count} "
            f"({'wrote and recorded the entries' if me.index == dist.WRITER else 'compiled; process 0 wrote'})",
            highlight=False,
        )

    # Every process checked the target before compiling (dist.warm): not ok means failed buckets.
    emit(
        result,
        as_json,
        human,
        failure=lambda r: OperationFailed(
            f"{r.report.summary.failed} of {r.report.summary.buckets} bucket(s) failed; see the error column"
        ),
    )


@click.command("warm")
@_with_common
@_cache_option("fill")
@click.option(
    "-j",
    "--jobs",
    type=click.IntRange(min=1),
    metavar="N",
    help=f"Buckets compiled at once (default: the cores here, {default_jobs()}).",
)
@click.option(
    "--executor",
    type=click.Choice(WARM_EXECUTORS),
    default=DEFAULT_WARM_EXECUTOR,
    show_default=True,
    help="Compile concurrently in threads of this process or in spawned processes.",
)
@click.option("--fail-fast", is_flag=True, help="Stop at the first failing bucket.")
@click.option(
    "--no-executables",
    is_flag=True,
    help="Store only JAX's cache entries, not the executables cachectl.serving loads.",
)
@click.option(
    "--dry-run", is_flag=True, help="List the buckets and check the target; compile nothing."
)
@click.option(
    "--sign-key",
    metavar="PATH",
    envvar=SIGNING_KEY_ENV,
    help="Sign the namespace's content list with this Ed25519 key afterwards (required when the "
    f"cache trusts keys). [env: {SIGNING_KEY_ENV}]",
)
@click.option(
    "--distributed/--no-distributed",
    default=None,
    help="Warm collectively inside a jax.distributed job (every process runs this command; "
    "default: when JAX_COORDINATOR_ADDRESS is set). Process 0 writes and records.",
)
@click.option(
    "--topology",
    metavar="NAME",
    help="Compile for this TPU slice without one (libtpu's compile-only devices), into the "
    "namespace the slice names: v5e:1x1, v5e:2x2, v5litepod-4, v5p:2x2x1, v6e:2x2 ...",
)
@click.option(
    "--check",
    "check_only",
    is_flag=True,
    help="Compile nothing: prove coverage in a fresh read-only process (= `cachectl warm-check`).",
)
@click.option(
    "--push",
    "push_to",
    metavar="oci://REGISTRY/REPO[:TAG]",
    help="Afterwards push what was warmed as a bundle artifact tagged for this environment "
    "(= `cachectl bundle push --manifest MANIFEST`).",
)
@insecure_option
@ca_file_option
@click.pass_obj
def warm_cmd(
    ctx: Context,
    manifest: str,
    cache_name: str | None,
    shard: str | None,
    shards: int | None,
    paths: tuple[str, ...],
    as_json: bool,
    jobs: int | None,
    executor: str,
    fail_fast: bool,
    dry_run: bool,
    check_only: bool,
    no_executables: bool,
    sign_key: str | None,
    distributed: bool | None,
    push_to: str | None,
    insecure: bool,
    ca_file: str | None,
    topology: str | None,
) -> None:
    """Compile every function x shape bucket of MANIFEST into this environment's namespace.

    Run it on the hardware the service runs on: afterwards the service's first
    request of every bucket is a cache hit. Buckets already in the cache are
    reported 'cached' and not recompiled.

    \b
    cachectl warm examples/manifest.yaml
    cachectl warm manifest.yaml --shard 2/4 --jobs 8
    cachectl warm manifest.yaml --shard auto --shards 4   # pod of an Indexed Job
    cachectl warm manifest.yaml --topology v5e:2x2   # a TPU slice's, on a CPU
    cachectl warm-check manifest.yaml   # prove it: 100% hits in a fresh process
    """
    if check_only:
        _run_check(
            ctx, manifest, cache_name, shard, paths, as_json, shards, distributed=distributed
        )
        return
    from cachectl.core.config import distributed_requested
    from cachectl.manifest import read_manifest

    _shard(shard, shards)  # a bad --shard/--shards is bad input before anything is opened
    if push_to is not None:
        from cachectl.bundle import oci

        oci.parse_reference(push_to)
    if distributed_requested(distributed):
        from cachectl.warm import distributed as dist

        if shard is not None or push_to is not None:
            raise BadInput(
                dist.SHARD_REFUSAL
                if shard is not None
                else "--push does not combine with "
                "--distributed: push from one host afterwards (cachectl bundle push)"
            )
        if topology is not None:
            raise BadInput("--topology compiles on one machine; it does not go with --distributed")
        _run_distributed(
            ctx,
            manifest,
            cache_name,
            paths,
            as_json,
            jobs,
            fail_fast,
            dry_run,
            no_executables,
            sign_key,
        )
        return
    with _json_quiet(as_json):
        loaded = read_manifest(manifest, import_paths=paths)  # read once, handed down
        # The warm stack (JAX, SQLAlchemy) after the manifest: a manifest error answers fast.
        from cachectl.warm import resign_written, signer_for, warm

        signer = None
        if not dry_run:
            signer = signer_for(ctx, loaded, cache_name, sign_key, paths)
        with Progress(enabled=not dry_run, terminal=stderr.is_terminal) as progress:
            report = warm(
                ctx,
                loaded,
                cache=cache_name,
                jobs=jobs,
                shard=_shard(shard, shards),
                paths=paths,
                fail_fast=fail_fast,
                dry_run=dry_run,
                executor=executor,
                progress=progress,
                executables=not no_executables,
                signer=signer,
                topology=topology,
                libtpu_startup_warnings=_verbosity() >= 1,
            )
    if signer is not None and not report.target_problems:
        resign_written(ctx, report, signer)

    def human(r: WarmReport) -> None:
        print_warm(r, logged=progress.logged)

    if push_to is None or dry_run or not report.ok:
        emit(report, as_json, human, failure=_warm_failure)
        return
    emit(report, as_json, human)
    # A deviceless warm (--topology) pushes the slice's namespace, not this machine's.
    env = str(report.environment["digest"]) if topology is not None else None
    _push_warmed(ctx, loaded, cache_name, sign_key, push_to, insecure, ca_file, as_json, env)


def _push_warmed(
    ctx: Context,
    manifest: LoadedManifest,
    cache_name: str | None,
    sign_key: str | None,
    push_to: str,
    insecure: bool,
    ca_file: str | None,
    as_json: bool,
    env: str | None = None,
) -> None:
    """`warm --push`: the namespace just warmed (``env``'s for a deviceless warm), pushed as
    `bundle push --manifest` does. With --json the report stays stdout's one document; the
    push's line goes to stderr."""
    from cachectl.bundle import oci

    result = oci.push(
        ctx,
        push_to,
        cache=ctx.cache(cache_name) if cache_name else None,
        env=env,
        manifest=manifest,
        sign_key=sign_key,
        insecure=insecure,
        ca_file=ca_file,
    )
    if as_json:
        click.echo(f"pushed {result.reference} as {result.digest}", err=True)
    else:
        print_push(result)


def _warm_failure(report: Any) -> CachectlError:
    """The error of a warm that is not ok: the wrong machine (exit 3), else failed buckets (exit 1)."""
    if report.target_problems:
        return EnvironmentMismatch(
            "this machine does not match the manifest's target: "
            + "; ".join(report.target_problems)
        )
    traced = [b for b in report.buckets if b.traceback]
    if _verbosity() >= 1:
        for b in traced:
            click.echo(f"{b.function}[{plain(b.bucket)}] failed:\n{b.traceback}\n", err=True)
    hint = "; -v prints the traceback of your code" if traced and _verbosity() < 1 else ""
    return OperationFailed(
        f"{report.summary.failed} of {report.summary.buckets} bucket(s) "
        f"failed; see each failed bucket's error{hint}"
    )


def _replay_failure(r: Any) -> OperationFailed:
    if r.exit_code != 0:
        return OperationFailed(f"the replayed command exited {r.exit_code}")
    if not r.requests:
        return OperationFailed("the replayed command made no compile request JAX counted")
    why = f": {host_callbacks_cause(r.host_callbacks)}" if r.host_callbacks else ""
    return OperationFailed(f"{r.misses} of {r.requests} compile requests missed the cache{why}")


def _run_replay(ctx: Context, run: str, cache_name: str | None, as_json: bool) -> None:
    from cachectl.warm.replay import replay_warm_run

    if run != "latest" and not run.isdigit():
        raise BadInput(f"--replay: a warm run's id or 'latest', got {run!r}")
    report = replay_warm_run(
        ctx,
        None if run == "latest" else int(run),
        cache=cache_name,
        child_stdout=sys.stderr if as_json else None,
    )
    emit(report, as_json, print_replay, failure=_replay_failure)


@click.command("warm-check")
@click.argument("manifest", required=False, type=click.Path(dir_okay=False))
@_with_common_options
@_cache_option("check")
@click.option(
    "--replay",
    metavar="RUN",
    is_flag=False,
    flag_value="latest",
    help="Instead of a MANIFEST: run the command warm-run RUN recorded (its id; alone, the "
    "latest) again, read-only as a service, and count JAX's cache hits in it.",
)
@click.option(
    "--canary",
    is_flag=True,
    help="Also compile every bucket here (jax.jit, JAX's persistent cache off) and compare its "
    "outputs on seeded random inputs with the stored executable's: they must be equal to the "
    "bit (same backend, same compiler), NaN equal to NaN, dtype and shape included. A "
    "difference exits 1. Costs one compile per bucket, as much as the warm did; off by default.",
)
@click.option(
    "--padding",
    is_flag=True,
    help="Also prove that padding changes no answer: for each bucket, a few raw sizes below it "
    "on each padded axis, padded to it as cachectl.serving pads a request, through the stored "
    "executable, cut back and compared with jax.jit at the raw shape (a tolerance per dtype; "
    "exact for integers and bools). A difference exits 1, naming the function and the axis. "
    "Compiles each raw size once.",
)
@click.option(
    "--rtol",
    type=click.FloatRange(min=0),
    metavar="X",
    help="With --padding: the relative tolerance for every floating output (default per dtype: "
    "float32 1e-5, bfloat16 1.6e-2, float16 2e-3, float64 1e-10).",
)
@click.option(
    "--atol",
    type=click.FloatRange(min=0),
    metavar="X",
    help="With --padding: the absolute tolerance for every floating output (default per dtype: "
    "float32 1e-6, bfloat16 1e-2, float16 1e-3, float64 1e-12).",
)
@click.option(
    "--distributed/--no-distributed",
    default=None,
    help="Check from inside a jax.distributed job (every process runs this command; the children "
    "join the job first, as its services do). Default: on when JAX_COORDINATOR_ADDRESS is set.",
)
@click.pass_obj
def warm_check_cmd(
    ctx: Context,
    manifest: str | None,
    cache_name: str | None,
    shard: str | None,
    shards: int | None,
    paths: tuple[str, ...],
    as_json: bool,
    replay: str | None,
    canary: bool,
    padding: bool,
    rtol: float | None,
    atol: float | None,
    distributed: bool | None,
) -> None:
    """Prove coverage: in a fresh process, activate the cache read-only and load every bucket.

    Reports hit or miss per bucket and the coverage; exits 1 below 100%. The result is
    recorded on the namespace in the index (`ls` and `stats` show it): proven when every
    bucket hit, every stored executable ran and, with --canary, gave a compile's outputs. With
    --replay, the command a warm-run ran runs again read-only (as `cachectl exec
    --readonly`); exits 1 unless it succeeds and every compile request hits.

    \b
    cachectl warm-check manifest.yaml
    cachectl warm-check manifest.yaml --canary
    cachectl warm-check manifest.yaml --padding --rtol 1e-4
    cachectl warm-check --replay          # the latest warm-run's command
    cachectl warm-check --replay 12 --json
    """
    if replay is not None:
        if manifest is not None:
            raise BadInput("give a MANIFEST or --replay, not both")
        if canary or padding:
            which = "--canary" if canary else "--padding"
            raise BadInput(f"{which} checks a MANIFEST's buckets; it does not go with --replay")
        _run_replay(ctx, replay, cache_name, as_json)
        return
    if manifest is None:
        raise BadInput("give the MANIFEST to check, or --replay for a warm-run's command")
    if not padding and (rtol is not None or atol is not None):
        raise BadInput("--rtol and --atol are --padding's tolerances: add --padding")
    options = {"rtol": rtol, "atol": atol} if padding else None
    _run_check(
        ctx, manifest, cache_name, shard, paths, as_json, shards, canary, options, distributed
    )


def register(cli: click.Group) -> None:
    cli.add_command(warm_cmd)
    cli.add_command(warm_check_cmd)
