"""`cachectl bundle create|install|ls|push|pull` and `cachectl key generate`."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import click

from cachectl.cli.oci_options import ca_file_option, insecure_option, print_push
from cachectl.cli.render import emit, json_option, key, size, stdout, table
from cachectl.core.config import SIGNING_KEY_ENV

if TYPE_CHECKING:
    from cachectl import bundle as bundle_lib
    from cachectl.bundle import oci as bundle_oci
    from cachectl.context import Context

# The bundle and signing libraries are imported by the command bodies when they run, never at
# import: `cachectl bundle create --help` builds its options from cachectl.core.config alone.

sign_key_option = click.option(
    "--sign-key",
    metavar="PATH",
    envvar=SIGNING_KEY_ENV,
    help=f"Ed25519 private key to sign the content list with (`cachectl key generate`). [env: {SIGNING_KEY_ENV}]",
)


def namespace_options(command: Callable[..., None]) -> Callable[..., None]:
    """Which namespace a bundle is made from (`bundle create`, `bundle push`), and its signer."""
    for option in reversed(
        [
            click.option(
                "--manifest",
                metavar="MANIFEST",
                type=click.Path(dir_okay=False),
                help="This machine's namespace in the manifest's cache.",
            ),
            click.option(
                "--env",
                "env",
                metavar="DIGEST",
                help="Another environment's namespace, by digest prefix.",
            ),
            click.option(
                "--cache",
                "cache_name",
                metavar="NAME",
                help="Cache to read (default: the global --cache).",
            ),
            sign_key_option,
        ]
    ):
        command = option(command)
    return command


@click.group("bundle")
def bundle_group() -> None:
    """Ship a namespace as one verified file (images, clusters without bucket access)."""


def _print_info(b: bundle_lib.BundleInfo) -> None:
    rows = [
        (
            e.function or "-",
            ",".join(f"{k}={v}" for k, v in (e.bucket or {}).items()) or "-",
            key(e.key),
            size(e.size),
            size(e.aot_size),
            "-" if e.compile_time_ms is None else f"{e.compile_time_ms / 1000:.2f}",
        )
        for e in b.entries
    ]
    stdout.print(
        table(
            f"bundle {b.path}: {b.namespace}",
            ["function", "bucket", "key", "size", "aot", "compile s"],
            rows,
            justify_right=("size", "aot", "compile s"),
        )
    )
    verb = "would write" if b.dry_run else "holds"
    stdout.print(
        f"{verb} {len(b.entries)} entries, {b.files} files ({size(b.content_bytes)}), "
        f"environment {b.digest[:16]}, from cache {b.source_cache}; "
        f"{'signed by ' + b.signed_by if b.signed_by else 'unsigned'}"
        + ("" if b.dry_run else f"; file {size(b.bundle_bytes)}"),
        highlight=False,
    )


@bundle_group.command("create")
@click.option(
    "-o",
    "--output",
    required=True,
    metavar="FILE",
    help="Bundle file to write, e.g. cache.tar.zst.",
)
@namespace_options
@click.option(
    "--level",
    type=click.IntRange(1, 19),
    default=3,
    show_default=True,
    help="zstd level of the metadata and stored executables (entries, compressed already, "
    "are stored as they are).",
)
@click.option("--dry-run", is_flag=True, help="List what would be bundled; write nothing.")
@json_option
@click.pass_obj
def create(
    ctx: Context,
    output: str,
    manifest: str | None,
    env: str | None,
    cache_name: str | None,
    sign_key: str | None,
    level: int,
    dry_run: bool,
    as_json: bool,
) -> None:
    """Write a namespace's entries, stored executables, env.json and index rows into one file."""
    from cachectl import bundle as bundle_lib

    cache = ctx.cache(cache_name) if cache_name else None
    result = bundle_lib.create(
        ctx,
        output,
        cache=cache,
        env=env,
        manifest=manifest,
        sign_key=sign_key,
        level=level,
        dry_run=dry_run,
    )
    emit(result, as_json, _print_info)


@bundle_group.command("install")
@click.argument("path", type=click.Path(dir_okay=False))
@click.option(
    "--cache",
    "cache_name",
    metavar="NAME",
    help="Cache to install into (default: the global --cache).",
)
@click.option("--dry-run", is_flag=True, help="Verify everything; install nothing.")
@json_option
@click.pass_obj
def install(ctx: Context, path: str, cache_name: str | None, dry_run: bool, as_json: bool) -> None:
    """Verify a bundle (environment, signature, every sha256), then install and index it.

    Exit 3 when it was made for another environment, 2 when any file does not match.
    """
    from cachectl import bundle as bundle_lib

    result = bundle_lib.install(ctx, path, cache=ctx.cache(cache_name), dry_run=dry_run)

    def human(r: bundle_lib.InstallResult) -> None:
        verb = "would install" if r.dry_run else "installed"
        stdout.print(
            f"{verb} {r.installed} of {r.entries} entries ({r.executables} with stored executables, "
            f"{size(r.bytes)}) into {r.dest}; {r.already_present} already present, "
            f"{len(r.conflicts)} conflicts; {'signed by ' + r.signed_by if r.signed_by else 'unsigned'} "
            f"({r.duration_s:.2f}s)",
            highlight=False,
        )
        for note in r.notes:
            stdout.print(f"note: {note}", highlight=False)

    emit(result, as_json, human)


