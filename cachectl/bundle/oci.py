"""Bundles as OCI artifacts: `bundle push|pull oci://REGISTRY/REPO[:TAG]`, `warm --push`.

The artifact carries the bundle file unchanged (one layer, ``LAYER_TYPE``); its config is a
small JSON of the environment and totals, and its annotations repeat them so that registry UIs
and ``--for-this-machine`` read them without a download. Every bundle is tagged
``env-<environment digest>`` (one tag per environment), and with the user's tag when one is
given. A signing key also signs the artifact's manifest digest: that signature travels as an
artifact whose ``subject`` is the bundle (the OCI referrers API, or the referrers tag schema
``sha256-<hex>`` where the registry lacks it), so a node checks it before it downloads anything.

A pull checks, before a byte of the bundle is fetched: the manifest and config by digest, the
environment against this machine (exit 3 naming the fields), the signature when the cache
trusts keys, the declared size against the cache's quota and the free disk. It then installs
the one blob as it arrives (``oci_download.Download``: a thread takes it off the socket and hashes it while
``bundle install`` reads it, every file verified again, ingest's checks), and publishes nothing
before the whole blob matched its digest (a blob that is not is refused). The staging
directories are ``bundle install``'s own: a killed pull leaves only what the next install or
``verify --repair`` removes.

This module is the pull; the rest of the client is its own modules: ``oci_artifact`` (references,
media types, the registry's JSON read shape by shape), ``oci_transport`` (the session: credentials
only to the registry, every request whole within ``CACHECTL_OCI_TIMEOUT``), ``oci_login`` (docker
``config.json`` and its credential helpers), ``oci_registry`` (one repository, through oras's
basic and bearer-token auth, each request tried once), ``oci_download`` and ``oci_push``.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cachectl.bundle.format import BadBundle, InstallResult
from cachectl.bundle.install import environment_diff, install_arriving, staging_dir
from cachectl.bundle.oci_artifact import (
    ARTIFACT_TYPE,
    CANDIDATES_MAX,
    CONFIG_FORMAT,
    CONFIG_TYPE,
    ENV_TAG_PREFIX,
    LAYER_TYPE,
    MANIFEST_TYPE,
    SIGNATURE_FORMAT,
    SIGNATURE_TYPE,
    A,
    Reference,
    as_list,
    as_object,
    count,
    descriptor,
    environment_tag,
    is_oci,
    load_json,
    parse_reference,
)
from cachectl.bundle.oci_push import PushResult, push
from cachectl.bundle.oci_registry import Registry
from cachectl.context import Context
from cachectl.core.errors import BadInput, EnvironmentMismatch, NotFound
from cachectl.core.fingerprint import Environment
from cachectl.core.units import format_size
from cachectl.index import CacheInfo
from cachectl.storage import ingest
from cachectl.trust import signing

__all__ = [
    "PullResult",
    "PushResult",
    "Reference",
    "Registry",
    "is_oci",
    "parse_reference",
    "pull",
    "push",
]


@dataclass(frozen=True)
class PullResult:
    reference: str
    digest: str
    tag: str | None
    environment: str
    downloaded_bytes: int
    signature_verified_by: str | None
    install: InstallResult
    duration_s: float
    notes: list[str] = field(default_factory=list)


# --------------------------------------------------------------------------- pull


@dataclass(frozen=True)
class _Artifact:
    """A bundle artifact's manifest and config, read and checked, nothing of the bundle yet."""

    digest: str
    tag: str | None
    layer_digest: str
    layer_size: int
    environment: dict[str, Any]
    env_digest: str
    content_bytes: int


