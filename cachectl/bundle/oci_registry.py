"""One repository of one registry: oras's auth (basic, or a bearer token from the registry's
token service) over the session of ``oci_transport`` (credentials only to the registry, every
request whole within ``CACHECTL_OCI_TIMEOUT``), each request tried once, each failure one line."""

from __future__ import annotations

import hashlib
import os
import urllib.parse
from pathlib import Path
from typing import Any

from cachectl.bundle.format import BadBundle
from cachectl.bundle.oci_artifact import (
    CANDIDATES_MAX,
    EMPTY_TYPE,
    INDEX_TYPE,
    MANIFEST_TYPE,
    REFERRER_PAGES_MAX,
    SMALL_MAX,
    Reference,
    as_list,
    as_object,
    descriptor,
    fallback_tag,
    kind_of,
    listed,
    load_json,
)
from cachectl.bundle.oci_download import Download
from cachectl.bundle.oci_login import config_hosts, docker_configs, helper_for, run_helper
from cachectl.bundle.oci_transport import (
    CA_ENV,
    TIMEOUT_ENV,
    RegistrySession,
    read_limited,
    realm_refusal,
    short,
    timeout_setting,
)
from cachectl.core.errors import BadInput, CachectlError, NotFound, Unreachable
from cachectl.core.units import format_size


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
        self.timeout = timeout_setting()
        self._requests = requests
        self.verify: bool | str = ca if ca is not None else True
        self.insecure = insecure
        self.prefix = "http" if insecure else "https"
        self.base = f"{self.prefix}://{ref.registry}/v2/{ref.repository}"
        self.session = RegistrySession(self.base, self.timeout)
        # oras retries every failure for minutes (3 + 3**n s); each request here is tried once.
        self._once = oras.provider.Registry.do_request.__wrapped__
        self.basic = False
        self.client: Any = None  # oras's Registry, once the auth the registry asks for is known
        if probe:
            self._authenticate(self._probe())

    def close(self) -> None:
        """Every connection given back, an open response's too (one an error left unread)."""
        self.session.close()

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
            helper = helper_for(ref.registry)
            login = helper and run_helper(*helper, ref.registry, self.timeout)
            if login:  # run here, bounded, its failures one line (oras would log and go on)
                self.client.auth.set_basic_auth(*login)
            elif helper is None:
                container = oras.container.Container(f"{ref.registry}/{ref.repository}")
                self.client.auth.load_configs(container, configs=docker_configs())
            if scheme == "bearer":
                self._guard_realm(self.client.auth)
            if not getattr(self.client.auth, "_basic_auth", None) and scheme == "basic":
                raise BadInput(
                    f"{self.what} asks for a login and no credentials for it were found: add "
                    f"them to the docker config.json ($DOCKER_CONFIG or ~/.docker; `docker login "
                    f"{ref.registry}` or `oras login` writes it, credential helpers are used)"
                )

    def _guard_realm(self, auth: Any) -> None:
        """The login goes to the token service the challenge names only where
        ``realm_refusal`` allows it; elsewhere the pull or push stops, one line."""
        request_token = auth.request_token

        def checked(h: Any) -> Any:
            realm = str(h.realm or "")
            if realm and not realm.startswith("http"):
                realm = h.realm = f"{self.prefix}://{realm}"
            if getattr(auth, "_basic_auth", None):
                why = realm_refusal(realm, self.ref.registry, self.insecure, config_hosts())
                if why is not None:
                    raise BadInput(
                        f"{self.what} sends its login to a token service at {realm.split('?')[0]} "
                        f"{why}: refused, nothing sent there (a login goes only over https, to "
                        "the registry's host or one the docker config names)"
                    )
                self.session.allow_realm(realm)
            return request_token(h)

        auth.request_token = checked

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
                f"{self.what}: TLS failed ({short(exc)}): give its CA with --ca-file (or "
                f"{CA_ENV}); plain HTTP only with --insecure, for a loopback registry"
            )
        if isinstance(exc, r.exceptions.Timeout):
            return Unreachable(
                f"{self.what} did not answer within {self.timeout:g} s ({TIMEOUT_ENV}, each "
                "request whole, its body included): nothing pulled or pushed"
            )
        return Unreachable(f"{self.what} is unreachable ({short(exc)}): check the address")

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
        except CachectlError:
            raise
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
        """A small body whole, refused past ``limit`` (at most one byte more is read)."""
        declared = r.headers.get("Content-Length", "")
        if declared.isascii() and declared.isdigit() and int(declared[:19]) > limit:
            r.close()
            raise BadBundle(f"{self.ref}: {what} is larger than {format_size(limit)}")
        try:
            body = read_limited(r, limit)
        except self._requests.RequestException as exc:
            raise self._unreachable(exc) from None
        if len(body) > limit:
            raise BadBundle(f"{self.ref}: {what} is larger than {format_size(limit)}")
        return body

    def manifest(self, reference: str, size: int | None = None) -> tuple[bytes, str, str]:
        """A manifest or index by tag or digest (``size``: what its descriptor declares): (bytes,
        media type, digest of the bytes). Over 4 MiB, or its declared size, it is refused."""
        r = self.request(
            "GET",
            f"{self.base}/manifests/{reference}",
            headers={"Accept": f"{MANIFEST_TYPE}, {INDEX_TYPE}"},
            stream=True,
            what=f"manifest {reference}",
        )
        media_type = r.headers.get("Content-Type", "").split(";")[0].strip()
        limit = SMALL_MAX if size is None else min(size, SMALL_MAX)
        body = self._read_small(r, limit, f"manifest {reference}")
        digest = "sha256:" + hashlib.sha256(body).hexdigest()
        if reference.startswith("sha256:") and digest != reference:
            raise BadBundle(
                f"{self.ref}: manifest {reference} does not match its digest (tampered or "
                "damaged in the registry): nothing installed"
            )
        return body, media_type, digest

    def small_blob(self, described: Any, what: str) -> bytes:
        """A config or signature blob, verified against its descriptor's size and digest."""
        digest, size = descriptor(described, f"{self.ref}: the {what} descriptor", SMALL_MAX)
        r = self.request("GET", f"{self.base}/blobs/{digest}", stream=True, what=what)
        body = self._read_small(r, size, what)
        if len(body) != size or "sha256:" + hashlib.sha256(body).hexdigest() != digest:
            raise BadBundle(
                f"{self.ref}: {what} {digest[:19]} does not match its digest (tampered or "
                "damaged in the registry): nothing installed"
            )
        return body

    def stream(self, digest: str, size: int) -> Download:
        """The blob as it arrives, read while a thread downloads and hashes it (``Download``)."""
        r = self.request("GET", f"{self.base}/blobs/{digest}", stream=True, what="the bundle blob")
        return Download(self.ref, r, digest, size, self._unreachable)

    def tags(self) -> list[str]:
        r = self.request("GET", f"{self.base}/tags/list?n=1000", stream=True, what="tag list")
        body = self._read_small(r, SMALL_MAX, "tag list")
        data = as_object(load_json(body, f"{self.ref}: the tag list"), f"{self.ref}: the tag list")
        tags = data.get("tags")
        return [t for t in tags if isinstance(t, str)] if isinstance(tags, list) else []

    def referrers(self, digest: str, artifact_type: str) -> list[dict[str, Any]]:
        """Descriptors of the artifacts that refer to ``digest``: the referrers API, else the
        referrers tag schema (``sha256-<hex>``), else none. Those listed as ``artifact_type``
        come first, then those listed with the empty config's media type or none: an artifact's
        type is its manifest's ``artifactType`` (OCI distribution 1.1), but go-containerregistry's
        registry lists its config's media type, the empty descriptor's for an artifact like a
        signature. The caller checks each manifest's own ``artifactType``."""
        try:
            found = self._referrers_api(digest, artifact_type)
        except NotFound:
            try:
                body, _, _ = self.manifest(fallback_tag(digest))
            except NotFound:
                return []
            found = listed(self.referrers_index(body, digest))
        return [d for d in found if d.get("artifactType") == artifact_type] + [
            d for d in found if d.get("artifactType") in (None, EMPTY_TYPE)
        ]

    def referrers_index(self, body: bytes, digest: str) -> dict[str, Any]:
        """A listing of ``digest``'s referrers (an API page, or the tag schema's index) as a
        JSON object; BadBundle, one line, for anything else."""
        what = f"{self.ref}: the referrers of {digest[:19]}"
        index = load_json(body, what)
        if not isinstance(index, dict):
            raise BadBundle(f"{what} are not a JSON index (a JSON {kind_of(index)})")
        return index

    def _referrers_api(self, digest: str, artifact_type: str) -> list[dict[str, Any]]:
        """The referrers API's listing, its pages followed (a registry may paginate it, with a
        ``Link: <...>; rel="next"`` header) up to ``CANDIDATES_MAX`` descriptors or
        ``REFERRER_PAGES_MAX`` pages, and only on this registry: a link elsewhere is not
        followed, as no login goes to another host. NotFound: the registry has no API."""
        url = f"{self.base}/referrers/{digest}?artifactType={artifact_type}"
        origin = urllib.parse.urlsplit(self.base)[:2]
        found: list[dict[str, Any]] = []
        for page in range(REFERRER_PAGES_MAX):
            try:
                r = self.request("GET", url, stream=True, what="referrers")
            except NotFound:
                if page == 0:
                    raise
                break  # a page gone since the one before named it: what was listed stands
            following = r.links.get("next", {}).get("url")
            body = self._read_small(r, SMALL_MAX, "referrers")
            found += listed(self.referrers_index(body, digest))
            if not following or len(found) >= CANDIDATES_MAX:
                break
            url = urllib.parse.urljoin(url, following)
            if urllib.parse.urlsplit(url)[:2] != origin:
                break
        return found

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


def _scheme(r: Any) -> str:
    """A 401's challenge: "bearer" (a token service) or "basic"."""
    header = r.headers.get("Www-Authenticate", "")
    return "bearer" if header.lower().startswith("bearer") else "basic"


def _errors(r: Any) -> str:
    """The messages of an error answer (its first 64 KiB read), else its reason."""
    try:
        body = r.content if r.raw is None or r._content_consumed else read_limited(r, 64 << 10)
        errors = as_list(as_object(load_json(body, "errors"), "errors").get("errors"), "errors")
        return "; ".join(str(as_object(e, "error").get("message")) for e in errors)[:200]
    except Exception:  # noqa: BLE001 - the body is only shown
        return r.reason or ""