@bundle_group.command("push")
@click.argument("target", metavar="oci://REGISTRY/REPO[:TAG]")
@namespace_options
@insecure_option
@ca_file_option
@json_option
@click.pass_obj
def push(
    ctx: Context,
    target: str,
    manifest: str | None,
    env: str | None,
    cache_name: str | None,
    sign_key: str | None,
    insecure: bool,
    ca_file: str | None,
    as_json: bool,
) -> None:
    """Push a namespace as a bundle artifact, tagged env-<environment digest> (and TAG).

    Credentials come from the docker config.json ($DOCKER_CONFIG, ~/.docker) and its
    credential helpers. Signed (--sign-key), the signature is pushed as an artifact that
    refers to the bundle.
    """
    from cachectl.bundle import oci

    oci.parse_reference(target)  # bad input before anything is opened
    result = oci.push(
        ctx,
        target,
        cache=ctx.cache(cache_name) if cache_name else None,
        env=env,
        manifest=manifest,
        sign_key=sign_key,
        insecure=insecure,
        ca_file=ca_file,
    )
    emit(result, as_json, print_push)


@bundle_group.command("pull")
@click.argument("source", metavar="oci://REGISTRY/REPO[:TAG]")
@click.option(
    "--for-this-machine",
    is_flag=True,
    help="Pick the bundle tagged for this machine's environment (env-<digest>); with none, "
    "name the fields that differ (exit 3) before downloading anything.",
)
@click.option(
    "--cache",
    "cache_name",
    metavar="NAME",
    help="Cache to install into (default: the global --cache).",
)
@insecure_option
@ca_file_option
@click.option("--dry-run", is_flag=True, help="Download and verify everything; install nothing.")
@json_option
@click.pass_obj
def pull(
    ctx: Context,
    source: str,
    for_this_machine: bool,
    cache_name: str | None,
    insecure: bool,
    ca_file: str | None,
    dry_run: bool,
    as_json: bool,
) -> None:
    """Pull a bundle artifact and install it, checking before the download: the environment
    (exit 3), the signature when the cache trusts keys, the quota and the free disk.

    The bundle is verified by digest as it streams, then installed as `bundle install` does.
    """
    from cachectl.bundle import oci

    oci.parse_reference(source)
    result = oci.pull(
        ctx,
        source,
        cache=ctx.cache(cache_name),
        for_this_machine=for_this_machine,
        insecure=insecure,
        ca_file=ca_file,
        dry_run=dry_run,
    )

    def human(r: bundle_oci.PullResult) -> None:
        i = r.install
        verb = "would install" if i.dry_run else "installed"
        stdout.print(
            f"pulled {r.reference} ({r.digest[:19]}, {size(r.downloaded_bytes)}); {verb} "
            f"{i.installed} of {i.entries} entries ({size(i.bytes)}) into {i.dest}; "
            f"{i.already_present} already present, {len(i.conflicts)} conflicts; "
            + (
                f"signature verified (key {r.signature_verified_by})"
                if r.signature_verified_by
                else ("signed by " + i.signed_by if i.signed_by else "unsigned")
            )
            + f" ({r.duration_s:.2f}s)",
            highlight=False,
        )
        for note in i.notes + r.notes:
            stdout.print(f"note: {note}", highlight=False)

    emit(result, as_json, human)


@bundle_group.command("ls")
@click.argument("path", type=click.Path(dir_okay=False))
@json_option
def ls(path: str, as_json: bool) -> None:
    """Show what a bundle holds."""
    from cachectl import bundle as bundle_lib

    emit(bundle_lib.describe(path), as_json, _print_info)


@click.group("key")
def key_group() -> None:
    """Signing keys: the trust root of signed caches."""


@key_group.command("generate")
@click.argument("path", type=click.Path(dir_okay=False))
@click.option("--force", is_flag=True, help="Replace an existing key.")
@click.option(
    "--dry-run", is_flag=True, help="Show the public key a new key would have; write nothing."
)
@json_option
def generate(path: str, force: bool, dry_run: bool, as_json: bool) -> None:
    """Write an Ed25519 private key to PATH (mode 0600) and its public key to PATH.pub.

    \b
    cachectl key generate ~/.config/cachectl/ci.key
    cachectl cache set prod --trust ~/.config/cachectl/ci.key.pub
    CACHECTL_SIGNING_KEY=~/.config/cachectl/ci.key cachectl warm m.yaml
    """
    from cachectl.trust import signing

    info = signing.generate(path, force=force, dry_run=dry_run)
    emit(
        info,
        as_json,
        lambda k: stdout.print(
            f"{'would write' if dry_run else 'wrote'} {k.path} and {k.public_path}\n{k.public_key}  (key {k.key_id})",
            highlight=False,
        ),
    )


def register(cli: click.Group) -> None:
    cli.add_command(bundle_group)
    cli.add_command(key_group)