def _artifact(
    registry: Registry, reference: str, tag: str | None, here: Environment | None = None
) -> _Artifact:
    """The artifact ``reference`` names, its manifest and config checked. With ``here`` (this
    machine's environment), a manifest whose annotations (what push writes) name exactly it,
    its namespace and the files' bytes is taken without its config: one registry round trip
    fewer per pull (BENCHMARKS.md, "OCI"). The annotations are as trustworthy as the config
    (the manifest's digest covers both, and a signature signs that digest), install checks the
    bundle's own environment before it stages a file, and any other manifest (another
    environment: its config names the fields that differ; an older push) is read with its
    config."""
    ref = registry.ref
    body, media_type, digest = registry.manifest(reference)
    by_digest = reference.startswith("sha256:")
    where = str(
        Reference(ref.registry, ref.repository, None, reference)
        if by_digest
        else ref.with_tag(reference)
    )
    m = load_json(body, f"{where}: its manifest")
    if not isinstance(m, dict) or (media_type or m.get("mediaType")) != MANIFEST_TYPE:
        raise BadBundle(f"{where} is not an artifact manifest (a {media_type or '?'})")
    config = as_object(m.get("config") or {}, f"{where}: its config descriptor")
    if m.get("artifactType") != ARTIFACT_TYPE and config.get("mediaType") != CONFIG_TYPE:
        raise BadBundle(f"{where} is not a cachectl bundle ({str(m.get('artifactType'))[:80]})")
    layers = as_list(m.get("layers") or [], f"{where}: its layers")
    if len(layers) != 1 or as_object(layers[0], f"{where}: its layer").get("mediaType") != (
        LAYER_TYPE
    ):
        raise BadBundle(f"{ref}: a cachectl bundle artifact has exactly one {LAYER_TYPE} layer")
    layer_digest, layer_size = descriptor(layers[0], f"{where}: its layer")
    notes = m.get("annotations") or {}
    if not isinstance(notes, dict):
        notes = {}
    noted_bytes = count(notes.get(A + "bytes"))
    if (
        here is not None
        and notes.get(A + "environment") == here.digest
        and notes.get(A + "namespace") == here.namespace
        and noted_bytes is not None
    ):
        return _Artifact(
            digest, tag, layer_digest, layer_size, here.to_dict(), here.digest, noted_bytes
        )
    what = f"{where}: its config"
    summary = as_object(load_json(registry.small_blob(config, "config"), what), what)
    try:
        environment = dict(as_object(summary.get("environment"), f"{what}'s environment"))
        env = Environment.from_dict(environment)
        content_bytes = summary["bytes"]
        if isinstance(content_bytes, bool) or not isinstance(content_bytes, int):
            raise TypeError("bytes is not a whole number")
    except (ValueError, TypeError, KeyError, OverflowError) as exc:
        raise BadBundle(f"{what} is not a bundle's ({str(exc)[:120]})") from None
    noted = notes.get(A + "environment")
    if (
        summary.get("format") != CONFIG_FORMAT
        or env.digest != summary.get("digest")
        or (noted is not None and noted != env.digest)
    ):
        raise BadBundle(f"{where}'s environment does not match its digest or annotations")
    return _Artifact(digest, tag, layer_digest, layer_size, environment, env.digest, content_bytes)


def _closest(registry: Registry, here: Environment) -> EnvironmentMismatch | NotFound:
    """No env tag for this machine: the error naming the fields that differ in the closest
    bundle the repository holds (read from manifests and configs only)."""
    try:
        tags = sorted(t for t in registry.tags() if t.startswith(ENV_TAG_PREFIX))
    except NotFound:
        tags = []
    best: tuple[int, str, list[str]] | None = None
    for tag in tags[:CANDIDATES_MAX]:
        try:
            art = _artifact(registry, tag, tag)
        except (BadInput, NotFound):
            continue
        diff = environment_diff(here, art.environment)
        if best is None or len(diff) < best[0]:
            best = (len(diff), tag, diff)
    if best is None:
        return NotFound(
            f"{registry.ref} holds no cachectl bundle: push one with `cachectl bundle push`"
        )
    _, tag, diff = best
    return EnvironmentMismatch(
        f"{registry.ref} holds no bundle for this machine (environment {here.digest[:16]}); "
        f"the closest of {len(tags)} ({tag[: len(ENV_TAG_PREFIX) + 16]}) differs: "
        + "; ".join(diff)
        + ": nothing downloaded"
    )


def _check_signature(registry: Registry, cache: CacheInfo, art: _Artifact) -> str | None:
    """With trusted keys, a signature artifact referring to this manifest, by a trusted key,
    over this manifest's digest; Untrusted otherwise. None when the cache trusts no key."""
    if not cache.trusted_keys:
        return None
    what = f"bundle {registry.ref}"
    last: Exception | None = None
    for d in registry.referrers(art.digest, SIGNATURE_TYPE)[:CANDIDATES_MAX]:
        try:
            # Read by digest only, so it is checked; no bigger than the listing says.
            sig_digest, sig_size = descriptor(d, f"{what}: a referrer")
            body, _, _ = registry.manifest(sig_digest, sig_size)
            m = as_object(load_json(body, f"{what}: a referrer"), f"{what}: a referrer")
            if m.get("artifactType") != SIGNATURE_TYPE:
                continue  # another kind of artifact, listed under its config's media type
            subject = m.get("subject")
            if not isinstance(subject, dict) or subject.get("digest") != art.digest:
                raise signing.Untrusted(f"{what}: a signature refers to another artifact")
            layers = as_list(m.get("layers"), f"{what}: a signature's layers") or [{}]
            signed = as_object(
                load_json(registry.small_blob(layers[0], "signature"), f"{what}: a signature"),
                f"{what}: a signature",
            )
            content = signing.verify(signed, cache.trusted_keys, what)
            if not isinstance(content, dict) or (
                content.get("format") != SIGNATURE_FORMAT or content.get("manifest") != art.digest
            ):
                raise signing.Untrusted(f"{what}: its signature signs another manifest")
            return signing.key_id(str(signed.get("key")))
        except (signing.Untrusted, BadInput, ValueError, AttributeError, TypeError) as exc:
            last = exc
    if isinstance(last, signing.Untrusted):
        raise signing.Untrusted(f"{last.message}: nothing downloaded")
    raise signing.Untrusted(
        f"{what} has no signature by a key cache {cache.name!r} trusts"
        + (f" ({last})" if last else "")
        + ": push it with --sign-key; nothing downloaded"
    )


