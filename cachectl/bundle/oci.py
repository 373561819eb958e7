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
the one blob as it arrives (``_Download``: a thread takes it off the socket and hashes it while
``bundle install`` reads it, every file verified again, ingest's checks), and publishes nothing
before the whole blob matched its digest (a blob that is not is refused). The staging
directories are ``bundle install``'s own: a killed pull leaves only what the next install or
``verify --repair`` removes.

The HTTP and auth are oras's (docker ``config.json``, basic and bearer token), except the
docker credential helpers, which are run here (bounded, a failure one line: oras logs and goes
on anonymously); every request is bounded by ``CACHECTL_OCI_TIMEOUT`` and never retried blindly.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import queue
import re
import shutil
import tempfile
import threading
import time
import urllib.parse
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from cachectl.bundle.create import create
from cachectl.bundle.format import BadBundle, InstallResult
from cachectl.bundle.install import environment_diff, install_arriving, staging_dir
from cachectl.context import Context
from cachectl.core.errors import BadInput, EnvironmentMismatch, NotFound, Unreachable
from cachectl.core.fingerprint import Environment
from cachectl.core.units import format_size
from cachectl.index import CacheInfo
from cachectl.manifest.load import LoadedManifest, as_loaded
from cachectl.storage import ingest
from cachectl.trust import signing

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
TIMEOUT_ENV = "CACHECTL_OCI_TIMEOUT"
CA_ENV = "CACHECTL_OCI_CA_FILE"
DEFAULT_TIMEOUT_S = 30.0
_SMALL_MAX = 4 << 20  # a manifest, config or signature larger than this is not ours
_CANDIDATES_MAX = 64  # env- tags, or signatures' referrers, read at most
_REFERRER_PAGES_MAX = 16  # pages of a paginated referrers listing read at most
_LOOPBACK = ("127.0.0.1", "localhost", "[::1]", "::1")
# The environment fields the annotations carry (the config carries them all).
_ANNOTATED = {
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
_DIGEST = re.compile(r"^sha256:[0-9a-f]{64}$")
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
        if not _DIGEST.match(digest):
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


# --------------------------------------------------------------------------- results


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


# --------------------------------------------------------------------------- the registry


def _timeout() -> float:
    raw = os.environ.get(TIMEOUT_ENV, "").strip()
    if not raw:
        return DEFAULT_TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        raise BadInput(f"{TIMEOUT_ENV}={raw!r} is not a number of seconds") from None
    if not 0 < value <= 3600:
        raise BadInput(f"{TIMEOUT_ENV}={raw!r}: give seconds between 0 and 3600")
    return value


def _docker_configs() -> list[str]:
    """The docker config.json files to read credentials from: $DOCKER_CONFIG's, then ~/.docker's
    (oras adds the latter itself)."""
    configs = []
    if os.environ.get("DOCKER_CONFIG"):
        configs.append(str(Path(os.environ["DOCKER_CONFIG"]) / "config.json"))
    return [c for c in configs if os.path.exists(c)]


_NOT_FOUND = "credentials not found"  # docker-credential-helpers' answer for an unknown server


def _helper_for(host: str) -> tuple[str, str] | None:
    """(helper, config file) that holds ``host``'s login: its ``credHelpers`` entry, else the
    ``credsStore``, in $DOCKER_CONFIG's or ~/.docker's config.json; None when a config holds the
    login inline (oras reads those) or names no helper."""
    home = os.path.expanduser("~/.docker/config.json")
    names = [host, *([host.replace("127.0.0.1", "localhost")] if "127.0.0.1" in host else [])]
    store: tuple[str, str] | None = None
    for path in [*_docker_configs(), *([home] if os.path.exists(home) else [])]:
        try:
            cfg = json.loads(Path(path).read_bytes())
        except (OSError, ValueError) as exc:
            raise BadInput(f"docker config {path} is not readable JSON ({exc}): fix it") from None
        if not isinstance(cfg, dict):
            raise BadInput(f"docker config {path} is not a JSON object: fix it")
        auths, helpers = cfg.get("auths") or {}, cfg.get("credHelpers") or {}
        for name in names:
            inline = auths.get(name) if isinstance(auths, dict) else None
            if isinstance(inline, dict) and inline.get("auth"):
                return None
            if isinstance(helpers, dict) and (helper := helpers.get(name)):
                return str(helper), path
        if cfg.get("credsStore") and store is None:
            store = str(cfg["credsStore"]), path
    return store


def _run_helper(helper: str, config: str, host: str, timeout: float) -> tuple[str, str] | None:
    """``docker-credential-<helper> get`` for ``host`` (docker's credential helper protocol: the
    server on stdin, {"Username", "Secret"} JSON on stdout); None when it holds no login for it.
    Any other failure is one line: a node must not pull anonymously, or hang, because its
    keychain is broken."""
    import subprocess

    binary = f"docker-credential-{helper}"
    fix = f"fix the helper, or its entry in {config}"
    try:
        done = subprocess.run(
            [binary, "get"], input=host.encode(), capture_output=True, timeout=timeout
        )
    except FileNotFoundError:
        raise BadInput(
            f"{config} names the credential helper {binary} for {host}, which is not on PATH: "
            "install it, or remove it from the config"
        ) from None
    except subprocess.TimeoutExpired:
        raise BadInput(
            f"credential helper {binary} did not answer for {host} within {timeout:g} s "
            f"({TIMEOUT_ENV}): {fix}"
        ) from None
    except OSError as exc:
        raise BadInput(f"credential helper {binary} cannot run ({exc.strerror}): {fix}") from None
    said = (done.stdout or done.stderr).decode(errors="replace").strip().splitlines()
    if done.returncode != 0:
        if said and _NOT_FOUND in said[0].lower():
            return None
        why = said[0][:200] if said else f"exit {done.returncode}, no message"
        raise BadInput(f"credential helper {binary} failed for {host} ({why}): {fix}")
    try:
        payload = json.loads(done.stdout)
        user, secret = payload["Username"], payload["Secret"]
        if not isinstance(user, str) or not isinstance(secret, str):
            raise TypeError("Username and Secret are not strings")
    except (ValueError, KeyError, TypeError) as exc:
        raise BadInput(
            f"credential helper {binary} gave no login for {host} (not the protocol's "
            f'{{"Username", "Secret"}} JSON: {exc}): {fix}'
        ) from None
    return user, secret


class Registry:
    """One repository of one registry, through oras's HTTP and auth, every request bounded."""

    def __init__(
        self,
        ref: Reference,
        *,
        insecure: bool = False,
        ca_file: str | None = None,
        probe: bool = True,
    ):
        """``probe``: GET /v2/ now for the auth scheme (a push, whose bodies are sent once);
        without it the first request learns it (``_first``), one round trip fewer."""
        import oras.provider
        import requests

        if insecure and not ref.loopback:
            raise BadInput(
                f"--insecure (plain HTTP) is allowed only for a loopback registry, not "
                f"{ref.registry}: use TLS, with --ca-file for a private CA"
            )
        ca = ca_file or os.environ.get(CA_ENV, "").strip() or None
        if ca is not None and not os.path.isfile(ca):
            raise BadInput(f"--ca-file {ca}: no such file")
        self.ref = ref
        self.what = f"registry {ref.registry}"
        self.timeout = _timeout()
        self._requests = requests
        timeout = (min(self.timeout, 10.0), self.timeout)

        class _Session(requests.Session):
            def request(self, *args: Any, **kwargs: Any) -> Any:
                kwargs.setdefault("timeout", timeout)
                return super().request(*args, **kwargs)

        self.verify: bool | str = ca if ca is not None else True
        self.insecure = insecure
        self.prefix = "http" if insecure else "https"
        self.base = f"{self.prefix}://{ref.registry}/v2/{ref.repository}"
        self.session = _Session()
        self.session.trust_env = False  # no proxy from the environment for a registry named here
        # oras retries every failure for minutes (3 + 3**n s); each request here is tried once.
        self._once = oras.provider.Registry.do_request.__wrapped__
        self.basic = False
        self.client: Any = None  # oras's Registry, once the auth the registry asks for is known
        if probe:
            self._authenticate(self._probe())

    def _authenticate(self, scheme: str | None) -> None:
        """oras's client for ``scheme`` (None: the registry asks for no login; "basic" or
        "bearer"), with the login from the docker config.json or its credential helper."""
        import oras.container
        import oras.provider

        ref = self.ref
        self.client = oras.provider.Registry(
            hostname=ref.registry,
            insecure=self.insecure,
            tls_verify=self.verify,
            auth_backend="basic" if scheme == "basic" else "token",
        )
        self.client.session = self.session
        self.client.auth.session = self.session
        self.basic = scheme == "basic"
        if scheme is not None:
            helper = _helper_for(ref.registry)
            login = helper and _run_helper(*helper, ref.registry, self.timeout)
            if login:  # run here, bounded, its failures one line (oras would log and go on)
                self.client.auth.set_basic_auth(*login)
            elif helper is None:
                container = oras.container.Container(f"{ref.registry}/{ref.repository}")
                self.client.auth.load_configs(container, configs=_docker_configs())
            if not getattr(self.client.auth, "_basic_auth", None) and scheme == "basic":
                raise BadInput(
                    f"{self.what} asks for a login and no credentials for it were found: add "
                    f"them to the docker config.json ($DOCKER_CONFIG or ~/.docker; `docker login "
                    f"{ref.registry}` or `oras login` writes it, credential helpers are used)"
                )

    def _probe(self) -> str | None:
        """GET /v2/: None when it answers without auth, else "basic" or "bearer"."""
        url = f"{self.prefix}://{self.ref.registry}/v2/"
        try:
            r = self.session.get(url, verify=self.verify)
        except Exception as exc:  # noqa: BLE001 - every transport failure is one clear line
            raise self._unreachable(exc) from None
        if r.status_code == 200:
            return None
        if r.status_code == 401:
            return _scheme(r)
        raise Unreachable(
            f"{self.what} answered /v2/ with HTTP {r.status_code}: is it an OCI registry?"
        )

    def _first(self, method: str, url: str, headers: dict[str, str], stream: bool) -> Any:
        """A pull's first request, with no /v2/ probe before it (a round trip to a registry that
        wakes for each, before the manifest's): sent without a login, it is the answer when the
        registry asks for none; a 401 names the scheme, and the caller sends it again with the
        login (the probe's checks and errors: no credentials, a refused login). Any other
        answer (a 404 too) is checked against /v2/ first, so a server that is no registry
        says so, as with the probe; then the request is sent again (None)."""
        try:
            r = self.session.request(
                method, url, headers=headers, stream=stream, verify=self.verify
            )
        except Exception as exc:  # noqa: BLE001 - every transport failure is one clear line
            raise self._unreachable(exc) from None
        if r.status_code == 401:
            r.close()
            self._authenticate(_scheme(r))
            return None
        if r.status_code != 200:
            r.close()
            self._authenticate(self._probe())  # raises for a server that is no registry
            return None
        self._authenticate(None)
        return r

    def _unreachable(self, exc: Exception) -> Exception:
        r = self._requests
        if isinstance(exc, r.exceptions.SSLError):
            return BadInput(
                f"{self.what}: TLS failed ({_short(exc)}): give its CA with --ca-file (or "
                f"{CA_ENV}); plain HTTP only with --insecure, for a loopback registry"
            )
        if isinstance(exc, r.exceptions.Timeout):
            return Unreachable(
                f"{self.what} did not answer within {self.timeout:g} s ({TIMEOUT_ENV}): "
                "nothing pulled or pushed"
            )
        return Unreachable(f"{self.what} is unreachable ({_short(exc)}): check the address")

    def request(
        self,
        method: str,
        url: str,
        *,
        data: Any = None,
        headers: dict[str, str] | None = None,
        stream: bool = False,
        ok: tuple[int, ...] = (200,),
        what: str = "",
    ) -> Any:
        """One request, authenticated as the registry asks; a failure is one line."""
        headers = dict(headers or {})
        first = None
        if self.client is None:  # no probe yet: only a request without a body goes first
            if data is not None:
                self._authenticate(self._probe())
            else:
                first = self._first(method, url, headers, stream)
        if self.basic:  # sent up front: a streamed body cannot be sent twice
            headers.update(self.client.auth.get_auth_header())
        try:
            r = first or self._once(
                self.client, url, method, data=data, headers=headers, stream=stream
            )
            if r.status_code == 401 and not self.basic and self.client.auth.token is not None:
                # A token of a narrower scope (pull, where a push needs pull,push): oras offers the
                # one it holds again; drop it so the challenge's scope gets a new one, once.
                self.client.auth.token = None
                if hasattr(data, "seek"):
                    data.seek(0)
                r = self._once(self.client, url, method, data=data, headers=headers, stream=stream)
        except ValueError as exc:  # oras: "Cannot respond to request for authentication."
            raise BadInput(
                f"{self.what} refused the login for {self.ref.repository} ({exc}): check the "
                "credentials in the docker config.json"
            ) from None
        except Exception as exc:  # noqa: BLE001 - every transport failure is one clear line
            raise self._unreachable(exc) from None
        if r.status_code in ok:
            return r
        if r.status_code in (401, 403):
            raise BadInput(
                f"{self.what} refused {what or method} for {self.ref.repository} "
                f"(HTTP {r.status_code}): check the credentials in the docker config.json"
            )
        if r.status_code == 404:
            raise NotFound(f"{self.ref}: {what or url} not found in the registry")
        raise Unreachable(
            f"{self.what}: {what or method} failed with HTTP {r.status_code} ({_errors(r)})"
        )

    # ----------------------------------------------------------------- reading

    def _read_small(self, r: Any, limit: int, what: str) -> bytes:
        body = b""
        try:
            for chunk in r.iter_content(64 << 10):
                body += chunk
                if len(body) > limit:
                    raise BadBundle(f"{self.ref}: {what} is larger than {format_size(limit)}")
        except self._requests.RequestException as exc:
            raise self._unreachable(exc) from None
        finally:
            r.close()
        return body

    def manifest(self, reference: str) -> tuple[bytes, str, str]:
        """A manifest or index by tag or digest: (bytes, media type, digest of the bytes)."""
        r = self.request(
            "GET",
            f"{self.base}/manifests/{reference}",
            headers={"Accept": f"{MANIFEST_TYPE}, {INDEX_TYPE}"},
            stream=True,
            what=f"manifest {reference}",
        )
        media_type = r.headers.get("Content-Type", "").split(";")[0].strip()
        body = self._read_small(r, _SMALL_MAX, f"manifest {reference}")
        digest = "sha256:" + hashlib.sha256(body).hexdigest()
        if reference.startswith("sha256:") and digest != reference:
            raise BadBundle(
                f"{self.ref}: manifest {reference} does not match its digest (tampered or "
                "damaged in the registry): nothing installed"
            )
        return body, media_type, digest

    def small_blob(self, descriptor: dict[str, Any], what: str) -> bytes:
        """A config or signature blob, verified against its descriptor's size and digest."""
        digest, size = str(descriptor.get("digest")), descriptor.get("size")
        if not _DIGEST.match(digest) or not isinstance(size, int) or not 0 <= size <= _SMALL_MAX:
            raise BadBundle(f"{self.ref}: bad {what} descriptor in the manifest")
        r = self.request("GET", f"{self.base}/blobs/{digest}", stream=True, what=what)
        body = self._read_small(r, size, what)
        if len(body) != size or "sha256:" + hashlib.sha256(body).hexdigest() != digest:
            raise BadBundle(
                f"{self.ref}: {what} {digest[:19]} does not match its digest (tampered or "
                "damaged in the registry): nothing installed"
            )
        return body

    def stream(self, digest: str, size: int) -> _Download:
        """The blob as it arrives, read while a thread downloads and hashes it (``_Download``)."""
        r = self.request("GET", f"{self.base}/blobs/{digest}", stream=True, what="the bundle blob")
        return _Download(self, r, digest, size)

    def tags(self) -> list[str]:
        r = self.request("GET", f"{self.base}/tags/list?n=1000", stream=True, what="tag list")
        try:
            data = json.loads(self._read_small(r, _SMALL_MAX, "tag list"))
        except ValueError as exc:
            raise BadBundle(f"{self.ref}: the tag list is not JSON ({exc})") from None
        return [str(t) for t in (data.get("tags") or []) if isinstance(t, str)]

    def referrers(self, digest: str, artifact_type: str) -> list[dict[str, Any]]:
        """Descriptors of the artifacts that refer to ``digest``: the referrers API, else the
        referrers tag schema (``sha256-<hex>``), else none. Those listed as ``artifact_type``
        come first, then those listed with the empty config's media type or none: an artifact's
        type is its manifest's ``artifactType`` (OCI distribution 1.1), but go-containerregistry's
        registry lists its config's media type, the empty descriptor's for an artifact like a
        signature. The caller checks each manifest's own ``artifactType``."""
        try:
            listed = self._referrers_api(digest, artifact_type)
        except NotFound:
            try:
                body, _, _ = self.manifest(_fallback_tag(digest))
            except NotFound:
                return []
            listed = _listed(self.referrers_index(body, digest))
        return [d for d in listed if d.get("artifactType") == artifact_type] + [
            d for d in listed if d.get("artifactType") in (None, EMPTY_TYPE)
        ]

    def referrers_index(self, body: bytes, digest: str) -> dict[str, Any]:
        """A listing of ``digest``'s referrers (an API page, or the tag schema's index) as a
        JSON object; BadBundle, one line, for anything else."""
        try:
            index = json.loads(body)
        except ValueError as exc:
            index = exc
        if not isinstance(index, dict):
            what = index if isinstance(index, ValueError) else f"a JSON {type(index).__name__}"
            raise BadBundle(
                f"{self.ref}: the referrers of {digest[:19]} are not a JSON index ({what})"
            )
        return index

    def _referrers_api(self, digest: str, artifact_type: str) -> list[dict[str, Any]]:
        """The referrers API's listing, its pages followed (a registry may paginate it, with a
        ``Link: <...>; rel="next"`` header) up to ``_CANDIDATES_MAX`` descriptors or
        ``_REFERRER_PAGES_MAX`` pages, and only on this registry: a link elsewhere is not
        followed, as no login goes to another host. NotFound: the registry has no API."""
        url = f"{self.base}/referrers/{digest}?artifactType={artifact_type}"
        origin = urllib.parse.urlsplit(self.base)[:2]
        listed: list[dict[str, Any]] = []
        for page in range(_REFERRER_PAGES_MAX):
            try:
                r = self.request("GET", url, stream=True, what="referrers")
            except NotFound:
                if page == 0:
                    raise
                break  # a page gone since the one before named it: what was listed stands
            following = r.links.get("next", {}).get("url")
            body = self._read_small(r, _SMALL_MAX, "referrers")
            listed += _listed(self.referrers_index(body, digest))
            if not following or len(listed) >= _CANDIDATES_MAX:
                break
            url = urllib.parse.urljoin(url, following)
            if urllib.parse.urlsplit(url)[:2] != origin:
                break
        return listed

    # ----------------------------------------------------------------- writing

    def has_blob(self, digest: str) -> bool:
        try:
            self.request("HEAD", f"{self.base}/blobs/{digest}", what="blob check")
        except NotFound:
            return False
        return True

    def put_blob(self, digest: str, size: int, source: Path | bytes) -> int:
        """Upload a blob unless the registry holds it: POST, then one PUT (monolithic, streamed
        from the file). Returns the bytes sent."""
        if self.has_blob(digest):
            return 0
        r = self.request(
            "POST",
            f"{self.base}/blobs/uploads/",
            headers={"Content-Length": "0"},
            ok=(202,),
            what="blob upload",
        )
        location = r.headers.get("Location", "")
        if not location:
            raise Unreachable(f"{self.what} started an upload without a Location")
        if location.startswith("/"):
            location = f"{self.prefix}://{self.ref.registry}{location}"
        url = location + ("&" if "?" in location else "?") + f"digest={digest}"
        headers = {"Content-Type": "application/octet-stream", "Content-Length": str(size)}
        if isinstance(source, bytes):
            self.request("PUT", url, data=source, headers=headers, ok=(201,), what="blob upload")
        else:
            with open(source, "rb") as fh:
                self.request("PUT", url, data=fh, headers=headers, ok=(201,), what="blob upload")
        return size

    def put_manifest(self, reference: str, body: bytes, media_type: str) -> Any:
        return self.request(
            "PUT",
            f"{self.base}/manifests/{reference}",
            data=body,
            headers={"Content-Type": media_type},
            ok=(201,),
            what=f"manifest {reference}",
        )


_QUEUED = 32  # chunks of 1 MiB read off the socket but not yet by install: its memory bound


class _Download:
    """A blob's bytes, read by install while a thread takes them off the socket and hashes them:
    the download and the install overlap (the socket's reads, the hash and zstd release the
    GIL). Never more than ``size`` bytes are taken; ``finish`` waits for the last and raises
    unless the whole blob matches its digest, so install publishes nothing before that."""

    def __init__(self, registry: Registry, response: Any, digest: str, size: int) -> None:
        self.size = size
        self._registry, self._response, self._digest = registry, response, digest
        self._chunks: queue.Queue[bytes | None] = queue.Queue(_QUEUED)  # None: the end
        self._buf, self._at = b"", 0
        self._ended = False
        self._error: Exception | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._pump, name="cachectl-pull", daemon=True)
        self._thread.start()

    def _put(self, chunk: bytes | None) -> bool:
        while not self._stop.is_set():
            try:
                self._chunks.put(chunk, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def _pump(self) -> None:
        import urllib3

        h, got, ref = hashlib.sha256(), 0, self._registry.ref
        raw, requests = self._response.raw, self._registry._requests
        try:
            # What has arrived, up to 1 MiB (iter_content waits for a whole chunk); an urllib3
            # before 2.1 has no read1: 64 KiB at a time.
            read1 = getattr(raw, "read1", None)
            while chunk := (
                read1(1 << 20, decode_content=True)
                if read1
                else raw.read(64 << 10, decode_content=True)
            ):
                got += len(chunk)
                if got > self.size:
                    raise BadBundle(
                        f"{ref}: the bundle blob is longer than its manifest says "
                        f"({self.size} bytes; tampered or damaged in the registry): nothing "
                        "installed"
                    )
                h.update(chunk)
                if not self._put(chunk):
                    return
            if got != self.size or "sha256:" + h.hexdigest() != self._digest:
                raise BadBundle(
                    f"{ref}: the bundle blob does not match its digest {self._digest[:19]} "
                    "(tampered or damaged in the registry): nothing installed"
                )
        except urllib3.exceptions.ReadTimeoutError as exc:
            self._error = self._registry._unreachable(requests.exceptions.ReadTimeout(exc))
        except (urllib3.exceptions.HTTPError, OSError) as exc:
            self._error = self._registry._unreachable(requests.exceptions.ConnectionError(exc))
        except Exception as exc:  # noqa: BLE001 - raised in the reading thread
            self._error = exc
        finally:
            self._response.close()
            self._put(None)  # after _error is set: the reader sees both

    def _next(self) -> bool:
        """The next chunk into the buffer; False at the end (raising the download's error)."""
        if not self._ended:
            chunk = self._chunks.get()
            if chunk is None:
                self._ended = True
            else:
                self._buf, self._at = chunk, 0
                return True
        if self._error is not None:
            raise self._error
        return False

    def read(self, n: int = -1) -> bytes:
        if self._at >= len(self._buf) and not self._next():
            return b""
        if n is None or n < 0:
            n = len(self._buf) - self._at
        data = self._buf[self._at : self._at + n]
        self._at += len(data)
        return data

    def peek(self, n: int = 0) -> bytes:
        if self._at >= len(self._buf) and not self._next():
            return b""
        return self._buf[self._at :]

    def finish(self) -> None:
        """Read to the end (what install did not need of it too), then the download's verdict."""
        self._buf, self._at = b"", 0
        while self._next():
            self._buf, self._at = b"", 0

    def stop(self) -> None:
        """Stop the download (an install that ended without reading it all). A thread still in
        a socket read ends at its timeout (a daemon: it never holds the process up); after
        ``finish`` it has ended already."""
        self._stop.set()
        self._thread.join(timeout=1)


def _scheme(r: Any) -> str:
    """A 401's challenge: "bearer" (a token service) or "basic"."""
    header = r.headers.get("Www-Authenticate", "")
    return "bearer" if header.lower().startswith("bearer") else "basic"


def _short(exc: BaseException) -> str:
    text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    m = re.search(r"\[Errno -?\d+\] ([^'\")]+)|Caused by \w+\('?([^'\")]+)", text)
    text = next((g for g in (m.groups() if m else ()) if g), text)
    return text[:160]


def _errors(r: Any) -> str:
    try:
        return "; ".join(str(e.get("message")) for e in r.json().get("errors", []))[:200]
    except Exception:  # noqa: BLE001 - the body is only shown
        return r.reason or ""


def _fallback_tag(digest: str) -> str:
    return digest.replace(":", "-")


def _descriptor(
    media_type: str, body_or_digest: bytes | str, size: int | None = None
) -> dict[str, Any]:
    if isinstance(body_or_digest, bytes):
        return {
            "mediaType": media_type,
            "digest": "sha256:" + hashlib.sha256(body_or_digest).hexdigest(),
            "size": len(body_or_digest),
        }
    return {"mediaType": media_type, "digest": body_or_digest, "size": size}


def _json(obj: Any) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()


def _file_digest(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(1 << 20):
            h.update(chunk)
    return "sha256:" + h.hexdigest()


# --------------------------------------------------------------------------- push


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
        layer_digest, layer_size = _file_digest(path), path.stat().st_size
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
        config = _json(summary)
        annotations = {
            A + "environment": info.digest,
            A + "namespace": info.namespace,
            A + "entries": str(len(info.entries)),
            A + "bytes": str(info.content_bytes),
            "org.opencontainers.image.created": info.created_at
            or datetime.now(UTC).isoformat(timespec="seconds"),
        }
        for name, label in _ANNOTATED.items():
            if name in environment:
                annotations[A + label] = str(environment[name])
        if loaded is not None:
            annotations[A + "manifest-digest"] = "sha256:" + str(summary["manifest_digest"])
        uploaded = registry.put_blob(layer_digest, layer_size, path)
    uploaded += registry.put_blob(_descriptor(CONFIG_TYPE, config)["digest"], len(config), config)
    body = _json(
        {
            "schemaVersion": 2,
            "mediaType": MANIFEST_TYPE,
            "artifactType": ARTIFACT_TYPE,
            "config": _descriptor(CONFIG_TYPE, config),
            "layers": [
                {
                    **_descriptor(LAYER_TYPE, layer_digest, layer_size),
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


def _push_signature(
    registry: Registry, key: signing.SigningKey, digest: str, size: int, environment: str
) -> tuple[str, str]:
    """The bundle manifest's digest signed, pushed as an artifact whose subject is the bundle;
    where the registry has no referrers API, listed in the ``sha256-<hex>`` index too."""
    signed = _json(
        signing.sign(
            key, {"format": SIGNATURE_FORMAT, "manifest": digest, "environment": environment}
        )
    )
    registry.put_blob(_descriptor(EMPTY_TYPE, EMPTY)["digest"], len(EMPTY), EMPTY)
    registry.put_blob(_descriptor(SIGNATURE_TYPE, signed)["digest"], len(signed), signed)
    created = datetime.now(UTC).isoformat(timespec="seconds")
    body = _json(
        {
            "schemaVersion": 2,
            "mediaType": MANIFEST_TYPE,
            "artifactType": SIGNATURE_TYPE,
            "config": _descriptor(EMPTY_TYPE, EMPTY),
            "layers": [_descriptor(SIGNATURE_TYPE, signed)],
            "subject": _descriptor(MANIFEST_TYPE, digest, size),
            "annotations": {A + "key-id": key.key_id, "org.opencontainers.image.created": created},
        }
    )
    sig_digest = "sha256:" + hashlib.sha256(body).hexdigest()
    r = registry.put_manifest(sig_digest, body, MANIFEST_TYPE)
    if r.headers.get("OCI-Subject") == digest:
        return sig_digest, "api"
    # The referrers tag schema: an index at sha256-<hex> listing what refers to the digest.
    tag = _fallback_tag(digest)
    try:
        existing, _, _ = registry.manifest(tag)
        index = registry.referrers_index(existing, digest)
    except NotFound:
        index = {"schemaVersion": 2, "mediaType": INDEX_TYPE, "manifests": []}
    entry = {
        **_descriptor(MANIFEST_TYPE, sig_digest, len(body)),
        "artifactType": SIGNATURE_TYPE,
        "annotations": {A + "key-id": key.key_id},
    }
    manifests = [m for m in _listed(index) if m.get("digest") != sig_digest]
    index["manifests"] = [*manifests, entry]
    registry.put_manifest(tag, _json(index), INDEX_TYPE)
    return sig_digest, "tag-schema"


def _listed(index: dict[str, Any]) -> list[dict[str, Any]]:
    """The descriptors a referrers listing holds (anything else in its list is left out)."""
    manifests = index.get("manifests")
    return [d for d in manifests if isinstance(d, dict)] if isinstance(manifests, list) else []


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
    try:
        m = json.loads(body)
    except ValueError as exc:
        raise BadBundle(f"{ref}: its manifest is not JSON ({exc})") from None
    if not isinstance(m, dict) or (media_type or m.get("mediaType")) != MANIFEST_TYPE:
        raise BadBundle(f"{ref}: {reference} is not an artifact manifest (a {media_type or '?'})")
    config = m.get("config") or {}
    if m.get("artifactType") != ARTIFACT_TYPE and config.get("mediaType") != CONFIG_TYPE:
        raise BadBundle(f"{ref}: {reference} is not a cachectl bundle ({m.get('artifactType')})")
    layers = m.get("layers") or []
    if len(layers) != 1 or layers[0].get("mediaType") != LAYER_TYPE:
        raise BadBundle(f"{ref}: a cachectl bundle artifact has exactly one {LAYER_TYPE} layer")
    layer_digest, layer_size = str(layers[0].get("digest")), layers[0].get("size")
    if not _DIGEST.match(layer_digest) or not isinstance(layer_size, int) or layer_size < 0:
        raise BadBundle(f"{ref}: bad layer descriptor in {reference}")
    notes = m.get("annotations") or {}
    if not isinstance(notes, dict):
        notes = {}
    noted_bytes = _count(notes.get(A + "bytes"))
    if (
        here is not None
        and notes.get(A + "environment") == here.digest
        and notes.get(A + "namespace") == here.namespace
        and noted_bytes is not None
    ):
        return _Artifact(
            digest, tag, layer_digest, layer_size, here.to_dict(), here.digest, noted_bytes
        )
    try:
        summary = json.loads(registry.small_blob(config, "config"))
        environment = dict(summary["environment"])
        env = Environment.from_dict(environment)
        content_bytes = int(summary["bytes"])
    except (ValueError, TypeError, KeyError) as exc:
        raise BadBundle(f"{ref}: bad config in {reference} ({exc})") from None
    noted = notes.get(A + "environment")
    if (
        summary.get("format") != CONFIG_FORMAT
        or env.digest != summary.get("digest")
        or (noted is not None and noted != env.digest)
    ):
        raise BadBundle(
            f"{ref}: {reference}'s environment does not match its digest or annotations"
        )
    return _Artifact(digest, tag, layer_digest, layer_size, environment, env.digest, content_bytes)


def _count(text: Any) -> int | None:
    """A byte count as an annotation writes it (decimal digits), else None."""
    return int(text) if isinstance(text, str) and text.isascii() and text.isdigit() else None


def _closest(registry: Registry, here: Environment) -> EnvironmentMismatch | NotFound:
    """No env tag for this machine: the error naming the fields that differ in the closest
    bundle the repository holds (read from manifests and configs only)."""
    try:
        tags = sorted(t for t in registry.tags() if t.startswith(ENV_TAG_PREFIX))
    except NotFound:
        tags = []
    best: tuple[int, str, list[str]] | None = None
    for tag in tags[:_CANDIDATES_MAX]:
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
    for d in registry.referrers(art.digest, SIGNATURE_TYPE)[:_CANDIDATES_MAX]:
        try:
            if not _DIGEST.match(str(d.get("digest"))):  # read by digest only, so it is checked
                raise signing.Untrusted(f"{what}: a referrer without a sha256 digest")
            body, _, _ = registry.manifest(str(d.get("digest")))
            m = json.loads(body)
            if m.get("artifactType") != SIGNATURE_TYPE:
                continue  # another kind of artifact, listed under its config's media type
            if (m.get("subject") or {}).get("digest") != art.digest:
                raise signing.Untrusted(f"{what}: a signature refers to another artifact")
            layer = (m.get("layers") or [{}])[0]
            signed = json.loads(registry.small_blob(layer, "signature"))
            content = signing.verify(signed, cache.trusted_keys, what)
            if content.get("format") != SIGNATURE_FORMAT or content.get("manifest") != art.digest:
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
        if store.is_local:
            with contextlib.suppress(OSError):  # only when empty: another install may be staging
                os.rmdir(staging.parent)
    return PullResult(
        str(ref), art.digest, tag, art.env_digest, got, signer, result, time.monotonic() - started
    )
