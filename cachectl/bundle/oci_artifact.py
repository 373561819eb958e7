"""What an OCI bundle artifact is on the wire: its references, media types and annotations,
and the JSON a registry hands back, read so that no shape of it is more than one line.

A manifest, config, signature or referrers listing comes from the registry, so from whoever
controls it: ``load_json`` takes no NaN or Infinity and turns nesting too deep for the parser
into the same one-line refusal as bad JSON, and ``as_object``, ``as_list`` and ``descriptor``
check each shape before it is used.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cachectl.bundle.format import BadBundle
from cachectl.core.errors import BadInput

SCHEME = "oci://"
ARTIFACT_TYPE = "application/vnd.cachectl.bundle.v1"
LAYER_TYPE = (
    "application/vnd.cachectl.bundle.v1+zstd"  # the bundle file, as `bundle create` wrote it
)
CONFIG_TYPE = "application/vnd.cachectl.bundle.config.v1+json"
SIGNATURE_TYPE = "application/vnd.cachectl.bundle.signature.v1+json"
MANIFEST_TYPE = "application/vnd.oci.image.manifest.v1+json"
INDEX_TYPE = "application/vnd.oci.image.index.v1+json"
EMPTY_TYPE = "application/vnd.oci.empty.v1+json"
EMPTY = b"{}"
CONFIG_FORMAT = "cachectl-oci-bundle/1"
SIGNATURE_FORMAT = "cachectl-oci-signature/1"
ENV_TAG_PREFIX = "env-"
A = "io.cachectl."  # annotation prefix
SMALL_MAX = 4 << 20  # a manifest, config or signature larger than this is not ours
CANDIDATES_MAX = 64  # env- tags, or signatures' referrers, read at most
REFERRER_PAGES_MAX = 16  # pages of a paginated referrers listing read at most
_LOOPBACK = ("127.0.0.1", "localhost", "[::1]", "::1")
# The environment fields the annotations carry (the config carries them all).
ANNOTATED = {
    "jax_version": "jax-version",
    "jaxlib_version": "jaxlib-version",
    "platform_version": "platform-version",  # libtpu's version on TPU, the CUDA runtime's on GPU
    "backend": "backend",
    "device_kind": "device-kind",
    "device_count": "device-count",
    "process_count": "process-count",
    "topology": "topology",
}


# --------------------------------------------------------------------------- references

_REPO = re.compile(
    r"^[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*(?:/[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*)*$"
)
_TAG = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9._-]{0,127}$")
DIGEST = re.compile(r"^sha256:[0-9a-f]{64}$")
_HOST = re.compile(r"^(?:\[[0-9a-fA-F:]+\]|[A-Za-z0-9.-]+)(?::[0-9]{1,5})?$")


@dataclass(frozen=True)
class Reference:
    """``oci://REGISTRY/REPO[:TAG][@sha256:...]``, parsed."""

    registry: str
    repository: str
    tag: str | None = None
    digest: str | None = None

    def __str__(self) -> str:
        tail = (f":{self.tag}" if self.tag else "") + (f"@{self.digest}" if self.digest else "")
        return f"{SCHEME}{self.registry}/{self.repository}{tail}"

    def with_tag(self, tag: str) -> Reference:
        return Reference(self.registry, self.repository, tag, None)

    @property
    def loopback(self) -> bool:
        host = self.registry.rsplit(":", 1)[0] if not self.registry.endswith("]") else self.registry
        return host in _LOOPBACK


def is_oci(text: str) -> bool:
    return text.startswith(SCHEME)


