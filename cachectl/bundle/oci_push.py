"""`bundle push oci://...` and `warm --push`: a namespace bundled (as `bundle create`) and
pushed as an artifact, tagged for its environment; signed, its signature a referrer of it."""

from __future__ import annotations

import hashlib
import tempfile
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

from cachectl.bundle.create import create
from cachectl.bundle.oci_artifact import (
    ANNOTATED,
    ARTIFACT_TYPE,
    CONFIG_FORMAT,
    CONFIG_TYPE,
    EMPTY,
    EMPTY_TYPE,
    INDEX_TYPE,
    LAYER_TYPE,
    MANIFEST_TYPE,
    SIGNATURE_FORMAT,
    SIGNATURE_TYPE,
    A,
    compact_json,
    environment_tag,
    fallback_tag,
    file_digest,
    listed,
    make_descriptor,
    parse_reference,
)
from cachectl.bundle.oci_registry import Registry
from cachectl.context import Context
from cachectl.core.errors import BadInput, NotFound
from cachectl.index import CacheInfo
from cachectl.manifest.load import LoadedManifest, as_loaded
from cachectl.trust import signing


@dataclass(frozen=True)
class PushResult:
    reference: str
    digest: str  # the bundle artifact's manifest digest
    tags: list[str]
    environment: str
    namespace: str
    entries: int
    content_bytes: int
    bundle_bytes: int
    uploaded_bytes: int  # blobs the registry did not hold yet
    signed_by: str | None
    signature: str | None  # the signature artifact's digest
    referrers: str | None  # "api" or "tag-schema" (how the signature refers to the bundle)
    duration_s: float


def push(
    ctx: Context,
    target: str,
    *,
    cache: CacheInfo | None = None,
    env: str | None = None,
    manifest: str | LoadedManifest | None = None,
    sign_key: str | None = None,
    level: int = 3,
    insecure: bool = False,
    ca_file: str | None = None,
) -> PushResult:
    """Bundle a namespace (as `bundle create`) and push it to ``target``, tagged for its
    environment (and ``target``'s tag); signed, its signature as a referrer of the bundle.
    The manifest is read once (`warm --push` hands over the one warm read)."""
    started = time.monotonic()
    ref = parse_reference(target)
    if ref.digest:
        raise BadInput(f"{target}: push to a tag (oci://REGISTRY/REPO[:TAG]), not a digest")
    key = signing.signing_key(sign_key)
    registry = Registry(ref, insecure=insecure, ca_file=ca_file)  # unreachable: before bundling
    try:
        loaded = as_loaded(manifest) if manifest is not None else None
        with tempfile.TemporaryDirectory(prefix="cachectl-oci-push-") as tmp:
            path = Path(tmp) / "bundle.tar.zst"
            # A manifest names the cache and, without ``env``, this machine's namespace; with ``env``
            # (a deviceless warm's slice) the namespace is that environment's, in the manifest's cache.
            if env is not None and loaded is not None and cache is None:
                cache = ctx.cache(loaded.manifest.cache or None)
            info = create(
                ctx,
                path,
                cache=cache,
                env=env,
                manifest=None if env is not None else loaded,
                sign_key=sign_key,
                level=level,
            )
            layer_digest, layer_size = file_digest(path), path.stat().st_size
            environment = dict(info.environment)
            summary = {
                "format": CONFIG_FORMAT,
                "environment": environment,
                "digest": info.digest,
                "namespace": info.namespace,
                "entries": len(info.entries),
                "bytes": info.content_bytes,
                "manifest_digest": loaded.digest if loaded is not None else None,
                "created_at": info.created_at,
            }
            config = compact_json(summary)
            annotations = {
                A + "environment": info.digest,
                A + "namespace": info.namespace,
                A + "entries": str(len(info.entries)),
                A + "bytes": str(info.content_bytes),
                "org.opencontainers.image.created": info.created_at
                or datetime.now(UTC).isoformat(timespec="seconds"),
            }
            for name, label in ANNOTATED.items():
                if name in environment:
                    annotations[A + label] = str(environment[name])
            if loaded is not None:
                annotations[A + "manifest-digest"] = "sha256:" + str(summary["manifest_digest"])
            uploaded = registry.put_blob(layer_digest, layer_size, path)
        uploaded += registry.put_blob(
            make_descriptor(CONFIG_TYPE, config)["digest"], len(config), config
        )
        body = compact_json(
            {
                "schemaVersion": 2,
                "mediaType": MANIFEST_TYPE,
                "artifactType": ARTIFACT_TYPE,
                "config": make_descriptor(CONFIG_TYPE, config),
                "layers": [
                    {
                        **make_descriptor(LAYER_TYPE, layer_digest, layer_size),
                        "annotations": {"org.opencontainers.image.title": "bundle.tar.zst"},
                    }
                ],
                "annotations": annotations,
            }
        )
        digest = "sha256:" + hashlib.sha256(body).hexdigest()
        tags = [environment_tag(info.digest)] + ([ref.tag] if ref.tag else [])
        for tag in tags:
            registry.put_manifest(tag, body, MANIFEST_TYPE)
        sig_digest = how = None
        if key is not None:
            sig_digest, how = _push_signature(registry, key, digest, len(body), info.digest)
        return PushResult(
            str(ref.with_tag(tags[-1])),
            digest,
            tags,
            info.digest,
            info.namespace,
            len(info.entries),
            info.content_bytes,
            layer_size,
            uploaded,
            key.key_id if key else None,
            sig_digest,
            how,
            time.monotonic() - started,
        )
    finally:
        registry.close()


