"""A signature found through the OCI referrers API, against a registry that serves it.

Debian's docker-registry (distribution 2.8, tests/test_oci.py) has no referrers API, so there the
client's fallback, the referrers tag schema, is what finds a signature. This registry is
go-containerregistry's (tests/registries/ggcr, built by scripts/test; in memory, plain HTTP on
loopback) with its referrers API on. It answers a manifest with a subject without the
``OCI-Subject`` header, so a push writes the tag schema's index too; the tests remove that index
before pulling, so only the API can name the signature. It lists each referrer under its config's
media type (the empty descriptor's, for a signature and for the other artifacts the tests make
refer to the bundle), not under the manifest's ``artifactType`` as OCI distribution 1.1 says.

Every test runs twice: against the registry answering the listing at once, and with
``-referrers-page 1`` (the command's ``paged.go``): one referrer a page, newest push first, each
page linking the next, as OCI distribution 1.1 lets a registry paginate it. The signature, pushed
before the other referrers, is then on the last page. Two tests start their own: one whose next
page is named on another host (not followed), one that answers a pushed referrer with
``OCI-Subject`` (the push writes no tag schema index).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urljoin

import pytest
import requests
from support.bundles import assert_nothing_installed, environments
from support.registry import put_blob
from support.warming import invoke, tiny

BINARY = os.environ.get("CACHECTL_TEST_REFERRERS_REGISTRY")
NO_REGISTRY = os.environ.get("CACHECTL_TEST_NO_REGISTRY") == "1"
XDG = ("XDG_DATA_HOME", "XDG_CACHE_HOME", "XDG_CONFIG_HOME", "XDG_STATE_HOME")
SIGNATURE_TYPE = "application/vnd.cachectl.bundle.signature.v1+json"
INDEX_TYPE = "application/vnd.oci.image.index.v1+json"
EMPTY_TYPE = "application/vnd.oci.empty.v1+json"
MANIFEST_TYPE = "application/vnd.oci.image.manifest.v1+json"
REPO = "rr/cache"


def _binary() -> str:
    if BINARY and os.access(BINARY, os.X_OK):
        return BINARY
    if NO_REGISTRY:
        pytest.skip("OCI registry tests skipped: CACHECTL_TEST_NO_REGISTRY=1")
    pytest.fail(
        "CACHECTL_TEST_REFERRERS_REGISTRY does not name an executable: run the tests through "
        "scripts/test, which builds tests/registries/ggcr, or set CACHECTL_TEST_NO_REGISTRY=1",
        pytrace=False,
    )


@contextlib.contextmanager
def _started(log: Path, *args: str) -> Iterator[str]:
    """The referrers registry on a free loopback port (HOST:PORT), with ``args``, logging its
    requests to ``log``."""
    proc = subprocess.Popen(
        [_binary(), "-addr", "127.0.0.1:0", "-log", str(log), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.startswith("listening on "), line
        url = line.split()[-1]
        assert requests.get(f"http://{url}/v2/", timeout=5).status_code == 200
        yield url
    finally:
        proc.kill()
        proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()


@pytest.fixture(scope="module", params=[0, 1], ids=["one-answer", "paged"])
def registry(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, Any]]:
    """The referrers registry, its request log, and how many referrers it lists a page (0: all
    in one answer)."""
    page: int = request.param
    log = tmp_path_factory.mktemp("referrers-registry") / "requests.log"
    with _started(log, *(["-referrers-page", str(page)] if page else [])) as url:
        yield {"url": url, "log": log, "page": page}


@pytest.fixture(scope="module")
def pushed(registry: dict[str, Any], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The tiny manifest warmed and pushed signed to ``registry``, as ``_push_signed`` does."""
    pushed = _push_signed(registry["url"], tmp_path_factory.mktemp("referrers-source"))
    return {**pushed, "page": registry["page"]}


def _push_signed(url: str, base: Path, *, oci_subject: bool = False) -> dict[str, Any]:
    """The tiny manifest warmed for real in its own home under ``base`` and pushed signed; then
    the tag schema's index removed from the registry, so a signature is found through the
    referrers API or not at all; then three other artifacts made to refer to the bundle.
    ``oci_subject``: the registry answers OCI-Subject (``-oci-subject``), so the push writes no
    tag schema index at all."""
    manifest = tiny(base)
    home = {v: str(base / v.split("_")[1].lower()) for v in XDG}
    key, other = base / "signer.key", base / "other.key"
    with pytest.MonkeyPatch.context() as mp:
        for k, v in home.items():
            Path(v).mkdir(parents=True, exist_ok=True)
            mp.setenv(k, v)
        invoke("warm", str(manifest))
        invoke("key", "generate", str(key))
        invoke("key", "generate", str(other))
        result = json.loads(
            invoke(
                "bundle",
                "push",
                f"oci://{url}/{REPO}:v1",
                "--manifest",
                str(manifest),
                "--sign-key",
                str(key),
                "--insecure",
                "--json",
            ).stdout
        )
    fallback = result["digest"].replace(":", "-")
    if oci_subject:  # the registry said it keeps the referrer: no index at the fallback tag
        assert result["referrers"] == "api", result
    else:
        # The registry answered the signature's manifest without OCI-Subject: the push listed it
        # in the tag schema's index as well. Removed here, so a pull cannot find it there.
        assert result["referrers"] == "tag-schema", result
        r = requests.delete(f"http://{url}/v2/{REPO}/manifests/{fallback}", timeout=5)
        assert r.status_code == 202, (r.status_code, r.text)
    gone = requests.get(
        f"http://{url}/v2/{REPO}/manifests/{fallback}", headers={"Accept": INDEX_TYPE}, timeout=5
    )
    assert gone.status_code == 404
    # Other artifacts refer to the bundle too (an SBOM, say): listed beside the signature, and
    # under the same media type by this registry.
    for i in range(3):
        _refer(url, result["digest"], i)
    return {
        **result,
        "url": url,
        "pub": Path(str(key) + ".pub"),
        "other_pub": Path(str(other) + ".pub"),
    }