def parse_reference(text: str) -> Reference:
    """BadInput, saying what is wrong, unless ``text`` is oci://REGISTRY/REPO[:TAG][@DIGEST]."""
    usage = "expected oci://REGISTRY/REPO[:TAG], e.g. oci://registry.example.com/ml/cache:v1"
    if not text.startswith(SCHEME):
        raise BadInput(f"{text!r} is not an OCI reference: {usage}")
    rest = text[len(SCHEME) :]
    registry, _, path = rest.partition("/")
    if not registry or not path or not _HOST.match(registry):
        raise BadInput(f"{text!r}: no registry host, or no repository: {usage}")
    digest = None
    if "@" in path:
        path, digest = path.split("@", 1)
        if not DIGEST.match(digest):
            raise BadInput(f"{text!r}: {digest!r} is not a sha256 digest (sha256:<64 hex digits>)")
    tag = None
    last = path.rsplit("/", 1)[-1]
    if ":" in last:
        path, tag = path.rsplit(":", 1)
        if not _TAG.match(tag):
            raise BadInput(f"{text!r}: {tag!r} is not a valid tag ([A-Za-z0-9_][A-Za-z0-9._-]*)")
    if not _REPO.match(path):
        raise BadInput(
            f"{text!r}: repository {path!r} is not valid (lower case letters, digits, and . _ - "
            "between them, / between components)"
        )
    return Reference(registry, path, tag, digest)


def environment_tag(digest: str) -> str:
    """The one tag per environment: ``env-<environment digest>``."""
    return ENV_TAG_PREFIX + digest


def fallback_tag(digest: str) -> str:
    return digest.replace(":", "-")


def make_descriptor(
    media_type: str, body_or_digest: bytes | str, size: int | None = None
) -> dict[str, Any]:
    if isinstance(body_or_digest, bytes):
        return {
            "mediaType": media_type,
            "digest": "sha256:" + hashlib.sha256(body_or_digest).hexdigest(),
            "size": len(body_or_digest),
        }
    return {"mediaType": media_type, "digest": body_or_digest, "size": size}


def compact_json(obj: Any) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()


def file_digest(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(1 << 20):
            h.update(chunk)
    return "sha256:" + h.hexdigest()


def listed(index: dict[str, Any]) -> list[dict[str, Any]]:
    """The descriptors a referrers listing holds (anything else in its list is left out)."""
    manifests = index.get("manifests")
    return [d for d in manifests if isinstance(d, dict)] if isinstance(manifests, list) else []


def count(text: Any) -> int | None:
    """A byte count as an annotation writes it (decimal digits, at most 16 of them), else None."""
    digits = isinstance(text, str) and text.isascii() and text.isdigit() and len(text) <= 16
    return int(text) if digits else None


# --------------------------------------------------------------------------- registry JSON

_SIZE_MAX = 1 << 53  # a byte count no registry holds


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"the number {text[:20]} is too large")
    return value


def load_json(body: bytes, what: str) -> Any:
    """``body`` as JSON; BadBundle, one line, for anything else (NaN, Infinity, nesting deeper
    than the parser goes, bytes that are no UTF-8)."""
    try:
        return json.loads(body, parse_constant=_no_constant, parse_float=_finite)
    except (ValueError, RecursionError) as exc:
        why = "nested too deep" if isinstance(exc, RecursionError) else str(exc)[:120]
        raise BadBundle(f"{what} is not JSON ({why})") from None


def as_object(value: Any, what: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise BadBundle(f"{what} is not a JSON object (a JSON {kind_of(value)})")
    return value


def as_list(value: Any, what: str) -> list[Any]:
    if not isinstance(value, list):
        raise BadBundle(f"{what} is not a JSON list (a JSON {kind_of(value)})")
    return value


def descriptor(value: Any, what: str, max_size: int = _SIZE_MAX) -> tuple[str, int]:
    """(digest, size) of an OCI descriptor, each checked; BadBundle naming ``what`` else."""
    d = as_object(value, what)
    digest, size = d.get("digest"), d.get("size")
    if not isinstance(digest, str) or not DIGEST.match(digest):
        raise BadBundle(f"{what}: its digest is not sha256:<64 hex digits>")
    if isinstance(size, bool) or not isinstance(size, int) or not 0 <= size <= max_size:
        raise BadBundle(f"{what}: its size is not a byte count up to {max_size}")
    return digest, size


def kind_of(value: Any) -> str:
    names = {dict: "object", list: "list", str: "string", bool: "boolean", type(None): "null"}
    return names.get(type(value), "number")
