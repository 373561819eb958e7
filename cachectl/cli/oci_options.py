"""The OCI registry options and the push line, shared by `bundle push|pull` and `warm --push`."""

from __future__ import annotations

from typing import TYPE_CHECKING

import click

from cachectl.cli.render import size, stdout

if TYPE_CHECKING:
    from cachectl.bundle.oci import PushResult

insecure_option = click.option(
    "--insecure",
    is_flag=True,
    help="Plain HTTP to the registry: only for a registry on loopback (127.0.0.1, ::1, localhost).",
)
ca_file_option = click.option(
    "--ca-file",
    metavar="PATH",
    envvar="CACHECTL_OCI_CA_FILE",
    help="CA certificate(s) to verify the registry's TLS with (a private CA). "
    "[env: CACHECTL_OCI_CA_FILE]",
)


def print_push(r: PushResult) -> None:
    stdout.print(
        f"pushed {r.entries} entries ({size(r.content_bytes)}; bundle {size(r.bundle_bytes)}, "
        f"{size(r.uploaded_bytes)} uploaded) to {r.reference} as {r.digest[:19]}, tags "
        f"{', '.join(r.tags)}; "
        + (
            f"signed by {r.signed_by} (signature {r.signature[:19] if r.signature else '-'} via "
            f"the referrers {'API' if r.referrers == 'api' else 'tag schema'})"
            if r.signed_by
            else "unsigned"
        )
        + f" ({r.duration_s:.2f}s)",
        highlight=False,
    )