def _listing(url: str, digest: str) -> tuple[int, list[dict[str, Any]]]:
    """The referrers API's whole listing, its pages followed: (pages, descriptors in order)."""
    pages, listed = 0, []
    at: str | None = f"http://{url}/v2/{REPO}/referrers/{digest}"
    while at is not None:
        r = requests.get(at, timeout=5)
        assert r.status_code == 200, r.text
        pages += 1
        listed += r.json()["manifests"]
        following = r.links.get("next", {}).get("url")
        at = urljoin(at, following) if following else None
    return pages, listed


def _blob(url: str, media_type: str, body: bytes) -> dict[str, Any]:
    return {"mediaType": media_type, "digest": put_blob(url, REPO, body), "size": len(body)}


def _refer(url: str, subject: str, i: int) -> None:
    """Another artifact (not a signature) whose subject is the bundle's manifest."""
    bundle = requests.get(
        f"http://{url}/v2/{REPO}/manifests/{subject}", headers={"Accept": MANIFEST_TYPE}, timeout=5
    )
    body = json.dumps(
        {
            "schemaVersion": 2,
            "mediaType": MANIFEST_TYPE,
            "artifactType": "application/vnd.example.sbom.v1+json",
            "config": _blob(url, EMPTY_TYPE, b"{}"),
            "layers": [_blob(url, "application/json", json.dumps({"sbom": i}).encode())],
            "subject": {"mediaType": MANIFEST_TYPE, "digest": subject, "size": len(bundle.content)},
        }
    ).encode()
    digest = "sha256:" + hashlib.sha256(body).hexdigest()
    r = requests.put(
        f"http://{url}/v2/{REPO}/manifests/{digest}",
        data=body,
        headers={"Content-Type": MANIFEST_TYPE},
        timeout=5,
    )
    assert r.status_code == 201, (r.status_code, r.text)


def test_the_registry_lists_the_signature_under_its_config_media_type(
    pushed: dict[str, Any],
) -> None:
    """What the client must cope with: this registry lists a referrer's config media type as its
    artifactType (the empty descriptor's, for a signature), not the manifest's artifactType."""
    url, digest = pushed["url"], pushed["digest"]
    pages, order = _listing(url, digest)
    listed = {d["digest"]: d["artifactType"] for d in order}
    assert len(listed) == 4 and set(listed.values()) == {EMPTY_TYPE}
    assert pushed["signature"] in listed
    if pushed["page"]:  # one a page, newest first: the signature, pushed first, comes last
        assert pages == 4 and order[-1]["digest"] == pushed["signature"], (pages, order)
    else:
        assert pages == 1
    manifest = requests.get(
        f"http://{url}/v2/{REPO}/manifests/{pushed['signature']}",
        headers={"Accept": MANIFEST_TYPE},
        timeout=5,
    ).json()
    assert manifest["artifactType"] == SIGNATURE_TYPE
    assert manifest["subject"]["digest"] == digest


def test_a_pull_verifies_a_signature_found_only_through_the_referrers_api(
    pushed: dict[str, Any], registry: dict[str, Any]
) -> None:
    invoke("cache", "set", "default", "--trust", str(pushed["pub"]))
    before = registry["log"].read_text()
    done = json.loads(
        invoke("bundle", "pull", f"oci://{pushed['url']}/{REPO}:v1", "--insecure", "--json").stdout
    )
    assert done["signature_verified_by"] == pushed["signed_by"]
    assert done["install"]["installed"] == 5 and done["install"]["signed_by"] == pushed["signed_by"]
    asked = registry["log"].read_text()[len(before) :]
    assert f"/v2/{REPO}/referrers/{pushed['digest']}" in asked, asked
    # Paged: the client followed each page's link to the last, where the signature is.
    assert asked.count("cursor=") == (3 if registry["page"] else 0), asked
    assert len(environments()) == 1