def _check_room(ctx: Context, cache: CacheInfo, art: _Artifact, staging: Path, store: Any) -> None:
    """The declared bytes against the cache's quota, and the files against the free disk,
    before anything is fetched (the quota only where the cache has a limit: no index read
    otherwise)."""
    if ingest.has_limits(ctx.index, cache):
        try:
            ctx.index.get_environment(cache.name, art.env_digest)
        except NotFound:  # a namespace new here: every byte is new (else install checks the delta)
            ingest.check_fits(ctx.index, cache, None, art.content_bytes)
    # The files: staged beside a local namespace (renamed into place), or in the local temporary
    # directory for an object store (install stages there, then uploads). The blob itself is
    # read as it arrives and never written (``_Download``).
    where = Path(store.url_for("")) if store.is_local else staging
    nbytes = art.content_bytes
    free = shutil.disk_usage(where).free
    if nbytes > free:
        raise BadInput(
            f"bundle {art.digest[:19]}: not enough free disk in {where}: it needs "
            f"{format_size(nbytes)}, {format_size(free)} free: nothing downloaded"
        )


def pull(
    ctx: Context,
    source: str,
    *,
    cache: CacheInfo | None = None,
    for_this_machine: bool = False,
    insecure: bool = False,
    ca_file: str | None = None,
    dry_run: bool = False,
) -> PullResult:
    """Pull a bundle artifact: preflight (environment, signature, quota, disk) before the bundle
    is fetched, the blob verified by digest as it streams, then `bundle install`."""
    started = time.monotonic()
    ref = parse_reference(source)
    if for_this_machine and (ref.tag or ref.digest):
        raise BadInput(
            f"{source}: --for-this-machine picks the tag itself (env-<digest>): give "
            "oci://REGISTRY/REPO without a tag"
        )
    if not for_this_machine and not (ref.tag or ref.digest):
        raise BadInput(f"{source}: give a tag (oci://REGISTRY/REPO:TAG) or --for-this-machine")
    cache = cache or ctx.cache()
    here = ctx.environment()
    registry = Registry(ref, insecure=insecure, ca_file=ca_file, probe=False)
    try:
        if for_this_machine:
            tag: str | None = environment_tag(here.digest)
            try:
                art = _artifact(registry, str(tag), tag, here)
            except NotFound:
                raise _closest(registry, here) from None
        else:
            tag = ref.tag
            art = _artifact(registry, str(ref.digest or ref.tag), tag, here)
        if art.env_digest != here.digest:
            raise EnvironmentMismatch(
                f"bundle {ref} was made for another environment: "
                + "; ".join(environment_diff(here, art.environment))
                + ": nothing downloaded"
            )
        signer = _check_signature(registry, cache, art)
        store = ctx.store(cache)
        staging = staging_dir(store, Environment.from_dict(art.environment).namespace)
        try:
            _check_room(ctx, cache, art, staging, store)
            # The blob is installed as it arrives (no file: install reads it off the socket, a
            # thread ahead), and nothing is published before the whole blob matches its digest.
            download = registry.stream(art.layer_digest, art.layer_size)
            try:
                result = install_arriving(
                    ctx, staging / "bundle.tar.zst", download, cache=cache, dry_run=dry_run
                )
            finally:
                download.stop()
            got = art.layer_size
        finally:
            shutil.rmtree(staging, ignore_errors=True)
            if store.is_local:  # only when empty: another install may be staging
                with contextlib.suppress(OSError):
                    os.rmdir(staging.parent)
        return PullResult(
            str(ref),
            art.digest,
            tag,
            art.env_digest,
            got,
            signer,
            result,
            time.monotonic() - started,
        )
    finally:
        registry.close()
