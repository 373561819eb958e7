"""A signature found through the OCI referrers API, against a registry that serves it.

Debian's docker-registry (distribution 2.8, tests/test_oci.py) has no referrers API, so there the
client's fallback, the referrers tag schema, is what finds a signature. This registry is
go-containerregistry's (tests/registries/ggcr, built by scripts/test; in memory, plain HTTP on
loopback) with its referrers API on. It answers a manifest with a subject without the
``OCI-Subject`` header, so a push writes the tag schema's index too; the tests remove that index
before pulling, so only the API can name the signature. It lists each referrer under its config's
media type (the empty descriptor's, for a signature and for the other artifacts the tests make
refer to the bundle), not under the manifest's ``artifactType`` as OCI distribution 1.1 says.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import requests
from support.bundles import environments
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


@pytest.fixture(scope="module")
def registry(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """The referrers registry on a free loopback port, and its request log."""
    log = tmp_path_factory.mktemp("referrers-registry") / "requests.log"
    proc = subprocess.Popen(
        [_binary(), "-addr", "127.0.0.1:0", "-log", str(log)],
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
        yield {"url": url, "log": log}
    finally:
        proc.kill()
        proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()


@pytest.fixture(scope="module")
def pushed(
    registry: dict[str, Any], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, Any]]:
    """The tiny manifest warmed for real in its own home and pushed signed; then the tag schema's
    index removed from the registry, so a signature is found through the referrers API or not
    at all."""
    base = tmp_path_factory.mktemp("referrers-source")
    manifest = tiny(base)
    home = {v: str(base / v.split("_")[1].lower()) for v in XDG}
    key, other = base / "signer.key", base / "other.key"
    url = registry["url"]
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
    # The registry answered the signature's manifest without OCI-Subject: the push listed it in
    # the tag schema's index as well. Removed here, so a pull cannot find it there.
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
    yield {
        **result,
        "url": url,
        "pub": Path(str(key) + ".pub"),
        "other_pub": Path(str(other) + ".pub"),
    }


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
    r = requests.get(f"http://{url}/v2/{REPO}/referrers/{digest}", timeout=5)
    assert r.status_code == 200, r.text
    listed = {d["digest"]: d["artifactType"] for d in r.json()["manifests"]}
    assert len(listed) == 4 and set(listed.values()) == {EMPTY_TYPE}
    assert pushed["signature"] in listed
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
    assert environments() == []


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