def _push_signature(
    registry: Registry, key: signing.SigningKey, digest: str, size: int, environment: str
) -> tuple[str, str]:
    """The bundle manifest's digest signed, pushed as an artifact whose subject is the bundle;
    where the registry has no referrers API, listed in the ``sha256-<hex>`` index too."""
    signed = compact_json(
        signing.sign(
            key, {"format": SIGNATURE_FORMAT, "manifest": digest, "environment": environment}
        )
    )
    registry.put_blob(make_descriptor(EMPTY_TYPE, EMPTY)["digest"], len(EMPTY), EMPTY)
    registry.put_blob(make_descriptor(SIGNATURE_TYPE, signed)["digest"], len(signed), signed)
    created = datetime.now(UTC).isoformat(timespec="seconds")
    body = compact_json(
        {
            "schemaVersion": 2,
            "mediaType": MANIFEST_TYPE,
            "artifactType": SIGNATURE_TYPE,
            "config": make_descriptor(EMPTY_TYPE, EMPTY),
            "layers": [make_descriptor(SIGNATURE_TYPE, signed)],
            "subject": make_descriptor(MANIFEST_TYPE, digest, size),
            "annotations": {A + "key-id": key.key_id, "org.opencontainers.image.created": created},
        }
    )
    sig_digest = "sha256:" + hashlib.sha256(body).hexdigest()
    r = registry.put_manifest(sig_digest, body, MANIFEST_TYPE)
    if r.headers.get("OCI-Subject") == digest:
        return sig_digest, "api"
    # The referrers tag schema: an index at sha256-<hex> listing what refers to the digest.
    tag = fallback_tag(digest)
    try:
        existing, _, _ = registry.manifest(tag)
        index = registry.referrers_index(existing, digest)
    except NotFound:
        index = {"schemaVersion": 2, "mediaType": INDEX_TYPE, "manifests": []}
    entry = {
        **make_descriptor(MANIFEST_TYPE, sig_digest, len(body)),
        "artifactType": SIGNATURE_TYPE,
        "annotations": {A + "key-id": key.key_id},
    }
    manifests = [m for m in listed(index) if m.get("digest") != sig_digest]
    index["manifests"] = [*manifests, entry]
    registry.put_manifest(tag, compact_json(index), INDEX_TYPE)
    return sig_digest, "tag-schema"