def test_a_signature_through_the_referrers_api_by_an_untrusted_key_is_refused(
    pushed: dict[str, Any],
) -> None:
    invoke("cache", "set", "default", "--trust", str(pushed["other_pub"]))
    refused = invoke("bundle", "pull", f"oci://{pushed['url']}/{REPO}:v1", "--insecure", code=2)
    # The signature was found (through the API) and its key named: not "has no signature".
    assert "which the cache does not trust" in refused.stderr, refused.stderr
    assert "nothing downloaded" in refused.stderr, refused.stderr
    assert refused.stderr.count("\n") == 1 and "Traceback" not in refused.stderr
    root = Path(os.environ["XDG_CACHE_HOME"]) / "cachectl" / "default"
    assert not root.exists() or not [p for p in root.rglob("*") if p.is_file()]
    assert_nothing_installed()


def test_a_pull_for_this_machine_verifies_its_signature_through_the_referrers_api(
    pushed: dict[str, Any],
) -> None:
    """The same through the environment's own tag (``env-<digest>``), which the push wrote too."""
    invoke("cache", "set", "default", "--trust", str(pushed["pub"]))
    done = json.loads(
        invoke(
            "bundle",
            "pull",
            f"oci://{pushed['url']}/{REPO}",
            "--for-this-machine",
            "--insecure",
            "--json",
        ).stdout
    )
    assert done["tag"].startswith("env-") and done["digest"] == pushed["digest"]
    assert done["signature_verified_by"] == pushed["signed_by"]
    assert done["install"]["installed"] == 5


def test_a_next_page_on_another_host_is_not_followed(tmp_path: Path) -> None:
    """A listing whose next page is named on another origin: the client reads no further (a
    request there would carry what this registry was asked with, a login included), and with the
    signature on a later page the pull is refused, nothing downloaded. Nothing connects to the
    other origin, a socket listening for it."""
    with socket.socket() as elsewhere:
        elsewhere.bind(("127.0.0.1", 0))
        elsewhere.listen()
        elsewhere.setblocking(False)
        base = f"http://127.0.0.1:{elsewhere.getsockname()[1]}"
        log = tmp_path / "requests.log"
        with _started(log, "-referrers-page", "1", "-referrers-link-base", base) as url:
            (tmp_path / "source").mkdir()
            pushed = _push_signed(url, tmp_path / "source")
            r = requests.get(f"http://{url}/v2/{REPO}/referrers/{pushed['digest']}", timeout=5)
            assert r.links["next"]["url"].startswith(base + "/v2/"), r.headers
            invoke("cache", "set", "default", "--trust", str(pushed["pub"]))
            refused = invoke("bundle", "pull", f"oci://{url}/{REPO}:v1", "--insecure", code=2)
        assert "has no signature by a key cache 'default' trusts" in refused.stderr, refused.stderr
        assert "nothing downloaded" in refused.stderr
        with pytest.raises(BlockingIOError):
            elsewhere.accept()  # nobody came
    assert_nothing_installed()


def test_a_registry_that_answers_oci_subject_gets_no_tag_schema_index(tmp_path: Path) -> None:
    """A registry that answers a pushed referrer with OCI-Subject (OCI distribution 1.1) keeps it
    in its referrers API: the push says ``api`` and writes no ``sha256-<hex>`` index (checked in
    ``_push_signed``), and a pull verifies the signature the API lists."""
    log = tmp_path / "requests.log"
    (tmp_path / "source").mkdir()
    with _started(log, "-oci-subject") as url:
        pushed = _push_signed(url, tmp_path / "source", oci_subject=True)
        invoke("cache", "set", "default", "--trust", str(pushed["pub"]))
        done = json.loads(
            invoke("bundle", "pull", f"oci://{url}/{REPO}:v1", "--insecure", "--json").stdout
        )
    assert done["signature_verified_by"] == pushed["signed_by"]
    assert done["install"]["installed"] == 5
    pushes = [line for line in log.read_text().splitlines() if "PUT /v2/" in line]
    assert any(f"/manifests/{pushed['signature']}" in line for line in pushes), pushes
    assert not any("/manifests/sha256-" in line for line in pushes), pushes


def test_a_tag_schema_index_that_is_no_json_object_is_one_line(tmp_path: Path) -> None:
    """Without the referrers API the pull reads the tag schema's ``sha256-<hex>`` index, by tag,
    so its bytes are not checked against a digest. This registry keeps a manifest's bytes as
    pushed: one that is JSON but no object is refused in one line, exit 2, nothing installed."""
    (tmp_path / "source").mkdir()
    with _started(tmp_path / "requests.log", "-referrers=false") as url:
        pushed = _push_signed(url, tmp_path / "source")  # its index removed: one put back
        fallback = pushed["digest"].replace(":", "-")
        r = requests.put(
            f"http://{url}/v2/{REPO}/manifests/{fallback}",
            data=b"[]",
            headers={"Content-Type": "application/json"},
            timeout=5,
        )
        assert r.status_code == 201, (r.status_code, r.text)
        invoke("cache", "set", "default", "--trust", str(pushed["pub"]))
        refused = invoke("bundle", "pull", f"oci://{url}/{REPO}:v1", "--insecure", code=2)
    assert "are not a JSON index (a JSON list)" in refused.stderr, refused.stderr
    assert len(refused.stderr.strip().splitlines()) == 1, refused.stderr
    assert_nothing_installed()
